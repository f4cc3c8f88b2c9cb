"""RMSNorm, as Llama/Qwen/Mistral compute it (and Gemma's ``1 + weight`` variant): the row normalized in fp32,
cast back to the input dtype, then multiplied by the weight.

``rms_norm_reference`` is the oracle and the CPU path; ``RMSNormTriton`` runs forward and backward as Triton
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
    """RMSNorm with the Triton kernels (``triton``, or ``auto`` on a GPU with Triton) or the reference."""
    backend = choose_backend(backend, x)
    if backend == "triton":
        return RMSNormTriton.apply(x, weight, eps, offset)
    return rms_norm_reference(x, weight, eps, offset)
