"""Checkpoints written as the hub's quantized releases ship, from a saved model: ``rewrite`` writes a release and
the model of its values side by side; ``write_rowwise_fp8`` writes Meta's FP8 layout (``fbgemm_fp8``)."""

import json
import re
import shutil

import torch
from safetensors.torch import load_file, save_file

LAYER_LINEAR = re.compile(r"(^|\.)layers\.\d+\..+\.weight$")
FUSED_EXPERTS = ("feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj")


def rewrite(src, out_dir, values_dir, convert, quantization_config) -> int:
    """``src`` (a saved model) written twice: to ``out_dir`` as a release that ships quantized (each tensor as
    ``convert(key, tensor)`` gives it: the tensors to store and its values, or None to keep it as it is;
    ``quantization_config`` in config.json) and to ``values_dir`` as the model of its values (same keys, same
    shards). Returns the bytes of the quantized checkpoint's tensors."""
    for out in (out_dir, values_dir):
        out.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if not f.name.endswith(".safetensors"):
                shutil.copy(f, out / f.name)
    index, total = {}, 0
    for shard in sorted(src.glob("*.safetensors")):
        packed, values = {}, {}
        for key, tensor in load_file(shard).items():
            made = convert(key, tensor)
            if made is None:
                packed[key] = values[key] = tensor
            else:
                packed.update(made[0])
                values[key] = made[1]
        save_file(packed, out_dir / shard.name, metadata={"format": "pt"})
        save_file(values, values_dir / shard.name, metadata={"format": "pt"})
        index.update(dict.fromkeys(packed, shard.name))
        total += sum(t.numel() * t.element_size() for t in packed.values())
    if (src / "model.safetensors.index.json").exists():
        (out_dir / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": index})
        )
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (out_dir / "config.json").write_text(json.dumps(config))
    return total


def write_rowwise_fp8(src, out_dir, values_dir, skip):
    """``src`` written as Meta's FP8 releases ship (``quant_method: fbgemm_fp8``): each decoder layer's linear
    weight (but the routers and the modules ``skip`` names, by the checkpoint's own names) as e4m3 codes with an
    fp32 scale per output channel, ``<key>_scale`` (out, 1); Llama 4's fused experts (experts, in, out) as codes
    of the same layout with ``gate_up_proj_scale`` (experts, 1, out) and ``down_proj_scale`` (experts, out, 1).
    The values written beside are the codes times their channel's scale. Returns the release's tensor bytes."""
    top = torch.finfo(torch.float8_e4m3fn).max

    def rowwise(matrix):  # (out, in) -> codes, scale (out, 1), values
        scale = (matrix.float().abs().amax(1, keepdim=True) / top).clamp(min=1e-12)
        codes = (matrix.float() / scale).to(torch.float8_e4m3fn)
        return codes, scale, codes.float() * scale

    def convert(key, tensor):
        if key.endswith(FUSED_EXPERTS):
            made = [rowwise(tensor[e].T) for e in range(len(tensor))]  # each expert's (out, in) matrix
            codes = torch.stack([c.T for c, _, _ in made]).contiguous()
            values = torch.stack([v.T for _, _, v in made]).contiguous()
            scales = torch.stack([s if key.endswith("down_proj") else s.T for _, s, _ in made])
            return {key: codes, f"{key}_scale": scales.contiguous()}, values
        module = key.removesuffix(".weight")
        if (
            not LAYER_LINEAR.search(key)
            or tensor.dim() != 2
            or module.endswith("router")
            or any(module == s or module.startswith(f"{s}.") for s in skip)
        ):
            return None
        codes, scale, values = rowwise(tensor)
        return {key: codes, f"{key}_scale": scale}, values

    config = {
        "quant_method": "fbgemm_fp8",
        "activation_scale_ub": 1200.0,
        "modules_to_not_convert": list(skip),
    }
    return rewrite(src, out_dir, values_dir, convert, config)
