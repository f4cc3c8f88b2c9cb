"""Which dtype matrix products run in: bf16 on a CPU without native bf16 products computes in fp32."""

import platform
from pathlib import Path

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
    """Where the CPU's flags settle it: AVX2 alone (the AMD EPYC where bf16 ran scalar) has no native bf16
    products; AVX-512 BF16 or AMX has. Other CPUs (AVX-512 without BF16) are oneDNN's call."""
    native = backend.native_matmul(torch.bfloat16)
    assert isinstance(native, bool) and isinstance(backend.native_matmul(torch.float16), bool)
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the flags below are x86's")
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    if "avx512f" not in flags and not flags & {"amx_bf16", "amx_tile"}:
        assert native is False
    elif flags & {"avx512_bf16", "amx_bf16"}:
        assert native is True
