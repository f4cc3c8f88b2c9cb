"""Triton kernel of a matrix product with an FP8 blockwise weight, dequantized inside it (see ``fp8.py``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tiertune.kernels.ops._triton_tiles import load_rows, store_rows


@triton.jit
def _e4m3(bits):
    """FP8 e4m3fn codes (as integers) to fp32: (8 + m) 2^(e - 10) for an exponent e > 0, m 2^-9 below."""
    e = (bits >> 3) & 0xF
    m = (bits & 0x7).to(tl.float32)
    magnitude = tl.where(e == 0, m * 0.001953125, (8.0 + m) * tl.exp2((e - 10).to(tl.float32)))
    return tl.where((bits & 0x80) != 0, -magnitude, magnitude)


@triton.jit
def _matmul(
    a,
    codes,
    scale,
    out,
    M,
    P,
    R,
    stride_am,
    stride_ar,
    stride_cp,
    stride_cr,
    stride_sp,
    stride_sr,
    stride_om,
    stride_op,
    SCALE_P: tl.constexpr,
    SCALE_R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    # out[m, p] = sum_r a[m, r] * W[p, r], W[p, r] = codes[p, r] * scale[p // SCALE_P, r // SCALE_R] (strides
    # make W or its transpose). A tile lies inside one scale block (BLOCK_P divides SCALE_P, BLOCK_R SCALE_R),
    # so each tile's product is scaled once: no dequantized weight is ever written to memory.
    pid_m = tl.program_id(0)
    pid_p = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rp = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    acc = tl.zeros((BLOCK_M, BLOCK_P), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        rr = r0 + tl.arange(0, BLOCK_R)
        x = load_rows(a, rm, rr, M, R, stride_am, stride_ar)
        bits = tl.load(
            codes + rr[:, None] * stride_cr + rp[None, :] * stride_cp,
            mask=(rr[:, None] < R) & (rp[None, :] < P),
            other=0,
        ).to(tl.int32)
        w = _e4m3(bits).to(x.dtype)  # (BLOCK_R, BLOCK_P): exact in bf16 and fp16 (3 mantissa bits)
        s = tl.load(scale + (pid_p * BLOCK_P // SCALE_P) * stride_sp + (r0 // SCALE_R) * stride_sr).to(
            tl.float32
        )
        acc += tl.dot(x, w) * s
    store_rows(out, acc, rm, rp, M, P, stride_om, stride_op)


def _tile(block: int, limit: int) -> int:
    """The largest power of two up to ``limit`` that divides ``block`` (a scale block's side)."""
    tile = 16
    while tile * 2 <= limit and block % (tile * 2) == 0:
        tile *= 2
    return tile


def matmul(
    a: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], transposed: bool
) -> torch.Tensor:
    """``a @ W.T`` (``transposed`` False: a (M, in) input) or ``a @ W`` (True: a (M, out) gradient) for the FP8
    weight ``W`` of ``codes`` (out, in; e4m3fn) and ``scale`` (one a ``block``), in ``a``'s dtype."""
    # W (out, in) or its transpose as (P, R): the product's columns by the reduction, and their scale blocks
    bits = codes.view(torch.uint8)
    bits, scale = (bits.t(), scale.t()) if transposed else (bits, scale)
    scale_p, scale_r = block[::-1] if transposed else block
    P, R = bits.shape
    M = a.shape[0]
    out = torch.empty((M, P), dtype=a.dtype, device=a.device)
    if M == 0:
        return out
    block_m = 64 if M >= 64 else 16
    block_p, block_r = _tile(scale_p, 128), _tile(scale_r, 64)
    grid = (triton.cdiv(M, block_m), triton.cdiv(P, block_p))
    _matmul[grid](
        a,
        bits,
        scale,
        out,
        M,
        P,
        R,
        a.stride(0),
        a.stride(1),
        bits.stride(0),
        bits.stride(1),
        scale.stride(0),
        scale.stride(1),
        out.stride(0),
        out.stride(1),
        SCALE_P=scale_p,
        SCALE_R=scale_r,
        BLOCK_M=block_m,
        BLOCK_P=block_p,
        BLOCK_R=block_r,
    )
    return out
