"""Triton kernel of RoPE (see ``rope.py``): one program per (batch, position) and block of heads."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope(
    x,
    y,
    cos,
    sin,
    sxb,
    sxh,
    sxs,
    sxd,
    syb,
    syh,
    sys,
    syd,
    scb,
    scs,
    scd,
    ssb,
    sss,
    ssd,
    seq,
    heads,
    half,
    dim,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    BACKWARD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    b = token // seq
    s = token % seq
    h = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
    c = tl.arange(0, BLOCK_HALF)
    in_c = c < half
    c_row = cos + b * scb + s * scs
    s_row = sin + b * ssb + s * sss
    c1 = tl.load(c_row + c * scd, mask=in_c, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(c_row + (c + half) * scd, mask=in_c, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(s_row + c * ssd, mask=in_c, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(s_row + (c + half) * ssd, mask=in_c, other=0.0).to(tl.float32)[None, :]

    x_rows = x + b * sxb + s * sxs + h[:, None] * sxh
    y_rows = y + b * syb + s * sys + h[:, None] * syh
    inside = (h < heads)[:, None] & in_c[None, :]
    x1 = tl.load(x_rows + c[None, :] * sxd, mask=inside, other=0.0).to(tl.float32)
    x2 = tl.load(x_rows + (c[None, :] + half) * sxd, mask=inside, other=0.0).to(tl.float32)
    if BACKWARD:  # the transpose: [x1, x2] -> [x1*c1 + x2*s2, x2*c2 - x1*s1]
        r1 = x2 * s2
        r2 = -(x1 * s1)
    else:  # x*cos + rotate_half(x)*sin, rotate_half(x) = [-x2, x1]
        r1 = -(x2 * s1)
        r2 = x1 * s2
    # eager torch rounds each product to the output dtype before the add; written the same here, but compiled
    # for an H100 (Triton 3.6) the results still differed from eager's by one bf16 ulp in 11-23% of elements
    # (the same bits under the interpreter): tests/kernels/test_rope.py holds both to the float64 truth
    dt = y.dtype.element_ty
    y1 = (x1 * c1).to(dt).to(tl.float32) + r1.to(dt).to(tl.float32)
    y2 = (x2 * c2).to(dt).to(tl.float32) + r2.to(dt).to(tl.float32)
    tl.store(y_rows + c[None, :] * syd, y1.to(dt), mask=inside)
    tl.store(y_rows + (c[None, :] + half) * syd, y2.to(dt), mask=inside)

    if BLOCK_PASS > 0:  # partial rotary: the features after rot_dim are copied through
        p = 2 * half + tl.arange(0, BLOCK_PASS)
        keep = (h < heads)[:, None] & (p < dim)[None, :]
        v = tl.load(x_rows + p[None, :] * sxd, mask=keep, other=0.0)
        tl.store(y_rows + p[None, :] * syd, v.to(dt), mask=keep)


def rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out_dtype: torch.dtype, backward: bool = False
) -> torch.Tensor:
    """RoPE of ``x`` [batch, heads, seq, head_dim] (any strides) by ``cos``/``sin`` [batch or 1, seq, rot_dim];
    ``backward`` rotates by ``-sin`` instead (the gradient). The result keeps ``x``'s memory layout when it is
    dense, and is contiguous otherwise."""
    batch, heads, seq, dim = x.shape
    y = torch.empty_like(x, dtype=out_dtype)
    if y.numel() == 0:
        return y
    half = cos.shape[-1] // 2
    block_half = triton.next_power_of_2(half)
    block_pass = triton.next_power_of_2(dim - 2 * half) if dim > 2 * half else 0
    block_h = min(triton.next_power_of_2(heads), max(1, 2048 // block_half))
    # cos/sin of batch 1 are shared by every sequence: a zero batch stride
    cb = cos.stride(0) if cos.shape[0] > 1 else 0
    sb = sin.stride(0) if sin.shape[0] > 1 else 0
    grid = (batch * seq, triton.cdiv(heads, block_h))
    _rope[grid](
        x,
        y,
        cos,
        sin,
        *x.stride(),
        *y.stride(),
        cb,
        *cos.stride()[1:],
        sb,
        *sin.stride()[1:],
        seq,
        heads,
        half,
        dim,
        BLOCK_H=block_h,
        BLOCK_HALF=block_half,
        BLOCK_PASS=block_pass,
        BACKWARD=backward,
    )
    return y
