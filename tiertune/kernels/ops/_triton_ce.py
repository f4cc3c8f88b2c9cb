"""The Triton kernel of the fused linear + cross-entropy: one program per row of a chunk of logits computes
the row's loss with an online log-sum-exp, then overwrites the row with its gradient (softmax minus one-hot,
times the reduction's scale). With ``CAPPED`` the logits ``z`` are soft-capped as they are read,
``softcap * tanh(z / softcap)``, and the gradient is taken through the cap. Imported only when the Triton
backend runs (GPU, or ``TRITON_INTERPRET=1``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _tanh(y):
    # exp of a non-positive argument cannot overflow; near 0, where 1 - exp(-2|y|) loses digits (logits of a
    # few units under a cap of 30), the series; libdevice.tanh would not run under the interpreter
    a = tl.abs(y)
    e = tl.exp(-2.0 * a)
    a2 = a * a
    series = a * (
        1.0
        + a2
        * (
            -0.3333333333333333
            + a2 * (0.13333333333333333 + a2 * (-0.05396825396825397 + a2 * 0.021869488536155203))
        )
    )
    t = tl.where(a < 0.25, series, (1.0 - e) / (1.0 + e))
    return tl.where(y < 0, -t, t)


@triton.jit
def _ce_rows(
    logits,
    stride,
    target,
    loss,
    n_cols,
    ignore_index,
    scale,
    softcap,
    BLOCK: tl.constexpr,
    CAPPED: tl.constexpr,
):
    row = tl.program_id(0)
    base = logits + row * stride
    t = tl.load(target + row)
    m = float("-inf")
    d = 0.0
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < n_cols
        x = tl.load(base + cols, mask=inside, other=float("-inf")).to(tl.float32)
        if CAPPED:  # the padding stays -inf (the cap would make it -softcap)
            x = tl.where(inside, softcap * _tanh(x / softcap), float("-inf"))
        m_new = tl.maximum(m, tl.max(x, 0))
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
    lse = m + tl.log(d)
    keep = t != ignore_index
    tt = tl.where(keep, t, 0)
    picked = tl.load(base + tt).to(tl.float32)
    if CAPPED:
        picked = softcap * _tanh(picked / softcap)
    tl.store(loss + row, tl.where(keep, lse - picked, 0.0))
    weight = tl.where(keep, scale, 0.0)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < n_cols
        x = tl.load(base + cols, mask=inside, other=0.0).to(tl.float32)
        if CAPPED:
            th = _tanh(x / softcap)
            grad = tl.exp(softcap * th - lse) - tl.where(cols == tt, 1.0, 0.0)
            grad = grad * (1.0 - th * th)  # d softcap * tanh(z / softcap) / dz
        else:
            grad = tl.exp(x - lse) - tl.where(cols == tt, 1.0, 0.0)
        tl.store(base + cols, grad * weight, mask=inside)


def ce_rows(
    logits: torch.Tensor, target: torch.Tensor, ignore_index: int, scale: float, softcap: float | None = None
) -> torch.Tensor:
    """Per-row losses of fp32 ``logits`` [rows, vocab] (0 for ignored rows), soft-capped when ``softcap`` is
    given; ``logits`` becomes their gradient (with respect to the logits before the cap)."""
    rows, vocab = logits.shape
    loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    block = min(4096, triton.next_power_of_2(vocab))
    cap = 1.0 if softcap is None else softcap
    _ce_rows[(rows,)](
        logits,
        logits.stride(0),
        target,
        loss,
        vocab,
        ignore_index,
        scale,
        cap,
        BLOCK=block,
        CAPPED=softcap is not None,
    )
    return loss
