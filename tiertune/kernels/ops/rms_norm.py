"""RMSNorm, as Llama/Qwen/Mistral compute it (and Gemma's ``1 + weight`` variant): the row normalized in fp32,
cast back to the input dtype, then multiplied by the weight.

``rms_norm_reference`` is the oracle and the no-autograd CPU path; ``RMSNormTorch`` is the CPU path that
back-propagates: the same arithmetic, but it keeps only the input and the per-row ``rstd`` for backward and
computes the input's gradient in one pass with in-place ops (autograd through the reference keeps the fp32
input, the normalized row and their cast, and its backward holds some five row-sized temporaries at once: at a
long sequence that is what a layer's backward peaks on). ``RMSNormTriton`` runs forward and backward as Triton
kernels (one program per row forward; backward programs each take a stride of rows and keep a partial sum of
the weight's gradient, summed at the end).
"""

from __future__ import annotations

import torch

from tiertune.kernels.ops.backend import choose_backend


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0
) -> torch.Tensor:
    """``(offset + weight) * (x * rsqrt(mean(x^2) + eps))``, normalized in fp32 and cast back first (HF's
    LlamaRMSNorm with ``offset`` 0; GemmaRMSNorm, which multiplies in fp32, is matched with ``offset`` 1 and
    an fp32 ``x``)."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (offset + weight) * h.to(dtype)


class RMSNormTorch(torch.autograd.Function):
    """RMSNorm over the last dimension in torch ops, keeping the input and ``rstd`` only (module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, eps, offset):
        dtype = x.dtype
        h = x.float()
        rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.offset = offset
        return (offset + weight) * (h * rstd).to(dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dtype = x.dtype
        xhat = x.float() * rstd
        dw = None
        if ctx.needs_input_grad[1]:  # as autograd reduces the product's broadcast: over every leading dim
            dw = (dy * xhat.to(dtype)).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        g = (dy * (ctx.offset + weight)).to(dtype).float()
        mean = (g * xhat).mean(-1, keepdim=True)
        dx = g.sub_(xhat.mul_(mean)).mul_(rstd).to(dtype)
        return dx, dw, None, None


class RMSNormTriton(torch.autograd.Function):
    """RMSNorm over the last dimension with Triton kernels (a GPU, or ``TRITON_INTERPRET=1``)."""

    @staticmethod
    def forward(ctx, x, weight, eps, offset):
        from tiertune.kernels.ops._triton_rms_norm import rms_norm_backward, rms_norm_forward

        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        y, rstd = rms_norm_forward(x2, weight, eps, offset)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.offset, ctx.backward_fn = offset, rms_norm_backward
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        dx, dw = ctx.backward_fn(dy.reshape(x2.shape).contiguous(), x2, weight, rstd, ctx.offset)
        return dx.view(dy.shape), dw.to(weight.dtype), None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0, backend: str = "auto"):
    """RMSNorm with the Triton kernels (``triton``, or ``auto`` on a GPU with Triton), else in torch ops:
    ``RMSNormTorch`` where autograd records it, the reference where it does not."""
    backend = choose_backend(backend, x)
    if backend == "triton":
        return RMSNormTriton.apply(x, weight, eps, offset)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return RMSNormTorch.apply(x, weight, eps, offset)
    return rms_norm_reference(x, weight, eps, offset)
