"""The fault-injection script, small: kill -9, SIGTERM and damaged checkpoints against a tiny recipe, every
resume checked against the uninterrupted run. BENCHMARKS.md has the full run's figures."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "faults.py"


@pytest.mark.timeout(900)
def test_faults_finds_no_defect_in_a_small_run(tmp_path):
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--kills", "2", "--sigterms", "2", "--damage", "3", "--disk-full", "1", "--steps", "8",
         "--seed", "3", "--dir", str(tmp_path / "faults")],
        capture_output=True, text=True, timeout=880,
    )  # fmt: skip
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    summary = lines[-1]["summary"]
    trials = [r for r in lines if "trial" in r]
    assert [r for r in trials if r["defects"]] == [], out.stdout[-3000:]
    assert out.returncode == 0, out.stderr[-3000:]
    assert (summary["kill"]["trials"], summary["sigterm"]["trials"], summary["damage"]["trials"]) == (2, 2, 3)
    assert summary["disk_full"]["trials"] == 1  # skipped where a tmpfs cannot be mounted (not root)
    assert summary["silent_wrong_results"] == 0 and summary["tracebacks"] == 0
    # the damage trials always hit a checkpoint that was there: each fell back to an intact one
    assert summary["damage"]["outcomes"] == {"fell back": 3}
