"""Rotary position embedding, as Llama/Qwen/Mistral apply it to the queries and keys (transformers'
``apply_rotary_pos_emb`` with ``unsqueeze_dim=1``), and the partial rotary of Phi-3 and GPT-NeoX: when ``cos``
is narrower than a head, only the first ``cos.shape[-1]`` features rotate and the rest pass through.

``rope_reference`` is the oracle; ``RoPETorch`` its arithmetic as one autograd Function, a tile of positions at a
time (the CPU path); ``RoPETriton`` runs forward and backward as a Triton kernel
(one program per token and block of heads, reading ``q``/``k`` through their strides, so HF's transposed views
need no copy). Backward is the rotation by ``-sin`` and saves only ``cos`` and ``sin``, not ``q`` and ``k``.
"""

from __future__ import annotations

import torch

from tiertune.kernels.ops.backend import choose_backend, row_tiles


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat((x_rot * cos + _rotate_half(x_rot) * sin, x_pass), dim=-1)


def _apply_transposed(g: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The gradient of ``_apply`` at its input for the output's gradient ``g``: ``g * cos`` plus the transposed
    ``rotate_half`` of ``g * sin`` (autograd's arithmetic through ``_apply``; the rotation by ``-sin`` when
    the two halves of ``sin`` are equal, as in every model's)."""
    rot = cos.shape[-1]
    half = rot // 2
    g_rot = g[..., :rot]
    s = g_rot * sin
    out = g_rot * cos + torch.cat((s[..., half:], -s[..., :half]), dim=-1)
    return out if rot == g.shape[-1] else torch.cat((out, g[..., rot:]), dim=-1)


def rope_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x * cos + rotate_half(x) * sin`` on the first ``cos.shape[-1]`` features of ``q`` [batch, q_heads,
    seq, head_dim] and ``k`` [batch, kv_heads, seq, head_dim], the rest unchanged; ``cos``/``sin`` are
    [batch or 1, seq, rot_dim], shared by all heads."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return _apply(q, cos, sin), _apply(k, cos, sin)


def _check(name: str, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if x.dim() != 4:
        raise ValueError(f"{name} must be [batch, heads, seq, head_dim], got shape {tuple(x.shape)}")
    if cos.shape != sin.shape or cos.dim() != 3:
        raise ValueError(
            f"cos and sin must both be [batch or 1, seq, rot_dim], got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    batch, _, seq, dim = x.shape
    if cos.shape[0] not in (1, batch) or cos.shape[1] != seq:
        raise ValueError(f"cos/sin of shape {tuple(cos.shape)} do not fit {name} of shape {tuple(x.shape)}")
    if cos.shape[2] % 2 or cos.shape[2] > dim:
        raise ValueError(f"rot_dim must be even and at most head_dim {dim}, got {cos.shape[2]}")


class RoPETriton(torch.autograd.Function):
    """RoPE on ``q`` and ``k`` with a Triton kernel (a GPU, or ``TRITON_INTERPRET=1``); no gradient for
    ``cos``/``sin``."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        _check("q", q, cos, sin)
        _check("k", k, cos, sin)
        from tiertune.kernels.ops._triton_rope import rope

        ctx.save_for_backward(cos, sin)
        ctx.dtypes = (q.dtype, k.dtype)
        ctx.rope = rope
        # the output's dtype is what eager ``q * cos`` gives: ``q``'s, unless ``cos`` is wider
        out_q, out_k = (torch.promote_types(x.dtype, cos.dtype) for x in (q, k))
        outs = rope(q, cos, sin, out_q), rope(k, cos, sin, out_k)
        # as in the reference, an output whose input wants no gradient (say frozen keys) needs none either
        ctx.mark_non_differentiable(
            *(o for o, want in zip(outs, ctx.needs_input_grad[:2], strict=True) if not want)
        )
        return outs

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        want_q, want_k = ctx.needs_input_grad[:2]
        # the rotation is orthogonal: its transpose, the rotation by -sin, carries the gradient back
        gq = ctx.rope(dq, cos, sin, ctx.dtypes[0], backward=True) if want_q else None
        gk = ctx.rope(dk, cos, sin, ctx.dtypes[1], backward=True) if want_k else None
        return gq, gk, None, None


_TOKENS = 2048  # positions a tile of ``RoPETorch`` rotates at once: its temporaries are a tile's


def _rotated(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype, apply=_apply
) -> torch.Tensor:
    """``apply`` over ``x`` [batch, heads, seq, dim] a tile of positions at a time, into one new tensor."""
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    for part in row_tiles(x.shape[2], _TOKENS):
        out[:, :, part] = apply(x[:, :, part], cos[:, :, part], sin[:, :, part])
    return out


class RoPETorch(torch.autograd.Function):
    """The reference's arithmetic as one autograd Function: saves only ``cos`` and ``sin`` (autograd through the
    reference keeps nothing of q and k either, but its backward and forward make several whole-length
    temporaries per tensor); forward and backward (``_apply_transposed``) a tile of positions at a time.
    No gradient for ``cos``/``sin``."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        ctx.save_for_backward(cos, sin)
        ctx.dtypes = (q.dtype, k.dtype)
        outs = tuple(_rotated(x, cos, sin, torch.promote_types(x.dtype, cos.dtype)) for x in (q, k))
        ctx.mark_non_differentiable(
            *(o for o, want in zip(outs, ctx.needs_input_grad[:2], strict=True) if not want)
        )
        return outs

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        grads = tuple(
            _rotated(g, cos, sin, dtype, _apply_transposed) if want else None
            for g, want, dtype in zip((dq, dk), ctx.needs_input_grad[:2], ctx.dtypes, strict=True)
        )
        return *grads, None, None


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on ``q`` and ``k`` with the Triton kernel (``triton``, or ``auto`` on a GPU with Triton) or in
    torch (``torch``: the reference's arithmetic, ``RoPETorch``)."""
    backend = choose_backend(backend, q)
    if backend == "triton":
        return RoPETriton.apply(q, k, cos, sin)
    return RoPETorch.apply(q, k, cos, sin)
