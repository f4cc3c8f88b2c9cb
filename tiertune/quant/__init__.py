"""Quantized weights as chunk payloads, through bitsandbytes: NF4 (``bnb4``) and INT8 (``bnb8``)."""

from __future__ import annotations

import torch

from tiertune.errors import ConfigError
from tiertune.quant.bnb4 import NF4
from tiertune.quant.bnb8 import Int8

Quantizer = NF4 | Int8


def make_quantizer(kind: str, compute_dtype: torch.dtype) -> Quantizer | None:
    """The quantizer of ``model.quantize`` (``none`` gives None)."""
    if kind == "none":
        return None
    if kind == "nf4":
        return NF4(compute_dtype)
    if kind == "int8":
        return Int8(compute_dtype)
    raise ConfigError(f"model.quantize must be none, nf4 or int8, got {kind!r}")


def is_quantized(param: object) -> bool:
    """Whether ``param`` is a bitsandbytes 4-bit or 8-bit weight (a converted module's weight)."""
    if param is None:
        return False
    import bitsandbytes as bnb

    return isinstance(param, bnb.nn.Params4bit | bnb.nn.Int8Params)
