"""What the dequantize-matmul kernels (``_triton_fp8.py``, ``_triton_mxfp4.py``) share: the tile of the input they
read at each step of the reduction and the tile of the output they write. Each decodes its own weight tile."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_rows(a, rm, rr, M, R, stride_am, stride_ar):
    """The (BLOCK_M, BLOCK_R) tile of ``a`` at rows ``rm`` and reduction columns ``rr`` (0 outside it)."""
    return tl.load(
        a + rm[:, None] * stride_am + rr[None, :] * stride_ar,
        mask=(rm[:, None] < M) & (rr[None, :] < R),
        other=0.0,
    )


@triton.jit
def store_rows(out, acc, rm, rp, M, P, stride_om, stride_op):
    """``acc`` (fp32) written as the (BLOCK_M, BLOCK_P) tile of ``out`` at rows ``rm``, columns ``rp``."""
    tl.store(
        out + rm[:, None] * stride_om + rp[None, :] * stride_op,
        acc.to(out.dtype.element_ty),
        mask=(rm[:, None] < M) & (rp[None, :] < P),
    )
