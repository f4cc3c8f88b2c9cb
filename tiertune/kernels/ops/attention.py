"""Causal attention that never materialises a sequence x sequence tensor: packed rows and padded rows run as
their own causal segments through ``scaled_dot_product_attention`` with ``is_causal`` and no mask, the call
whose kernels keep memory linear in the length (flash or memory-efficient on a GPU, torch's flash kernel on a
CPU).

transformers' ``sdpa`` builds a 4-D mask for a packed row (``position_ids`` restarting at each document: a
block-diagonal causal mask) or a padded one: sequence x sequence bytes per row (8 GiB of booleans at 96K
tokens, 64 GiB at 256K) and SDPA's masked kernels, which keep the scores too on a CPU. Here the model's
attention implementation is ``tiertune_segments``: its mask function hands the attention the 2-D padding mask
(as transformers' flash-attention path does), and the attention cuts each row into segments, from the
``position_ids`` (a new document wherever a position is not its predecessor's plus one, as transformers finds
them) and the padding (a right-padded row's valid prefix). Segments of equal length run together in one call;
a row with only one segment is its whole length. A padded tail's queries attend to all of their row's valid
keys (what sdpa's causal-and-padding mask gives them: nothing reads them, the labels there are ignored, but an
MoE router sees them); a row with no valid token gives zeros.

Exact: each segment's queries see exactly the keys the block-diagonal causal mask allows. A row without
padding or packing takes the same SDPA call as transformers' ``sdpa`` (the same bits).

Only plain causal attention: a sliding window, logit soft-capping or attention sinks keep ``sdpa``
(``segment_attention_fits`` says why not)."""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

NAME = "tiertune_segments"


def segment_attention_fits(config) -> str | None:
    """None when ``config``'s attention is plain causal attention ``segment_attention`` computes exactly; else
    why not (a sliding window, soft-capping, sinks)."""
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True) is not False:
        return "a sliding attention window"
    if any("sliding" in str(t) or "chunked" in str(t) for t in getattr(config, "layer_types", None) or ()):
        return "sliding or chunked attention layers"
    if getattr(config, "attn_logit_softcapping", None):
        return "attention logit soft-capping"
    if getattr(config, "model_type", "") == "gpt_oss":
        return "attention sinks"
    if not getattr(config, "is_causal", True):
        return "bidirectional attention"
    return None


def segments(
    position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None, batch: int, length: int
) -> list[list[tuple[int, int]]] | None:
    """Each row's causal segments as (start, end); None when some row's padding is not a suffix (a hole or
    left padding: such a row needs the mask)."""
    rows: list[list[tuple[int, int]]] = [[(0, length)] for _ in range(batch)]
    if attention_mask is not None:
        mask = attention_mask[:, -length:].bool()
        valid = mask.sum(-1).tolist()
        for b, n in enumerate(valid):
            if n < length and bool(mask[b, n:].any()):
                return None
            rows[b] = [(0, n)] if n else []
    if position_ids is not None:
        ids = position_ids.expand(batch, -1)
        starts = torch.diff(ids, dim=-1) != 1  # a new document at j + 1
        if bool(starts.any()):
            for b in range(batch):
                cuts = (starts[b].nonzero().flatten() + 1).tolist()
                end = rows[b][0][1] if rows[b] else 0
                edges = [0, *(c for c in cuts if c < end), end]
                rows[b] = [(s, e) for s, e in itertools.pairwise(edges) if e > s]
    return rows


