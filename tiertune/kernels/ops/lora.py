"""The LoRA branch ``dropout(x) @ A^T @ B^T * scale`` (A: [r, in_features], B: [out_features, r]) without
storing the dropped-out copy of ``x``.

peft computes ``lora_B(lora_A(dropout(x))) * scaling``, so autograd keeps, per adapted module, the dropout mask
and ``dropout(x)``, each as large as ``x``, until backward. The fused ops keep ``x`` itself (which the caller
holds anyway), ``h = dropout(x) @ A^T`` ([tokens, r]), the weights and an integer seed; backward draws the
same mask again from the seed. The seed comes from torch's default CPU generator, so ``torch.manual_seed``
makes runs reproducible and a recomputation that restores the CPU RNG state (``torch.utils.checkpoint``, the
engine's layer recompute) sees the same mask.

Dtypes follow peft: ``x`` is cast to A's dtype before the dropout, the branch runs in A's dtype (tl.dot and
torch's matmuls accumulate in fp32) and returns A's dtype; ``x``'s gradient comes back in ``x``'s dtype. With
an fp32 adapter on a bf16 model the fused ops cast tile by tile, peft's module holds an fp32 copy of ``x``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tiertune.kernels.ops.backend import choose_backend


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


def _dropped(x: torch.Tensor, dtype: torch.dtype, seed: int, p: float) -> torch.Tensor:
    if p == 0:
        return x.to(dtype)
    keep = dropout_keep_mask(seed, x.shape, p, x.device, backend="torch")
    return torch.mul(x.to(dtype), keep).div_(1.0 - p)


class LoRABranchTorch(torch.autograd.Function):
    """The fused branch in plain torch: the mask comes from a ``torch.Generator`` seeded per call and is drawn
    again in backward. ``seed=None`` draws one."""

    @staticmethod
    def forward(ctx, x, a, b, scale, p, seed=None):
        seed = draw_seed() if seed is None and p > 0 else (seed or 0)
        h = F.linear(_dropped(x, a.dtype, seed, p), a)
        ctx.save_for_backward(x, a, b, h)
        ctx.scale, ctx.p, ctx.seed = scale, p, seed
        return F.linear(h, b).mul_(scale)

    @staticmethod
    def backward(ctx, grad_out):
        x, a, b, h = ctx.saved_tensors
        want_x, want_a, want_b = ctx.needs_input_grad[:3]
        grad_x = grad_a = grad_b = None
        gs = (grad_out * ctx.scale).to(b.dtype)  # the gradient of lora_B's output
        if want_b:
            grad_b = gs.reshape(-1, gs.shape[-1]).t() @ h.reshape(-1, h.shape[-1])
        gh = gs @ b
        if want_a:
            dropped = _dropped(x, a.dtype, ctx.seed, ctx.p)
            grad_a = gh.reshape(-1, gh.shape[-1]).t() @ dropped.reshape(-1, x.shape[-1])
            del dropped
        if want_x:
            grad_x = gh.to(a.dtype) @ a
            if ctx.p > 0:
                keep = dropout_keep_mask(ctx.seed, x.shape, ctx.p, x.device, backend="torch")
                grad_x.mul_(keep).div_(1.0 - ctx.p)
            grad_x = grad_x.to(x.dtype)
        return grad_x, grad_a, grad_b, None, None, None


class LoRABranchTriton(torch.autograd.Function):
    """The fused branch with Triton kernels (a GPU, or ``TRITON_INTERPRET=1``): ``dropout(x) @ A^T`` and both
    gradients through A, with the mask drawn in-kernel from the seed; the rank-sized products with B in torch.
    ``seed=None`` draws one."""

    @staticmethod
    def forward(ctx, x, a, b, scale, p, seed=None):
        from tiertune.kernels.ops._triton_lora import lora_a_backward, lora_a_forward

        seed = draw_seed() if seed is None and p > 0 else (seed or 0)
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        h = lora_a_forward(x2, a, seed, p)
        ctx.save_for_backward(x2, a, b, h)
        ctx.scale, ctx.p, ctx.seed, ctx.shape = scale, p, seed, x.shape
        ctx.backward_fn = lora_a_backward
        return F.linear(h, b).mul_(scale).view(*x.shape[:-1], b.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x2, a, b, h = ctx.saved_tensors
        want_x, want_a, want_b = ctx.needs_input_grad[:3]
        gs = (grad_out.reshape(-1, grad_out.shape[-1]) * ctx.scale).to(b.dtype)
        grad_b = gs.t() @ h if want_b else None
        grad_x, grad_a = ctx.backward_fn(x2, a, gs @ b, ctx.seed, ctx.p, want_x, want_a)
        if grad_x is not None:
            grad_x = grad_x.view(ctx.shape)
        return grad_x, grad_a, grad_b, None, None, None


def lora_branch(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: float,
    p: float = 0.0,
    training: bool = True,
    backend: str = "auto",
) -> torch.Tensor:
    """``dropout(x) @ A^T @ B^T * scale`` (dropout probability ``p`` when ``training``) without storing the
    dropped-out ``x``. ``backend``: ``torch``, ``triton`` or ``auto`` (Triton on a CUDA device when it is
    installed). Without dropout and with ``x`` in A's dtype the torch backend is the plain reference: there is no
    mask and no cast copy of ``x`` that autograd would keep."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"the dropout probability must be in [0, 1), got {p}")
    backend = choose_backend(backend, x)
    p = p if training else 0.0
    if backend == "triton":
        return LoRABranchTriton.apply(x, a, b, scale, p, None)
    if p == 0 and x.dtype == a.dtype:  # nothing to cast: autograd keeps x itself
        return lora_branch_reference(x, a, b, scale)
    return LoRABranchTorch.apply(x, a, b, scale, p, None)
