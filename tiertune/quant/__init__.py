"""Quantized weights as chunk payloads: through bitsandbytes, 4-bit NF4/FP4 (``bnb4``) and INT8 (``bnb8``); and
the formats checkpoints ship in, read as they are and dequantized at use (``shipped``: FP8 with blockwise or
per-channel scales, MXFP4, compressed-tensors' INT4/INT8/FP8).

A base is quantized on load (``model.quantize``), or read as it is from a checkpoint saved quantized (its
config.json has a ``quantization_config``): a bitsandbytes one (``quant_method: bitsandbytes``, saved by
transformers from a bitsandbytes-quantized model) under the ``model.quantize`` it was saved with, a shipped
format (``quant_method: fp8``, ``mxfp4``, ``fbgemm_fp8``, ``compressed-tensors``) under ``model.quantize: none``. ``make_quantizer`` takes the checkpoint's settings,
and refuses a ``model.quantize`` that contradicts them.
"""

from __future__ import annotations

from typing import Any

import torch

from tiertune.errors import ConfigError, ModelError
from tiertune.quant.bnb4 import NF4, SavedWeight
from tiertune.quant.bnb8 import Int8
from tiertune.quant.shipped import FP8, MXFP4, Compressed, RowwiseFP8, compressed_settings, is_shipped

Quantizer = NF4 | Int8 | FP8 | MXFP4 | RowwiseFP8 | Compressed
SHIPPED = ("fp8", "mxfp4", "fbgemm_fp8", "compressed-tensors")  # read as checkpoints ship them (quant_method)
SHIPPED_NAMES = {
    "fp8": "FP8",
    "mxfp4": "MXFP4",
    "fbgemm_fp8": "FP8 with a scale per channel (fbgemm_fp8)",
    "compressed-tensors": "compressed-tensors' format",
}
KINDS = ("none", "nf4", "fp4", "int8")

__all__ = [
    "FP8",
    "KINDS",
    "Compressed",
    "MXFP4",
    "NF4",
    "Int8",
    "Quantizer",
    "RowwiseFP8",
    "SavedWeight",
    "is_quantized",
    "make_quantizer",
    "saved_quantization",
    "store_experts",
]


def saved_quantization(config: Any, where: str = "the model") -> dict[str, Any] | None:
    """The quantization a pre-quantized checkpoint was saved with (its config's ``quantization_config``):
    bitsandbytes' ``{"kind": nf4|fp4|int8, "double_quant": bool, "skip": [...]}``, a shipped format's
    ``{"kind": "fp8", "block": (rows, cols), "scale_fmt": float|ue8m0, "skip": [...]}``, or None for an
    unquantized checkpoint. Raises ModelError for a quantization tiertune cannot read, naming those it reads."""
    raw = getattr(config, "quantization_config", None)
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raw = raw.to_dict() if hasattr(raw, "to_dict") else vars(raw)
    method = raw.get("quant_method", "bitsandbytes")
    if method == "fp8":
        return _fp8(raw, where)
    if method == "mxfp4":  # gpt-oss: the experts alone
        return {"kind": "mxfp4", "skip": tuple(raw.get("modules_to_not_convert") or ())}
    if method == "fbgemm_fp8":  # Meta's FP8 releases (Llama 4 Maverick, Llama 3.1 405B): a scale per channel
        return {"kind": "fbgemm_fp8", "skip": tuple(raw.get("modules_to_not_convert") or ())}
    if method == "compressed-tensors":
        settings = compressed_settings(raw, where)
        stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.bfloat16
        settings["scale_dtype"] = (
            getattr(torch, stored.removeprefix("torch.")) if isinstance(stored, str) else stored
        )
        return settings
    if method != "bitsandbytes":
        raise ModelError(
            f"{where} is saved quantized with {method!r} (quantization_config in its config.json); tiertune "
            "reads unquantized checkpoints (bf16/fp16/fp32), FP8 ones with blockwise scales (quant_method "
            "fp8: DeepSeek-V3, Kimi-K2, Qwen3-FP8), FP8 with a scale per channel (quant_method fbgemm_fp8: "
            "Llama 4 Maverick, Llama 3.1 405B), MXFP4 experts (quant_method mxfp4: gpt-oss), "
            "compressed-tensors INT4/INT8 and FP8 (Kimi-K2-Thinking, GLM's and Llama 4's FP8) and bitsandbytes "
            "4-bit or 8-bit ones: point model.path at one of those releases of the model"
        )
    skip = tuple(raw.get("llm_int8_skip_modules") or ())
    if raw.get("load_in_8bit") or raw.get("_load_in_8bit"):
        return {
            "kind": "int8",
            "double_quant": False,
            "skip": skip,
            "threshold": float(raw.get("llm_int8_threshold", 6.0)),
        }
    if raw.get("load_in_4bit") or raw.get("_load_in_4bit"):
        kind = raw.get("bnb_4bit_quant_type", "fp4")
        return {"kind": kind, "double_quant": bool(raw.get("bnb_4bit_use_double_quant", False)), "skip": skip}
    return None


