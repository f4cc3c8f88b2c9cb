"""The MXFP4 expert-matrix op (gpt-oss's experts): the Triton kernel (``TRITON_INTERPRET=1`` on a CPU, fp32; bf16 on a
GPU) against the matrix as ``quant.shipped.MXFP4`` dequantizes it (transformers' gpt-oss loader's values, bit for
bit: ``tests/quant/test_shipped.py``) and ``F.linear``, forward and the input's gradient."""

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from parity import assert_frozen_linear

from tiertune.kernels.ops.mxfp4 import dequantize_mxfp4, mxfp4_linear
from tiertune.quant.shipped import MXFP4

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed"
)


def _matrix(out, inp, seed=0):
    g = torch.Generator().manual_seed(seed)
    return MXFP4().quantize(torch.randn(out, inp, generator=g) * torch.logspace(-3, 1, inp)[None, :])


def test_the_op_s_dequantization_is_the_format_s():
    blocks, scales = _matrix(40, 96)
    assert torch.equal(
        dequantize_mxfp4(blocks, scales, torch.float32), MXFP4().dequantize(blocks, scales, torch.float32)
    )


@needs_triton
@pytest.mark.parametrize("out, inp", [(96, 64), (40, 160), (130, 32)])
@pytest.mark.parametrize("rows", [3, 70])
def test_the_kernel_is_the_dequantized_matrix_s_product_forward_and_backward(out, inp, rows):
    blocks, scales = _matrix(out, inp)
    weight = MXFP4().dequantize(blocks, scales, torch.float32)
    assert_frozen_linear(lambda x: mxfp4_linear(x, blocks, scales, backend="triton"), weight, rows)


@needs_triton
def test_every_code_and_a_range_of_scales_decode_exactly():
    """All 16 e2m1 codes in every group, under scales 2^-20 ... 2^11: times the identity, the matrix itself."""
    codes = torch.arange(16, dtype=torch.uint8)
    row = (codes[0::2] | (codes[1::2] << 4)).repeat(2)  # 32 codes: 16 bytes, each code twice
    blocks = row.reshape(1, 1, 16).repeat(32, 1, 1)  # 32 rows of one group
    scales = (torch.arange(32, dtype=torch.int32) + 107).to(torch.uint8).reshape(32, 1)
    eye = torch.eye(32)
    got = mxfp4_linear(eye, blocks, scales, backend="triton")
    torch.testing.assert_close(got.T, MXFP4().dequantize(blocks, scales, torch.float32), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_kernel_in_bf16_on_a_gpu():
    blocks, scales = (t.cuda() for t in _matrix(2880, 2880))  # gpt-oss-120b's expert matrices are 2880 wide
    x = torch.randn(37, 2880, device="cuda").bfloat16().requires_grad_(True)
    got = mxfp4_linear(x, blocks, scales, backend="triton")
    weight = MXFP4().dequantize(blocks, scales, torch.float32)
    torch.testing.assert_close(got.float(), F.linear(x.float(), weight), rtol=2e-2, atol=2e-1)
    got.float().sum().backward()
    torch.testing.assert_close(
        x.grad.float(), torch.ones(37, 2880, device="cuda") @ weight, rtol=2e-2, atol=5e-1
    )
