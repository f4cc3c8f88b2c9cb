"""Triton kernels of the gated activation ``act(gate) * up`` (see ``swiglu.py``).

The tensors arrive as ``(rows, cols)`` views whose last dimension is contiguous; the row strides may differ
from ``cols`` (halves of a fused gate/up projection), so no copy is needed for them. Outputs are contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ACTIVATION_IDS = {"silu": 0, "gelu_tanh": 1}  # the kernels' ACT
BLOCK = 1024


@triton.jit
def _offsets(pid, n, n_cols, stride_a, stride_b, stride_c, CONTIGUOUS: tl.constexpr, BLOCK: tl.constexpr):
    # int64: a (tokens, intermediate) activation can pass 2**31 elements
    idx = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = idx < n
    if CONTIGUOUS:
        a, b, c = idx, idx, idx
    else:
        row = idx // n_cols
        col = idx - row * n_cols
        a, b, c = row * stride_a + col, row * stride_b + col, row * stride_c + col
    return idx, a, b, c, inside


@triton.jit
def _gelu_inner(g):
    # sqrt(2 / pi) * (g + 0.044715 g^3), the tanh argument; literals, as a constexpr global times a tensor
    # breaks under the interpreter
    return 0.7978845608028654 * (g + 0.044715 * g * g * g)


@triton.jit
def _tanh(z):
    # exp of a non-positive argument cannot overflow; libdevice.tanh would not run under the interpreter
    e = tl.exp(-2.0 * tl.abs(z))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(z < 0, -t, t)


@triton.jit
def _forward(
    g_ptr,
    u_ptr,
    y_ptr,
    n,
    n_cols,
    stride_g,
    stride_u,
    ACT: tl.constexpr,
    CONTIGUOUS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    out, og, ou, _, inside = _offsets(
        tl.program_id(0), n, n_cols, stride_g, stride_u, 0, CONTIGUOUS=CONTIGUOUS, BLOCK=BLOCK
    )
    gr = tl.load(g_ptr + og, mask=inside, other=0.0)
    g = gr.to(tl.float32)
    u = tl.load(u_ptr + ou, mask=inside, other=0.0).to(tl.float32)
    a = g * tl.sigmoid(g) if ACT == 0 else 0.5 * g * (1.0 + _tanh(_gelu_inner(g)))
    # eager torch rounds the activation to the input dtype before the product: so do we
    a = a.to(gr.dtype).to(tl.float32)
    tl.store(y_ptr + out, (a * u).to(gr.dtype), mask=inside)


@triton.jit
def _backward(
    dy_ptr,
    g_ptr,
    u_ptr,
    dg_ptr,
    du_ptr,
    n,
    n_cols,
    stride_dy,
    stride_g,
    stride_u,
    ACT: tl.constexpr,
    CONTIGUOUS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    out, og, ou, ody, inside = _offsets(
        tl.program_id(0), n, n_cols, stride_g, stride_u, stride_dy, CONTIGUOUS=CONTIGUOUS, BLOCK=BLOCK
    )
    gr = tl.load(g_ptr + og, mask=inside, other=0.0)
    g = gr.to(tl.float32)
    u = tl.load(u_ptr + ou, mask=inside, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + ody, mask=inside, other=0.0).to(tl.float32)
    # the activation and its derivative, recomputed from the saved gate
    if ACT == 0:
        s = tl.sigmoid(g)
        a = g * s
        da = s * (1.0 + g * (1.0 - s))
    else:
        t = _tanh(_gelu_inner(g))
        a = 0.5 * g * (1.0 + t)
        da = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * g * g)
    # the same roundings as autograd through eager torch: each product's gradient lands in the input dtype
    a = a.to(gr.dtype).to(tl.float32)
    d_act = (dy * u).to(gr.dtype).to(tl.float32)
    tl.store(dg_ptr + out, (d_act * da).to(gr.dtype), mask=inside)
    tl.store(du_ptr + out, (dy * a).to(gr.dtype), mask=inside)


def _contiguous(n_cols: int, *tensors: torch.Tensor) -> bool:
    return all(t.shape[0] <= 1 or t.stride(0) == n_cols for t in tensors)


def glu_forward(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(gate) * up`` of two ``(rows, cols)`` views with unit column stride; the result is contiguous."""
    rows, cols = gate.shape
    y = torch.empty((rows, cols), dtype=gate.dtype, device=gate.device)
    n = rows * cols
    if n == 0:
        return y
    _forward[(triton.cdiv(n, BLOCK),)](
        gate,
        up,
        y,
        n,
        cols,
        gate.stride(0),
        up.stride(0),
        ACT=ACTIVATION_IDS[activation],
        CONTIGUOUS=_contiguous(cols, gate, up),
        BLOCK=BLOCK,
    )
    return y


def glu_backward(
    dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of ``act(gate) * up`` for gate and up (contiguous), recomputing the activation."""
    rows, cols = gate.shape
    dg = torch.empty((rows, cols), dtype=gate.dtype, device=gate.device)
    du = torch.empty_like(dg)
    n = rows * cols
    if n == 0:
        return dg, du
    _backward[(triton.cdiv(n, BLOCK),)](
        dy,
        gate,
        up,
        dg,
        du,
        n,
        cols,
        dy.stride(0),
        gate.stride(0),
        up.stride(0),
        ACT=ACTIVATION_IDS[activation],
        CONTIGUOUS=_contiguous(cols, dy, gate, up),
        BLOCK=BLOCK,
    )
    return dg, du
