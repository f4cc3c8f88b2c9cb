"""Quantized weights as chunk payloads, through bitsandbytes: 4-bit NF4/FP4 (``bnb4``) and INT8 (``bnb8``).

A base is quantized on load (``model.quantize``), or read as it is from a checkpoint that transformers saved
from a bitsandbytes-quantized model (its config.json has a ``quantization_config`` with ``quant_method:
bitsandbytes``): ``make_quantizer`` then takes the checkpoint's settings, and refuses a ``model.quantize``
that contradicts them.
"""

from __future__ import annotations

from typing import Any

import torch

from tiertune.errors import ConfigError, ModelError
from tiertune.quant.bnb4 import NF4, SavedWeight
from tiertune.quant.bnb8 import Int8

Quantizer = NF4 | Int8
KINDS = ("none", "nf4", "fp4", "int8")

__all__ = [
    "KINDS",
    "NF4",
    "Int8",
    "Quantizer",
    "SavedWeight",
    "is_quantized",
    "make_quantizer",
    "saved_quantization",
]


def saved_quantization(config: Any, where: str = "the model") -> dict[str, Any] | None:
    """The bitsandbytes settings a pre-quantized checkpoint was saved with (its config's
    ``quantization_config``): ``{"kind": nf4|fp4|int8, "double_quant": bool, "skip": [...]}``, or None for an
    unquantized checkpoint. Raises ModelError for a quantization tiertune cannot read (fp8, GPTQ, AWQ...)."""
    raw = getattr(config, "quantization_config", None)
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raw = raw.to_dict() if hasattr(raw, "to_dict") else vars(raw)
    method = raw.get("quant_method", "bitsandbytes")
    if method != "bitsandbytes":
        raise ModelError(
            f"{where} is saved quantized with {method!r} (quantization_config in its config.json); tiertune "
            "reads unquantized checkpoints (bf16/fp16/fp32) and bitsandbytes 4-bit or 8-bit ones: point "
            "model.path at the bf16 release of the model, or at a bitsandbytes (bnb-4bit) one"
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


def make_quantizer(
    kind: str, compute_dtype: torch.dtype, saved: dict[str, Any] | None = None, where: str = "the model"
) -> Quantizer | None:
    """The quantizer of ``model.quantize`` (``none`` gives None). ``saved`` (``saved_quantization``) is the
    checkpoint's own quantization: its weights are read as they are, so ``kind`` must name the same one."""
    if kind not in KINDS:
        raise ValueError(
            f"the quantizations are {', '.join(KINDS)} (a recipe's model.quantize), got {kind!r}"
        )
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


def is_quantized(param: object) -> bool:
    """Whether ``param`` is a bitsandbytes 4-bit or 8-bit weight (a converted module's weight)."""
    if param is None:
        return False
    import bitsandbytes as bnb

    return isinstance(param, bnb.nn.Params4bit | bnb.nn.Int8Params)
