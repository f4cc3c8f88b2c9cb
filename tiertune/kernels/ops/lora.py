"""The LoRA branch ``dropout(x) @ A^T @ B^T * scale`` (A: [r, in_features], B: [out_features, r]) without
storing the dropped-out copy of ``x``.

peft computes ``lora_B(lora_A(dropout(x))) * scaling``, so autograd keeps, per adapted module, the dropout mask
and ``dropout(x)``, each as large as ``x``, until backward. The fused ops keep ``x`` itself (which the caller
holds anyway), ``h = dropout(x) @ A^T`` ([tokens, r]), the weights and an integer seed; backward draws the
same mask again from the seed. The seed comes from torch's default CPU generator, so ``torch.manual_seed``
makes runs reproducible and a recomputation that restores the CPU RNG state (``torch.utils.checkpoint``, the
engine's layer recompute) sees the same mask.

Dtypes follow peft: ``x`` is cast to A's dtype before the dropout, the branch runs in A's dtype (tl.dot and
torch's matmuls accumulate in fp32) and returns A's dtype, or the one asked for (the model's, which tiertune's
patched LoRA layer asks for: the cast happens a tile at a time, and the output's gradient arrives in it);
``x``'s gradient comes back in ``x``'s dtype. With an fp32 adapter on a bf16 model the fused ops cast tile by
tile, peft's module holds an fp32 copy of ``x``. The products with B (and, in torch, with A) run a tile of rows
at a time, so the fp32 temporaries of a long sequence's backward are a tile's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tiertune.kernels.ops.backend import choose_backend, row_tiles


def lora_branch_reference(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: float,
    p: float = 0.0,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """``lora_B(lora_A(dropout(x))) * scale`` as peft's ``lora.Linear`` computes it (the oracle), with the
    dropout given as its keep mask (``None``: no dropout); ``x`` is cast to A's dtype first, like peft."""
    h = x.to(a.dtype)
    if keep is not None:
        h = h * keep / (1.0 - p)
    return F.linear(F.linear(h, a), b) * scale


def draw_seed() -> int:
    """A dropout seed from torch's default CPU generator (so ``torch.manual_seed`` governs it)."""
    return int(torch.randint(0, 2**31 - 1, (), dtype=torch.int64))


def dropout_keep_mask(
    seed: int,
    shape: tuple[int, ...] | torch.Size,
    p: float,
    device: torch.device | str,
    backend: str = "triton",
) -> torch.Tensor:
    """The boolean keep mask (kept with probability ``1 - p``) that the ``triton`` kernels or ``LoRABranchTorch``
    (``torch``) draw for ``seed`` over an input of ``shape``."""
    if backend == "triton":
        from tiertune.kernels.ops._triton_lora import keep_mask

        return keep_mask(seed, torch.Size(shape).numel(), p, torch.device(device)).view(shape)
    if backend == "torch":
        g = torch.Generator(device=device).manual_seed(seed)
        return torch.rand(shape, generator=g, device=device) >= p
    raise ValueError(f"backend must be triton or torch, got {backend!r}")


def _dropped(x: torch.Tensor, dtype: torch.dtype, keep: torch.Tensor | None, p: float) -> torch.Tensor:
    """``dropout(x)`` in ``dtype`` with the keep mask ``keep`` (None: no dropout)."""
    if keep is None:
        return x.to(dtype)
    return torch.mul(x.to(dtype), keep).div_(1.0 - p)


def _keep(seed: int, x: torch.Tensor, p: float) -> torch.Tensor | None:
    return dropout_keep_mask(seed, x.shape, p, x.device, backend="torch") if p > 0 else None


_ROWS = (
    2048  # tokens a tile of the B-side products runs at: their fp32 temporaries are a tile's, not the input's
)


def _b_forward(h: torch.Tensor, b: torch.Tensor, scale: float, out_dtype: torch.dtype) -> torch.Tensor:
    """``(h @ B^T) * scale`` for ``h`` [tokens, r], cast to ``out_dtype`` a tile of rows at a time."""
    out = torch.empty(h.shape[0], b.shape[0], dtype=out_dtype, device=h.device)
    for rows in row_tiles(h.shape[0], _ROWS):
        out[rows] = F.linear(h[rows], b).mul_(scale)
    return out


def _b_backward(grad: torch.Tensor, h: torch.Tensor, b: torch.Tensor, scale: float, want_b: bool):
    """For the output's gradient ``grad`` [tokens, out]: the gradient at ``h`` ([tokens, r], B's dtype) and
    B's (None unless ``want_b``), a tile of rows at a time (``grad * scale`` in B's dtype is a tile's)."""
    gh = torch.empty(h.shape[0], b.shape[1], dtype=b.dtype, device=h.device)
    grad_b = torch.zeros_like(b) if want_b else None
    for rows in row_tiles(h.shape[0], _ROWS):
        gs = (grad[rows] * scale).to(b.dtype)  # the gradient of lora_B's output
        if grad_b is not None:
            grad_b += gs.t() @ h[rows]
        gh[rows] = gs @ b
    return gh, grad_b


