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
            raise ValueError(f"{NAME} attention computes plain causal attention; this layer passes {unsupported}")
    batch, heads, length, _ = query.shape
    gqa = key.shape[1] != heads

    def sdpa(q, k, v, mask=None, causal=True):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling,
                                              is_causal=causal and mask is None, enable_gqa=gqa)  # fmt: skip

    kv = key.shape[2]
    rows = segments(kwargs.get("position_ids"), attention_mask, batch, length) if kv == length > 1 else None
    if rows is not None and all(r == [(0, length)] for r in rows):
        return sdpa(query, key, value).transpose(1, 2).contiguous(), None
    if rows is None:  # decoding against a cache, or padding that is not a suffix: the mask (small, or rare)
        q_at = torch.arange(length, device=query.device)[:, None] + (kv - length)
        mask = (torch.arange(kv, device=query.device)[None, :] <= q_at)[None, None]
        if attention_mask is not None:
            mask = mask & attention_mask[:, -kv:].bool()[:, None, None, :]
        return sdpa(query, key, value, mask).transpose(1, 2).contiguous(), None
    by_length: dict[int, list[int]] = defaultdict(list)  # segment length -> the flat index of each start
    for b, row in enumerate(rows):
        for s, e in row:
            by_length[e - s].append(b * length + s)
    # tokens gathered and scattered by flat index: one index_select per tensor and length, one index_copy out
    # (slicing each segment apart would make backward allocate a whole-row gradient per segment)
    flat = [x.transpose(1, 2).reshape(batch * length, x.shape[1], x.shape[3]) for x in (query, key, value)]
    parts, where = [], []
    for n, starts in by_length.items():
        index = (torch.tensor(starts)[:, None] + torch.arange(n)).flatten().to(query.device)
        q, k, v = (x.index_select(0, index).view(len(starts), n, *x.shape[1:]).transpose(1, 2) for x in flat)
        o = sdpa(q, k, v) if n > 1 else v.repeat_interleave(heads // key.shape[1], 1) if gqa else v
        parts.append(o.transpose(1, 2).reshape(len(starts) * n, heads, -1))
        where.append(index)
    for b, row in enumerate(rows):  # a padded tail's queries see every valid key of their row, as sdpa's mask has it
        n = row[-1][1] if row else 0
        if 0 < n < length:
            at = b * length
            tail = torch.arange(at + n, at + length, device=query.device)
            valid = torch.arange(at, at + n, device=query.device)
            q = flat[0].index_select(0, tail).view(1, length - n, *flat[0].shape[1:]).transpose(1, 2)
            k, v = (x.index_select(0, valid).view(1, n, *x.shape[1:]).transpose(1, 2) for x in flat[1:])
            parts.append(sdpa(q, k, v, causal=False).transpose(1, 2).reshape(length - n, heads, -1))
            where.append(tail)
    out = query.new_zeros(batch * length, heads, query.shape[-1]).index_copy(0, torch.cat(where), torch.cat(parts))
    return out.view(batch, length, heads, -1), None


def segment_mask(
    batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
    mask_function=None, attention_mask: torch.Tensor | None = None, **kwargs,
) -> torch.Tensor | None:  # fmt: skip
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
    why = "no config" if config is None else segment_attention_fits(config)
    if why is not None:
        return why
    if getattr(config, "_attn_implementation", None) not in ("sdpa", "eager", NAME):
        return f"its attention is {config._attn_implementation}"
    AttentionInterface.register(NAME, segment_attention)
    AttentionMaskInterface.register(NAME, segment_mask)
    config._attn_implementation = NAME
    return None
