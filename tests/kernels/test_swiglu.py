"""The GLU activation (SwiGLU and tanh GeGLU): the Triton kernels (``TRITON_INTERPRET=1`` on a CPU, fp32)
against the reference, forward and backward, several shapes incl. non-powers of two and strided halves of a
fused projection; the reference against transformers' activations and a LlamaMLP / GemmaMLP."""

import importlib.util

import pytest
import torch

from tiertune.kernels.ops.swiglu import GLU_ACTIVATIONS, glu, glu_reference

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed"
)


def _both_backends(gate, up, dy, activation):
    """Forward output and the gradients of gate and up, per backend."""
    outs = {}
    for backend in ("torch", "triton"):
        y = glu(gate, up, activation, backend=backend)
        y.backward(dy)
        outs[backend] = (y.detach(), gate.grad.clone(), up.grad.clone())
        gate.grad = up.grad = None
    return outs


@needs_triton
@pytest.mark.parametrize("shape", [(3, 5, 37), (2, 1000), (1, 11008 // 8), (4, 256), (7,)])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_triton_matches_the_reference(shape, activation):
    g = torch.Generator().manual_seed(sum(shape))
    # a wide gate covers both tails of the activations (sigmoid and tanh saturate)
    gate = (3 * torch.randn(*shape, generator=g)).requires_grad_()
    up = torch.randn(*shape, generator=g, requires_grad=True)
    dy = torch.randn(*shape, generator=g)
    outs = _both_backends(gate, up, dy, activation)
    for a, b in zip(outs["triton"], outs["torch"], strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@needs_triton
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_triton_reads_the_halves_of_a_fused_projection(activation):
    g = torch.Generator().manual_seed(1)
    fused = torch.randn(2, 3, 2 * 45, generator=g, requires_grad=True)
    dy = torch.randn(2, 3, 45, generator=g)
    grads = {}
    for backend in ("torch", "triton"):
        gate, up = fused.chunk(2, dim=-1)  # views with row stride 90, not 45
        y = glu(gate, up, activation, backend=backend)
        y.backward(dy)
        grads[backend] = (y.detach(), fused.grad.clone())
        fused.grad = None
    for a, b in zip(grads["triton"], grads["torch"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # a transposed input (no unit column stride) is copied, with the same result
    gate_t = torch.randn(45, 6, generator=g).t()
    up_t = torch.randn(6, 45, generator=g)
    torch.testing.assert_close(
        glu(gate_t, up_t, activation, backend="triton"), glu_reference(gate_t, up_t, activation)
    )


@needs_triton
def test_triton_saves_only_the_inputs():
    gate = torch.randn(4, 33, requires_grad=True)
    up = torch.randn(4, 33, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        glu(gate, up, backend="triton")
    assert len(saved) == 2
    assert {t.data_ptr() for t in saved} == {gate.data_ptr(), up.data_ptr()}


def test_unknown_activation_and_backend_raise():
    x = torch.randn(3)
    with pytest.raises(ValueError, match="silu, gelu_tanh"):
        glu(x, x, "gelu")
    with pytest.raises(ValueError, match="silu, gelu_tanh"):
        glu_reference(x, x, "relu")
    with pytest.raises(ValueError, match="backend"):
        glu(x, x, backend="cuda")


@pytest.mark.parametrize("hidden_act", sorted(GLU_ACTIVATIONS))
def test_the_reference_is_what_transformers_activations_compute(hidden_act):
    from transformers.activations import ACT2FN

    g = torch.Generator().manual_seed(0)
    gate, up = 4 * torch.randn(2, 3, 64, generator=g), torch.randn(2, 3, 64, generator=g)
    expected = ACT2FN[hidden_act](gate) * up
    ours = glu_reference(gate, up, GLU_ACTIVATIONS[hidden_act])
    # the names transformers computes with torch's own kernels match bit for bit; the written-out ones
    # (gelu_new, gelu_fast, gelu_python_tanh) up to fp32 rounding
    exact = hidden_act in ("silu", "swish", "gelu_pytorch_tanh")
    torch.testing.assert_close(ours, expected, rtol=0 if exact else 1e-5, atol=0 if exact else 1e-5)


@pytest.mark.parametrize("family", ["llama", "gemma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_glu_inside_a_transformers_mlp_gives_its_output(family, dtype):
    from transformers import GemmaConfig, LlamaConfig
    from transformers.models.gemma.modeling_gemma import GemmaMLP
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    kwargs = dict(hidden_size=32, intermediate_size=88)
    if family == "llama":
        config = LlamaConfig(hidden_act="silu", **kwargs)
        mlp = LlamaMLP(config)
    else:
        config = GemmaConfig(hidden_act="gelu_pytorch_tanh", **kwargs)
        mlp = GemmaMLP(config)
    mlp = mlp.to(dtype)
    x = torch.randn(2, 5, 32, dtype=dtype)
    activation = GLU_ACTIVATIONS[config.hidden_act]
    ours = mlp.down_proj(glu(mlp.gate_proj(x), mlp.up_proj(x), activation))
    torch.testing.assert_close(ours, mlp(x), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("shape", [(4, 2048, 14336), (3, 77, 11008), (5, 1000)])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_triton_matches_torch_in_bf16_on_a_gpu(shape, activation):
    g = torch.Generator(device="cuda").manual_seed(0)
    gate = (3 * torch.randn(*shape, device="cuda", generator=g)).bfloat16().requires_grad_()
    up = torch.randn(*shape, device="cuda", generator=g).bfloat16().requires_grad_()
    dy = torch.randn(*shape, device="cuda", generator=g).bfloat16()
    outs = _both_backends(gate, up, dy, activation)
    for a, b in zip(outs["triton"], outs["torch"], strict=True):
        assert a.dtype == torch.bfloat16
        # the kernel rounds where eager torch does: what differs is an fp32 ulp in exp/tanh, which flips a
        # bf16 rounding now and then, one bf16 ulp (2**-8 relative) of that value or of a product of it
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
        assert (a.float() - b.float()).abs().mean() < 1e-3
