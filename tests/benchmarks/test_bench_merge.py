import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_merge.py"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_merging_into_a_1_2_gb_base_stays_under_700_mib_and_equals_peft(tmp_path):
    """A 1.2 GB bf16 Llama-shaped base and a rank-16 adapter on every linear layer: `tiertune merge` peaks
    below 700 MiB (imports included) where peft's merge_and_unload holds the model, and writes the same
    tensors in the same files."""
    out = subprocess.run(
        [sys.executable, str(BENCH), "--dir", str(tmp_path)], check=True, capture_output=True, text=True
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["checkpoint_bytes"] >= 1.2e9
    assert result["tiertune_merge"]["peak_rss_bytes"] < 700 * 2**20, result
    # it holds the model
    assert result["peft_merge_and_unload"]["peak_rss_bytes"] > result["checkpoint_bytes"]
    outputs = result["outputs"]
    assert outputs["same_names"] and outputs["files"] == result["base_files"]
    assert outputs["identical_share"] >= 0.99 and outputs["max_abs_difference"] <= 2**-7 * 0.2, outputs
    assert not any(tmp_path.iterdir())
