"""RMSNorm, as Llama/Qwen/Mistral compute it (and Gemma's ``1 + weight`` variant): the row normalized in fp32,
cast back to the input dtype, then multiplied by the weight.

``rms_norm_reference`` is the oracle; ``RMSNormTorch`` is the CPU path: the same arithmetic, row by row the
same bits, but a tile of rows at a time, keeping only the input and the per-row ``rstd`` for backward, which
computes the input's gradient with in-place ops (autograd through the reference keeps the fp32 input, the
normalized row and their cast, and its backward holds some five temporaries as large as the input at once: at
a long sequence that was what a layer's backward peaked on). ``RMSNormTriton`` runs forward and backward as Triton
kernels (one program per row forward; backward programs each take a stride of rows and keep a partial sum of
the weight's gradient, summed at the end).
"""

from __future__ import annotations

import torch

from tiertune.kernels.ops.backend import choose_backend, row_tiles


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
        n = x.shape[-1]
        x2 = x.reshape(-1, n)
        scale = offset + weight
        y = torch.empty(x2.shape, dtype=torch.result_type(scale, x), device=x.device)
        rstd = torch.empty(x2.shape[0], 1, dtype=torch.float32, device=x.device)
        for part in row_tiles(x2.shape[0], _ROWS):  # a tile of rows at a time, as backward
            h = x2[part].float()
            rstd[part] = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
            y[part] = scale * (h * rstd[part]).to(x.dtype)
            del h
        ctx.save_for_backward(x, weight, rstd)
        ctx.offset = offset
        return y.view(*x.shape[:-1], n)

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        n = x.shape[-1]
        x2, dy2, rstd2 = x.reshape(-1, n), dy.reshape(-1, n), rstd.reshape(-1, 1)
        dx = torch.empty(
            x.shape, dtype=x.dtype, device=x.device
        )  # not a view: autograd may add into it in place
        dx2 = dx.view(-1, n)
        dw = torch.zeros(n, dtype=torch.float32, device=x.device) if ctx.needs_input_grad[1] else None
        for part in row_tiles(x2.shape[0], _ROWS):
            dx2[part] = _rows_backward(x2[part], dy2[part], rstd2[part], weight, ctx.offset, dw)
        del dx2
        return dx, dw.to(weight.dtype) if dw is not None else None, None, None


_ROWS = 1024  # rows of a tile in ``RMSNormTorch``


def _rows_backward(x, dy, rstd, weight, offset, dw) -> torch.Tensor:
    """The input's gradient for some rows; their share of the weight's gradient added to ``dw`` (fp32) when
    it is wanted. The arithmetic of autograd through ``rms_norm_reference``: ``dy * (offset + weight)`` cast to
    the input's dtype and back, ``rstd * (g - xhat * mean(g * xhat))``."""
    dtype = x.dtype
    xhat = x.float() * rstd
    if dw is not None:
        dw += (dy * xhat.to(dtype)).float().sum(0)
    g = (dy * (offset + weight)).to(dtype).float()
    mean = (g * xhat).mean(-1, keepdim=True)
    return g.sub_(xhat.mul_(mean)).mul_(rstd).to(dtype)


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
    ``RMSNormTorch`` (the reference's arithmetic, a tile of rows at a time)."""
    backend = choose_backend(backend, x)
    if backend == "triton":
        return RMSNormTriton.apply(x, weight, eps, offset)
    return RMSNormTorch.apply(x, weight, eps, offset)