def segment_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface: ``query`` (batch, heads, length, dim), ``key``/``value``
    (batch, kv heads, length, dim); returns (batch, length, heads, dim) and no weights."""
    for unsupported in ("sliding_window", "softcap", "s_aux", "position_bias"):
        if kwargs.get(unsupported) is not None:
            raise ValueError(
                f"{NAME} attention computes plain causal attention; this layer passes {unsupported}"
            )
    batch, heads, length, _ = query.shape
    gqa = key.shape[1] != heads

    def sdpa(q, k, v, mask=None, causal=True):
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=dropout,
            scale=scaling,
            is_causal=causal and mask is None,
            enable_gqa=gqa,
        )

    kv = key.shape[2]
    rows = segments(kwargs.get("position_ids"), attention_mask, batch, length) if kv == length > 1 else None
    if rows is not None and all(r == [(0, length)] for r in rows):
        if length >= _GROUPED_TOKENS and torch.is_grad_enabled():
            return _HeadGroups.apply(query, key, value, dropout, scaling), None
        return sdpa(query, key, value).transpose(1, 2).contiguous(), None
    if rows is None:  # decoding against a cache, or padding that is not a suffix: the mask (small, or rare)
        q_at = torch.arange(length, device=query.device)[:, None] + (kv - length)
        mask = (torch.arange(kv, device=query.device)[None, :] <= q_at)[None, None]
        if attention_mask is not None:
            mask = mask & attention_mask[:, -kv:].bool()[:, None, None, :]
        return sdpa(query, key, value, mask).transpose(1, 2).contiguous(), None
    return _Segments.apply(query, key, value, _jobs(rows, length, query.device), dropout, scaling), None


# the most query tokens of equal-length segments one SDPA call takes: what bounds backward's temporaries
_JOB_TOKENS = 2048
# rows of one document this long run their attention with autograd a KV head at a time (``_HeadGroups``)
_GROUPED_TOKENS = 16384


def _jobs(rows: list[list[tuple[int, int]]], length: int, device: torch.device) -> list[tuple]:
    """The SDPA calls that cover ``rows``: ``(q_at, kv_at, segments, causal)`` with ``q_at``/``kv_at`` the
    (row, position) index pairs of the calls' queries and keys, segment by segment. Equal-length segments go
    together, up to ``_JOB_TOKENS`` queries a call; a padded tail's queries attend to their row's valid keys."""
    by_length: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for b, row in enumerate(rows):
        for s, e in row:
            by_length[e - s].append((b, s))
    jobs = []
    for n, starts in by_length.items():
        step = max(1, _JOB_TOKENS // n)
        for i in range(0, len(starts), step):
            part = torch.tensor(starts[i : i + step])
            at = (part[:, :1].expand(-1, n).flatten(), (part[:, 1:] + torch.arange(n)).flatten())
            at = tuple(t.to(device) for t in at)
            jobs.append((at, at, len(part), True))
    for b, row in enumerate(rows):
        n = row[-1][1] if row else 0
        if 0 < n < length:
            q_at = (torch.full((length - n,), b), torch.arange(n, length))
            kv_at = (torch.full((n,), b), torch.arange(n))
            jobs.append((tuple(t.to(device) for t in q_at), tuple(t.to(device) for t in kv_at), 1, False))
    return jobs


def _gather(x: torch.Tensor, at: tuple[torch.Tensor, torch.Tensor], segments: int) -> torch.Tensor:
    """The tokens ``at`` of ``x`` (batch, heads, length, dim) as (segments, heads, tokens, dim)."""
    picked = x[at[0], :, at[1]]  # (tokens, heads, dim)
    return picked.view(segments, -1, *picked.shape[1:]).transpose(1, 2)


class _Segments(torch.autograd.Function):
    """Every segment's causal attention, written into one (batch, length, heads, dim) output. Keeps the
    queries, keys and values only: backward gathers each call's tokens again and recomputes its attention
    with autograd, its gradients written into the whole tensors' (autograd through the gathers would keep a
    copy of every gathered token and output, and make each call's backward a whole-length zero tensor per input).
    Dropout draws the same in the recomputation: the random state is kept from forward.

    Where no call reads another's tokens (no padded tail attending to its row's keys) and the queries, keys and
    values are the layer's own intermediates (not leaves a caller holds, three separate storages), each
    call's gradients are written over the very tokens it read: nothing reads them again, and backward then
    holds no second set of whole-length tensors."""

    @staticmethod
    def forward(ctx, q, k, v, jobs, dropout, scaling):
        ctx.save_for_backward(q, k, v)
        ctx.jobs, ctx.dropout, ctx.scaling = jobs, dropout, scaling
        ctx.in_place = all(causal for *_, causal in jobs) and _own_intermediates(q, k, v)
        ctx.rng = _rng_state(q.device) if dropout > 0 else None
        batch, heads, length, _ = q.shape
        out = q.new_zeros(batch, length, heads, v.shape[-1])
        for q_at, kv_at, n, causal in jobs:
            o = _call(
                _gather(q, q_at, n), _gather(k, kv_at, n), _gather(v, kv_at, n), dropout, scaling, causal
            )
            out[q_at] = o.transpose(1, 2).reshape(-1, heads, v.shape[-1])
            del o  # one call's temporaries at a time
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v = ctx.saved_tensors
        heads = q.shape[1]
        if ctx.in_place:  # (batch, length, heads, dim) views of the inputs themselves
            grads = [x.transpose(1, 2) for x in (q, k, v)]
        else:
            grads = [
                torch.zeros(x.shape[0], x.shape[2], x.shape[1], x.shape[3], dtype=x.dtype, device=x.device)
                for x in (q, k, v)
            ]
        with _forwards_rng(q.device, ctx.rng):
            for q_at, kv_at, n, causal in ctx.jobs:
                parts = [
                    x[at[0], :, at[1]].detach().requires_grad_()
                    for x, at in ((q, q_at), (k, kv_at), (v, kv_at))
                ]
                with torch.enable_grad():
                    o = _call(
                        *(x.view(n, -1, *x.shape[1:]).transpose(1, 2) for x in parts),
                        ctx.dropout,
                        ctx.scaling,
                        causal,
                    )
                g = grad[q_at].view(n, -1, heads, grad.shape[-1]).transpose(1, 2)
                got = torch.autograd.grad(o, parts, g)
                del o, parts, g  # one call's temporaries at a time
                for whole, at, part in zip(grads, (q_at, kv_at, kv_at), got, strict=True):
                    # over the tokens read, or added (a padded tail's call shares its row's keys)
                    whole.index_put_(at, part, accumulate=not ctx.in_place)
                del got, part
        return *(x.transpose(1, 2) for x in grads), None, None, None


def _own_intermediates(q, k, v) -> bool:
    """Whether the queries, keys and values are a layer's intermediates (not leaves a caller holds) in three
    storages of their own: a backward that has read them may write their gradients over them."""
    storages = {
        x.untyped_storage()._cdata for x in (q, k, v)
    }  # the storage itself (a meta one has no address)
    return all(x.grad_fn is not None for x in (q, k, v)) and len(storages) == 3


class _HeadGroups(torch.autograd.Function):
    """Causal attention over whole rows (one document each), one SDPA call per row and KV head with the query
    heads that read it, written into one (batch, length, heads, dim) output. Keeps the queries, keys and values
    only; backward recomputes each call with autograd.

    A long row's attention through SDPA with autograd keeps its output and log-sum-exp for backward, and the
    flash kernel's backward holds an fp32 accumulator of the queries' gradient and, for grouped KV heads, the
    keys' and values' gradients at the query heads' count: at 256K tokens of Llama-3-8B four times the queries'
    bytes beside the three gradients. A call per KV head holds a group's share of that. The price: the
    attention forward runs again in backward (a long row's attention is most of its compute). Gradients are
    written over the inputs when they are the layer's intermediates (``_own_intermediates``); dropout draws
    the same in the recomputation (the random state is kept from forward)."""

    @staticmethod
    def forward(ctx, q, k, v, dropout, scaling):
        ctx.save_for_backward(q, k, v)
        ctx.dropout, ctx.scaling = dropout, scaling
        ctx.in_place = _own_intermediates(q, k, v)
        ctx.rng = _rng_state(q.device) if dropout > 0 else None
        batch, heads, length, _ = q.shape
        out = q.new_empty(batch, length, heads, v.shape[-1])
        for b, h, j in _head_calls(q, k):
            o = _call(q[b, h][None], k[b, j][None], v[b, j][None], dropout, scaling, True)
            out[b, :, h] = o[0].transpose(0, 1)
            del o  # one call's temporaries at a time
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v = ctx.saved_tensors
        grads = (q, k, v) if ctx.in_place else tuple(torch.empty_like(x) for x in (q, k, v))
        with _forwards_rng(q.device, ctx.rng):
            for b, h, j in _head_calls(q, k):
                parts = [x[b, at][None].detach().requires_grad_() for x, at in ((q, h), (k, j), (v, j))]
                with torch.enable_grad():
                    o = _call(*parts, ctx.dropout, ctx.scaling, True)
                got = torch.autograd.grad(o, parts, grad[b, :, h].transpose(0, 1)[None])
                del o, parts  # nothing reads this call's inputs again: its gradients may go over them
                for whole, at, part in zip(grads, (h, j, j), got, strict=True):
                    whole[b, at] = part[0]
                del got
        # views when written over the inputs (returned as themselves, autograd would take them for outputs)
        return *(x.view_as(x) for x in grads), None, None


def _head_calls(q: torch.Tensor, k: torch.Tensor):
    """(row, query heads, KV head) of each call of ``_HeadGroups``: the query heads that read KV head j."""
    per = q.shape[1] // k.shape[1]
    for b in range(q.shape[0]):
        for j in range(k.shape[1]):
            yield b, slice(j * per, (j + 1) * per), slice(j, j + 1)


def _call(q, k, v, dropout: float, scaling: float | None, causal: bool) -> torch.Tensor:
    return F.scaled_dot_product_attention(
        q, k, v, dropout_p=dropout, scale=scaling, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1]
    )


def _rng_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


@contextmanager
def _forwards_rng(device: torch.device, state: torch.Tensor | None) -> Iterator[None]:
    """A backward's recomputation drawing what forward drew: ``device``'s random state set to ``state`` (kept
    from forward; None: nothing drawn, nothing to set) and restored after."""
    with torch.random.fork_rng([device] if device.type != "cpu" else [], enabled=state is not None):
        if state is not None:
            _set_rng_state(device, state)
        yield


def _set_rng_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def segment_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor | None:
    """transformers' mask-function interface for ``NAME``: the 2-D padding mask (None when nothing is padded),
    as its flash-attention path has it; ``segment_attention`` finds the documents in ``position_ids``."""
    if attention_mask is not None:
        attention_mask = attention_mask[:, -kv_length:]
        if attention_mask.shape[1] == kv_length and bool(attention_mask.all()):
            return None
    return attention_mask


def use_segment_attention(model: torch.nn.Module) -> str | None:
    """Make ``model`` (this instance and its config) run ``segment_attention``; returns None when it does, else
    why it keeps its own attention. Registers ``NAME`` with transformers once."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    config = getattr(model, "config", None)
    # the decoder's own config: a multimodal class's language model reads its text config (the tower's attention,
    # never run on text, keeps its own)
    config = config.get_text_config(decoder=True) if config is not None else None
    why = "no config" if config is None else segment_attention_fits(config)
    if why is not None:
        return why
    if getattr(config, "_attn_implementation", None) not in ("sdpa", "eager", NAME):
        return f"its attention is {config._attn_implementation}"
    AttentionInterface.register(NAME, segment_attention)
    AttentionMaskInterface.register(NAME, segment_mask)
    config._attn_implementation = NAME
    return None