class LoRABranchTorch(torch.autograd.Function):
    """The fused branch in plain torch: the mask comes from a ``torch.Generator`` seeded per call and is drawn
    again in backward. ``seed=None`` draws one. Returns ``out_dtype`` (None: A's); backward's products run a
    tile of rows at a time."""

    @staticmethod
    def forward(ctx, x, a, b, scale, p, seed=None, out_dtype=None):
        seed = draw_seed() if seed is None and p > 0 else (seed or 0)
        x2 = x.reshape(-1, x.shape[-1])
        keep = _keep(seed, x2, p)
        h = torch.empty(x2.shape[0], a.shape[0], dtype=a.dtype, device=x.device)
        for rows in row_tiles(x2.shape[0], _ROWS):  # x cast (and dropped out) a tile at a time
            h[rows] = F.linear(_dropped(x2[rows], a.dtype, keep[rows] if keep is not None else None, p), a)
        del keep
        h = h.view(*x.shape[:-1], a.shape[0])
        ctx.save_for_backward(x, a, b, h)
        ctx.scale, ctx.p, ctx.seed = scale, p, seed
        out = _b_forward(h.reshape(-1, h.shape[-1]), b, scale, out_dtype or a.dtype)
        return out.view(*x.shape[:-1], b.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x, a, b, h = ctx.saved_tensors
        want_x, want_a, want_b = ctx.needs_input_grad[:3]
        x2 = x.reshape(-1, x.shape[-1])
        gh, grad_b = _b_backward(
            grad_out.reshape(-1, grad_out.shape[-1]), h.reshape(-1, h.shape[-1]), b, ctx.scale, want_b
        )
        keep = _keep(ctx.seed, x2, ctx.p)
        grad_a = torch.zeros_like(a) if want_a else None
        # x's shape, not a view of a flat tensor: autograd adds the base layer's gradient into it in place
        grad_x = torch.empty(x.shape, dtype=x.dtype, device=x.device) if want_x else None
        flat = grad_x.view(-1, x.shape[-1]) if grad_x is not None else None
        for rows in row_tiles(x2.shape[0], _ROWS):
            part = keep[rows] if keep is not None else None
            g = gh[rows].to(a.dtype)
            if grad_a is not None:
                grad_a += g.t() @ _dropped(x2[rows], a.dtype, part, ctx.p)
            if flat is not None:
                flat[rows] = _dropped(g @ a, a.dtype, part, ctx.p)
        del flat
        return grad_x, grad_a, grad_b, None, None, None, None


class LoRABranchTriton(torch.autograd.Function):
    """The fused branch with Triton kernels (a GPU, or ``TRITON_INTERPRET=1``): ``dropout(x) @ A^T`` and both
    gradients through A, with the mask drawn in-kernel from the seed; the rank-sized products with B in torch,
    a tile of rows at a time. ``seed=None`` draws one; returns ``out_dtype`` (None: A's)."""

    @staticmethod
    def forward(ctx, x, a, b, scale, p, seed=None, out_dtype=None):
        from tiertune.kernels.ops._triton_lora import lora_a_backward, lora_a_forward

        seed = draw_seed() if seed is None and p > 0 else (seed or 0)
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        h = lora_a_forward(x2, a, seed, p)
        ctx.save_for_backward(x2, a, b, h)
        ctx.scale, ctx.p, ctx.seed, ctx.shape = scale, p, seed, x.shape
        ctx.backward_fn = lora_a_backward
        return _b_forward(h, b, scale, out_dtype or a.dtype).view(*x.shape[:-1], b.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x2, a, b, h = ctx.saved_tensors
        want_x, want_a, want_b = ctx.needs_input_grad[:3]
        gh, grad_b = _b_backward(grad_out.reshape(-1, grad_out.shape[-1]), h, b, ctx.scale, want_b)
        grad_x, grad_a = ctx.backward_fn(x2, a, gh, ctx.seed, ctx.p, want_x, want_a, tuple(ctx.shape))
        return grad_x, grad_a, grad_b, None, None, None, None


def lora_branch(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: float,
    p: float = 0.0,
    training: bool = True,
    backend: str = "auto",
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``dropout(x) @ A^T @ B^T * scale`` (dropout probability ``p`` when ``training``) in ``out_dtype`` (None:
    A's) without storing the dropped-out ``x`` or a cast copy of it. ``backend``: ``torch``, ``triton`` or
    ``auto`` (Triton on a CUDA device when it is installed)."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"the dropout probability must be in [0, 1), got {p}")
    backend = choose_backend(backend, x)
    p = p if training else 0.0
    fused = LoRABranchTriton if backend == "triton" else LoRABranchTorch
    return fused.apply(x, a, b, scale, p, None, out_dtype)
