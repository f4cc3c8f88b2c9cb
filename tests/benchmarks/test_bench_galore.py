import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_galore.py"


def test_the_svd_benchmark_times_both_methods_and_counts_the_bytes_saved():
    """A small layer: both SVDs timed for every projected weight, the randomized projection keeping nearly
    all of the energy the exact one keeps (the gradients have rank <= 64 tokens, far above r = 16: a hard
    case for a sketch), and the gradient bytes the optimizer receives m/r = 256/16 times fewer for each
    weight whose smaller side is 256."""
    out = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--layers",
            "4",
            "--hidden",
            "256",
            "--intermediate",
            "688",
            "--heads",
            "4",
            "--kv-heads",
            "4",
            "--rank",
            "16",
            "--tokens",
            "64",
            "--device",
            "cpu",
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for method in ("exact", "randomized"):
        timed = result[method]["seconds_by_weight"]
        assert len(timed) == 7 and all(s > 0 for s in timed.values())
        assert result[method]["first_step_svd_s"] == 4 * result[method]["seconds_per_layer"]
    assert result["exact"]["worst_energy_ratio"] == 1.0
    assert 0.9 < result["randomized"]["worst_energy_ratio"] <= 1.0 + 1e-6
    assert result["gradient_bytes_per_layer"]["ratio"] == 256 / 16
