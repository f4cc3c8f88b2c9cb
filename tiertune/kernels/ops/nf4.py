"""NF4 dequantization from bitsandbytes' packed format, and a linear layer over a frozen NF4 weight.

The layout is what ``bitsandbytes.functional.quantize_4bit`` writes: the weight flattened row-major, two 4-bit
codes per byte with the first element in the high nibble (an odd element count leaves the last low nibble as
padding), and one scale per ``blocksize`` consecutive elements of the *flattened* weight (the last block may
be short, and blocks run across rows). A value is ``NF4_CODE[code] * scale``, computed in fp32 and then cast.
When the state is nested (``compress_statistics=True``) the scales are themselves uint8 codes into
``state.state2.code`` (bitsandbytes' dynamic 8-bit map), one fp32 ``state2.absmax`` per ``state2.blocksize``
(256) of them, plus ``state.offset``: ``scale = state2.code[q] * state2.absmax[i // 256] + offset``.

``dequantize_nf4_reference`` is the oracle and the CPU path; the Triton kernel does the same in one pass,
decoding the scale from the double-quantized statistics per element (no intermediate scale tensor).
``NF4Linear`` is ``F.linear`` over such a weight that keeps only the packed bytes for backward, as
bitsandbytes' ``MatMul4Bit`` does for a frozen base weight.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tiertune.kernels.ops.backend import choose_backend

# bitsandbytes' NF4 table (``bitsandbytes.functional.get_4bit_type("nf4")``; a test checks they are equal).
NF4_CODE = torch.tensor(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ],
    dtype=torch.float32,
)

_codes: dict[torch.device, torch.Tensor] = {}


def nf4_code(device: torch.device) -> torch.Tensor:
    """``NF4_CODE`` on ``device`` (copied once per device)."""
    if device not in _codes:
        _codes[device] = NF4_CODE.to(device)
    return _codes[device]


def packed_bytes(packed: torch.Tensor, state) -> torch.Tensor:
    """The packed weight as a flat uint8 tensor, checked against ``state`` (nf4, enough bytes)."""
    if state.quant_type != "nf4":
        raise ValueError(f"expected an nf4 quant state, got quant_type={state.quant_type!r}")
    if packed.dtype != torch.uint8:  # bitsandbytes' quant_storage: the same bytes in a wider dtype
        packed = packed.contiguous().view(torch.uint8)
    packed = packed.reshape(-1)
    numel = math.prod(state.shape)
    if packed.numel() < (numel + 1) // 2:
        raise ValueError(
            f"packed weight has {packed.numel()} bytes, a weight of shape {tuple(state.shape)} needs "
            f"{(numel + 1) // 2}"
        )
    return packed


def dequantize_nf4_reference(packed: torch.Tensor, state, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The weight of shape ``state.shape`` in ``dtype`` (default ``state.dtype``), as bitsandbytes'
    ``dequantize_4bit`` computes it: products in fp32, cast once at the end."""
    packed = packed_bytes(packed, state)
    numel, blocksize = math.prod(state.shape), state.blocksize
    codes = torch.stack((packed >> 4, packed & 0xF), dim=1).reshape(-1)[:numel]
    values = nf4_code(packed.device)[codes.int()]
    blocks = -(-numel // blocksize)
    scale = block_scales(state, blocks)
    values = F.pad(values, (0, blocks * blocksize - numel)).view(blocks, blocksize) * scale[:, None]
    return values.reshape(-1)[:numel].to(dtype or state.dtype).view(state.shape)


def block_scales(state, blocks: int) -> torch.Tensor:
    """The fp32 scale of each of the ``blocks`` blocks, decoded from the nested statistics if there are."""
    if not state.nested:
        return state.absmax[:blocks].float()
    inner = state.state2
    scales = inner.code.float()[state.absmax[:blocks].int()]
    groups = -(-blocks // inner.blocksize)
    scales = F.pad(scales, (0, groups * inner.blocksize - blocks)).view(groups, inner.blocksize)
    scales = (scales * inner.absmax[:groups].float()[:, None]).reshape(-1)[:blocks]
    return scales + torch.as_tensor(state.offset, dtype=torch.float32, device=scales.device)


def dequantize_nf4(
    packed: torch.Tensor, state, backend: str = "auto", dtype: torch.dtype | None = None
) -> torch.Tensor:
    """The weight of shape ``state.shape`` in ``dtype`` (default ``state.dtype``), with the Triton kernel
    (``triton``, or ``auto`` on a GPU with Triton) or the reference."""
    backend = choose_backend(backend, packed)
    if backend == "triton":
        from tiertune.kernels.ops._triton_nf4 import dequantize

        return dequantize(packed_bytes(packed, state), state, dtype or state.dtype, nf4_code(packed.device))
    return dequantize_nf4_reference(packed, state, dtype)


class NF4Linear(torch.autograd.Function):
    """``F.linear(x, W, bias)`` over a frozen NF4 weight ``W``: only the packed bytes are kept for backward,
    which dequantizes again for the input's gradient; the weight gets none. ``W`` is dequantized straight
    to ``x.dtype``."""

    @staticmethod
    def forward(ctx, x, packed, state, bias, backend):
        weight = dequantize_nf4(packed, state, backend, dtype=x.dtype)
        ctx.save_for_backward(packed)
        ctx.state, ctx.backend = state, backend
        ctx.bias_dtype = None if bias is None else bias.dtype
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        (packed,) = ctx.saved_tensors
        dx = dbias = None
        if ctx.needs_input_grad[0]:
            dx = dy.matmul(dequantize_nf4(packed, ctx.state, ctx.backend, dtype=dy.dtype))
        if ctx.needs_input_grad[3]:
            dbias = dy.reshape(-1, dy.shape[-1]).sum(0, dtype=ctx.bias_dtype)
        return dx, None, None, dbias, None


def nf4_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    state,
    bias: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """``x @ W.T + bias`` for the NF4 weight ``(packed, state)`` (a bitsandbytes ``QuantState``); ``bias``
    is cast to ``x.dtype`` as ``Linear4bit`` does."""
    backend = choose_backend(backend, x)
    if bias is not None:
        bias = bias.to(x.dtype)
    return NF4Linear.apply(x, packed, state, bias, backend)
