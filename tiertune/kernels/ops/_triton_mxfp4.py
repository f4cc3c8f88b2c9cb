"""Triton kernel of a matrix product with an MXFP4 weight, dequantized inside it (see ``mxfp4.py``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tiertune.kernels.ops._triton_tiles import load_rows, store_rows


@triton.jit
def _e2m1(code):
    """FP4 e2m1 codes (0..15, as integers) to fp32: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives."""
    e = (code >> 1) & 0x3
    m = (code & 0x1).to(tl.float32)
    magnitude = tl.where(e == 0, m * 0.5, (1.0 + m * 0.5) * tl.exp2((e - 1).to(tl.float32)))
    return tl.where((code & 0x8) != 0, -magnitude, magnitude)


@triton.jit
def _matmul(
    a,
    blocks,
    scales,
    out,
    M,
    P,
    R,
    stride_am,
    stride_ar,
    stride_bo,
    stride_so,
    stride_om,
    stride_op,
    TRANSPOSED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    # out[m, p] = sum_r a[m, r] * W(p, r). W's element (o, i) of the (out, in) matrix is the code in nibble i % 2
    # of byte (i // 2) of row o's blocks, times 2^(scales[o, i // 32] - 127); forward (o, i) = (p, r), the input's
    # gradient (TRANSPOSED) (o, i) = (r, p). The weight is decoded tile by tile, never written to memory.
    pid_m = tl.program_id(0)
    pid_p = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rp = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    acc = tl.zeros((BLOCK_M, BLOCK_P), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        rr = r0 + tl.arange(0, BLOCK_R)
        x = load_rows(a, rm, rr, M, R, stride_am, stride_ar)
        if TRANSPOSED:
            o = rr[:, None]
            i = rp[None, :]
        else:
            o = rp[None, :]
            i = rr[:, None]
        inside = (rr[:, None] < R) & (rp[None, :] < P)
        byte = tl.load(blocks + o * stride_bo + i // 2, mask=inside, other=0).to(tl.int32)
        code = (byte >> ((i % 2) * 4)) & 0xF
        exponent = tl.load(scales + o * stride_so + i // 32, mask=inside, other=127).to(tl.int32)
        w = _e2m1(code) * tl.exp2((exponent - 127).to(tl.float32))  # (BLOCK_R, BLOCK_P)
        acc += tl.dot(x, w.to(x.dtype))
    store_rows(out, acc, rm, rp, M, P, stride_om, stride_op)


def matmul(a: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, transposed: bool) -> torch.Tensor:
    """``a @ W.T`` (``transposed`` False: a (M, in) input) or ``a @ W`` (True: a (M, out) gradient) for the MXFP4
    weight ``W`` of ``blocks`` (out, in / 32, 16) uint8 and ``scales`` (out, in / 32) uint8, in ``a``'s dtype."""
    rows = blocks.shape[0]
    cols = blocks.shape[1] * 32
    flat_blocks = blocks.reshape(rows, -1)
    flat_scales = scales.reshape(rows, -1)
    P, R = (cols, rows) if transposed else (rows, cols)
    M = a.shape[0]
    out = torch.empty((M, P), dtype=a.dtype, device=a.device)
    if M == 0:
        return out
    block_m = 64 if M >= 64 else 16
    grid = (triton.cdiv(M, block_m), triton.cdiv(P, 64))
    _matmul[grid](
        a,
        flat_blocks,
        flat_scales,
        out,
        M,
        P,
        R,
        a.stride(0),
        a.stride(1),
        flat_blocks.stride(0),
        flat_scales.stride(0),
        out.stride(0),
        out.stride(1),
        TRANSPOSED=transposed,
        BLOCK_M=block_m,
        BLOCK_P=64,
        BLOCK_R=32,
    )
    return out
