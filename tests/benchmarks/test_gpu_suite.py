"""The GPU suite's CPU rehearsal (``--dry-run``): every phase runs at toy sizes and prints every key the run on
a GPU prints, with numbers wherever a CPU can measure them."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import gpu_suite
from bench_kernels import OPS

# A hang guard, not a speed test: the dry run takes ~200 s on a quiet 2-core machine and over 360 s on one that
# other programs load (a disk writer and a CPU burner beside the suite's two workers: benchmarks/under_load.py)
pytestmark = pytest.mark.timeout(1600)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """The JSON lines of one dry run, by result name."""
    out = subprocess.run(
        [sys.executable, gpu_suite.__file__, "--dry-run", "--dir", str(tmp_path_factory.mktemp("suite"))],
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert out.returncode == 0, out.stderr[-5000:]
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(lines) == len(out.stdout.splitlines())  # stdout is JSON lines only; progress goes to stderr
    by_name: dict[str, list[dict]] = {}
    for line in lines:
        by_name.setdefault(line["result"], []).append(line)
    return by_name


def _finite(values):
    return bool(values) and all(isinstance(v, float) and math.isfinite(v) for v in values)


def test_every_phase_prints_all_its_results_without_errors(results):
    expected = {r for phase in gpu_suite.PHASES for r in gpu_suite.PHASE_RESULTS[phase]}
    assert set(results) == expected
    assert {r["op"] for r in results["kernels"]} == set(OPS)
    for name, lines in results.items():
        for line in lines:
            assert "error" not in line, (name, line.get("error"))
            assert line["dry_run"] is True and line["command"].startswith("python benchmarks/gpu_suite.py")
            assert line["machine"]["cpus"] >= 1 and line["machine"]["gpu"] is None
    # only what a CPU cannot run is skipped, and says why
    assert [r["result"] for lines in results.values() for r in lines if "skipped" in r] == ["full/deepspeed"]
    assert "pip download" in results["full/deepspeed"][0]["skipped"]


def test_each_result_has_exactly_its_schema_and_nulls_only_where_a_gpu_is_needed(results):
    for name, lines in results.items():
        for line in lines:
            keys = set(gpu_suite.COMMON_KEYS) | {"wall_s"} | set(gpu_suite.KEYS[name])
            assert set(line) == keys, (name, set(line) ^ keys)
            for key in keys:
                if key in gpu_suite.GPU_ONLY:
                    assert line[key] is None, (name, key)
                else:
                    assert line[key] is not None, (name, key)


def test_the_dry_run_measures_what_a_cpu_can(results):
    (tests,) = results["tests"]
    # the GPU tests, collected and skipped here (collection errors elsewhere in the tree are counted, not fatal)
    assert tests["counts"]["skipped"] > 0 and tests["counts"]["failed"] == 0
    for line in results["kernels"]:
        for impl in ("eager", "tiertune"):
            assert line[impl]["forward_backward_s"] > 0, line
        assert "skipped" in line["liger"]  # Triton needs a GPU
        assert line["speedup_vs_eager"]["tiertune"] > 0 and line["speedup_vs_eager"]["liger"] is None
    (galore,) = results["galore"]
    assert galore["exact_s_per_layer"] > 0 and galore["randomized_s_per_layer"] > 0
    assert 0.5 < galore["worst_energy_ratio"] <= 1 + 1e-6 and galore["gradient_bytes_per_layer"]["ratio"] > 1
    (ours,) = results["qlora/tiertune"]
    assert ours["tokens_per_second"] > 0 and _finite(ours["losses"])
    assert ours["bytes_moved_per_step"]["disk->host"] > 0  # the base streamed from the disk tier
    assert ours["step_over_io_lower_bound"] > 0
    usage = ours["disk_usage"]
    # the decoder layers are a hole in the checkpoint: listed in its headers, no disk blocks
    assert usage["checkpoint_allocated_bytes"] < usage["checkpoint_apparent_bytes"] / 4
    (peft,) = results["qlora/peft"]
    assert peft["tokens_per_second"] > 0 and _finite(peft["losses"])
    assert [a["outcome"] for a in peft["attempts"]] == ["fit"]
    (full,) = results["full/tiertune"]
    (fsdp2,) = results["full/fsdp2"]
    for line in (full, fsdp2):
        assert line["tokens_per_second"] > 0 and _finite(line["losses"])
        assert line["tflops"] > 0 and 0 < line["mfu"] < line["hfu"]
    assert 0 <= full["optimizer_hidden_share"] <= 1
    (delayed,) = results["full/tiertune-delayed"]  # the one-step-delayed update beside them, the same schema
    assert delayed["tokens_per_second"] > 0 and _finite(delayed["losses"])
    assert fsdp2["backend"] == "gloo"
    # same checkpoint, batches, AdamW and learning-rate schedule, fp32 on the CPU: the same losses
    assert full["losses"] == pytest.approx(fsdp2["losses"], rel=1e-4)
    (long,) = results["longseq/tiertune"]
    # the dry run's rows (256 and 512 tokens) are tiled by 256 tokens, the longer in two tiles
    assert long["sequence_tile"] == 256 and long["longest_trained"] == 512
    assert all(r["tokens_per_second"] > 0 and _finite(r["losses"]) for r in long["runs"].values())
    (shipped,) = results["shipped/tiertune"]
    assert (
        shipped["base"]["ships_as"] == "fp8"
        and shipped["tokens_per_second"] > 0
        and _finite(shipped["losses"])
    )
    # read in place from the release's own files: at most a forward and a backward pass a step
    assert 0 < shipped["disk_passes_per_step"] <= 2 * 1.1
    (grpo,) = results["grpo/tiertune"]
    assert grpo["completions"] == 16 and grpo["decoded_tokens_per_second"] > 0 and _finite(grpo["losses"])
    # a decoded token moves the decoder layers' weights to the device once for all 16 completions (the device
    # tier may keep a little of them between passes: below 1, never 16)
    assert 0.9 <= grpo["layer_passes_per_decoded_token"]["host->device"] <= 1.05
