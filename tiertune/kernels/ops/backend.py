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
