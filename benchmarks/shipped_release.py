"""A random checkpoint laid out as a quantized release ships (the ``quantization_config`` of its config.json: FP8
with block scales, per-channel FP8, MXFP4, compressed-tensors INT4), cut to a few decoder layers: what the GPU
suite's ``shipped`` phase trains on, and what ``bench_qlora.py --quantize none`` can point at.

Its layout (each tensor's name, dtype and shape, one module per expert where the release keeps them so) is
tiertune's own layout of the config, the tensors transformers would save (``loading.model.saved_checkpoint``,
what ``estimate`` lays out for a config.json alone); the tests check that layout against releases written by
their own quantizers. Its values are drawn on the GPU when there is one: the weights N(0, 0.02) (FP8 codes of
N(0, 64) under a scale of 0.02 / 64), norms 1, biases 0. One shard per decoder layer.

    python benchmarks/shipped_release.py tiertune/recipes/models/deepseek-ai/DeepSeek-V3.1/config.json OUT --layers 4
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

LAYER = re.compile(r"\.layers\.(\d+)\.")
CODE_STD = 64.0  # FP8 codes drawn N(0, 64) under a scale of 0.02 / 64: values N(0, 0.02), within e4m3's 448
WEIGHT_STD = 0.02


def cut_config(raw: dict, layers: int, overrides: dict | None = None) -> dict:
    """``raw`` (a config.json) with ``layers`` decoder layers and ``overrides`` applied to its text model's
    settings (the config itself, or its ``text_config``)."""
    out = json.loads(json.dumps(raw))
    text = out.get("text_config", out)
    text["num_hidden_layers"] = layers
    for key in ("layer_types", "mlp_layer_types"):  # per-layer lists follow the depth
        if isinstance(text.get(key), list):
            text[key] = text[key][:layers]
    text.update(overrides or {})
    return out


def _values(name: str, shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A tensor of the release: its codes, scales or 16-bit values (see the module docstring)."""
    device = gen.device
    if dtype == torch.float8_e4m3fn:
        codes = torch.randn(shape, generator=gen, device=device) * CODE_STD
        return codes.clamp(-448, 448).to(dtype)
    if name.endswith(("_scale_inv", "_scale")) and dtype.is_floating_point:
        scale = torch.full(shape, WEIGHT_STD / CODE_STD, device=device)
        if dtype == torch.float8_e8m0fnu:  # ue8m0: a power of two
            return torch.exp2(torch.round(torch.log2(scale))).to(dtype)
        return scale.to(dtype)
    if dtype == torch.uint8 and name.endswith("_scales"):  # MXFP4's e8m0 exponents: 2^-8 times codes up to 6
        return torch.full(shape, 127 - 8, dtype=dtype, device=device)
    if dtype in (torch.uint8, torch.int32):  # MXFP4 blocks, packed INT4 words: random codes
        info = torch.iinfo(dtype)
        return torch.randint(info.min, info.max, shape, generator=gen, device=device, dtype=dtype)
    if dtype.is_floating_point:
        if name.endswith("bias") or "e_score_correction" in name:
            return torch.zeros(shape, dtype=dtype, device=device)
        if "norm" in name and len(shape) == 1:
            return torch.ones(shape, dtype=dtype, device=device)
        return (torch.randn(shape, generator=gen, device=device) * WEIGHT_STD).to(dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


def write_release(config: Path, out: Path, layers: int, overrides: dict | None = None) -> dict:
    """Write the release ``config`` (a config.json) describes, cut to ``layers`` decoder layers, into ``out``.
    Returns its figures: tensor bytes, those of the decoder layers, tensors, the quantization it ships in."""
    from safetensors.torch import save_file

    from tiertune.engine.routing import route_experts
    from tiertune.loading.model import build_skeleton, saved_checkpoint, split_model
    from tiertune.quant import make_quantizer, saved_quantization, store_experts
    from tiertune.quant.shipped import is_shipped_format

    out.mkdir(parents=True, exist_ok=True)
    raw = cut_config(json.loads(Path(config).read_text()), layers, overrides)
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    dtype = torch.bfloat16
    with torch.device("meta"):
        model = build_skeleton(out, dtype)
    route_experts(model)
    parts = split_model(model)
    saved = saved_quantization(model.config, str(out))
    quant = make_quantizer("none", dtype, saved, str(out))  # a shipped format is read as it ships
    if quant is not None:
        for i, layer in enumerate(parts.layers):
            if is_shipped_format(quant):
                quant.convert(layer, f"{parts.layers_name}.{i}")
            else:
                quant.convert(layer)
            store_experts(layer, quant)
    laid = saved_checkpoint(out, model, quant, saved)
    shards: dict[int, list] = {}
    for entry in laid.entries.values():
        found = LAYER.search(entry.name)
        shards.setdefault(int(found.group(1)) + 1 if found else 0, []).append(entry)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator(device).manual_seed(0)
    weight_map: dict[str, str] = {}
    total = layer_bytes = 0
    for index in sorted(shards):
        file = f"model-{index:05d}-of-{max(shards):05d}.safetensors"
        tensors = {}
        for entry in shards[index]:
            known = laid.content(entry.name)  # what the layout carries (a packed weight's shape)
            value = known if known is not None else _values(entry.name, entry.shape, entry.dtype, gen)
            tensors[entry.name] = value.cpu().contiguous()
            weight_map[entry.name] = file
        save_file(tensors, out / file, metadata={"format": "pt"})
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        total += nbytes
        layer_bytes += nbytes if index else 0
        del tensors
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    return {
        "tensor_bytes": total,
        "layer_bytes": layer_bytes,
        "tensors": len(weight_map),
        "ships_as": (saved or {}).get("kind", "unquantized"),
        "generated_on": device.type,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config", type=Path, help="the release's config.json")
    p.add_argument("out", type=Path, help="directory to write")
    p.add_argument("--layers", type=int, default=4, help="decoder layers to keep")
    p.add_argument("--override", default="{}", help="JSON of text-model settings to change (toy sizes)")
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    print(json.dumps(write_release(args.config, args.out, args.layers, json.loads(args.override))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
