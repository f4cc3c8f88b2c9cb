"""RMSNorm: the Triton kernels (``TRITON_INTERPRET=1`` on a CPU, fp32) against the reference, forward and
backward, several shapes incl. non-powers of two, Llama's and Gemma's (1 + weight) variants; the reference
against transformers' own modules."""

import importlib.util

import pytest
import torch

from tiertune.kernels.ops.rms_norm import rms_norm, rms_norm_reference

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed"
)


@needs_triton
@pytest.mark.parametrize("shape", [(3, 64), (2, 5, 96), (7, 130), (1, 4096)])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_triton_matches_the_reference(shape, offset):
    g = torch.Generator().manual_seed(shape[-1])
    x = torch.randn(*shape, generator=g, requires_grad=True)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).requires_grad_()
    dy = torch.randn(*shape, generator=g)
    outs = {}
    for backend in ("torch", "triton"):
        y = rms_norm(x, w, 1e-6, offset, backend=backend)
        y.backward(dy)
        outs[backend] = (y.detach(), x.grad.clone(), w.grad.clone())
        x.grad = w.grad = None
    for a, b in zip(outs["triton"], outs["torch"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_the_reference_is_what_transformers_computes(family):
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    module = LlamaRMSNorm(48, eps=1e-6) if family == "llama" else GemmaRMSNorm(48, eps=1e-6)
    with torch.no_grad():
        module.weight.normal_()
    x = torch.randn(4, 48)
    offset = 1.0 if family == "gemma" else 0.0
    torch.testing.assert_close(
        rms_norm_reference(x, module.weight, 1e-6, offset), module(x), rtol=1e-6, atol=1e-6
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("weight_grad", [True, False])
def test_the_torch_function_back_propagates_as_autograd_through_the_reference(dtype, offset, weight_grad):
    """``RMSNormTorch`` (the CPU path under autograd: it keeps the input and rstd only) gives the reference's
    output bit for bit, and the gradients autograd computes through the reference (fp32: 1e-5, the weight's a
    sum over 3000 rows in another order; bf16: within a bf16 rounding)."""
    from tiertune.kernels.ops.rms_norm import RMSNormTorch

    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 1000, 96, generator=g).to(dtype).requires_grad_()  # several tiles of rows, one short
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype).requires_grad_(weight_grad)
    dy = torch.randn(3, 1000, 96, generator=g).to(dtype)
    ours = RMSNormTorch.apply(x, w, 1e-6, offset)
    ref = rms_norm_reference(x, w, 1e-6, offset)
    assert torch.equal(ours, ref)
    wanted = [x, w] if weight_grad else [x]
    got, expected = torch.autograd.grad(ours, wanted, dy), torch.autograd.grad(ref, wanted, dy)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    for a, b in zip(got, expected, strict=True):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, **tol)
    with torch.no_grad():  # no autograd: the same bits
        assert torch.equal(rms_norm(x, w, 1e-6, offset, backend="torch"), ref)
