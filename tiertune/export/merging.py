"""A LoRA adapter folded into its base as a stream: one tensor, or one block of a tensor's rows, at a time.

``PeftModel.merge_and_unload`` needs the whole base in memory (a 70B model is 140 GB in bf16). Here the base's
safetensors are read tensor by tensor (``Checkpoint``, no memory maps), each weight the adapter changes gets
the same arithmetic peft's merge applies to it, and each output file is written as it is read: the header
first (every tensor's shape and dtype is known up front), then the tensors in order. Peak memory is a block of
rows, or one whole weight where a quantized base must be dequantized whole (its scales span the tensor);
the output is sharded as the base is: the same files, the same tensors in each.

The arithmetic, per weight ``W`` in the output dtype (peft's, so the result equals ``merge_and_unload``'s):
``W + (B @ A) * scale`` computed in fp32 and rounded once (an embedding's ``(B @ A)^T``); DoRA's
``m / ||W + (B @ A) * scale||_row * (W + (B @ A) * scale)``; ``lora_B``'s bias added to the base's bias;
``modules_to_save`` copies replacing the base's tensors. A base trained quantized (``model.quantize``, or
saved by bitsandbytes) contributes its dequantized weights: what the adapter was trained against.

A release read as it ships (FP8, compressed-tensors' INT4 and FP8, MXFP4) is written 16-bit, each weight under
the name of its values (a packed weight's ``weight_packed`` as ``weight``, no scales left). Routed experts stored
one matrix per expert in its files are written one matrix at a time, dequantized, as the checkpoint names them;
gpt-oss's MXFP4 experts (a layer's fused in its files) one expert at a time into the 16-bit tensor transformers
saves for them, (experts, in, out). Adapted parameters that are matrices (a shared expert's projection, which
``adapter_config.json`` names as a parameter on the DeepSeek family: ``methods.lora.as_peft_loads``) merge as
linear layers do. What this does not stream (a peft type other than LoRA, adapted fused MoE experts, 4-bit
experts, ``fan_in_fan_out`` layers, layer replication) is reported by
``plan_merge`` as a reason, and merged by peft in memory instead.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tiertune.formats import ADAPTER_FILE, PEFT_PREFIX
from tiertune.loading.weights import Checkpoint
from tiertune.offload.aio import buffer_of

SLICE_BYTES = 16 << 20  # rows of a weight merged at once, in fp32
_TORCH_TO_SAFETENSORS = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


@dataclass(frozen=True)
class Delta:
    """What an adapter adds to one base weight: ``a`` and ``b`` name its factors in the adapter file
    (``lora_A`` (r, in) and ``lora_B`` (out, r); an embedding's ``lora_embedding_A`` (r, rows) and
    ``lora_embedding_B`` (dim, r)), ``magnitude`` DoRA's per-row magnitudes."""

    a: str
    b: str
    scale: float
    embedding: bool = False
    magnitude: str | None = None


