"""Fault injection against a small recipe: kill -9 and SIGTERM at random moments, damaged checkpoints.

Every trial is judged against one uninterrupted reference run of the same recipe (same losses at every step,
each step logged once, the same final weights) and against what the user is told:

- ``kill``: ``kill -9`` at a random moment of a run, then ``tiertune train <run>/recipe.yaml
  training.resume_from_checkpoint=auto`` until it finishes. Clean if the result equals the reference.
- ``sigterm``: SIGTERM at a random moment. Clean if the run exits 143 saying where it stopped and how to
  resume (or 0 if it had finished), leaves no offload slot file and no partial checkpoint, and the resume
  command it printed completes to the reference.
- ``disk_full``: the run directory on a small tmpfs that another file fills at a random step. Clean if the run
  stops with exit 2 and a disk-full message, leaves no partial checkpoint or export, and completes to the
  reference once the space is freed (needs root to mount the tmpfs; skipped otherwise).
- ``damage``: a stopped run whose newest checkpoint has one file damaged (bytes flipped, truncated, or
  deleted). Resuming that checkpoint by path must be exit 2 naming the damaged file; ``auto`` must fall back
  to an intact checkpoint (saying so) and complete to the reference.

A defect is any traceback, any exit code other than the expected ones, any finished run that differs from
the reference (a silent wrong result), or a stop that leaves slot files or partial checkpoints behind. Prints
one JSON object per trial and a summary; exits 1 if there was a defect.

Runs go through the real command-line entry point (``tiertune.cli.app:main``) in processes forked from this
one after tiertune is imported (``--spawn`` starts ``tiertune`` executables instead: slower, the same code).

    python benchmarks/faults.py --kills 20 --sigterms 5 --disk-full 3 --damage 10 --dir /tmp/faults
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine

TEXTS = [
    f"the {a} cat sat on the {b} mat ." for a in ("red", "big", "old", "fat") for b in ("blue", "flat", "wet")
]


def setup(work: Path, steps: int) -> Path:
    """A tiny random Llama, its data and a recipe with weights and optimizer states on disk, checkpoints every
    2 steps; returns the recipe's path."""
    import yaml

    from tiertune.cli.demo import make_model

    model = work / "model"
    if not (model / "config.json").is_file():
        make_model(model, TEXTS, layers=3, hidden=64)
    data = work / "data.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    recipe = {
        "model": {"path": str(model), "dtype": "float32"},
        "data": {"path": str(data), "max_seq_len": 32},
        "training": {
            "output_dir": str(work / "runs" / "reference"),
            "max_steps": steps,
            "per_device_train_batch_size": 4,
            "gradient_accumulation_steps": 2,
            "learning_rate": "3e-3",
            "lr_scheduler_type": "cosine",
            "warmup_steps": 2,
            "weight_decay": 0.01,
            "logging_steps": 1,
            "save_steps": 2,
            "save_total_limit": 3,
            "report_to": "none",
        },
        "offload": {
            "disk_path": str(work / "nvme"),
            "params": "disk",
            "optimizer_states": "disk",
            "device_budget": "4MiB",
            "host_budget": "1MiB",
        },
    }
    path = work / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


class Launcher:
    """Starts ``tiertune ARGS`` with stdout and stderr to files: forked from this process (tiertune already
    imported, so a run starts in a fraction of a second) or spawned as a fresh executable."""

    def __init__(self, spawn: bool) -> None:
        self.spawn = spawn
        if not spawn:
            import tiertune.cli.app
            import tiertune.finetune.train  # noqa: F401

    def start(self, args: list[str], log: Path) -> int:
        if self.spawn:
            with open(log, "wb") as f:
                tool = Path(sys.executable).with_name("tiertune")
                return subprocess.Popen([str(tool), *args], stdout=f, stderr=subprocess.STDOUT).pid
        pid = os.fork()
        if pid:
            return pid
        code = 1
        try:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            sys.argv = ["tiertune", *args]
            from tiertune.cli.app import main

            try:
                main()
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    @staticmethod
    def wait(pid: int, timeout: float = 600, log: Path | None = None) -> int:
        """The exit code, or -n for a process ended by signal n (as subprocess says it); a process still
        running after ``timeout`` seconds is hung: its threads' stacks go to ``log`` (with py-spy, where
        installed), it is killed, and the code is -1."""
        deadline = time.monotonic() + timeout
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status)
            if time.monotonic() > deadline:
                spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
                if log is not None and Path(spy).exists():
                    with open(log, "a") as f:
                        f.write("\n--- hung: py-spy dump ---\n")
                        f.flush()
                        subprocess.run([spy, "dump", "--pid", str(pid)], stdout=f, stderr=f, timeout=60)
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return -1
            time.sleep(0.005)

    def run(self, args: list[str], log: Path) -> int:
        return self.wait(self.start(args, log))


class Judge:
    """What the reference run produced, and the comparison of another run with it."""

    def __init__(self, run_dir: Path) -> None:
        self.losses = _losses(run_dir)
        self.weights = _weights(run_dir)

    def differences(self, run_dir: Path, rtol: float = 1e-6, atol: float = 1e-7) -> list[str]:
        """Why ``run_dir``'s finished run is not the reference (empty when it is). A run that went through
        several processes sums its gradients in another order: compared with ``rtol=1e-5, atol=1e-6``."""
        import torch

        if not (run_dir / "model.safetensors").is_file():
            return ["no model exported"]
        problems = []
        losses = _losses(run_dir)
        if [s for s, _ in losses] != [s for s, _ in self.losses]:
            problems.append(f"logged steps {[s for s, _ in losses]} (each step once expected)")
        elif any(abs(a - b) > max(rtol, 1e-6) * abs(b) for (_, a), (_, b) in zip(losses, self.losses)):
            problems.append("losses differ from the uninterrupted run")
        weights = _weights(run_dir)
        if set(weights) != set(self.weights) or any(
            not torch.allclose(weights[k], v, rtol=rtol, atol=atol) for k, v in self.weights.items()
        ):
            problems.append("final weights differ from the uninterrupted run")
        return problems


def _logged(run_dir: Path) -> int:
    """Steps in a run's log so far."""
    try:
        return (run_dir / "trainer_log.jsonl").read_bytes().count(b"\n")
    except OSError:
        return 0


