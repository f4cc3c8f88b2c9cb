"""Distillation through the head, fused: a student's divergence from a teacher (TRL's generalized JSD) and its
cross-entropy on the data, from the student's hidden states and head, without the [tokens x vocab] logits.

The teacher is given one of two ways:

- ``TopK``: per token, the teacher's ``k`` most likely token ids, their log-probabilities at the temperature,
  and the log of the mass left outside them (the tail). Both distributions are then compared over ``k + 1``
  buckets: the ``k`` tokens and one bucket for the rest of each distribution's mass (the teacher's tail; the
  student's mass outside the same ``k`` tokens, computed as a log-sum-exp over them, never as ``1 - sum``).
- ``Full``: the teacher's own hidden states and head; its logits are made one chunk of tokens at a time beside
  the student's, and the divergence runs over the whole vocabulary, as TRL's ``generalized_jsd_loss``.

``generalized_jsd`` is TRL's formula (``GKDTrainer.generalized_jsd_loss``): ``beta`` 0 the forward KL
(teacher || student), 1 the reverse KL (student || teacher), between the two the JSD against the mixture
``(1 - beta) q + beta p``; both distributions are ``log_softmax(logits / temperature)``.

The op works as ``linear_ce`` does: tokens in chunks, each chunk's fp32 logits turned at once into their
gradient (the divergence's derivative by the student's bucketed log-probabilities, taken by autograd on the
small [chunk, k + 1] tensor, then spread over the vocabulary in place), multiplied into the gradients of
``x``, the head and its bias; backward only scales them. Each token carries two weights, one for its
cross-entropy (untempered logits, against ``target``) and one for its divergence: the engine passes ``alpha /
n`` and ``(1 - alpha) / n`` over a step's ``n`` scored tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tiertune.kernels.ops.linear_ce import (
    backprop_chunk,
    chunk_logits,
    default_chunk_tokens,
    head_slices,
    mixed_matmul,
)


@dataclass
class TopK:
    """A teacher's top-k per token: ``ids`` [tokens, k] (int), ``logps`` [tokens, k] and ``tail`` [tokens],
    the log of the mass outside the k tokens (fp32; all at the temperature the divergence uses)."""

    ids: torch.Tensor
    logps: torch.Tensor
    tail: torch.Tensor


@dataclass
class Full:
    """A teacher's last hidden states before each token [tokens, hidden'] (its logit scale applied) and its
    head (``weight`` [vocab, hidden'], ``bias``, ``softcap``): logits made a chunk at a time."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None = None
    softcap: float | None = None


def _kl(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    """``p (log p - log q)`` elementwise (``F.kl_div(q_log, p_log, log_target=True)``), 0 where ``p`` is 0."""
    low = torch.finfo(p_log.dtype).min
    return torch.where(p_log > -math.inf, p_log.exp() * (p_log.clamp(min=low) - q_log), 0.0)


def generalized_jsd(student: torch.Tensor, teacher: torch.Tensor, beta: float) -> torch.Tensor:
    """The generalized JSD per token from log-probabilities over the last dimension (TRL's formula, the module's
    docstring): ``student`` and ``teacher`` [..., buckets]; returns [...]."""
    if beta == 0:
        terms = _kl(teacher, student)
    elif beta == 1:
        terms = _kl(student, teacher)
    else:
        b = torch.tensor(beta, dtype=student.dtype, device=student.device)
        mixture = torch.logsumexp(torch.stack([student + torch.log1p(-b), teacher + torch.log(b)]), dim=0)
        terms = beta * _kl(teacher, mixture) + (1 - beta) * _kl(student, mixture)
    return terms.sum(-1)


def _capped(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return logits if softcap is None else logits.div_(softcap).tanh_().mul_(softcap)


@torch.no_grad()
def topk_logprobs(
    x: torch.Tensor,
    weight: torch.Tensor,
    k: int,
    temperature: float = 1.0,
    bias: torch.Tensor | None = None,
    softcap: float | None = None,
    chunk_tokens: int | None = None,
    vocab_limit: int | None = None,
) -> TopK:
    """A teacher's ``TopK`` for each row of ``x`` ([tokens, hidden], its last hidden states) through its head:
    ``log_softmax(logits / temperature)``'s ``k`` largest (ids as int32) and the log of the rest's mass, a
    chunk of fp32 logits at a time. ``vocab_limit``: the k are chosen among the first ``vocab_limit`` tokens
    (a student's vocabulary, where the teacher's head is padded wider), the others stay in the tail."""
    vocab = weight.shape[0]
    limit = vocab if vocab_limit is None else min(vocab_limit, vocab)
    if not 0 < k < limit:
        raise ValueError(f"top_k must be in [1, {limit - 1}] for a vocabulary of {limit}, got {k}")
    mixed = mixed_matmul(x, weight)
    chunk_tokens = chunk_tokens or default_chunk_tokens(vocab, mixed)
    slices = [(slice(None), weight)] if mixed else head_slices(weight)
    b32 = None if bias is None else bias.float()
    n = x.shape[0]
    ids = torch.empty(n, k, dtype=torch.int32, device=x.device)
    logps = torch.empty(n, k, dtype=torch.float32, device=x.device)
    tail = torch.empty(n, dtype=torch.float32, device=x.device)
    for start in range(0, n, chunk_tokens):
        xs = x[start : start + chunk_tokens]
        s = _capped(chunk_logits(xs, xs if mixed else xs.float(), weight, b32, slices, mixed), softcap)
        if temperature != 1:
            s.div_(temperature)
        lse = torch.logsumexp(s, dim=-1)
        values, top = s[:, :limit].topk(k, dim=-1)
        rows = slice(start, start + len(xs))
        ids[rows], logps[rows] = top.to(torch.int32), values - lse.unsqueeze(1)
        s.scatter_(1, top, -math.inf)
        tail[rows] = torch.logsumexp(s, dim=-1) - lse
    return TopK(ids, logps, tail)


class _LinearDistill(torch.autograd.Function):
    """The fused op (``linear_distill``); its gradients made in forward, scaled in backward."""

    @staticmethod
    def forward(
        ctx, x, weight, bias, target, teacher, ce_weight, kd_weight, beta, temperature, softcap, chunk
    ):
        want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        want_b = bias is not None and ctx.needs_input_grad[2]
        grad_x = torch.empty_like(x) if want_x else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if want_b else None
        wanted = want_x or want_w or want_b
        mixed = mixed_matmul(x, weight)
        slices = [(slice(None), weight)] if mixed else head_slices(weight)
        b32 = None if bias is None else bias.float()
        n = x.shape[0]
        ce = torch.zeros(n, dtype=torch.float32, device=x.device)
        kd = torch.zeros(n, dtype=torch.float32, device=x.device)
        full = isinstance(teacher, Full)
        t_slices = (
            head_slices(teacher.weight) if full and not mixed_matmul(teacher.hidden, teacher.weight) else None
        )
        for start in range(0, n, chunk):
            rows = slice(start, start + chunk)
            xs, ts = x[rows], target[rows]
            wc, wk = ce_weight[rows].float(), kd_weight[rows].float()
            z = chunk_logits(xs, xs if mixed else xs.float(), weight, b32, slices, mixed)
            tanh = None
            if softcap is not None:  # tanh(z / softcap) kept for the gradient through the cap
                tanh = (z / softcap).tanh_()
                z = tanh * softcap
            grad = _cross_entropy_part(z, ts, wc, ce, rows, wanted)
            if full:
                g = _full_part(z, teacher, rows, t_slices, wk, kd, beta, temperature, wanted)
            else:
                g = _topk_part(z, teacher, rows, wk, kd, beta, temperature, wanted)
            if not wanted:
                continue
            grad = g if grad is None else grad.add_(g)
            del g
            if tanh is not None:
                grad.mul_(tanh.square_().neg_().add_(1.0))
            backprop_chunk(grad, xs, weight, slices, mixed, start, grad_x, grad_w, grad_b)
        ctx.save_for_backward(*(g for g in (grad_x, grad_w, grad_b) if g is not None))
        ctx.have = (want_x, want_w, want_b)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(ce, kd)
        total = (ce * ce_weight.float()).sum() + (kd * kd_weight.float()).sum()
        return total, ce, kd

    @staticmethod
    def backward(ctx, grad_out, _ce, _kd):
        saved = iter(ctx.saved_tensors)
        want_x, want_w, want_b = ctx.have
        grad_x = next(saved) * grad_out if want_x else None
        grad_w = (next(saved) * grad_out).to(ctx.dtypes[0]) if want_w else None
        grad_b = (next(saved) * grad_out).to(ctx.dtypes[1]) if want_b else None
        return grad_x, grad_w, grad_b, *([None] * 8)


def _cross_entropy_part(
    z: torch.Tensor, ts: torch.Tensor, wc: torch.Tensor, ce: torch.Tensor, rows: slice, wanted: bool
) -> torch.Tensor | None:
    """The chunk's cross-entropy on the untempered logits ``z`` (into ``ce``) and, where a token's weight is
    not 0, its gradient times the weight (a new buffer; None when no token has weight)."""
    valid = ts >= 0
    lse = torch.logsumexp(z, dim=-1)
    picked = z.gather(1, ts.clamp_min(0).unsqueeze(1)).squeeze(1)
    ce[rows] = torch.where(valid, lse - picked, 0.0)
    if not wanted or not bool((wc != 0).any()):
        return None
    grad = (z - lse.unsqueeze(1)).exp_()
    grad[torch.arange(len(ts), device=ts.device), ts.clamp_min(0)] -= 1.0
    return grad.mul_(torch.where(valid, wc, 0.0).unsqueeze(1))


def _topk_part(
    z: torch.Tensor,
    teacher: TopK,
    rows: slice,
    wk: torch.Tensor,
    kd: torch.Tensor,
    beta: float,
    temperature: float,
    wanted: bool,
) -> torch.Tensor:
    """The chunk's divergence over the teacher's k tokens and the tail (into ``kd``) and its gradient by the
    logits times ``wk``, made in ``z``'s place (``z`` is consumed)."""
    ids = teacher.ids[rows].long()
    s = z.div_(temperature) if temperature != 1 else z
    lse = torch.logsumexp(s, dim=-1)
    picked = s.gather(1, ids) - lse.unsqueeze(1)  # the student's log-probabilities of the k tokens
    s.scatter_(1, ids, -math.inf)
    rest = torch.logsumexp(s, dim=-1) - lse  # and of the rest of the vocabulary
    student = torch.cat([picked, rest.unsqueeze(1)], 1).requires_grad_()
    t = torch.cat([teacher.logps[rows].float(), teacher.tail[rows].float().unsqueeze(1)], 1)
    with torch.enable_grad():
        per_token = generalized_jsd(student, t, beta)
        (g,) = torch.autograd.grad((per_token * wk).sum(), student) if wanted else (None,)
    kd[rows] = per_token.detach()
    if not wanted:
        return s
    # d D / d s_v = sum_j g_j d l_j / d s_v: l_i = s_(id_i) - lse, l_rest = lse_rest - lse, so for v outside the
    # k tokens q_v / q_rest * g_rest - q_v * G, and at id_i g_i - q_i * G (G = sum_j g_j)
    total = g.sum(1)
    g_rest, q_rest = g[:, -1], rest.exp()
    s.sub_((rest + lse).unsqueeze(1)).exp_()  # q_v / q_rest outside the k tokens, 0 at them
    s.mul_((g_rest - total * q_rest).unsqueeze(1))
    s.scatter_(1, ids, g[:, :-1] - total.unsqueeze(1) * picked.exp())
    return s.div_(temperature) if temperature != 1 else s


def _full_part(
    z: torch.Tensor,
    teacher: Full,
    rows: slice,
    t_slices: list | None,
    wk: torch.Tensor,
    kd: torch.Tensor,
    beta: float,
    temperature: float,
    wanted: bool,
) -> torch.Tensor:
    """The chunk's divergence over the whole vocabulary against the teacher's logits of the same tokens (into
    ``kd``), and its gradient by the logits times ``wk`` (``z`` is consumed)."""
    h = teacher.hidden[rows]
    mixed = t_slices is None
    b32 = None if teacher.bias is None else teacher.bias.float()
    slices = [(slice(None), teacher.weight)] if mixed else t_slices
    t = _capped(
        chunk_logits(h, h if mixed else h.float(), teacher.weight, b32, slices, mixed), teacher.softcap
    )
    t_log = torch.log_softmax(t.div_(temperature), dim=-1)
    del t
    s = z.div_(temperature) if temperature != 1 else z
    student = torch.log_softmax(s, dim=-1).requires_grad_()
    with torch.enable_grad():
        per_token = generalized_jsd(student, t_log, beta)
        (g,) = torch.autograd.grad((per_token * wk).sum(), student) if wanted else (None,)
    kd[rows] = per_token.detach()
    if not wanted:
        return s
    # l = s - lse(s): d D / d s = g - softmax(s) * sum(g)
    q = student.detach().exp_()
    g.sub_(q.mul_(g.sum(1, keepdim=True)))
    return g.div_(temperature) if temperature != 1 else g


def linear_distill(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    teacher: TopK | Full,
    ce_weight: torch.Tensor,
    kd_weight: torch.Tensor,
    beta: float,
    temperature: float = 1.0,
    bias: torch.Tensor | None = None,
    softcap: float | None = None,
    chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sum of ce_weight x cross-entropy + kd_weight x divergence, each token's cross-entropy, each token's
    divergence)`` of the student ``x @ weight.T (+ bias)`` (``x`` [tokens, hidden], the scored tokens alone;
    ``target`` [tokens], ``-100`` for none) against ``teacher`` (the module's docstring); the first is
    differentiable by ``x``, ``weight`` and ``bias``. Chunks of ``chunk_tokens`` tokens: by default a quarter of
    the cross-entropy's (the divergence holds a few chunk-sized buffers; a quarter again with a ``Full``
    teacher, whose log-probabilities and mixture are chunk-sized too)."""
    if not 0 <= beta <= 1:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_tokens is None:
        chunk_tokens = max(1, default_chunk_tokens(weight.shape[0], mixed_matmul(x, weight)) // 4)
        if isinstance(teacher, Full):
            chunk_tokens = max(1, chunk_tokens // 4)
    total, ce, kd = _LinearDistill.apply(
        x,
        weight,
        bias,
        target,
        teacher,
        ce_weight.detach(),
        kd_weight.detach(),
        float(beta),
        float(temperature),
        softcap,
        chunk_tokens,
    )
    return total, ce, kd


def linear_distill_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    teacher: TopK | Full,
    ce_weight: torch.Tensor,
    kd_weight: torch.Tensor,
    beta: float,
    temperature: float = 1.0,
    bias: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The unfused computation (the oracle): full logits, then ``logits_distill``'s weighted sum."""
    z = F.linear(x, weight, bias).float()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    total, _, _ = logits_distill(z, target, teacher, ce_weight, kd_weight, beta, temperature)
    return total


def logits_distill(
    z: torch.Tensor,
    target: torch.Tensor,
    teacher: TopK | Full,
    ce_weight: torch.Tensor,
    kd_weight: torch.Tensor,
    beta: float,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``linear_distill``'s three results from the student's whole fp32 logits ``z`` [tokens, vocab] by autograd
    (a model whose head the op does not fuse): the buckets by masking, ``generalized_jsd``."""
    ce = F.cross_entropy(z, target, ignore_index=-100, reduction="none")
    s = torch.log_softmax(z / temperature, dim=-1)
    if isinstance(teacher, Full):
        with torch.no_grad():
            t = F.linear(teacher.hidden, teacher.weight, teacher.bias).float()
            if teacher.softcap is not None:
                t = teacher.softcap * torch.tanh(t / teacher.softcap)
        kd = generalized_jsd(s, torch.log_softmax(t / temperature, dim=-1), beta)
    else:
        ids = teacher.ids.long()
        outside = torch.ones_like(s, dtype=torch.bool).scatter_(1, ids, False)
        rest = torch.logsumexp(s.masked_fill(~outside, -math.inf), dim=-1, keepdim=True)
        student = torch.cat([s.gather(1, ids), rest], 1)
        kd = generalized_jsd(student, torch.cat([teacher.logps, teacher.tail.unsqueeze(1)], 1).float(), beta)
    total = (ce * ce_weight).sum() + (kd * kd_weight).sum()
    return total, ce.detach(), kd.detach()


__all__ = [
    "Full",
    "TopK",
    "generalized_jsd",
    "linear_distill",
    "linear_distill_reference",
    "logits_distill",
    "topk_logprobs",
]
