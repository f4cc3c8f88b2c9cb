"""Which dtype matrix products run in: bf16 on a CPU without native bf16 products computes in fp32."""

import pytest
import torch

from tiertune.kernels.ops import backend


@pytest.mark.parametrize("native", [True, False])
def test_bf16_products_run_in_fp32_only_on_a_cpu_without_native_ones(monkeypatch, native):
    monkeypatch.setattr(backend, "native_matmul", lambda dtype: native)
    cpu = torch.device("cpu")
    expected = torch.bfloat16 if native else torch.float32
    assert backend.matmul_dtype(torch.bfloat16, cpu) == expected
    assert backend.matmul_dtype(torch.float16, cpu) == (torch.float16 if native else torch.float32)
    assert backend.matmul_dtype(torch.float32, cpu) == torch.float32
    assert backend.matmul_dtype(torch.bfloat16, torch.device("cuda", 0)) == torch.bfloat16


def test_native_matmul_answers_for_this_cpu():
    assert isinstance(backend.native_matmul(torch.bfloat16), bool)
    assert isinstance(backend.native_matmul(torch.float16), bool)
