import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_kernels.py"


@pytest.mark.timeout(900)
def test_every_op_is_measured_against_eager_and_the_lora_branch_keeps_less(tmp_path):
    """Small shapes on the CPU: one JSON object with each op's figures and comparisons; the fused LoRA branch
    keeps less from forward to backward than peft's module (no dropped-out copy of x, no mask)."""
    shape = [
        "--tokens",
        "64",
        "--hidden",
        "64",
        "--intermediate",
        "96",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--head-dim",
        "16",
        "--vocab",
        "300",
        "--rank",
        "4",
        "--reps",
        "1",
        "--warmup",
        "1",
        "--in-process",
    ]  # peak memory is not checked here: one process is enough
    out = subprocess.run([sys.executable, str(BENCH), *shape], check=True, capture_output=True, text=True)
    report = json.loads(out.stdout)
    assert set(report["ops"]) == {"ce", "rms_norm", "rope", "swiglu", "nf4", "lora", "fp8", "mxfp4"}
    for op, results in report["ops"].items():
        for impl in ("eager", "tiertune"):
            assert results[impl]["forward_backward_s"] > 0, (op, impl, results)
        assert "skipped" in results["liger"]  # a CPU: Liger's kernels need a GPU
        assert results["speedup_vs_eager"] > 0
    lora = report["ops"]["lora"]
    x_bytes = 64 * 64 * 4
    assert lora["tiertune"]["saved_bytes"] + x_bytes <= lora["eager"]["saved_bytes"], lora
