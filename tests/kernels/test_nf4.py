"""NF4: the reference against bitsandbytes' own ``dequantize_4bit`` (exactly, fp32 and bf16, nested or not,
several block sizes and shapes whose rows are not whole blocks); the Triton kernel (``TRITON_INTERPRET=1`` on
a CPU, fp32) against the reference; ``nf4_linear`` against ``bnb.nn.Linear4bit`` forward and backward."""

import copy
import importlib.util
import math

import bitsandbytes as bnb
import bitsandbytes.functional as BF
import pytest
import torch
from torch import nn

from tiertune.kernels.ops.nf4 import NF4_CODE, dequantize_nf4, dequantize_nf4_reference, nf4_linear

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed"
)

# Rows of 64 (whole blocks), of 40 and 24 (blocks run across rows, a short last block at blocksize 128),
# 130 columns with more than 256 blocks (several nested groups), and an odd element count.
SHAPES = [(33, 64), (96, 40), (1000, 24), (300, 130), (7, 9)]


def quantize(shape, blocksize, nested, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(*shape, generator=g).to(dtype)
    packed, state = BF.quantize_4bit(
        weight, blocksize=blocksize, compress_statistics=nested, quant_type="nf4"
    )
    return weight, packed, state


def bnb_dequantize(packed, state):
    """bitsandbytes' ``dequantize_4bit``. Its AVX-512 CPU kernel takes each row of a 2-D weight to be whole
    blocks, which ``quantize_4bit`` (and the CUDA kernel) do not assume: they block the flattened weight. For
    such shapes it is asked for the weight as one flat row, which it dequantizes correctly."""
    if state.shape[-1] % state.blocksize == 0:
        return BF.dequantize_4bit(packed, state)
    flat = copy.copy(state)
    flat.shape = torch.Size([math.prod(state.shape)])
    return BF.dequantize_4bit(packed, flat).view(state.shape)


def test_the_code_is_bitsandbytes_nf4():
    assert torch.equal(NF4_CODE, BF.get_4bit_type("nf4", device="cpu"))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("blocksize", [64, 128])
@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_reference_is_what_bitsandbytes_computes(shape, blocksize, nested, dtype):
    _, packed, state = quantize(shape, blocksize, nested, dtype)
    assert state.nested == nested and state.dtype == dtype
    out = dequantize_nf4_reference(packed, state)
    assert out.shape == shape and out.dtype == dtype
    assert torch.equal(out, bnb_dequantize(packed, state))


def test_the_reference_blocks_the_flattened_weight():
    # Rows of 64 at blocksize 128: every other block starts mid-row. Each element is within half the widest
    # gap of the NF4 table (times its block's scale) of the original, which a per-row blocking misses.
    weight, packed, state = quantize((33, 64), 128, nested=False)
    out = dequantize_nf4_reference(packed, state)
    scale = state.absmax.repeat_interleave(128)[: weight.numel()].view(weight.shape)
    half_gap = (NF4_CODE[1:] - NF4_CODE[:-1]).max() / 2
    assert ((out - weight).abs() <= scale * half_gap * (1 + 1e-6)).all()


@needs_triton
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("blocksize", [64, 128])
@pytest.mark.parametrize("nested", [False, True])
def test_triton_matches_the_reference(shape, blocksize, nested):
    _, packed, state = quantize(shape, blocksize, nested, seed=shape[0])
    out = dequantize_nf4(packed, state, backend="triton")
    assert out.shape == shape and out.dtype == torch.float32
    assert torch.equal(out, dequantize_nf4_reference(packed, state))


def linear4bit(weight, bias, blocksize, nested):
    """A ``Linear4bit`` holding ``weight`` quantized, built as ``tiertune.quant.bnb4`` builds one."""
    out_features, in_features = weight.shape
    packed, state = BF.quantize_4bit(
        weight, blocksize=blocksize, compress_statistics=nested, quant_type="nf4"
    )
    layer = bnb.nn.Linear4bit(
        in_features, out_features, compute_dtype=torch.float32, compress_statistics=nested, quant_type="nf4"
    )
    layer.weight = bnb.nn.Params4bit(
        packed,
        requires_grad=False,
        quant_state=state,
        blocksize=blocksize,
        compress_statistics=nested,
        quant_type="nf4",
        bnb_quantized=True,
    )
    layer.bias = nn.Parameter(bias.clone())
    return layer, packed, state


# in_features 128 is whole blocks; 40 is not, and (not a multiple of 16) keeps bitsandbytes' CPU kernel on
# its flat path.
@pytest.mark.parametrize("in_features,out_features", [(128, 33), (40, 24)])
@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_nf4_linear_matches_linear4bit(in_features, out_features, nested, backend):
    g = torch.Generator().manual_seed(in_features)
    weight = torch.randn(out_features, in_features, generator=g) * 0.1
    bias = torch.randn(out_features, generator=g)
    layer, packed, state = linear4bit(weight, bias, 64, nested)
    x = torch.randn(5, in_features, generator=g)
    dy = torch.randn(5, out_features, generator=g)

    x1 = x.clone().requires_grad_()
    y1 = layer(x1)
    y1.backward(dy)

    x2 = x.clone().requires_grad_()
    b2 = bias.clone().requires_grad_()
    y2 = nf4_linear(x2, packed, state, b2, backend=backend)
    y2.backward(dy)

    assert torch.equal(y2, y1)
    assert torch.equal(x2.grad, x1.grad)
    assert torch.equal(b2.grad, layer.bias.grad)
    assert layer.weight.grad is None


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_nf4_linear_on_a_batch_of_sequences(backend):
    _, packed, state = quantize((24, 40), 64, nested=True, seed=3)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 3, 40, generator=g, requires_grad=True)
    bias = torch.randn(24, generator=g, requires_grad=True)
    dy = torch.randn(2, 3, 24, generator=g)

    y = nf4_linear(x, packed, state, bias, backend=backend)
    y.backward(dy)
    got = (y.detach(), x.grad.clone(), bias.grad.clone())
    x.grad = bias.grad = None
    expected = torch.nn.functional.linear(x, dequantize_nf4_reference(packed, state), bias)
    expected.backward(dy)
    for a, b in zip(got, (expected.detach(), x.grad, bias.grad)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_nf4_linear_keeps_only_the_packed_weight_for_backward():
    _, packed, state = quantize((24, 40), 64, nested=True)
    x = torch.randn(5, 40, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = nf4_linear(x, packed, state, backend="torch")
    assert len(saved) == 1 and saved[0].dtype == torch.uint8 and saved[0].numel() == packed.numel()
    y.sum().backward()
    assert x.grad is not None


def test_bad_arguments_are_refused():
    _, packed, state = quantize((8, 16), 64, nested=False)
    with pytest.raises(ValueError, match="backend"):
        dequantize_nf4(packed, state, backend="cuda")
    with pytest.raises(ValueError, match="bytes"):
        dequantize_nf4_reference(packed[:10], state)
    fp4 = copy.copy(state)
    fp4.quant_type = "fp4"
    with pytest.raises(ValueError, match="nf4"):
        dequantize_nf4_reference(packed, fp4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("shape", [(4096, 4096), (1000, 24), (11008, 4096)])
@pytest.mark.parametrize("nested", [False, True])
def test_triton_matches_bitsandbytes_in_bf16_on_a_gpu(shape, nested):
    g = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(*shape, device="cuda", generator=g).bfloat16()
    packed, state = BF.quantize_4bit(weight, blocksize=64, compress_statistics=nested, quant_type="nf4")
    expected = BF.dequantize_4bit(packed, state)
    for backend in ("triton", "torch"):
        out = dequantize_nf4(packed, state, backend=backend)
        assert out.dtype == torch.bfloat16 and out.shape == shape
        # At most one bf16 ulp apart (the fp32 products are the same; the last rounding may differ).
        torch.testing.assert_close(out.float(), expected.float(), rtol=2**-7, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_nf4_linear_matches_linear4bit_in_bf16_on_a_gpu():
    g = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(768, 1024, device="cuda", generator=g) * 0.02
    bias = torch.randn(768, device="cuda", generator=g)
    packed, state = BF.quantize_4bit(
        weight.bfloat16(), blocksize=64, compress_statistics=True, quant_type="nf4"
    )
    layer = bnb.nn.Linear4bit(1024, 768, compute_dtype=torch.bfloat16, quant_type="nf4", device="cuda")
    layer.weight = bnb.nn.Params4bit(
        packed, requires_grad=False, quant_state=state, blocksize=64, quant_type="nf4", bnb_quantized=True
    )
    layer.bias = nn.Parameter(bias.bfloat16())
    x = torch.randn(256, 1024, device="cuda", generator=g).bfloat16()
    dy = torch.randn(256, 768, device="cuda", generator=g).bfloat16()

    x1 = x.clone().requires_grad_()
    y1 = layer(x1)
    y1.backward(dy)
    x2 = x.clone().requires_grad_()
    b2 = bias.bfloat16().requires_grad_()
    y2 = nf4_linear(x2, packed, state, b2, backend="triton")
    y2.backward(dy)
    for a, b in ((y2, y1), (x2.grad, x1.grad), (b2.grad, layer.bias.grad)):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
