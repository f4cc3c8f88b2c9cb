"""Which implementation of an op runs: its Triton kernels or its torch reference; and how the torch paths walk a
long input (``row_tiles``)."""

from __future__ import annotations

import importlib.util
import os

import torch


def triton_available() -> bool:
    """Whether Triton can run here: installed, and a GPU or its interpreter (``TRITON_INTERPRET=1``)."""
    if importlib.util.find_spec("triton") is None:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def default_backend(device: torch.device) -> str:
    """What ``auto`` means on ``device``: ``triton`` on a CUDA device where Triton can run, else ``torch``."""
    return "triton" if device.type == "cuda" and triton_available() else "torch"


def choose_backend(backend: str, x: torch.Tensor) -> str:
    """``backend`` made concrete for an op on ``x``: ``auto`` is ``default_backend(x.device)``; ``torch`` and
    ``triton`` stay; anything else raises ValueError."""
    if backend == "auto":
        return default_backend(x.device)
    if backend not in ("torch", "triton"):
        raise ValueError(f"backend must be auto, torch or triton, got {backend!r}")
    return backend


def native_matmul(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies ``dtype`` (bf16 or fp16) matrices natively: oneDNN's own check (AVX-512 BF16 or
    FP16, or AMX). Without it torch computes them with a scalar loop, far slower than fp32."""
    checks = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}
    check = getattr(torch.ops.mkldnn, checks[dtype], None)
    try:
        return bool(check()) if check is not None else False
    except RuntimeError:  # a build without oneDNN
        return False


def matmul_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype that matrix products of ``dtype`` values run in on ``device``: ``dtype`` itself, except bf16
    and fp16 on a CPU that has no native support for them (``native_matmul``), where fp32 is faster (an AMD
    EPYC with AVX2 took over 26 minutes for one step of a 104B QLoRA in bf16). Dequantized 4-bit weights are
    computed in it."""
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float16) or native_matmul(dtype):
        return dtype
    return torch.float32


def row_tiles(rows: int, size: int) -> list[slice]:
    """``rows`` rows cut into slices of ``size`` (the last shorter): the torch paths compute a long input a tile
    at a time so that their fp32 temporaries are a tile's, not the input's."""
    return [slice(i, i + size) for i in range(0, rows, size)]
