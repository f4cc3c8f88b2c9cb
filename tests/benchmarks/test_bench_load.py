import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_load.py"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_streaming_load_of_a_3b_checkpoint_stays_under_2_5_gib_rss(tmp_path):
    """Llama-3.2-3B shape, random bf16 weights (6.4 GB), streamed into disk-homed chunks via a 1 GiB host budget."""
    out = subprocess.run(
        [sys.executable, str(BENCH), "--dir", str(tmp_path)], check=True, capture_output=True, text=True
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["parameters"] >= 3_000_000_000
    assert result["peak_rss_bytes"] < 2.5 * 2**30, result
    assert result["bytes_written_to_disk"] >= result["checkpoint_bytes"] * 0.99  # it really all went to disk
    assert not any(tmp_path.iterdir())  # the 6.4 GB checkpoint and the slot file are gone
