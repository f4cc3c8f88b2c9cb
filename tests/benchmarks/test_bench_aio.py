import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_aio.py"
SMALL = [
    "--size",
    "16MiB",
    "--chunk-size",
    "4MiB",
    "--block-size",
    "256KiB",
    "--host-bytes",
    "8MiB",
    "--rounds",
    "1",
    "--overlap-chunks",
    "6",
    "--overlap-chunk-size",
    "1MiB",
    "--overlap-steps",
    "1",
]


def _run(args):
    out = subprocess.run(
        [sys.executable, str(BENCH), *args], check=True, capture_output=True, text=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_bench_aio_prints_the_named_figures(tmp_path):
    result = _run(["--disk-path", str(tmp_path), "--no-fio", *SMALL])
    assert result["benchmark"] == "aio" and result["bytes_moved"] == 16 << 20
    assert result["write_gbps"] > 0 and result["read_gbps"] > 0
    assert result["overlap_ratio"] > 0 and [o["compute_over_io"] for o in result["overlap"]] == [
        0.5,
        1.0,
        2.0,
    ]
    assert result["divergences"] == 0  # the replayed order matched the recorded trace
    assert not any(tmp_path.glob("tiertune-store-*"))  # the benchmark cleaned up after itself


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed")
def test_bench_aio_compares_with_fio(tmp_path):
    result = _run(["--disk-path", str(tmp_path), *SMALL])
    assert result["read_fio_ratio"] > 0 and result["write_fio_ratio"] > 0
    assert result["fio_read_gbps"] > 0 and result["fio_write_gbps"] > 0
