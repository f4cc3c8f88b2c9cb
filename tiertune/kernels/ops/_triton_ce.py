"""The Triton kernel of the fused linear + cross-entropy: one program per row of a chunk of logits computes
the row's loss with an online log-sum-exp, then overwrites the row with its gradient (softmax minus one-hot,
times the reduction's scale). Imported only when the Triton backend runs (GPU, or ``TRITON_INTERPRET=1``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _ce_rows(logits, stride, target, loss, n_cols, ignore_index, scale, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = logits + row * stride
    t = tl.load(target + row)
    m = float("-inf")
    d = 0.0
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
    lse = m + tl.log(d)
    keep = t != ignore_index
    tt = tl.where(keep, t, 0)
    picked = tl.load(base + tt).to(tl.float32)
    tl.store(loss + row, tl.where(keep, lse - picked, 0.0))
    weight = tl.where(keep, scale, 0.0)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < n_cols
        x = tl.load(base + cols, mask=inside, other=0.0).to(tl.float32)
        grad = tl.exp(x - lse) - tl.where(cols == tt, 1.0, 0.0)
        tl.store(base + cols, grad * weight, mask=inside)


def ce_rows(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, scale: float) -> torch.Tensor:
    """Per-row losses of fp32 ``logits`` [rows, vocab] (0 for ignored rows); ``logits`` becomes their gradient."""
    rows, vocab = logits.shape
    loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    block = min(4096, triton.next_power_of_2(vocab))
    _ce_rows[(rows,)](logits, logits.stride(0), target, loss, vocab, ignore_index, scale, BLOCK=block)
    return loss
