"""``benchmarks/bench_grpo_generation.py`` on a small model: a generation that feeds two steps reads fewer bytes
from disk per completion than one a step (its completions decoded together), and the estimate says the same of
the generation's own bytes."""

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_grpo_generation.py"


def test_a_generation_feeding_two_steps_reads_less_a_completion(tmp_path):
    # (the bench's model: 8 layers of 256 under 4 MiB budgets, completions of up to 16 tokens; with completions
    # of 8 tokens and a 4-layer model the budgets keep, the old policy's two passes outweigh what the decoding
    # saves: 1.16x, seen)
    args = ["--dir", str(tmp_path), "--spans", "1,2", "--steps", "2"]
    out = subprocess.run([sys.executable, str(BENCH), *args], check=True, capture_output=True, text=True)
    runs = json.loads(out.stdout.strip().splitlines()[-1])["runs"]
    one, two = runs["1"], runs["2"]
    assert (
        one["estimated_sequences_decoded_together"] == 8 and two["estimated_sequences_decoded_together"] == 16
    )
    # the generation's weights read once a decoded token for 16 completions, not 8 (the steps' own reads stay)
    assert two["disk_bytes_per_completion_vs_one_step"] < 0.85, runs
    assert (
        two["estimated_generation_disk_bytes_per_completion"]
        < 0.75 * one["estimated_generation_disk_bytes_per_completion"]
    ), runs
