"""Which implementation of an op runs: its Triton kernels or its torch reference."""

from __future__ import annotations

import importlib.util
import os

import torch


def triton_available() -> bool:
    """Whether Triton can run here: installed, and a GPU or its interpreter (``TRITON_INTERPRET=1``)."""
    if importlib.util.find_spec("triton") is None:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def choose_backend(backend: str, x: torch.Tensor) -> str:
    """``backend`` made concrete for an op on ``x``: ``auto`` is ``triton`` on a CUDA tensor where Triton can
    run, else ``torch``; ``torch`` and ``triton`` stay; anything else raises ValueError."""
    if backend == "auto":
        return "triton" if x.is_cuda and triton_available() else "torch"
    if backend not in ("torch", "triton"):
        raise ValueError(f"backend must be auto, torch or triton, got {backend!r}")
    return backend
