"""The fault-injection script, small: kill -9, SIGTERM, damaged checkpoints, bad input, damaged and full-disk
exports, and 2-process runs (a rank killed writing a checkpoint, a run stopped before its first checkpoint
restarted on one process), every resume checked against the uninterrupted run. A killed torchrun and a stopped
`tiertune launch` are tests of their own (tests/distributed/test_launch.py). BENCHMARKS.md has the full run's
figures."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "faults.py"


@pytest.mark.timeout(1500)
def test_faults_finds_no_defect_in_a_small_run(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--kills",
            "1",
            "--sigterms",
            "1",
            "--damage",
            "3",
            "--disk-full",
            "1",
            "--inputs",
            "10",
            "--export-damage",
            "2",
            "--export-full",
            "1",
            "--rank-kills",
            "1",
            "--elastic-early",
            "1",
            "--steps",
            "8",
            "--seed",
            "3",
            "--dir",
            str(tmp_path / "faults"),
        ],
        capture_output=True,
        text=True,
        timeout=1480,
    )
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    summary = lines[-1]["summary"]
    trials = [r for r in lines if "trial" in r]
    assert [r for r in trials if r["defects"]] == [], out.stdout[-3000:]
    assert out.returncode == 0, out.stderr[-3000:]
    counts = {
        kind: summary[kind]["trials"]
        for kind in ("kill", "sigterm", "damage", "bad_input", "export_damage", "rank_kill", "elastic_early")
    }
    assert counts == {
        "kill": 1,
        "sigterm": 1,
        "damage": 3,
        "bad_input": 10,
        "export_damage": 2,
        "rank_kill": 1,
        "elastic_early": 1,
    }
    assert summary["disk_full"]["trials"] == summary["export_full"]["trials"] == 1  # skipped where not root
    assert summary["silent_wrong_results"] == 0 and summary["tracebacks"] == 0
    # the damage trials always hit a checkpoint that was there: each fell back to an intact one
    assert summary["damage"]["outcomes"] == {"fell back": 3}
    # one export damaged a one-process checkpoint, one a 2-process one (per-rank shards): both refused
    assert sorted(r["ranks"] for r in trials if r["trial"] == "export_damage") == [1, 2]
    assert summary["export_damage"]["outcomes"] == {"refused": 2}
    assert summary["elastic_early"]["outcomes"] == {"restarted on one process": 1}
    assert "trials  kind" in out.stdout  # the table
