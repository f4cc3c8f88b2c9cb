"""What a run says on the console: the banner tells what will really happen (data left out, the optimizer
and when it runs), the final line how it went; --quiet leaves only that line, --verbose adds the debug log."""

import json

import pytest
from typer.testing import CliRunner

from tiertune.cli.app import app


@pytest.fixture(scope="module")
def model_dir(cat_model):
    return cat_model(2)


@pytest.fixture
def recipe(tmp_path, model_dir, write_recipe):
    path = write_recipe(
        tmp_path, model_dir, training={"max_steps": 3, "save_steps": 0}, data={"skip_bad_rows": True}
    )
    data = tmp_path / "data.jsonl"
    data.write_text(
        data.read_text() + json.dumps({"txt": "no text field"}) + "\n" + json.dumps({"text": 3}) + "\n"
    )
    return path


def _run(*args):
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.output


def test_the_banner_counts_skipped_rows_and_says_how_the_optimizer_runs(recipe):
    out = _run("train", recipe)
    assert "2 bad rows skipped" in out
    assert "optimizer: AdamW (torch, fused) on the CPU during backward, speculatively" in out
    done = out.strip().splitlines()[-1]  # after the progress bar's last refresh
    assert "done: 3 steps" in done and "optimizer during backward in" in done and "redone)" in done
    assert out.count("tiertune: full, ") == 1  # the banner once


def test_a_run_whose_steps_clip_says_how_to_hide_their_updates(recipe):
    """Every step clips (max_grad_norm far below the norms): after the first, each step's update runs after
    backward, and the final line names the setting that overlaps them."""
    done = _run("train", recipe, "training.max_grad_norm=1e-6", "-q").strip().splitlines()[-1]
    assert "after it in 3 (clipped: 1 redone)" in done, done
    assert "offload.delay_update: true" in done
    calm = _run("train", recipe, "training.max_grad_norm=0", "-q", "training.overwrite_output_dir=true")
    assert "offload.delay_update" not in calm


def test_galore_is_named_in_the_banner(recipe):
    out = _run("train", recipe, "method.type=galore", "method.galore.rank=4", "training.max_grad_norm=0")
    assert "optimizer: GaLore AdamW (rank 4, projections refreshed every 200 steps" in out
    assert "during backward, layer by layer, in place (no clipping)" in out


def test_quiet_prints_only_the_last_line_and_verbose_the_debug_log(recipe):
    quiet = _run("train", recipe, "-q")
    assert quiet.strip().splitlines() == [quiet.strip().splitlines()[-1]]
    assert quiet.startswith("done: 3 steps")
    verbose = _run("train", recipe, "--verbose", "training.overwrite_output_dir=true")
    assert "DEBUG tiertune.kernels: kernels (torch)" in verbose and "bad rows skipped" in verbose


def test_a_run_piped_to_a_file_prints_plain_step_lines_not_bar_frames(recipe):
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    tool = shutil.which("tiertune") or str(Path(sys.executable).parent / "tiertune")
    done = subprocess.run(
        [tool, "train", str(recipe)], capture_output=True, text=True, timeout=300
    )  # not a tty
    assert done.returncode == 0, done.stderr
    out = done.stdout + done.stderr
    assert "\r" not in out and "step/s" not in out  # no progress bar frames in a log
    lines = [line for line in done.stdout.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["1/3", "2/3", "3/3"]  # logging_steps: 1
    assert all("loss " in line and "tokens/s" in line and "peak device" in line for line in lines)


AVX512_BF16 = '''
import importlib.abc
import sys


class AvxBf16(importlib.abc.MetaPathFinder):
    """bitsandbytes as on a CPU with AVX-512 BF16: its CPU backend then tries to fetch a hub kernel."""

    def find_spec(self, name, path, target=None):
        if name == "bitsandbytes.backends.cpu.ops":
            import bitsandbytes.functional as functional

            functional.has_avx512bf16 = lambda: True
        return None


sys.meta_path.insert(0, AvxBf16())
'''


def test_a_dependency_s_unactionable_warning_is_not_printed(tmp_path, recipe):
    """On CPUs with AVX-512 BF16 every command printed bitsandbytes' "Failed to load CPU gemm_4bit_forward from
    kernels-community" warning (the campaign's machines; here the CPU is made to look like one), even with -q and
    for unquantized models: --quiet prints the final line alone."""
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "shim").mkdir()
    (tmp_path / "shim" / "sitecustomize.py").write_text(AVX512_BF16)
    env = {**__import__("os").environ, "PYTHONPATH": str(tmp_path / "shim")}
    probe = subprocess.run(
        [sys.executable, "-c", "import bitsandbytes"], env=env, capture_output=True, text=True
    )
    assert "kernels-community" in probe.stderr  # what bitsandbytes alone prints there
    tool = str(Path(sys.executable).with_name("tiertune"))
    done = subprocess.run(
        [tool, "train", str(recipe), "-q"], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "kernels-community" not in done.stdout + done.stderr
    assert (
        done.stderr == "" and done.stdout.startswith("done: 3 steps") and len(done.stdout.splitlines()) == 1
    )
