import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_train.py"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bench_train_modes_agree_and_stay_within_budgets_plus_a_fixed_overhead(tmp_path):
    """A 30M-parameter model: states on disk (optimizer overlapped and serial, and GaLore) and in memory."""
    args = [
        "--layers",
        "6",
        "--hidden",
        "512",
        "--intermediate",
        "1376",
        "--heads",
        "8",
        "--kv-heads",
        "8",
        "--vocab",
        "4000",
        "--seq",
        "128",
        "--steps",
        "3",
        "--device-budget",
        "48MiB",
        "--host-budget",
        "160MiB",
        "--memory-device-budget",
        "256MiB",
        "--memory-host-budget",
        "1GiB",
        "--modes",
        "disk,disk-serial,memory,disk-galore",
        "--galore-rank",
        "64",
    ]
    out = subprocess.run(
        [sys.executable, str(BENCH), "--dir", str(tmp_path), *args],
        check=True,
        capture_output=True,
        text=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    disk, serial, memory = result["disk"], result["disk-serial"], result["memory"]
    # same data, same numerics: every placement and optimizer schedule gives the same losses
    assert disk["losses"] == serial["losses"] == memory["losses"]
    assert disk["overlap"] and disk["optimizer_steps"]["speculative"] == 3
    assert not serial["overlap"] and serial["optimizer_steps"]["after_backward"] == 3
    assert 0 < disk["optimizer_hidden_share"] <= 1 and serial["optimizer_hidden_share"] == 0
    assert disk["bytes_moved_per_step"]["disk->host"] > 0  # the states really streamed from disk
    galore = result["disk-galore"]
    # another optimizer, a small learning rate: after two updates the losses are still close to AdamW's
    assert all(abs(g - a) < 0.1 * a for g, a in zip(galore["losses"], disk["losses"], strict=True))
    # rank 64 of 512-wide layers; the embedding and head (a sixth of the parameters here) keep full moments
    assert result["galore_state_ratio"] <= 0.4
    for mode in (disk, serial, memory, galore):
        budgets = {"device": 48 << 20, "host": 160 << 20} if mode is not memory else {"host": 1 << 30}
        for tier, budget in budgets.items():
            assert mode["peak_bytes"][tier] <= budget
        # RSS beyond the budgets: the runtime, a fixed 256 MiB (the model's code, the checkpoint reader's
        # 64 MiB conversion buffer, per-thread malloc arenas) and a few parameter-group-sized transient
        # buffers; nothing that grows with the number of layers
        overhead = mode["rss_over_budgets_bytes"] - mode["runtime_rss_bytes"]
        assert overhead <= 6 * mode["largest_group_fp32_bytes"] + (256 << 20), mode


@pytest.mark.timeout(600)
def test_the_stand_in_gpu_runs_each_layer_on_its_own_thread_and_the_hand_off_waits_for_it(tmp_path):
    """``--fast-compute``: the device's seconds are the launched layers' (forward and backward of every layer,
    every step after the first), at either hand-off lag, with the same losses (the layers pass their input on)."""
    args = [
        *("--layers", "3", "--hidden", "128", "--intermediate", "256", "--heads", "4", "--kv-heads", "4"),
        *("--vocab", "500", "--seq", "16", "--steps", "3", "--modes", "host", "--max-grad-norm", "0"),
        *("--device-budget", "32MiB", "--host-budget", "128MiB", "--fast-compute", "5,15"),
    ]
    results = []
    for lag in ("0", "1"):
        out = subprocess.run(
            [sys.executable, str(BENCH), "--dir", str(tmp_path), *args, "--handoff-lag", lag],
            check=True,
            capture_output=True,
            text=True,
        )
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    for result in results:
        host = result["host"]
        # 3 layers x (5 + 15) ms a step: sleeps the device thread ran (each at least as long as asked)
        assert 0.060 <= host["device_busy_s"] < 0.2, host["device_busy_s"]
        assert host["step_s"] >= 0.060  # the step waited for its device
        assert host["optimizer_steps"]["speculative"] == 3
    assert results[0]["host"]["losses"] == results[1]["host"]["losses"]
    assert [r["settings"]["handoff_lag"] for r in results] == [0, 1]


OVERLAP = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_overlap.py"
CASES_RUN = ("--cases", "large_vocab_tied,gpu_like_lag1")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_overlap_benchmark_puts_each_case_beside_its_serial_run(tmp_path):
    """``bench_overlap.py --quick``: each case's overlapped and serial runs in one JSON, the same losses, the
    bound and the ratios computed from the kept fields (no timing is asserted: a busy machine moves them)."""
    out = subprocess.run(
        [sys.executable, str(OVERLAP), "--dir", str(tmp_path), "--quick", "--steps", "3", *CASES_RUN],
        check=True,
        capture_output=True,
        text=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for name in ("large_vocab_tied", "gpu_like_lag1"):
        case = result[name]
        assert case["same_losses"], name
        host, serial = case["overlapped"], case["serial"]
        assert serial["optimizer_hidden_share"] == 0 and host["optimizer_busy_s"] > 0
        bound = max(host["compute_s"] + host["io_wait_s"], host["optimizer_busy_s"])
        if name.startswith("gpu_like"):
            bound = max(host["device_busy_s"], host["optimizer_busy_s"])
        assert case["bound_s"] == bound and case["step_over_bound"] == host["step_s"] / bound
    assert result["gpu_like_lag1"]["overlapped"]["device_busy_s"] > 0