def _exited(pid: int) -> bool:
    """Whether ``pid`` has ended (without reaping it)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:  # a zombie has ended and is not yet waited for
            return f.read().rsplit(b") ", 1)[-1][:1] == b"Z"
    except FileNotFoundError:
        return True


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    lines = (run_dir / "trainer_log.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines)]


def _weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(run_dir / "model.safetensors")


def _leftovers(run_dir: Path, disk: Path) -> list[str]:
    """Slot files of the disk tier and partial checkpoints or exports a stopped run left behind."""
    found = [p.name for p in disk.glob("tiertune-store-*")] if disk.is_dir() else []
    found += [p.name for p in run_dir.glob(".checkpoint-*")] + [p.name for p in run_dir.glob(".export-*")]
    return found


def _traceback(log: Path) -> bool:
    return "Traceback (most recent call last)" in log.read_text(errors="replace")


class Trials:
    def __init__(self, work: Path, recipe: Path, launcher: Launcher, steps: int, rng: random.Random) -> None:
        self.work, self.recipe, self.launcher, self.steps, self.rng = work, recipe, launcher, steps, rng
        self.disk_root = work / "nvme"

    def _dirs(self, name: str) -> tuple[Path, Path, list[str]]:
        run_dir, disk = self.work / "runs" / name, self.work / "nvme-runs" / name
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
        args = [f"training.output_dir={run_dir}", f"offload.disk_path={disk}"]
        return run_dir, disk, args

    def reference(self) -> tuple[Judge, float]:
        """The uninterrupted run; measures how long start-up and a step take, for ``strike``."""
        run_dir, _, args = self._dirs("reference")
        log = self.work / "logs" / "reference.log"
        began = time.monotonic()
        pid = self.launcher.start(["train", str(self.recipe), "-q", *args], log)
        while not _logged(run_dir) and not _exited(pid):
            time.sleep(0.002)
        self.startup_s = time.monotonic() - began
        code = self.launcher.wait(pid)
        seconds = time.monotonic() - began
        self.step_s = (seconds - self.startup_s) / self.steps
        self.full_s = seconds
        if code != 0:
            raise SystemExit(f"the reference run failed (exit {code}); see {log}")
        return Judge(run_dir), seconds

    def strike(self, pid: int, run_dir: Path, signum: int) -> str:
        """Send ``signum`` at a random moment: during start-up, or after a random step (0 to all of them)
        plus a random part of a step's time, so that loading, steps, checkpoint writes and the export at the
        end are all hit. Returns where."""
        k = self.rng.randrange(-1, self.steps)
        if k < 0:
            delay = self.rng.uniform(0, self.startup_s)
            time.sleep(delay)
            where = f"start-up +{delay:.2f}s"
        else:
            # after step k (for k = 0: once the run directory is set up, the first step about to start)
            while (_logged(run_dir) < k or not (run_dir / "recipe.yaml").is_file()) and not _exited(pid):
                time.sleep(0.001)
            delay = self.rng.uniform(0, 1.5 * self.step_s)
            time.sleep(delay)
            where = f"step {k} +{delay:.2f}s"
        if not _exited(pid):
            os.kill(pid, signum)
        return where

    def _finish(self, run_dir: Path, name: str, judge: Judge, limit: int = 5) -> tuple[list[str], int]:
        """Resume with ``auto`` until the run is finished; returns (defects, resumes)."""
        defects: list[str] = []
        for n in range(limit):
            if (run_dir / "trainer_state.json").is_file():  # finished (possibly before it was stopped)
                break
            log = self.work / "logs" / f"{name}-resume{n}.log"
            args = ["train", str(run_dir / "recipe.yaml"), "training.resume_from_checkpoint=auto", "-q"]
            code = self.launcher.run(args, log)
            if _traceback(log):
                defects.append(f"traceback on resume ({log})")
            if code != 0:
                defects.append(f"resume exit {code} ({log})")
                return defects, n + 1
        else:
            return [*defects, f"not finished after {limit} resumes"], limit
        return defects + judge.differences(run_dir), n

    def _stopped(self, name: str, signum: int) -> tuple[Path, Path, Path, str, int]:
        """A run of the recipe sent ``signum`` at a random moment: (run directory, its disk tier's directory,
        its console log, where it was struck, exit code)."""
        run_dir, disk, args = self._dirs(name)
        log = self.work / "logs" / f"{name}.log"
        pid = self.launcher.start(["train", str(self.recipe), "-q", *args], log)
        at = self.strike(pid, run_dir, signum)
        return run_dir, disk, log, at, self.launcher.wait(pid, timeout=max(120, 20 * self.full_s), log=log)

    def _start_again(self, run_dir: Path, log: Path) -> list[str]:
        """A run stopped before its run directory was set up is started again as it was first (there is no
        recipe.yaml in it to resume)."""
        if (run_dir / "recipe.yaml").is_file():
            return []
        args = [
            f"training.output_dir={run_dir}",
            f"offload.disk_path={self.work / 'nvme-runs' / run_dir.name}",
        ]
        code = self.launcher.run(["train", str(self.recipe), "-q", *args], log.with_suffix(".again.log"))
        return [f"fresh start exit {code}"] if code else []

    def kill(self, i: int, judge: Judge) -> dict:
        run_dir, _disk, log, at, code = self._stopped(f"kill{i}", signal.SIGKILL)
        checkpoints = sorted(p.name for p in run_dir.glob("checkpoint-*")) if run_dir.is_dir() else []
        defects = [f"traceback before the kill ({log})"] if _traceback(log) else []
        defects += self._start_again(run_dir, log)
        more, resumes = self._finish(run_dir, f"kill{i}", judge)
        outcome = "finished before the kill" if code == 0 else "resumed" if checkpoints else "started over"
        return {
            "trial": "kill",
            "i": i,
            "at": at,
            "exit": code,
            "checkpoints_at_kill": checkpoints,
            "outcome": outcome,
            "resumes": resumes,
            "defects": defects + more,
        }

    def sigterm(self, i: int, judge: Judge) -> dict:
        run_dir, disk, log, at, code = self._stopped(f"term{i}", signal.SIGTERM)
        text = log.read_text(errors="replace")
        defects = [f"traceback ({log})"] if _traceback(log) else []
        left = _leftovers(run_dir, disk)
        if left:
            defects.append(f"left behind: {left}")
        if code == 143:
            if "stopped by SIGTERM" not in text:
                defects.append("exit 143 without saying it was stopped")
            said = "resume with: tiertune train" in text
            if (run_dir / "recipe.yaml").is_file() and not said:
                defects.append("no resume command")
            outcome = "stopped cleanly"
        elif code == 0:
            outcome = "finished before the signal"
        elif code == -signal.SIGTERM and not run_dir.exists():
            outcome = "ended by the signal in interpreter start-up, before tiertune ran"
        else:
            defects.append(
                f"exit {code} (143 expected){' (hung: stacks in ' + str(log) + ')' if code == -1 else ''}"
            )
            outcome = "hung" if code == -1 else "unclean"
        defects += self._start_again(run_dir, log)
        more, resumes = self._finish(run_dir, f"term{i}", judge)
        return {
            "trial": "sigterm",
            "i": i,
            "at": at,
            "exit": code,
            "outcome": outcome,
            "resumes": resumes,
            "defects": defects + more,
        }

    def damage(self, i: int, judge: Judge, stopped: Path) -> dict:
        run_dir, disk, _args = self._dirs(f"damage{i}")
        shutil.copytree(stopped, run_dir)
        newest = max(run_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
        files = sorted(p for p in newest.rglob("*") if p.is_file())
        target = self.rng.choice(files)
        kind = self.rng.choice(["flip", "truncate", "delete"])
        size = target.stat().st_size
        if kind == "flip" and size:
            data = bytearray(target.read_bytes())
            start = self.rng.randrange(size)
            for k in range(start, min(size, start + self.rng.randint(1, 8))):
                data[k] ^= 1 << self.rng.randrange(8)
            target.write_bytes(bytes(data))
        elif kind == "truncate" or kind == "flip":
            kind = "truncate"
            os.truncate(target, self.rng.randrange(max(size, 1)))
        else:
            target.unlink()
        # the copied run's recipe names the original directories: this trial's instead (settings a resumed
        # run may change)
        recipe_args = [f"offload.disk_path={disk}", f"training.output_dir={run_dir}"]
        defects = []
        log = self.work / "logs" / f"damage{i}-explicit.log"
        code = self.launcher.run(
            [
                "train",
                str(run_dir / "recipe.yaml"),
                "-q",
                *recipe_args,
                f"training.resume_from_checkpoint={newest}",
            ],
            log,
        )
        text = log.read_text(errors="replace")
        if _traceback(log):
            defects.append(f"traceback ({log})")
        if code != 2 or "damaged" not in text:
            defects.append(f"explicit resume of the damaged checkpoint: exit {code} ({log})")
        elif target.name not in text and target.name != "checksums.json":
            # a damaged table names a file it lists
            defects.append(f"the error does not name {target.name} ({log})")
        log = self.work / "logs" / f"damage{i}-auto.log"
        code = self.launcher.run(
            ["train", str(run_dir / "recipe.yaml"), *recipe_args, "training.resume_from_checkpoint=auto"], log
        )
        text = log.read_text(errors="replace")
        if _traceback(log):
            defects.append(f"traceback ({log})")
        fell_back = f"{newest.name} is damaged" in text
        if code != 0:
            defects.append(f"auto resume exit {code} ({log})")
        elif not fell_back:
            defects.append(f"auto resumed without saying {newest.name} is damaged ({log})")
        else:
            defects += judge.differences(run_dir)
        return {
            "trial": "damage",
            "i": i,
            "kind": kind,
            "file": str(target.relative_to(run_dir)),
            "outcome": "fell back" if fell_back and code == 0 else "defect",
            "defects": defects,
        }

    def disk_full(self, i: int, judge: Judge) -> dict:
        """The run directory on a small tmpfs that fills up at a random moment (another process's file): the
        run must stop with a DiskFullError (exit 2, no partial checkpoint or export left), and complete to the
        reference once space is freed. Needs root to mount; skipped otherwise."""
        mount = self.work / f"full{i}"
        mount.mkdir()
        size = 32 << 20
        if subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True
        ).returncode:
            return {"trial": "disk_full", "i": i, "outcome": "skipped (cannot mount a tmpfs)", "defects": []}
        try:
            run_dir, disk = mount / "run", self.work / "nvme-runs" / f"full{i}"
            args = [f"training.output_dir={run_dir}", f"offload.disk_path={disk}"]
            # every other trial saves no checkpoint: the space then runs out writing the log or the model
            # (with checkpoints, the check before each one finds it first)
            args += ["training.save_steps=0"] if i % 2 else []
            log = self.work / "logs" / f"full{i}.log"
            pid = self.launcher.start(["train", str(self.recipe), "-q", *args], log)
            k = self.rng.randrange(1, self.steps)
            while _logged(run_dir) < k and not _exited(pid):
                time.sleep(0.001)
            left = self.rng.randrange(0, 512 << 10)
            filler = mount / "filler"
            with open(filler, "wb") as f:  # everything but ``left`` bytes
                free = shutil.disk_usage(mount).free
                with contextlib.suppress(OSError):
                    f.write(b"\0" * max(0, free - left))
            code = self.launcher.wait(pid)
            text = log.read_text(errors="replace")
            defects = [f"traceback ({log})"] if _traceback(log) else []
            left_behind = _leftovers(run_dir, disk)
            if left_behind:
                defects.append(f"left behind: {left_behind}")
            if code == 2 and ("no room" in text or "is full" in text or "no space" in text):
                outcome = "stopped: disk full"
            elif code == 0:
                outcome = "finished in the space left"
            else:
                outcome = "unclean"
                defects.append(f"exit {code} without a disk-full error ({log})")
            filler.unlink()
            more, resumes = self._finish(run_dir, f"full{i}", judge)
            return {
                "trial": "disk_full",
                "i": i,
                "at": f"step {k}, {left} bytes left",
                "exit": code,
                "checkpoints": not i % 2,
                "outcome": outcome,
                "resumes": resumes,
                "defects": defects + more,
            }
        finally:
            subprocess.run(["umount", str(mount)], capture_output=True)

    def stopped_run(self) -> Path:
        """A run killed once its third checkpoint (step 6) is complete, for the damage trials to copy."""
        run_dir, _, args = self._dirs("stopped")
        log = self.work / "logs" / "stopped.log"
        pid = self.launcher.start(["train", str(self.recipe), "-q", *args], log)
        deadline = time.monotonic() + 600
        while not (run_dir / "checkpoint-6" / "checksums.json").is_file():
            if time.monotonic() > deadline or os.waitpid(pid, os.WNOHANG)[0]:
                raise SystemExit(f"the run to damage did not reach checkpoint-6; see {log}")
            time.sleep(0.002)
        os.kill(pid, signal.SIGKILL)
        self.launcher.wait(pid)
        if (run_dir / "trainer_state.json").is_file():
            raise SystemExit("the run to damage finished before it was stopped; use more --steps")
        return run_dir


# ---------------------------------------------------------------- bad input


def bad_inputs(work: Path, recipe: Path) -> list[tuple[str, list[str], str]]:
    """``(name, tiertune arguments, what the message must say)`` for every kind of bad input a user can give; the
    files they need are made under ``work/inputs``. Each must end with exit 2, one line, no traceback, and no
    output directory made."""
    from tiertune.cli.demo import make_tokenizer

    root = work / "inputs"
    root.mkdir(exist_ok=True)
    model = work / "model"

    def file(name: str, content: str | bytes) -> str:
        path = root / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        return str(path)

    def rows(*items: object) -> str:
        return "".join(json.dumps(r) + "\n" for r in items)

    def model_copy(name: str, without: tuple[str, ...] = ()) -> Path:
        out = root / name
        if not out.exists():
            shutil.copytree(model, out, ignore=shutil.ignore_patterns(*without))
        return out

    # a config that says Qwen2 beside a word-level tokenizer: transformers builds Qwen2's tokenizer class
    qwen = root / "qwen-config"
    if not qwen.exists():
        from transformers import Qwen2Config

        tok = make_tokenizer(TEXTS, qwen)
        shutil.copy(model / "model.safetensors", qwen)
        Qwen2Config(
            vocab_size=len(tok),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
        ).save_pretrained(qwen)
    ints = model_copy("int32-weight")
    if not (ints / "marker").exists():
        import torch
        from safetensors.torch import load_file, save_file

        tensors = load_file(ints / "model.safetensors")
        norm = tensors["model.norm.weight"]
        tensors["model.norm.weight"] = torch.arange(norm.numel(), dtype=torch.int32)
        save_file(tensors, ints / "model.safetensors", metadata={"format": "pt"})
        (ints / "marker").write_text("int32")
    bare = model_copy("no-tokenizer", without=("tokenizer*",))
    dup = "training:\n  max_steps: 3\n  learning_rate: 1e-4\n  max_steps: 5\n"
    (root / "a-directory").mkdir(exist_ok=True)
    (root / "a-directory" / "notes.txt").write_text("x")
    taken = file("output-is-a-file", "not a directory")
    train = ["train", str(recipe)]
    latin1 = file("latin1.jsonl", b'{"text": "caf\xe9"}\n')
    cases = [
        ("unknown key", [*train, "training.learnig_rate=1e-4"], "did you mean `training.learning_rate`"),
        ("unknown section", [*train, "modle.path=x"], "did you mean `model`"),
        ("wrong type", [*train, "training.max_steps=abc"], "must be int"),
        ("negative learning rate", [*train, "training.learning_rate=-1"], "learning_rate must be >= 0"),
        ("learning rate not a number", [*train, "training.learning_rate=.nan"], "must be a finite number"),
        ("not key=value", [*train, "training"], "must look like section.key=value"),
        ("bad size", [*train, "offload.host_budget=lots"], "cannot read 'lots' as a size"),
        ("budget without a unit", [*train, "offload.host_budget=64"], "has no unit"),
        ("budget beyond the machine", [*train, "offload.host_budget=100TiB"], "but this machine has"),
        (
            "budget too small",
            [*train, "offload.host_budget=16KiB"],
            "checked before loading the model: the host tier needs",
        ),
        ("unknown choice", [*train, "model.quantize=nf5"], "must be one of none, nf4, fp4, int8"),
        (
            "missing model directory",
            [*train, "model.path=/nonexistent/model"],
            "not a Hugging Face model directory",
        ),
        ("quantized full fine-tuning", [*train, "model.quantize=nf4"], "use method.type: lora"),
        ("lora rank 0", [*train, "method.lora.r=0"], "method.lora.r must be >= 1"),
        (
            "galore rank 0",
            [*train, "method.type=galore", "method.galore.rank=0"],
            "method.galore.rank must be >= 1",
        ),
        ("sequence too short", [*train, "data.max_seq_len=1"], "data.max_seq_len must be >= 2"),
        ("unknown optimizer", [*train, "training.optim=sgd"], "training.optim must be one of"),
        (
            "disk without a path",
            [*train, "offload.disk_path=null", "offload.params=disk"],
            "disk_path is not set",
        ),
        ("unwritable disk path", [*train, "offload.disk_path=/proc/tiertune"], "/proc/tiertune"),
        (
            "resume a missing checkpoint",
            [*train, "training.resume_from_checkpoint=/nonexistent/checkpoint-5"],
            "does not exist; use auto",
        ),
        ("override that is not YAML", [*train, "training.learning_rate=[1e-4"], "is not valid YAML"),
        (
            "seed beyond 64 bits",
            [*train, "training.seed=100000000000000000000000"],
            "training.seed must be in",
        ),
        ("negative weight decay", [*train, "training.weight_decay=-0.1"], "weight_decay must be >= 0"),
        ("negative adam epsilon", [*train, "training.adam_epsilon=-1e-8"], "adam_epsilon must be >= 0"),
        ("negative max_grad_norm", [*train, "training.max_grad_norm=-1"], "max_grad_norm must be >= 0"),
        (
            "negative save_total_limit",
            [*train, "training.save_total_limit=-2"],
            "save_total_limit must be >= 0",
        ),
        (
            "a mapping where a list belongs",
            [*train, "method.type=lora", "method.lora.target_modules={q_proj: 1}"],
            "must be a string or a list of names",
        ),
        ("a section that is a list", [*train, "training=[1]"], "section training must be a mapping"),
        ("output_dir that is a file", [*train, f"training.output_dir={taken}"], "is a file, not a directory"),
        ("data file missing", [*train, "data.path=/nonexistent.jsonl"], "does not exist"),
        (
            "data file of an unknown type",
            [*train, f"data.path={file('d.xml', '<x/>')}"],
            "must end in .jsonl",
        ),
        (
            "row without its field",
            [*train, f"data.path={file('field.jsonl', rows({'txt': 'a'}))}"],
            "row 1: expected a string field 'text', found no such field",
        ),
        ("empty dataset", [*train, f"data.path={file('empty.jsonl', '')}"], "holds no rows"),
        (
            "line that is not JSON",
            [*train, f"data.path={file('oops.jsonl', '{oops' + chr(10))}"],
            "not valid JSON",
        ),
        (
            "a JSON line that is an array",
            [*train, f"data.path={file('array.jsonl', rows({'text': TEXTS[0]}, [1, 2]))}"],
            "line 2: an array, not a JSON object",
        ),
        ("data not UTF-8", [*train, f"data.path={latin1}"], "is not UTF-8 text: byte 0xe9"),
        ("data path a directory", [*train, f"data.path={root / 'a-directory'}"], "is a directory"),
        ("chat without a template", [*train, "data.format=chat"], "this tokenizer has none"),
        (
            "rows the tokenizer cannot represent",
            [*train, f"data.path={file('unknown.jsonl', rows({'text': 'zebras juggle lanterns'}))}"],
            "keeps 0 of the row's 20 characters",
        ),
        (
            "a tokenizer that is not the data's",
            [*train, f"model.path={qwen}"],
            "picked for this model (Qwen2Tokenizer)",
        ),
        (
            "same, rows skipped",
            [*train, f"model.path={qwen}", "data.skip_bad_rows=true"],
            "loses most of the text of 12 of 12 rows",
        ),
        (
            "model without a tokenizer",
            [*train, f"model.path={bare}"],
            "no tokenizer.json or tokenizer_config.json",
        ),
        (
            "an integer tensor for a float weight",
            [*train, f"model.path={ints}"],
            "is int32, but it is a floating",
        ),
        (
            "recipe not UTF-8",
            ["train", file("latin1.yaml", b"model:\n  path: caf" + bytes([0xE9]) + b"\n")],
            "is not UTF-8 text: byte 0xe9",
        ),
        (
            "recipe with a key given twice",
            ["train", file("twice.yaml", dup)],
            "given twice in one section (lines 2 and 4)",
        ),
        (
            "recipe that is a directory",
            ["train", str(root / "a-directory")],
            "is a directory; give a YAML recipe",
        ),
        ("recipe missing", ["train", str(root / "nope.yaml")], "does not exist"),
        (
            "recipe not YAML",
            ["train", file("bad.yaml", "model:\n  path: [unclosed\n")],
            "not valid YAML at line",
        ),
        ("recipe a list", ["train", file("list.yaml", "- 1\n- 2\n")], "must be a mapping of sections"),
        (
            "estimate with a bad override",
            ["estimate", str(recipe), "--no-probe", "training.max_steps=abc"],
            "must be int",
        ),
        (
            "demo of 0 steps",
            ["demo", "--steps", "0", "--workdir", str(root / "demo")],
            "--steps must be >= 1",
        ),
        (
            "recipes --to an unwritable path",
            ["recipes", "demo", "--to", "/proc/no/such/demo.yaml"],
            "cannot write",
        ),
        ("recipes of an unknown name", ["recipes", "nope"], "no built-in recipe 'nope'"),
        ("export of nothing", ["export", str(root / "no-run"), "--out", str(root / "out")], "does not exist"),
        (
            "export of a model that is not a run",
            ["export", str(model), "--out", str(root / "out")],
            "has no recipe.yaml",
        ),
        (
            "merge of what is not an adapter",
            ["merge", str(model), "--out", str(root / "out")],
            "is not a PEFT adapter",
        ),
    ]
    return cases


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


class InputTrials:
    """Bad input through the command line: exit 2, one line naming what to change, no traceback, nothing made."""

    def __init__(self, work: Path, recipe: Path, launcher: Launcher) -> None:
        self.work, self.recipe, self.launcher = work, recipe, launcher

    def trial(self, i: int, case: tuple[str, list[str], str]) -> dict:
        name, args, message = case
        out = self.work / "runs" / f"input{i}"
        disk = self.work / "nvme-runs" / f"input{i}"
        shutil.rmtree(out, ignore_errors=True)
        if args[0] == "train":  # before the case's own overrides, which win
            args = [*args[:2], f"training.output_dir={out}", f"offload.disk_path={disk}", *args[2:]]
        log = self.work / "logs" / f"input{i}.log"
        code = self.launcher.run([*args, "-q"] if args[0] in ("train", "demo") else args, log)
        text = log.read_text(errors="replace")
        defects = [f"traceback ({log})"] if _traceback(log) else []
        if code != 2:
            defects.append(f"exit {code} (2 expected) ({log})")
        if message not in text:
            defects.append(f"the message does not say {message!r} ({log})")
        if len(_lines(text)) != 1:
            defects.append(f"{len(_lines(text))} lines, not one ({log})")
        made = [p for p in (out, self.work / "inputs" / "out", self.work / "inputs" / "demo") if p.exists()]
        if made:
            defects.append(f"made {[str(p) for p in made]}")
        return {
            "trial": "bad_input",
            "i": i,
            "input": name,
            "exit": code,
            "outcome": "refused" if not defects else "defect",
            "defects": defects,
        }


# ---------------------------------------------------------------- export


class ExportTrials:
    """``tiertune export`` of damaged checkpoints (one process's and per-rank shards), and to a filling disk."""

    def __init__(self, work: Path, launcher: Launcher, rng: random.Random) -> None:
        self.work, self.launcher, self.rng = work, launcher, rng

    def damaged(self, i: int, stopped: Path) -> dict:
        """A copy of ``stopped``'s newest checkpoint with one file damaged (flipped, truncated, deleted, swapped for
        the older checkpoint's, or the index edited to read one role from another's file with the checksums made to
        match): exit 2 naming the damaged file, and nothing written."""
        from tiertune.finetune.checkpoint import CHECKSUMS, write_checksums

        run_dir = self.work / "runs" / f"export-damage{i}"
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.copytree(stopped, run_dir)
        found = sorted(run_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
        newest, older = found[-1], found[-2]
        files = sorted(p for p in newest.rglob("*") if p.is_file())
        target = self.rng.choice(files)
        kind = self.rng.choice(["flip", "truncate", "delete", "swap", "index"])
        named = target.name
        if kind == "swap":  # a rank's shards (or a file) from another checkpoint
            shards = [p for p in files if p.parent.name.startswith("rank-")]
            target = self.rng.choice(shards or [p for p in files if p.suffix == ".safetensors"])
            swapped = target.parent
            for f in swapped.iterdir():
                twin = older / f.relative_to(newest)
                if twin.is_file():
                    shutil.copy(twin, f)
            named = ""  # any file of what was swapped: checked below
        elif kind == "index":
            index_file = newest / "state" / "index.json"
            index = json.loads(index_file.read_text())
            for key, entry in index["tensors"].items():
                if key.startswith("exp_avg/"):
                    for piece in entry["pieces"]:
                        piece[0] = piece[0].replace(".exp_avg.", ".exp_avg_sq.")
            index_file.write_text(json.dumps(index))
            (newest / CHECKSUMS).unlink()
            write_checksums(newest)
            named = "index.json"
        elif kind == "flip" and target.stat().st_size:
            data = bytearray(target.read_bytes())
            start = self.rng.randrange(len(data))
            for k in range(start, min(len(data), start + 4)):
                data[k] ^= 0xFF
            target.write_bytes(bytes(data))
        elif kind in ("flip", "truncate"):
            kind = "truncate"
            os.truncate(target, self.rng.randrange(max(target.stat().st_size, 1)))
        else:
            target.unlink()
        out = self.work / "exports" / f"damage{i}"
        log = self.work / "logs" / f"export-damage{i}.log"
        code = self.launcher.run(["export", str(newest), "--out", str(out)], log)
        text = log.read_text(errors="replace")
        defects = [f"traceback ({log})"] if _traceback(log) else []
        if code != 2 or "damaged" not in text:
            defects.append(f"exit {code}, not 2 naming the damage ({log})")
        elif named and named not in text and named != "checksums.json":
            # a damaged table names a file it lists
            defects.append(f"the error does not name {named} ({log})")
        if out.exists() or list(out.parent.glob(f".{out.name}.*")):
            defects.append("something was written")
        return {
            "trial": "export_damage",
            "i": i,
            "kind": kind,
            "file": str(target.relative_to(run_dir)),
            "ranks": len(list((newest / "state").glob("rank-*/"))) or 1,
            "outcome": "refused" if not defects else "defect",
            "defects": defects,
        }

    def full_disk(self, i: int, sources: list[Path]) -> dict:
        """Export into a small tmpfs that another process fills while the export writes (from the moment its
        temporary directory appears, or at once): exit 2 saying the disk is full with nothing left in the tmpfs,
        or exit 0 with a model that loads. Needs root to mount; skipped otherwise."""
        mount = self.work / f"export-full{i}"
        mount.mkdir(exist_ok=True)
        source = sources[i % len(sources)]
        size = sum(p.stat().st_size for p in source.rglob("*.safetensors") if "exp_avg" not in p.name)
        size = int(size * self.rng.uniform(1.2, 2.5)) + (1 << 20)
        if subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True
        ).returncode:
            return {
                "trial": "export_full",
                "i": i,
                "outcome": "skipped (cannot mount a tmpfs)",
                "defects": [],
            }
        try:
            out = mount / "model"
            log = self.work / "logs" / f"export-full{i}.log"
            early = self.rng.random() < 0.3
            filler = mount / "filler"
            if early:  # full before it starts
                _fill(filler, self.rng.randrange(0, 256 << 10))
            pid = self.launcher.start(["export", str(source), "--out", str(out)], log)
            if not early:
                while not list(mount.glob(".model.export-*")) and not _exited(pid):
                    time.sleep(0.0002)
                _fill(filler, 0)
            code = self.launcher.wait(pid)
            text = log.read_text(errors="replace")
            defects = [f"traceback ({log})"] if _traceback(log) else []
            left = sorted(p.name for p in mount.iterdir() if p.name not in ("filler", "model"))
            if code == 2 and "no room to write" in text:
                outcome = "stopped: disk full"
                if out.exists() or left:
                    defects.append(f"left behind: {[*left, *(['model'] if out.exists() else [])]}")
            elif code == 0:
                outcome = "finished in the space left"
                from transformers import AutoConfig

                try:
                    AutoConfig.from_pretrained(out)
                    _weights(out)
                except Exception as exc:
                    defects.append(f"the export does not load: {exc}")
            else:
                outcome = "unclean"
                defects.append(f"exit {code} without a disk-full error ({log})")
            return {
                "trial": "export_full",
                "i": i,
                "source": source.name,
                "when": "before" if early else "during",
                "exit": code,
                "outcome": outcome,
                "defects": defects,
            }
        finally:
            subprocess.run(["umount", str(mount)], capture_output=True)


def _fill(path: Path, leave: int) -> None:
    """Fill ``path``'s filesystem but ``leave`` bytes."""
    with open(path, "ab") as f, contextlib.suppress(OSError):
        while (free := shutil.disk_usage(path.parent).free) > leave:
            f.write(b"\0" * min(free - leave, 1 << 20))
            f.flush()


# ---------------------------------------------------------------- several processes


class RankTrials:
    """2-process runs under torchrun (gloo on the CPU): a rank killed while the checkpoint writer works, the
    launcher killed (its ranks must stop), the launch stopped by SIGTERM (``tiertune launch``), a run stopped
    before its first checkpoint restarted on another number of processes. Every run is finished by resuming on a
    random number of processes (1 or 2, the global micro-batch kept) and compared with the reference."""

    def __init__(self, trials: Trials, judge: Judge) -> None:
        self.t, self.judge = trials, judge
        self.work = trials.work

    def _command(self, ranks: int, args: list[str], launch: bool = False) -> list[str]:
        per_device = [f"training.per_device_train_batch_size={4 // ranks}"]
        if launch:
            tool = str(Path(sys.executable).with_name("tiertune"))
            return [tool, "launch", "--standalone", "--nproc_per_node", str(ranks), *args, *per_device, "-q"]
        head = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
        return [*head, "-m", "tiertune.cli", *args, *per_device, "-q"]

    def _start(self, ranks: int, args: list[str], log: Path, launch: bool = False) -> subprocess.Popen:
        env = dict(os.environ, OMP_NUM_THREADS="1", TIERTUNE_COLLECTIVE_TIMEOUT="60", PYTHONUNBUFFERED="1")
        with open(log, "wb") as f:
            return subprocess.Popen(
                self._command(ranks, args, launch), stdout=f, stderr=subprocess.STDOUT, env=env
            )

    def _ranks_of(self, proc: subprocess.Popen) -> list[int]:
        import psutil

        with contextlib.suppress(psutil.Error):
            return [
                p.pid
                for p in psutil.Process(proc.pid).children(recursive=True)
                if "tiertune.cli" in " ".join(p.cmdline())
            ]
        return []

    def _gone(self, pids: list[int], timeout: float) -> bool:
        import psutil

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            alive = []
            for pid in pids:
                with contextlib.suppress(psutil.Error):
                    if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                        alive.append(pid)
            if not alive:
                return True
            time.sleep(0.1)
        return False

    def _finish(self, run_dir: Path, disk: Path, name: str) -> tuple[list[str], list[int]]:
        """Resume with ``auto`` on 1 or 2 processes (random) until finished; the result against the reference
        (multi-process tolerance), and no slot file left in the disk path. Returns (defects, world sizes)."""
        defects: list[str] = []
        sizes = []
        for n in range(5):
            if (run_dir / "trainer_state.json").is_file():
                break
            ranks = self.t.rng.choice([1, 2])
            sizes.append(ranks)
            log = self.work / "logs" / f"{name}-resume{n}.log"
            args = ["train", str(run_dir / "recipe.yaml"), "training.resume_from_checkpoint=auto"]
            if ranks == 1:
                code = self.t.launcher.run([*args, "training.per_device_train_batch_size=4", "-q"], log)
            else:
                proc = self._start(2, args, log)
                try:
                    code = proc.wait(timeout=600)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    code = -1
            if (
                "Traceback"
                in "\n".join(
                    line
                    for line in log.read_text(errors="replace").splitlines()
                    if not line.startswith("[rank")
                )
                and ranks == 1
            ):
                defects.append(f"traceback on resume ({log})")
            if code != 0:
                return [*defects, f"resume on {ranks} exit {code} ({log})"], sizes
        else:
            return [*defects, "not finished after 5 resumes"], sizes
        defects += self.judge.differences(run_dir, rtol=1e-5, atol=1e-6)
        left = [p.name for p in disk.rglob("*.slots")] if disk.is_dir() else []
        if left:
            defects.append(f"slot files left in the disk path: {left}")
        return defects, sizes

    def _dirs(self, name: str) -> tuple[Path, Path, list[str]]:
        return self.t._dirs(name)

    def rank_kill(self, i: int) -> dict:
        """kill -9 of a random rank while a checkpoint is being written (its partial directory exists): the
        launch ends non-zero, every rank exits, the newest complete checkpoint verifies, and the run resumes."""
        from tiertune.finetune.checkpoint import checkpoints, verify

        run_dir, disk, args = self._dirs(f"rank-kill{i}")
        log = self.work / "logs" / f"rank-kill{i}.log"
        proc = self._start(2, ["train", str(self.t.recipe), *args], log)
        nth = self.t.rng.randrange(1, self.t.steps // 2)  # which checkpoint write to strike
        seen: set[str] = set()
        victim, at = None, "never"
        while proc.poll() is None:
            partial = [p.name for p in run_dir.glob(".checkpoint-*.partial")] if run_dir.is_dir() else []
            seen.update(partial)
            if partial and len(seen) >= nth:
                ranks = self._ranks_of(proc)
                if ranks:
                    victim = self.t.rng.choice(ranks)
                    time.sleep(self.t.rng.uniform(0, 0.05))
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(victim, signal.SIGKILL)
                    at = f"writing {partial[0]}"
                break
            time.sleep(0.001)
        ranks = self._ranks_of(proc)
        try:
            code = proc.wait(timeout=240)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = -1
        defects = [] if self._gone(ranks, 60) else ["ranks left running"]
        if code == -1:
            defects.append("the launch hung")
        for path in checkpoints(run_dir):
            try:
                verify(path)
            except Exception as exc:
                defects.append(f"{path.name} does not verify: {exc}")
        more, sizes = self._finish(run_dir, disk, f"rank-kill{i}")
        return {
            "trial": "rank_kill",
            "i": i,
            "at": at,
            "exit": code,
            "resumed_on": sizes,
            "outcome": "finished before the kill" if code == 0 else "resumed",
            "defects": defects + more,
        }

    def orphan(self, i: int) -> dict:
        """kill -9 of torchrun after a random step: its ranks must stop (SIGTERM from the kernel, through their
        clean-up: no slot file left), then the run resumes."""
        run_dir, disk, args = self._dirs(f"orphan{i}")
        log = self.work / "logs" / f"orphan{i}.log"
        proc = self._start(2, ["train", str(self.t.recipe), *args], log)
        k = self.t.rng.randrange(1, self.t.steps)
        while _logged(run_dir) < k and proc.poll() is None:
            time.sleep(0.005)
        ranks = self._ranks_of(proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        defects = [] if self._gone(ranks, 60) else ["ranks went on training after their launcher was killed"]
        if not defects and "tiertune: stopped by SIGTERM" not in log.read_text(errors="replace"):
            defects.append(f"rank 0 does not say it was stopped by SIGTERM ({log})")
        left = [p.name for p in disk.rglob("*.slots")] if disk.is_dir() else []
        if left and not defects:
            defects.append(f"the stopped ranks left slot files: {left}")
        more, sizes = self._finish(run_dir, disk, f"orphan{i}")
        return {
            "trial": "orphan",
            "i": i,
            "at": f"after step {k}",
            "ranks": len(ranks),
            "resumed_on": sizes,
            "outcome": "ranks stopped" if not defects else "defect",
            "defects": defects + more,
        }

    def launch_term(self, i: int) -> dict:
        """SIGTERM to ``tiertune launch`` at a random moment: exit 143 and its last line saying every rank stopped
        (or 0 if it had finished), no traceback, no slot file; then the run resumes."""
        run_dir, disk, args = self._dirs(f"launch-term{i}")
        log = self.work / "logs" / f"launch-term{i}.log"
        proc = self._start(2, ["train", str(self.t.recipe), *args], log, launch=True)
        k = self.t.rng.randrange(0, self.t.steps)
        while (_logged(run_dir) < k or not (run_dir / "recipe.yaml").is_file()) and proc.poll() is None:
            time.sleep(0.005)
        time.sleep(self.t.rng.uniform(0, 1.5 * self.t.step_s))
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=240)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = -1
        text = log.read_text(errors="replace")
        defects = [f"traceback ({log})"] if "Traceback" in text else []
        last = _lines(text)[-1] if _lines(text) else ""
        if code == 143:
            if not last.startswith("tiertune launch: stopped by SIGTERM"):
                defects.append(f"the last line is {last!r}")
            if (run_dir / "recipe.yaml").is_file() and "tiertune: stopped by SIGTERM" not in text:
                defects.append(f"rank 0 does not say it was stopped by SIGTERM ({log})")
        elif code != 0:
            defects.append(f"exit {code} (143 expected) ({log})")
        left = [p.name for p in disk.rglob("*.slots")] if disk.is_dir() else []
        if left:
            defects.append(f"left behind: {left}")
        more, sizes = self._finish(run_dir, disk, f"launch-term{i}")
        return {
            "trial": "launch_term",
            "i": i,
            "at": f"step {k}",
            "exit": code,
            "resumed_on": sizes,
            "outcome": "stopped cleanly"
            if code == 143
            else "finished before the signal"
            if code == 0
            else "defect",
            "defects": defects + more,
        }

    def elastic_early(self, i: int) -> dict:
        """A 2-process run stopped (kill -9 of a rank, or of the launcher) before its first checkpoint, restarted
        with ``auto`` on one process of the same global batch: it starts over (it was refused as "another run's
        outputs"), and finishes as the reference."""
        run_dir, disk, args = self._dirs(f"elastic-early{i}")
        log = self.work / "logs" / f"elastic-early{i}.log"
        proc = self._start(2, ["train", str(self.t.recipe), *args], log)
        while not _logged(run_dir) and proc.poll() is None:  # step 1 done; checkpoint-2 comes after step 2
            time.sleep(0.002)
        how = self.t.rng.choice(["a rank", "the launcher"])
        ranks = self._ranks_of(proc)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.t.rng.choice(ranks) if how == "a rank" and ranks else proc.pid, signal.SIGKILL)
        try:
            proc.wait(timeout=240)
        except subprocess.TimeoutExpired:
            proc.kill()
        defects = [] if self._gone(ranks, 60) else ["ranks left running"]
        from tiertune.finetune.checkpoint import checkpoints

        early = not checkpoints(run_dir)
        log2 = self.work / "logs" / f"elastic-early{i}-one.log"
        code = self.t.launcher.run(
            [
                "train",
                str(run_dir / "recipe.yaml"),
                "training.resume_from_checkpoint=auto",
                "training.per_device_train_batch_size=4",
                "-q",
            ],
            log2,
        )
        if code != 0 or _traceback(log2):
            defects.append(f"restart on one process: exit {code} ({log2})")
        else:
            defects += self.judge.differences(run_dir, rtol=1e-5, atol=1e-6)
            left = [p.name for p in disk.rglob("*.slots")] if disk.is_dir() else []
            if left:
                defects.append(f"slot files left in the disk path: {left}")
        return {
            "trial": "elastic_early",
            "i": i,
            "killed": how,
            "before_first_checkpoint": early,
            "outcome": "restarted on one process" if not defects else "defect",
            "defects": defects,
        }

    def stopped(self) -> Path:
        """A 2-process run killed once its third checkpoint is complete (per-rank shards), for export trials."""
        run_dir, _, args = self._dirs("stopped-ranks")
        log = self.work / "logs" / "stopped-ranks.log"
        proc = self._start(2, ["train", str(self.t.recipe), *args], log)
        deadline = time.monotonic() + 600
        while not (run_dir / "checkpoint-6" / "checksums.json").is_file():
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit(f"the 2-process run to damage did not reach checkpoint-6; see {log}")
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)  # its ranks stop (their launcher died)
        proc.wait()
        time.sleep(3)
        return run_dir


KINDS = (
    "kill",
    "sigterm",
    "disk_full",
    "damage",
    "bad_input",
    "export_damage",
    "export_full",
    "rank_kill",
    "orphan",
    "launch_term",
    "elastic_early",
)


def table(results: list[dict]) -> str:
    """The trials by kind: how many, how many clean, how many with a defect."""
    rows = [("trials", "kind", "clean", "defects", "skipped")]
    for kind in KINDS:
        mine = [r for r in results if r["trial"] == kind]
        if not mine:
            continue
        skipped = sum(1 for r in mine if str(r["outcome"]).startswith("skipped"))
        bad = sum(1 for r in mine if r["defects"])
        rows.append((str(len(mine)), kind, str(len(mine) - bad - skipped), str(bad), str(skipped)))
    total = len(results)
    bad = sum(1 for r in results if r["defects"])
    skipped = sum(1 for r in results if str(r["outcome"]).startswith("skipped"))
    rows.append((str(total), "all", str(total - bad - skipped), str(bad), str(skipped)))
    widths = [max(len(r[k]) for r in rows) for k in range(5)]
    return "\n".join(
        "  ".join(c.rjust(w) if k != 1 else c.ljust(w) for k, (c, w) in enumerate(zip(r, widths)))
        for r in rows
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=".tiertune-faults", help="working directory (emptied first)")
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--sigterms", type=int, default=5)
    p.add_argument("--damage", type=int, default=10)
    p.add_argument("--disk-full", type=int, default=3, help="runs whose output_dir fills up (tmpfs; root)")
    p.add_argument("--inputs", type=int, default=-1, help="bad inputs tried (-1: every one in bad_inputs)")
    p.add_argument(
        "--export-damage", type=int, default=0, help="exports of damaged checkpoints (half per-rank)"
    )
    p.add_argument("--export-full", type=int, default=0, help="exports into a filling tmpfs (root)")
    p.add_argument(
        "--rank-kills", type=int, default=0, help="2-process runs, a rank killed writing a checkpoint"
    )
    p.add_argument("--orphans", type=int, default=0, help="2-process runs whose torchrun is killed")
    p.add_argument(
        "--launch-terms", type=int, default=0, help="2-process `tiertune launch` runs sent SIGTERM"
    )
    p.add_argument("--elastic-early", type=int, default=0, help="2-process runs stopped before a checkpoint")
    p.add_argument("--steps", type=int, default=12, help="steps of the recipe (checkpoints every 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--spawn", action="store_true", help="start tiertune executables instead of forking")
    args = p.parse_args()
    work = Path(args.dir).resolve()
    shutil.rmtree(work, ignore_errors=True)
    (work / "logs").mkdir(parents=True)
    (work / "exports").mkdir()
    rng = random.Random(args.seed)
    recipe = setup(work, args.steps)
    trials = Trials(work, recipe, Launcher(args.spawn), args.steps, rng)
    began = time.monotonic()
    judge, seconds = trials.reference()
    print(
        json.dumps(
            {
                "reference": {
                    "steps": args.steps,
                    "seconds": round(seconds, 2),
                    "startup_s": round(trials.startup_s, 2),
                    "step_s": round(trials.step_s, 3),
                }
            }
        ),
        flush=True,
    )
    results = []

    def record(result: dict) -> None:
        results.append(result)
        print(json.dumps(result), flush=True)

    for i in range(args.kills):
        record(trials.kill(i, judge))
    for i in range(args.sigterms):
        record(trials.sigterm(i, judge))
    for i in range(args.disk_full):
        record(trials.disk_full(i, judge))
    stopped = trials.stopped_run() if args.damage or args.export_damage else None
    for i in range(args.damage):
        record(trials.damage(i, judge, stopped))
    cases = bad_inputs(work, recipe)
    inputs = InputTrials(work, recipe, trials.launcher)
    for i, case in enumerate(cases if args.inputs < 0 else cases[: args.inputs]):
        record(inputs.trial(i, case))
    ranks = RankTrials(trials, judge)
    exports = ExportTrials(work, trials.launcher, rng)
    if args.export_damage:
        sources = [stopped, ranks.stopped()]
        for i in range(args.export_damage):
            record(exports.damaged(i, sources[i % 2]))
    if args.export_full:
        reference = work / "runs" / "reference"
        sources = [reference, reference / f"checkpoint-{args.steps}"]
        for i in range(args.export_full):
            record(exports.full_disk(i, sources))
    for i in range(args.rank_kills):
        record(ranks.rank_kill(i))
    for i in range(args.orphans):
        record(ranks.orphan(i))
    for i in range(args.launch_terms):
        record(ranks.launch_term(i))
    for i in range(args.elastic_early):
        record(ranks.elastic_early(i))
    summary: dict = {
        "machine": machine(),
        "launch": "spawn" if args.spawn else "fork",
        "seed": args.seed,
        "seconds": round(time.monotonic() - began, 1),
    }
    for kind in KINDS:
        mine = [r for r in results if r["trial"] == kind]
        outcomes: dict[str, int] = {}
        for r in mine:
            outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
        summary[kind] = {
            "trials": len(mine),
            "outcomes": outcomes,
            "defects": sum(1 for r in mine if r["defects"]),
        }
    all_defects = [d for r in results for d in r["defects"]]
    summary["silent_wrong_results"] = sum(
        1 for d in all_defects if "differ" in d or "each step once" in d or "without saying" in d
    )
    summary["tracebacks"] = sum(1 for d in all_defects if "traceback" in d)
    summary["trials"] = len(results)
    summary["defects"] = sum(1 for r in results if r["defects"])
    print(json.dumps({"summary": summary}), flush=True)
    print(table(results), flush=True)
    sys.exit(1 if summary["defects"] else 0)


if __name__ == "__main__":
    main()
