"""Triton kernel of NF4 dequantization (see ``nf4.py``)."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _dequantize(
    packed,
    code,
    absmax,
    code2,
    absmax2,
    offset,
    out,
    numel,
    blocksize,
    blocksize2,
    NESTED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One program per BLOCK outputs: each reads its byte (neighbours share it through the cache) so that
    # the stores stay contiguous.
    start = tl.program_id(0).to(tl.int64) * BLOCK
    idx = start + tl.arange(0, BLOCK)
    inside = idx < numel
    byte = tl.load(packed + idx // 2, mask=inside, other=0).to(tl.int32)
    nibble = (byte >> (4 - 4 * (idx % 2).to(tl.int32))) & 0xF  # even elements in the high nibble
    value = tl.load(code + nibble, mask=inside, other=0.0)
    block = idx // blocksize
    if NESTED:
        q = tl.load(absmax + block, mask=inside, other=0).to(tl.int32)
        group_scale = tl.load(absmax2 + block // blocksize2, mask=inside, other=0.0)
        scale = tl.load(code2 + q, mask=inside, other=0.0) * group_scale + tl.load(offset)
    else:
        scale = tl.load(absmax + block, mask=inside, other=0.0).to(tl.float32)
    tl.store(out + idx, (value * scale).to(out.dtype.element_ty), mask=inside)


def dequantize(packed: torch.Tensor, state, dtype: torch.dtype, code: torch.Tensor) -> torch.Tensor:
    """``packed`` (flat uint8) dequantized to ``state.shape`` in ``dtype``; ``code``: the 16 NF4 values, fp32
    on ``packed``'s device (``nf4.nf4_code``)."""
    device = packed.device
    numel = math.prod(state.shape)
    out = torch.empty(numel, dtype=dtype, device=device)
    if numel == 0:
        return out.view(state.shape)
    if state.nested:
        inner = state.state2
        stats = (
            state.absmax.contiguous(),
            inner.code.to(device, torch.float32).contiguous(),
            inner.absmax.to(device, torch.float32).contiguous(),
            torch.as_tensor(state.offset, dtype=torch.float32, device=device).reshape(1),
        )
        blocksize2 = inner.blocksize
    else:
        absmax = state.absmax.contiguous()
        stats, blocksize2 = (absmax, absmax, absmax, absmax), 1  # only absmax is read
    grid = (triton.cdiv(numel, BLOCK),)
    # No fused multiply-add: bitsandbytes rounds ``code2 * absmax2`` before adding the offset.
    _dequantize[grid](
        packed,
        code,
        *stats,
        out,
        numel,
        state.blocksize,
        blocksize2,
        NESTED=state.nested,
        BLOCK=BLOCK,
        enable_fp_fusion=False,
    )
    return out.view(state.shape)
