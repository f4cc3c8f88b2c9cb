import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_distill.py"


@pytest.mark.timeout(600)
def test_the_teacher_pass_reads_its_weights_once_a_wave(tmp_path):
    """A small bf16 teacher with its weights on disk: the bytes the pass reads per scored token are the model's
    once a wave (within 2%), so they fall as 1 / wave; the cache holds k x (4 + 4) + 4 bytes a token."""
    args = [
        "--dir",
        str(tmp_path),
        "--layers",
        "2",
        "--hidden",
        "128",
        "--intermediate",
        "256",
        "--heads",
        "4",
    ]
    args += [
        "--kv-heads",
        "4",
        "--vocab",
        "512",
        "--rows",
        "8",
        "--seq",
        "16",
        "--top-k",
        "16",
        "--waves",
        "1,4",
    ]
    out = subprocess.run([sys.executable, str(BENCH), *args], check=True, capture_output=True, text=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    one, four = result["waves"]["1"], result["waves"]["4"]
    for wave in (one, four):
        assert wave["over_read_once_a_wave"] == pytest.approx(1.0, abs=0.02), wave
        assert wave["tokens"] == 8 * 12  # the last three quarters of each row, shifted
        assert wave["cache_bytes"] >= wave["tokens"] * (16 * 8 + 4)
    assert one["disk_bytes_per_token"] / four["disk_bytes_per_token"] == pytest.approx(4.0, rel=0.05)
    assert result["bytes_per_token_falls_with_the_wave"]
