"""A linear layer over a frozen FP8 blockwise weight (DeepSeek-V3's, Kimi-K2's, GLM-4.6's and Qwen3's FP8
releases): e4m3 codes with one scale per ``block`` (rows, columns), element (r, c) ``codes[r, c] * scale[r //
b0, c // b1]``.

On a GPU with Triton the product runs in one kernel (``_triton_fp8.py``) that reads the 1-byte codes and decodes
them tile by tile into the input's dtype, scaling each tile's partial product once: the 16-bit weight is never
written to memory, where eager code writes it whole and reads it back (twice the weight's bytes in 16 bits, per
use). Backward computes the input's gradient the same way from the same codes; the weight gets none. Elsewhere
(a CPU, blocks that are not multiples of 16) the weight is dequantized and multiplied as ``F.linear`` does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tiertune.kernels.ops.backend import choose_backend


def dequantize_fp8(
    codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """The weight of ``codes`` (out, in) and ``scale`` (one a ``block``) in ``dtype``: computed in fp32, as
    DeepSeek's ``weight_dequant`` does, then rounded once."""
    rows, cols = codes.shape
    s = scale.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return (codes.float() * s).to(dtype)


def fused(block: tuple[int, int]) -> bool:
    """Whether the kernel takes scale blocks of ``block``: each side a multiple of 16 (a tile of its products)."""
    return block[0] % 16 == 0 and block[1] % 16 == 0


class FP8Linear(torch.autograd.Function):
    """``x @ W.T`` (x 2-D) over a frozen FP8 weight: by the fused kernel (``triton``), or with the weight
    dequantized and ``F.linear`` (``torch``); either way only the codes and scales are kept for backward, which
    computes the input's gradient from them again (the weight gets none)."""

    @staticmethod
    def forward(ctx, x, codes, scale, block, backend):  # type: ignore[no-untyped-def]
        ctx.save_for_backward(codes, scale)
        ctx.block, ctx.backend = block, backend
        if backend == "triton":
            from tiertune.kernels.ops._triton_fp8 import matmul

            return matmul(x, codes, scale, block, transposed=False)
        return F.linear(x, dequantize_fp8(codes, scale, block, x.dtype))

    @staticmethod
    def backward(ctx, dy):  # type: ignore[no-untyped-def]
        codes, scale = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        if ctx.backend == "triton":
            from tiertune.kernels.ops._triton_fp8 import matmul

            return matmul(dy.contiguous(), codes, scale, ctx.block, transposed=True), None, None, None, None
        return dy @ dequantize_fp8(codes, scale, ctx.block, dy.dtype), None, None, None, None


def fp8_linear(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """``x @ W.T + bias`` for the FP8 weight ``(codes, scale)`` in ``x``'s dtype: the fused kernel (``triton``,
    or ``auto`` on a GPU with Triton, for blocks ``fused`` takes), else the weight dequantized and multiplied."""
    backend = choose_backend(backend, x)
    if backend == "triton" and not fused(block):
        backend = "torch"
    flat = x.reshape(-1, x.shape[-1])
    out = FP8Linear.apply(flat, codes, scale.float().contiguous(), block, backend)
    out = out.reshape(*x.shape[:-1], codes.shape[0])
    return out if bias is None else out + bias.to(out.dtype)


__all__ = ["FP8Linear", "dequantize_fp8", "fp8_linear", "fused"]
