import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_distill.py"


def _bench(tmp_path, host: str, device: str) -> dict:
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
    args += ["--host-budget", host, "--device-budget", device]
    out = subprocess.run([sys.executable, str(BENCH), *args], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(600)
def test_the_teacher_pass_reads_its_weights_about_once_a_wave_or_once(tmp_path):
    """A small bf16 teacher (0.94 MB) with its weights on disk. Budgets that keep a part of it: a wave reads about
    the model again (less what the budgets kept from the wave before; a second wave, the first on the pass's
    trace, can read a layer twice), so bytes per scored token fall with the wave's rows. Budgets that hold it:
    the model is read once for all the waves. The cache holds k x (4 + 4) + 4 bytes a token."""
    tight = _bench(tmp_path / "tight", "512KiB", "640KiB")
    one, four = tight["waves"]["1"], tight["waves"]["4"]
    for wave in (one, four):
        assert wave["over_read_once"] > 1.5 and wave["over_read_once_a_wave"] <= 1.1, wave
        assert wave["tokens"] == 8 * 12  # the last three quarters of each row, shifted
        assert wave["cache_bytes"] >= wave["tokens"] * (16 * 8 + 4)
    assert one["disk_bytes_per_token"] > 2 * four["disk_bytes_per_token"]
    assert tight["bytes_per_token_falls_with_the_wave"]
    held = _bench(tmp_path / "held", "16MiB", "64MiB")
    for wave in held["waves"].values():  # read once, whatever the waves
        assert wave["over_read_once"] == pytest.approx(1.0, abs=0.02), wave