@dataclass
class MergePlan:
    """How each base tensor becomes a merged one. ``keys`` are the base checkpoint's tensors written out (its
    model's parameters; quantization statistics are not), by file in the order they are stored."""

    keys: dict[Path, list[str]]
    shapes: dict[str, tuple[int, ...]]
    deltas: dict[str, Delta] = field(default_factory=dict)
    replaced: dict[str, str] = field(default_factory=dict)  # base key -> the adapter's trained copy
    biases: dict[str, tuple[str, float]] = field(
        default_factory=dict
    )  # base bias key -> (lora_B bias, scale)
    quantized: dict[str, Any] = field(default_factory=dict)  # base key -> the parameter name it quantizes as
    saved: dict[str, Any] = field(default_factory=dict)  # base key -> its bitsandbytes bytes (SavedWeight)
    quant: Any = None  # the Quantizer the run trained with, or None
    # fused experts shipped as one tensor (gpt-oss's MXFP4, Llama 4's FP8), written 16-bit under their own name ->
    # the keys of their codes and scales
    mx: dict[str, tuple[str, str]] = field(default_factory=dict)


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """peft's ``rank_pattern``/``alpha_pattern`` lookup (its ``get_pattern_key``): the pattern that matches the
    module's name at a dot boundary (a regex matched against the name's end). Not imported from peft: importing
    peft costs the merge ~220 MiB of its memory bound."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


def plan_merge(adapter: Path, base: Path, quantize: str, train_dtype: torch.dtype) -> MergePlan | str:
    """The streamed merge of the PEFT ``adapter`` into the ``base`` model directory, or why it cannot be
    streamed (a sentence). ``quantize`` and ``train_dtype``: how the run held its base (``model.quantize`` and
    ``model.dtype``)."""
    from tiertune.engine.routing import route_experts
    from tiertune.loading.model import build_skeleton, checkpoint_names, tower_parameters
    from tiertune.quant import SHIPPED, is_quantized, make_quantizer, saved_quantization, store_experts
    from tiertune.quant.shipped import SCALE

    config = json.loads((adapter / "adapter_config.json").read_text())
    unsupported = [
        (config.get("peft_type", "LORA") != "LORA", f"a {config.get('peft_type')} adapter (not LoRA)"),
        (bool(config.get("fan_in_fan_out")), "fan_in_fan_out layers (GPT-2's Conv1D)"),
        (bool(config.get("layer_replication")), "layer replication"),
        (not (adapter / ADAPTER_FILE).is_file(), f"no {ADAPTER_FILE} (a .bin adapter)"),
    ]
    for bad, why in unsupported:
        if bad:
            return why
    checkpoint = Checkpoint(base)
    with torch.device("meta"):
        model = build_skeleton(base, train_dtype)
    route_experts(model)  # the experts described as the run described them (Llama 4's: stored transposed)
    # adapted parameters merge as linear layers do when each is a matrix (a shared expert's projection, which
    # adapter_config.json names by its weight: ``methods.lora.as_peft_loads``); fused experts' are not streamed
    matrices = {n for n, p in model.named_parameters() if p.dim() == 2}
    fused = [
        t
        for t in config.get("target_parameters") or ()
        if not any(n == t or n.endswith(f".{t}") for n in matrices)
    ]
    if fused:
        return f"adapted parameters that are not matrices (target_parameters {fused[0]!r}: fused MoE experts)"
    with torch.device("meta"):
        saved_config = saved_quantization(model.config, str(base))
        shipped = (
            saved_config is not None and saved_config["kind"] in SHIPPED
        )  # read as it ships: FP8, MXFP4...
        kind = "none" if shipped else saved_config["kind"] if saved_config else quantize
        quant = make_quantizer(kind, train_dtype, saved_config)
        experts: set[str] = set()  # fused expert weights stored one matrix per expert
        if quant is not None:
            from tiertune.loading.model import find_decoder_layers

            layers_name, layers = find_decoder_layers(model)
            for i, layer in enumerate(layers):
                if shipped:  # its skip list names modules by their full names
                    quant.convert(layer, f"{layers_name}.{i}")
                else:
                    quant.convert(layer)
                marked = store_experts(layer, quant)
                if marked and not shipped:
                    return "MoE experts stored one matrix per expert, 4-bit"
                experts |= {f"{layers_name}.{i}.{m}" for m in marked}
    split: list[str] = []  # tensors transformers splits on load (a tower's fused qkv): written as they are
    sources = checkpoint_names(model, checkpoint, split)
    params = dict(model.named_parameters())
    tower = set(tower_parameters(model))  # never adapted: what the split tensors load into
    # each tensor written is named as the checkpoint names its values (a compressed-tensors weight's packed
    # integers, ``..._packed``, are written as the weight ``...``); ``stored``: the checkpoint tensor it comes from
    key_of: dict[str, str] = {}
    stored: dict[str, str] = {}
    # an expert's own matrix (experts one module each in the files): its checkpoint key, its shape
    pieces: dict[str, tuple[str, tuple[int, ...]]] = {}
    mx: dict[
        str, tuple[str, str, str]
    ] = {}  # experts fused in the file: written name -> codes, scales, parameter
    for name in params:
        source = sources.get(name)
        if source is None and name in tower and split:
            continue  # read from a split tensor, copied whole below
        if source is None:
            return f"the base checkpoint has no tensor for {name}"
        if name in experts and quant.transposed_experts:  # type: ignore[union-attr]
            # gpt-oss's MXFP4, Llama 4's FP8: a layer's experts one tensor, written as transformers saves them
            found = quant.experts_saved(name, tuple(params[name].shape), source.pieces, checkpoint)  # type: ignore[union-attr]
            if found is None:
                return f"the experts {name} are not stored as their release's format says (codes with scales)"
            codes, scales = found.tensors[name], found.tensors[f"{name}.{SCALE}"]
            mx[codes.removesuffix("_blocks")] = (codes, scales, name)
            stored[codes.removesuffix("_blocks")] = codes
            continue
        if name in experts:  # each expert's matrix written dequantized, as the checkpoint names it
            for key, index in source.pieces:
                out = key.removesuffix("_packed")
                pieces[out] = (key, tuple(params[name][index].shape))
                stored[out] = key
            continue
        if len(source.pieces) != 1 or source.pieces[0][1]:  # 16-bit experts one module each in the files:
            for key, _ in source.pieces:  # never adapted (refused above), so written as the files hold them
                stored[key] = key
            continue
        key = source.pieces[0][0]
        key_of[name] = key.removesuffix("_packed")
        stored[key_of[name]] = key
    for key in split:
        stored[key] = key
    # persistent buffers the checkpoint holds (DeepSeek-V3's routers' e_score_correction_bias), written as they are
    for (
        buffer,
        _,
    ) in model.named_buffers():  # under the checkpoint's own names (Kimi K2.5's language_model.model)
        found = sources.get(buffer)
        if found is not None and len(found.pieces) == 1 and found.pieces[0][0] not in stored:
            stored[found.pieces[0][0]] = found.pieces[0][0]
    by_file: dict[Path, list[str]] = {}
    for key in sorted(
        stored, key=lambda k: (checkpoint.entries[stored[k]].file, checkpoint.entries[stored[k]].start)
    ):
        by_file.setdefault(checkpoint.entries[stored[key]].file, []).append(key)
    shapes = {k: tuple(checkpoint.entries[v].shape) for k, v in stored.items()}  # buffers: as stored
    shapes.update({key_of[n]: tuple(p.shape) for n, p in params.items() if n in key_of})
    shapes.update({out: shape for out, (_, shape) in pieces.items()})
    shapes.update({out: tuple(params[name].shape) for out, (_, _, name) in mx.items()})
    plan = MergePlan(by_file, shapes, quant=quant, mx={out: (b, sc) for out, (b, sc, _) in mx.items()})
    for out, (key, shape) in pieces.items():  # its codes and their scales, read as a linear weight's
        plan.quantized[out] = out
        found = quant.saved(out, key, shape, checkpoint)  # type: ignore[union-attr]
        if found is None:
            return f"expert matrix {key} is not stored as its release's format says (codes with their scales)"
        plan.saved[out] = found
    for name, param in params.items():
        if name in key_of and quant is not None and is_quantized(param):
            key = key_of[name]
            plan.quantized[key] = name
            found = quant.saved(name, stored[key], tuple(param.shape), checkpoint)
            if found is not None:
                plan.saved[key] = found
    why = _adapter_plan(adapter, config, plan, key_of)
    return why if why is not None else plan


def _adapter_plan(adapter: Path, config: dict, plan: MergePlan, key_of: dict[str, str]) -> str | None:
    """Fill ``plan`` with what the adapter's tensors do to the base's; or why they cannot be streamed."""
    tensors = Checkpoint(adapter, files=[ADAPTER_FILE]).entries
    suffixes = {".lora_A.weight": "linear", ".lora_embedding_A": "embedding"}
    used: set[str] = set()
    for key in tensors:
        module = key.removeprefix(PEFT_PREFIX)
        kind = next((k for s, k in suffixes.items() if module.endswith(s)), None)
        if kind is None:
            continue
        module = module[: module.rindex(".lora_")]
        b = key.replace(".lora_A.weight", ".lora_B.weight").replace("lora_embedding_A", "lora_embedding_B")
        magnitude = next(
            (
                m
                for m in (
                    f"{PEFT_PREFIX}{module}.lora_magnitude_vector",
                    f"{PEFT_PREFIX}{module}.lora_magnitude_vector.weight",
                )
                if m in tensors
            ),
            None,
        )
        weight = key_of.get(f"{module}.weight")
        if b not in tensors or weight is None:
            return f"adapter tensor {key} has no lora_B or no base weight {module}.weight"
        if magnitude is not None and kind == "embedding":
            return f"DoRA on an embedding ({module})"
        r = tensors[key].shape[0]
        alpha = _pattern_value(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", 8))
        scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        plan.deltas[weight] = Delta(key, b, scale, kind == "embedding", magnitude)
        used |= {key, b} | ({magnitude} if magnitude else set())
        bias = key.replace(".lora_A.weight", ".lora_B.bias")
        if kind == "linear" and bias in tensors:
            base_bias = key_of.get(f"{module}.bias")
            if base_bias is None:
                return f"{module} has a lora_B bias but its base layer has no bias"
            plan.biases[base_bias] = (bias, scale)
            used.add(bias)
    for key in tensors:
        if key in used:
            continue
        # a module saved whole: modules_to_save's copy, or an adapted embedding's base (save_embedding_layers)
        name = re.sub(r"\.(modules_to_save(\.[^.]+)?|base_layer)\.", ".", key.removeprefix(PEFT_PREFIX))
        if name not in key_of:
            return f"adapter tensor {key} matches no parameter of the base"
        if key_of[name] in plan.quantized:
            return f"adapter tensor {key} replaces a quantized weight"
        plan.replaced[key_of[name]] = key
    return None


class _Merger:
    """The tensors of the merged model, computed from the base and the adapter as ``plan`` says."""

    def __init__(self, plan: MergePlan, base: Path, adapter: Path, dtype: torch.dtype) -> None:
        self.plan, self.dtype = plan, dtype
        self.base = Checkpoint(base)
        self.adapter = Checkpoint(adapter, files=[ADAPTER_FILE])
        self._factors: dict[str, torch.Tensor] = {}

    def out_dtype(self, key: str) -> torch.dtype:
        """The merged tensor's dtype: the merge's for floating-point tensors (every quantized weight is)."""
        if key in self.plan.mx or key in self.plan.quantized:
            return self.dtype
        stored = self.base.entries[key].dtype
        return self.dtype if stored.is_floating_point or key in self.plan.quantized else stored

    def blocks(self, key: str) -> Any:
        """The merged tensor ``key`` as blocks of rows (each one of ``out_dtype``), in order."""
        shape = self.plan.shapes[key]
        if (
            key in self.plan.mx
        ):  # one expert at a time: its (out, in) values, stored (in, out) as transformers does
            from tiertune.quant.shipped import SCALE

            codes_key, scales_key = self.plan.mx[key]
            for e in range(shape[0]):
                views = {}
                for entry, source in ((key, codes_key), (f"{key}.{SCALE}", scales_key)):
                    stored = self.base.entries[source]
                    views[entry] = torch.empty((1, *stored.shape[1:]), dtype=stored.dtype)
                    self.base.read_into(source, views[entry], row=e)
                values = self.plan.quant.expert(views, key, 0).dequantize(torch.float32)
                yield values.T.contiguous().to(self.dtype)[None]
            return
        if key in self.plan.quantized:  # the scales span the tensor: dequantized whole
            yield self._merged(key, self._dequantized(key), 0)
            return
        # a base tensor the adapter saved whole (modules_to_save, or a resized embedding) is read from it
        source, name = (
            (self.adapter, self.plan.replaced[key]) if key in self.plan.replaced else (self.base, key)
        )
        row = 4 * max(1, math.prod(shape[1:]))
        step = max(1, SLICE_BYTES // row) if shape else 1
        for start in range(0, shape[0] if shape else 1, step):
            rows = min(step, shape[0] - start) if shape else 0
            block = torch.empty((rows, *shape[1:]) if shape else (), dtype=self.out_dtype(key))
            source.read_into(name, block, row=start if shape else None)
            yield self._merged(key, block, start)

    def _merged(self, key: str, block: torch.Tensor, start: int) -> torch.Tensor:
        """``block`` (rows ``start``... of base tensor ``key``, in the output dtype) with the adapter's change."""
        delta = self.plan.deltas.get(key)
        if delta is not None:
            a, b = self._factor(delta.a), self._factor(delta.b)
            rows = slice(start, start + len(block))
            change = (b @ a[:, rows]).T * delta.scale if delta.embedding else (b[rows] @ a) * delta.scale
            if delta.magnitude is None:
                return (block.float() + change).to(block.dtype)
            summed = block + change  # fp32, as DoRA's norm and product are computed
            norm = torch.linalg.norm(summed, dim=1).to(summed.dtype)
            factor = self._factor(delta.magnitude).reshape(-1)[rows] / norm
            return (factor.view(-1, 1) * summed).to(block.dtype)
        bias = self.plan.biases.get(key)
        if bias is not None:
            return (block.float() + self._factor(bias[0]) * bias[1]).to(block.dtype)
        return block

    def _factor(self, key: str) -> torch.Tensor:
        """An adapter tensor in fp32 (peft upcasts a 16-bit adapter on load, and merges in fp32 on a CPU); the
        factors of the weight being merged are kept while its blocks go by."""
        if key not in self._factors:
            if len(self._factors) >= 3:
                self._factors.clear()
            self._factors[key] = self._read_adapter(key).float()
        return self._factors[key]

    def _read_adapter(self, key: str) -> torch.Tensor:
        entry = self.adapter.entries[key]
        out = torch.empty(entry.shape, dtype=entry.dtype)
        self.adapter.read_into(key, out)
        return out

    def _dequantized(self, key: str) -> torch.Tensor:
        """A weight the run held quantized, as its quantized storage gives it back, in the output dtype."""
        from tiertune.quant import NF4
        from tiertune.quant.shipped import SCALE, is_shipped_format

        quant, name, shape = self.plan.quant, self.plan.quantized[key], self.plan.shapes[key]
        views = {n: torch.empty(s, dtype=dt) for n, s, dt in quant.entries(name, shape)}
        if is_shipped_format(quant):  # read as it ships: its codes times their scales
            self.plan.saved[key].read_into(self.base, views)
            return quant.dequantize(views[name], views[f"{name}.{SCALE}"], torch.float32).to(self.dtype)
        import bitsandbytes.functional as bnb_f  # a base bitsandbytes quantized (not needed for a shipped one)

        if key in self.plan.saved:
            self.plan.saved[key].read_into(self.base, views)
        else:  # quantized from the dtype the run loaded it in, as it was
            weight = torch.empty(shape, dtype=quant.compute_dtype)
            self.base.read_into(key, weight)
            quant.quantize_into(name, weight, views)
            del weight
        if isinstance(quant, NF4):
            weight = bnb_f.dequantize_4bit(
                views[name], quant.parameter(name, torch.Size(shape), views).quant_state
            )
        else:
            weight = bnb_f.int8_vectorwise_dequant(views[name], views[f"{name}.SCB"])
        return weight.to(self.dtype)


