"""Triton kernels of RMSNorm (see ``rms_norm.py``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _forward(x, y, w, rstd, stride, n_cols, eps, offset, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < n_cols
    xr = tl.load(x + row * stride + cols, mask=inside, other=0.0)
    h = xr.to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(h * h, 0) / n_cols + eps)
    tl.store(rstd + row, r)
    wr = tl.load(w + cols, mask=inside, other=0.0).to(tl.float32)
    normed = (h * r).to(xr.dtype).to(tl.float32)  # cast back before the weight, as the reference does
    tl.store(y + row * stride + cols, ((offset + wr) * normed).to(xr.dtype), mask=inside)


@triton.jit
def _backward(
    dy,
    x,
    w,
    rstd,
    dx,
    dw_partial,
    stride,
    n_rows,
    n_cols,
    offset,
    ROWS_PER: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < n_cols
    wr = tl.load(w + cols, mask=inside, other=0.0).to(tl.float32) + offset
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(ROWS_PER):
        row = pid * ROWS_PER + i
        if row < n_rows:
            h = tl.load(x + row * stride + cols, mask=inside, other=0.0).to(tl.float32)
            g = tl.load(dy + row * stride + cols, mask=inside, other=0.0).to(tl.float32)
            r = tl.load(rstd + row)
            xhat = h * r
            gw = g * wr
            c = tl.sum(gw * xhat, 0) / n_cols
            tl.store(dx + row * stride + cols, (r * (gw - xhat * c)).to(dx.dtype.element_ty), mask=inside)
            dw += g * xhat
    tl.store(dw_partial + pid * BLOCK + cols, dw, mask=inside)


def rms_norm_forward(x: torch.Tensor, w: torch.Tensor, eps: float, offset: float):
    rows, cols = x.shape
    y = torch.empty_like(x)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(cols)
    _forward[(rows,)](x, y, w, rstd, x.stride(0), cols, eps, offset, BLOCK=block)
    return y, rstd


def rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rstd: torch.Tensor, offset: float):
    rows, cols = x.shape
    block = triton.next_power_of_2(cols)
    programs = min(rows, 256)
    per = -(-rows // programs)
    dx = torch.empty_like(x)
    partial = torch.empty((programs, block), dtype=torch.float32, device=x.device)
    _backward[(programs,)](
        dy, x, w, rstd, dx, partial, x.stride(0), rows, cols, offset, ROWS_PER=per, BLOCK=block
    )
    return dx, partial[:, :cols].sum(0)