def _fp8(raw: dict[str, Any], where: str) -> dict[str, Any]:
    """The settings of an FP8 checkpoint's ``quantization_config`` (transformers' ``FineGrainedFP8Config``)."""
    block = raw.get("weight_block_size")
    fmt = raw.get("fmt", "e4m3")
    scale_fmt = raw.get("scale_fmt") or "float"
    expert_dtype = raw.get("expert_dtype", "fp8")
    problem = ""
    if not (
        isinstance(block, list | tuple)
        and len(block) == 2
        and all(isinstance(b, int) and b > 0 for b in block)
    ):
        problem = f"weight_block_size {block!r} (expected two positive integers, e.g. [128, 128])"
    elif fmt != "e4m3":
        problem = f"fmt {fmt!r} (tiertune reads e4m3 codes)"
    elif scale_fmt not in ("float", "ue8m0"):
        problem = f"scale_fmt {scale_fmt!r} (tiertune reads float or ue8m0 scales)"
    elif expert_dtype != "fp8":
        problem = f"expert_dtype {expert_dtype!r} (tiertune reads FP8 experts)"
    if problem:
        raise ModelError(
            f"{where} is saved in FP8 with {problem} in the quantization_config of its config.json; tiertune "
            "reads FP8 e4m3 weights with a float or ue8m0 scale per block (quant_method fp8, as DeepSeek-V3 ships)"
        )
    skip = tuple(raw.get("modules_to_not_convert") or ())
    return {"kind": "fp8", "block": tuple(block), "scale_fmt": scale_fmt, "skip": skip}


def make_quantizer(
    kind: str, compute_dtype: torch.dtype, saved: dict[str, Any] | None = None, where: str = "the model"
) -> Quantizer | None:
    """The quantizer of ``model.quantize`` (``none`` gives None). ``saved`` (``saved_quantization``) is the
    checkpoint's own quantization: its weights are read as they are, so ``kind`` must name the same one."""
    if kind not in KINDS:
        raise ValueError(
            f"the quantizations are {', '.join(KINDS)} (a recipe's model.quantize), got {kind!r}"
        )
    if saved is not None and saved["kind"] in SHIPPED:
        if kind != "none":
            raise ConfigError(
                f"{where} ships its weights in {SHIPPED_NAMES[saved['kind']]} (the quantization_config of its "
                "config.json), "
                f"which tiertune reads as they are: set model.quantize: none (it is {kind})"
            )
        if saved["kind"] == "mxfp4":
            return MXFP4(compute_dtype, tuple(saved["skip"]))
        if saved["kind"] == "fbgemm_fp8":
            return RowwiseFP8(compute_dtype, tuple(saved["skip"]))
        if saved["kind"] == "compressed-tensors":
            fields = ("format", "bits", "group", "scale_dtype")
            return Compressed(compute_dtype, *(saved[k] for k in fields), skip=tuple(saved["skip"]))
        return FP8(compute_dtype, saved["block"], saved["scale_fmt"], tuple(saved["skip"]))
    if saved is not None and kind != saved["kind"]:
        bits = "8-bit" if saved["kind"] == "int8" else f"4-bit {saved['kind'].upper()}"
        raise ConfigError(
            f"{where} holds weights quantized by bitsandbytes to {bits} (the quantization_config of its "
            f"config.json), which train as a frozen base read as they are: set model.quantize: {saved['kind']} "
            f"(it is {kind}) and method.type: lora; to train other settings, start from the unquantized release"
        )
    if kind == "none":
        return None
    skip = tuple(saved["skip"]) if saved else ()
    if kind == "int8":
        return Int8(compute_dtype, threshold=saved.get("threshold", 6.0) if saved else 6.0, skip=skip)
    return NF4(
        compute_dtype, quant_type=kind, double_quant=saved["double_quant"] if saved else True, skip=skip
    )


def store_experts(layer: Any, quant: object) -> list[str]:
    """Mark the fused MoE expert weights inside ``layer`` (meta) to be stored one matrix per expert as ``quant``
    stores weights: as the checkpoint ships them (``shipped.mark_experts``) or 4-bit (``experts.convert_experts``).
    Returns the names marked, relative to ``layer``."""
    from tiertune.quant import experts
    from tiertune.quant.shipped import is_shipped_format, mark_experts

    return mark_experts(layer, quant) if is_shipped_format(quant) else experts.convert_experts(layer, quant)


def is_quantized(param: object) -> bool:
    """Whether ``param`` is a quantized linear weight: bitsandbytes 4-bit or 8-bit (a converted module's), or
    kept in its shipped format (``shipped.ShippedWeight``)."""
    if param is None:
        return False
    if is_shipped(param):
        return True
    import bitsandbytes as bnb

    return isinstance(param, bnb.nn.Params4bit | bnb.nn.Int8Params)