def write_merged(plan: MergePlan, base: Path, adapter: Path, dtype: torch.dtype, out: Path) -> list[str]:
    """Write the merged weights into directory ``out``: one safetensors file per base file, of the same name,
    with the same tensors, and the base's index (its sizes recomputed) when it has one. Returns the files."""
    from tqdm.auto import tqdm

    merger = _Merger(plan, base, adapter, dtype)
    total_bytes = sum(
        math.prod(plan.shapes[k]) * merger.out_dtype(k).itemsize for keys in plan.keys.values() for k in keys
    )
    # a bar in a terminal, nothing in a log file (tqdm's disable=None)
    bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="merge", disable=None, leave=False)
    written = []
    weight_map: dict[str, str] = {}
    total = 0
    for file, keys in plan.keys.items():
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for key in keys:
            shape = plan.shapes[key]
            nbytes = math.prod(shape) * merger.out_dtype(key).itemsize
            header[key] = {
                "dtype": _TORCH_TO_SAFETENSORS[merger.out_dtype(key)],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        with open(out / file.name, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            for key in keys:
                for block in merger.blocks(key):
                    f.write(buffer_of(block.contiguous()))
                    bar.update(block.numel() * block.element_size())
            if f.tell() != 8 + len(raw) + offset:
                raise RuntimeError(
                    f"{file.name}: wrote {f.tell()} bytes, the header says {8 + len(raw) + offset}"
                )
            f.flush()
            os.fsync(f.fileno())
        written.append(file.name)
        weight_map.update(dict.fromkeys(keys, file.name))
        total += offset
    bar.close()
    if (base / "model.safetensors.index.json").is_file():
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return written
