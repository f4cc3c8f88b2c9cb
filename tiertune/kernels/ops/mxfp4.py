"""A product with one MXFP4 expert matrix (gpt-oss's experts as they ship): e2m1 codes, two to a byte, in groups of
32 along the inputs with one e8m0 scale (a power of two biased by 127) each; element (o, i) is ``code * 2^(scale[o,
i // 32] - 127)``.

On a GPU with Triton the product runs in one kernel (``_triton_mxfp4.py``) that decodes each tile of codes and
scales into the input's dtype as it multiplies: the 16-bit matrix is never written to memory. Backward computes
the input's gradient the same way from the same bytes; the weight gets none. Elsewhere the matrix is dequantized
and multiplied.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tiertune.kernels.ops.backend import choose_backend

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""e2m1's 16 values, by code (the sign in bit 3)."""


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The (out, in) matrix of ``blocks`` (out, in / 32, 16) and ``scales`` (out, in / 32), in ``dtype``: each code
    (the low nibble first) times its group's power of two, computed in fp32."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)
    values = torch.ldexp(codes.reshape(*blocks.shape[:-1], 32), (scales.to(torch.int32) - 127)[..., None])
    return values.reshape(blocks.shape[0], -1).to(dtype)


class MXFP4Linear(torch.autograd.Function):
    """``x @ W.T`` (x 2-D) over a frozen MXFP4 matrix, by the fused kernel (``triton``) or dequantized
    (``torch``); only the bytes are kept for backward."""

    @staticmethod
    def forward(ctx, x, blocks, scales, backend):  # type: ignore[no-untyped-def]
        ctx.save_for_backward(blocks, scales)
        ctx.backend = backend
        if backend == "triton":
            from tiertune.kernels.ops._triton_mxfp4 import matmul

            return matmul(x, blocks, scales, transposed=False)
        return F.linear(x, dequantize_mxfp4(blocks, scales, x.dtype))

    @staticmethod
    def backward(ctx, dy):  # type: ignore[no-untyped-def]
        blocks, scales = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        if ctx.backend == "triton":
            from tiertune.kernels.ops._triton_mxfp4 import matmul

            return matmul(dy.contiguous(), blocks, scales, transposed=True), None, None, None
        return dy @ dequantize_mxfp4(blocks, scales, dy.dtype), None, None, None


def mxfp4_linear(
    x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, backend: str = "auto"
) -> torch.Tensor:
    """``x @ W.T`` for the MXFP4 matrix ``(blocks, scales)`` in ``x``'s dtype: the fused kernel (``triton``, or
    ``auto`` on a GPU with Triton), else the matrix dequantized and multiplied."""
    backend = choose_backend(backend, x)
    flat = x.reshape(-1, x.shape[-1])
    out = MXFP4Linear.apply(flat, blocks, scales, backend)
    return out.reshape(*x.shape[:-1], blocks.shape[0])


__all__ = ["FP4_VALUES", "MXFP4Linear", "dequantize_mxfp4", "mxfp4_linear"]
