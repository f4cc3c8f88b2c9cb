"""Fused linear + cross-entropy: the loss of ``x @ weight.T (+ bias)`` against targets, without ever holding
the [tokens x vocab] logits.

The tokens are processed in chunks. For each chunk the logits are computed in fp32, reduced to the loss, and
turned at once into the chunk's gradients (softmax minus one-hot), which are multiplied into the gradients of
``x`` and ``weight``. Backward only scales those by the incoming gradient (the loss is a scalar), so peak
memory is one chunk's logits plus the gradients themselves, instead of the logits, their fp32 copy, the
softmax and the logits' gradient. Targets equal to ``ignore_index`` contribute nothing; ``reduction`` is
``sum`` (what the engine uses: it divides by the step's target tokens itself) or ``mean`` over the targets
that are not ignored. ``softcap`` (Gemma 2's final-logit soft-capping) replaces the logits ``z`` by
``softcap * tanh(z / softcap)`` before the softmax; their gradient is taken through the cap (times
``1 - tanh(z / softcap)^2``).

The logits are always fp32. On a CUDA device with a bf16 or fp16 head and input (``mixed_matmul``), the
products run on the tensor cores in that dtype with an fp32 output (``torch.mm(..., out_dtype=float32)``): the
logits are never rounded to bf16 and the head is never copied; the logits' gradient is rounded to the input's
dtype for the two backward products (as autograd through a bf16 ``lm_head`` does), and the head's gradient is
summed over the chunks in fp32. Elsewhere (a CPU, an fp32 head) the products run in fp32, and a head stored in
another dtype is upcast one slice of at most ``SLICE_BYTES`` of vocabulary rows at a time, never whole:
Command R+'s tied 256k x 12k head is 12.6 GB in fp32, more than the rest of a step needs on a 24 GB GPU or a
small host. ``working_bytes`` is what the op holds beside its inputs and gradients (the memory plan's figure).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from tiertune.kernels.ops.backend import choose_backend

IGNORE_INDEX = -100
"""A label that takes no loss (torch's ``cross_entropy`` default): prompt tokens, padding, a packed row's
first token. The one definition: the data pipeline writes it, the losses skip it."""
SLICE_BYTES = 64 << 20
"""The most bytes of the head upcast to fp32 at a time (when it is not fp32 already)."""
CHUNK_BYTES = 64 << 20
"""The fp32 logits of one chunk of tokens, by default, where the products run in fp32."""
MIXED_CHUNK_BYTES = 512 << 20
"""The same on the tensor cores (``mixed_matmul``): each chunk adds its share of the head's fp32 gradient, a
product whose inner dimension is the chunk's tokens; at 64 MiB (130 tokens of a 128k vocabulary) reading and
writing that gradient, not the arithmetic, set its time (an H100 took 22x eager's time), at 512 MiB (1046)
the arithmetic does."""


@functools.cache
def _mixed_supported(device_type: str) -> bool:
    """Whether this torch multiplies bf16 matrices into fp32 on ``device_type`` (``mm``'s ``out_dtype``)."""
    a = torch.ones(2, 2, dtype=torch.bfloat16, device=device_type)
    try:
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError):  # an older torch, or a backend without the kernel (the CPU's)
        return False


def mixed_matmul(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the op's products run in ``x``'s dtype with fp32 outputs: a CUDA device, bf16 or fp16 ``x`` and
    ``weight`` alike, and a torch whose ``mm`` takes ``out_dtype``."""
    return (
        x.device.type == "cuda"
        and x.dtype == weight.dtype
        and x.dtype in (torch.bfloat16, torch.float16)
        and _mixed_supported(x.device.type)
    )


def default_chunk_tokens(vocab: int, mixed: bool) -> int:
    """Tokens per chunk: ``MIXED_CHUNK_BYTES`` or ``CHUNK_BYTES`` of fp32 logits."""
    return max(1, (MIXED_CHUNK_BYTES if mixed else CHUNK_BYTES) // (4 * vocab))


def working_bytes(
    tokens: int, vocab: int, hidden: int, dtype: torch.dtype, mixed: bool, softcap: bool = False
) -> int:
    """What the op holds at its peak beside its inputs and the gradients it returns, for ``tokens`` tokens of a
    ``vocab`` x ``hidden`` head in ``dtype`` with the default chunks: the chunk's fp32 logits (which become
    their gradient in place), a second chunk for soft-capped logits (their tanh, on the torch path), and either
    the gradient's copy in ``dtype`` (``mixed``) or one slice of the head upcast to fp32 (a head not in fp32)."""
    chunk = min(default_chunk_tokens(vocab, mixed), tokens) * vocab
    held = chunk * 4 * (2 if softcap else 1)
    if mixed:
        return held + chunk * torch.finfo(dtype).bits // 8
    return held + (min(SLICE_BYTES, vocab * hidden * 4) if dtype != torch.float32 else 0)


def head_slices(weight: torch.Tensor) -> list[tuple[slice, torch.Tensor]]:
    """``weight`` (vocab x hidden) as (rows, the rows in fp32): itself when it is fp32, else slices of rows
    of at most ``SLICE_BYTES`` in fp32, each upcast when it is used (lazily, by the caller's iteration)."""
    if weight.dtype == torch.float32:
        return [(slice(None), weight)]
    rows = max(1, SLICE_BYTES // (4 * weight.shape[1]))
    return [(slice(v, v + rows), weight[v : v + rows]) for v in range(0, weight.shape[0], rows)]


def linear_cross_entropy_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
    reduction: str = "sum",
    softcap: float | None = None,
) -> torch.Tensor:
    """The unfused computation: full logits, upcast to fp32, soft-capped, ``F.cross_entropy`` (the oracle)."""
    logits = F.linear(x, weight, bias).float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return F.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """The fused op over chunks of ``chunk_tokens`` tokens: each chunk's logits by a torch matmul, then its
    loss and logit gradients in torch or, with ``backend="triton"``, in one Triton kernel (``ce_rows``)."""

    @staticmethod
    def forward(
        ctx,
        x,
        weight,
        target,
        bias,
        ignore_index,
        reduction,
        chunk_tokens,
        backend="torch",
        softcap=None,
        grads=True,
        token_weight=None,
        rows_out=None,
    ):
        n = x.shape[0]
        valid = target != ignore_index
        count = int(valid.sum())
        scale = 1.0 / max(count, 1) if reduction == "mean" else 1.0
        # the loss of token t counts token_weight[t] times (None: once); an ignored token's weight is unused
        weights = valid.float() if token_weight is None else torch.where(valid, token_weight.float(), 0.0)
        # the gradients are computed here, in forward; none when autograd will not ask for them (no_grad)
        want_x, want_w = grads and ctx.needs_input_grad[0], grads and ctx.needs_input_grad[1]
        want_b = grads and bias is not None and ctx.needs_input_grad[3]
        wanted = want_x or want_w or want_b
        grad_x = torch.empty_like(x) if want_x else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if want_b else None
        mixed = mixed_matmul(x, weight)
        slices = [(slice(None), weight)] if mixed else head_slices(weight)
        b32 = None if bias is None else bias.float()
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        for start in range(0, n, chunk_tokens):
            xs = x[start : start + chunk_tokens]
            ts = target[start : start + chunk_tokens]
            keep = weights[start : start + chunk_tokens]
            x32 = xs if mixed else xs.float()
            logits = chunk_logits(xs, x32, weight, b32, slices, mixed)
            # one kernel: the rows' losses, and the logits become their gradient
            if backend == "triton" and wanted:
                from tiertune.kernels.ops._triton_ce import ce_rows

                rows = ce_rows(logits, ts, ignore_index, scale, softcap)
                total += (rows * keep).sum()
                if rows_out is not None:
                    rows_out[start : start + len(ts)] = torch.where(ts != ignore_index, rows / scale, 0.0)
                grad = logits
                if token_weight is not None:
                    grad.mul_(keep.unsqueeze(1))
            else:
                if softcap is not None:  # tanh(z / softcap) stays for the gradient: a second chunk buffer
                    tanh = logits.div_(softcap).tanh_()
                    logits = tanh * softcap
                lse = torch.logsumexp(logits, dim=-1)
                picked = logits.gather(1, ts.clamp_min(0).unsqueeze(1)).squeeze(1)
                total += ((lse - picked) * keep).sum()
                if rows_out is not None:
                    rows_out[start : start + len(ts)] = torch.where(ts != ignore_index, lse - picked, 0.0)
                if not wanted:
                    continue
                # d loss / d logits = softmax - one-hot on kept rows (times the reduction's scale)
                grad = logits.sub_(lse.unsqueeze(1)).exp_()
                grad[torch.arange(len(ts), device=ts.device), ts.clamp_min(0)] -= 1.0
                grad.mul_((keep * scale).unsqueeze(1))
                if softcap is not None:  # through the cap: d softcap * tanh(z / softcap) / dz = 1 - tanh^2
                    grad.mul_(tanh.square_().neg_().add_(1.0))
            backprop_chunk(grad, xs, weight, slices, mixed, start, grad_x, grad_w, grad_b)
        ctx.save_for_backward(*(g for g in (grad_x, grad_w, grad_b) if g is not None))
        ctx.have = (want_x, want_w, want_b)
        ctx.used = False
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return total * scale

    @staticmethod
    def backward(ctx, grad_out):
        # the gradients were computed in forward; they are scaled in place (no second copy of the head's
        # gradient), so this backward can run only once, like any loss's without retain_graph
        if ctx.used:
            raise RuntimeError(
                "the fused linear + cross-entropy cannot run backward twice; compute the loss again"
            )
        ctx.used = True
        saved = iter(ctx.saved_tensors)
        want_x, want_w, want_b = ctx.have
        grad_x = next(saved).mul_(grad_out) if want_x else None
        grad_w = next(saved).mul_(grad_out).to(ctx.dtypes[0]) if want_w else None
        grad_b = next(saved).mul_(grad_out).to(ctx.dtypes[1]) if want_b else None
        return grad_x, grad_w, None, grad_b, None, None, None, None, None, None, None, None


def backprop_chunk(
    grad: torch.Tensor,
    xs: torch.Tensor,
    weight: torch.Tensor,
    slices: list[tuple[slice, torch.Tensor]],
    mixed: bool,
    start: int,
    grad_x: torch.Tensor | None,
    grad_w: torch.Tensor | None,
    grad_b: torch.Tensor | None,
) -> None:
    """A chunk's logit gradient ``grad`` (fp32, [chunk, vocab]) into the gradients of its tokens ``xs`` (rows
    ``start`` on of ``grad_x``), of the head (summed into the fp32 ``grad_w``) and of its bias: on the tensor
    cores in ``x``'s dtype (``mixed``: the gradient rounded to it, as autograd through a bf16 head has it), else
    in fp32 a slice of the head at a time."""
    if mixed:
        g = grad.to(xs.dtype)
        if grad_x is not None:
            grad_x[start : start + len(xs)] = g @ weight
        if grad_w is not None:
            torch.addmm(grad_w, g.t(), xs, out_dtype=torch.float32, out=grad_w)
        if grad_b is not None:
            grad_b += grad.sum(0)
        return
    if grad_x is not None:
        gx = grad[:, slices[0][0]] @ slices[0][1].float()
        for rows, w in slices[1:]:
            gx.addmm_(grad[:, rows], w.float())
        grad_x[start : start + len(xs)] = gx.to(xs.dtype)
    if grad_w is not None:
        x32 = xs.float()
        for rows, _ in slices:
            grad_w[rows].addmm_(grad[:, rows].t(), x32)
    if grad_b is not None:
        grad_b += grad.sum(0)


def chunk_logits(
    xs: torch.Tensor,
    x32: torch.Tensor,
    weight: torch.Tensor,
    b32: torch.Tensor | None,
    slices: list[tuple[slice, torch.Tensor]],
    mixed: bool,
) -> torch.Tensor:
    """The fp32 logits of a chunk of tokens ``xs`` (``x32``: in fp32 unless ``mixed``)."""
    if mixed:  # the tensor cores, in x's dtype, into fp32
        logits = torch.mm(xs, weight.t(), out_dtype=torch.float32)
        if b32 is not None:
            logits += b32
        return logits
    if len(slices) == 1:
        return F.linear(x32, slices[0][1].float(), b32)
    # each slice of the head upcast in turn: one slice's fp32 copy at a time
    logits = torch.empty(len(xs), weight.shape[0], dtype=torch.float32, device=xs.device)
    for rows, w in slices:
        logits[:, rows] = x32 @ w.float().t()
    if b32 is not None:
        logits += b32
    return logits


@torch.no_grad()
def token_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
    chunk_tokens: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Each token's cross-entropy of ``x @ weight.T (+ bias)`` against ``target`` in fp32 (0 where the target is
    ``ignore_index``), without autograd and without the whole logits: a chunk's at a time, as
    ``linear_cross_entropy`` computes them (its loss is these summed). A preference objective's sequence
    log-probabilities are these negated, summed per sequence (``engine.objective``)."""
    return _token_figures(x, weight, target, bias, ignore_index, chunk_tokens, softcap, entropy=False)[0]


@torch.no_grad()
def token_cross_entropy_and_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
    chunk_tokens: int | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``token_cross_entropy``'s figures and, from the same logits, each token's entropy of ``softmax(logits)``
    (``-sum p log p``, fp32; 0 where the target is ``ignore_index``): GRPO's ``entropy`` metric. A chunk holds
    half the tokens ``token_cross_entropy``'s does (its probabilities beside its logits)."""
    if chunk_tokens is None:
        chunk_tokens = max(1, default_chunk_tokens(weight.shape[0], mixed_matmul(x, weight)) // 2)
    losses, entropies = _token_figures(
        x, weight, target, bias, ignore_index, chunk_tokens, softcap, entropy=True
    )
    assert entropies is not None
    return losses, entropies


def _token_figures(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    ignore_index: int,
    chunk_tokens: int | None,
    softcap: float | None,
    entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each token's cross-entropy (0 where the target is ``ignore_index``) and, with ``entropy``, its entropy,
    a chunk of logits at a time (``_logit_chunks``)."""
    losses = torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
    entropies = torch.zeros_like(losses) if entropy else None
    for start, logits in _logit_chunks(x, weight, bias, chunk_tokens, softcap):
        end = start + len(logits)
        ts = target[start:end]
        valid = ts != ignore_index
        lse = torch.logsumexp(logits, dim=-1)
        picked = logits.gather(1, ts.clamp_min(0).unsqueeze(1)).squeeze(1)
        losses[start:end] = (lse - picked) * valid
        if entropies is not None:
            logp = logits.sub_(lse.unsqueeze(1))  # (in place: the chunk's logits are done with)
            entropies[start:end] = -logp.exp().mul_(logp).sum(-1) * valid
    return losses, entropies


def _logit_chunks(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    chunk_tokens: int | None,
    softcap: float | None,
) -> Iterator[tuple[int, torch.Tensor]]:
    """The fp32 logits of ``x @ weight.T (+ bias)`` (capped by ``softcap``), ``chunk_tokens`` tokens at a time,
    each with its first token's index."""
    mixed = mixed_matmul(x, weight)
    if chunk_tokens is None:
        chunk_tokens = default_chunk_tokens(weight.shape[0], mixed)
    slices = [(slice(None), weight)] if mixed else head_slices(weight)
    b32 = None if bias is None else bias.float()
    for start in range(0, x.shape[0], chunk_tokens):
        xs = x[start : start + chunk_tokens]
        logits = chunk_logits(xs, xs if mixed else xs.float(), weight, b32, slices, mixed)
        if softcap is not None:
            logits = logits.div_(softcap).tanh_().mul_(softcap)
        yield start, logits


def linear_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
    reduction: str = "sum",
    chunk_tokens: int | None = None,
    backend: str = "auto",
    softcap: float | None = None,
    token_weight: torch.Tensor | None = None,
    rows_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Cross-entropy of ``x @ weight.T (+ bias)`` (``x``: [tokens, hidden], ``target``: [tokens]) without
    materializing the logits. ``chunk_tokens`` defaults to ``default_chunk_tokens``: 64 MiB of fp32 logits per
    chunk, 512 MiB on the tensor cores (``mixed_matmul``).
    ``backend``: ``torch``, ``triton`` (the per-row loss and gradient in one kernel) or ``auto`` (Triton on a
    CUDA device when it is installed). ``softcap``: the logits become ``softcap * tanh(logits / softcap)``
    (Gemma 2's ``final_logit_softcapping``); None leaves them as they are. ``token_weight`` ([tokens], not
    trained): token t's loss counts that many times in the sum (a preference objective's gradient is such a sum,
    its weights the objective's derivative by each sequence's log-probability). ``rows_out`` ([tokens], fp32):
    each token's own loss written there too (0 where ignored; unweighted, unreduced)."""
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction must be sum or mean, got {reduction!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive or None, got {softcap!r}")
    if chunk_tokens is None:
        chunk_tokens = default_chunk_tokens(weight.shape[0], mixed_matmul(x, weight))
    backend = choose_backend(backend, x)
    return ChunkedLinearCrossEntropy.apply(
        x,
        weight,
        target,
        bias,
        ignore_index,
        reduction,
        chunk_tokens,
        backend,
        softcap,
        torch.is_grad_enabled(),
        None if token_weight is None else token_weight.detach(),
        rows_out,
    )
