"""The FP8 blockwise linear op: the Triton kernel (``TRITON_INTERPRET=1`` on a CPU, fp32; bf16 on a GPU) against the
weight dequantized as DeepSeek's ``weight_dequant`` does and ``F.linear``, forward and the input's gradient; every
e4m3 code decoded as torch decodes it; the op dispatch (the dequantizing fallback where blocks are not multiples of
16)."""

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from parity import assert_frozen_linear

from tiertune.kernels.ops.fp8 import dequantize_fp8, fp8_linear, fused
from tiertune.quant.shipped import FP8

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed"
)

# (out, in, block): DeepSeek's 128 x 128 blocks with edge blocks on both sides (160 rows over 2 block rows, 200
# columns over 2), blocks of other shapes, and an input of rows that are not a whole tile
CASES = [(160, 200, (128, 128)), (96, 64, (32, 64)), (48, 80, (16, 16))]


def _weight(out, inp, block, seed=0):
    g = torch.Generator().manual_seed(seed)
    codes, scale = FP8(block=block).quantize(torch.randn(out, inp, generator=g) * 0.1)
    return codes, scale


@needs_triton
@pytest.mark.parametrize("out, inp, block", CASES)
@pytest.mark.parametrize("rows", [5, 70])
def test_the_kernel_is_the_dequantized_weights_product_forward_and_backward(out, inp, block, rows):
    codes, scale = _weight(out, inp, block)
    weight = dequantize_fp8(codes, scale, block, torch.float32)
    assert_frozen_linear(lambda x: fp8_linear(x, codes, scale, block, backend="triton"), weight, rows)


@needs_triton
def test_every_e4m3_code_decodes_as_torch_decodes_it():
    """All 254 finite e4m3fn codes (both zeros and the subnormals included) through the kernel: a weight whose
    rows are every code, its scales 1, times the identity gives each code's value."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    finite = codes[~torch.isnan(codes.float())]
    weight = finite[: 16 * (len(finite) // 16)].reshape(-1, 16)  # whole tiles: 15 rows of 16
    scale = torch.ones(1, 1)
    eye = torch.eye(16)
    got = fp8_linear(
        eye, weight, scale, (weight.shape[0] if weight.shape[0] % 16 == 0 else 16, 16), backend="triton"
    )
    torch.testing.assert_close(got.T, weight.float(), rtol=0, atol=0)


def test_blocks_not_multiples_of_16_take_the_dequantizing_path():
    """Blocks the kernel's tiles cannot divide: the weight dequantized and ``F.linear``, the same values."""
    assert not fused((4, 8)) and fused((128, 128))
    codes, scale = _weight(12, 24, (4, 8))
    x = torch.randn(3, 24)
    got = fp8_linear(x, codes, scale, (4, 8), bias=torch.ones(12), backend="triton")
    torch.testing.assert_close(
        got, F.linear(x, dequantize_fp8(codes, scale, (4, 8), torch.float32), torch.ones(12))
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("out, inp, block", CASES)
def test_the_kernel_in_bf16_on_a_gpu(out, inp, block):
    """bf16 on a GPU: within bf16's rounding of the same product computed in fp32."""
    codes, scale = (t.cuda() for t in _weight(out, inp, block))
    x = torch.randn(33, inp, device="cuda").bfloat16().requires_grad_(True)
    got = fp8_linear(x, codes, scale, block, backend="triton")
    expected = F.linear(x.float(), dequantize_fp8(codes, scale, block, torch.float32))
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2)
    got.float().sum().backward()
    dx = torch.ones(33, out, device="cuda") @ dequantize_fp8(codes, scale, block, torch.float32)
    torch.testing.assert_close(x.grad.float(), dx, rtol=2e-2, atol=2e-2)
