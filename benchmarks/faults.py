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

TEXTS = [f"the {a} cat sat on the {b} mat ." for a in ("red", "big", "old", "fat") for b in ("blue", "flat", "wet")]


def setup(work: Path, steps: int) -> Path:
    """A tiny random Llama, its data and a recipe with weights and optimizer states on disk, checkpoints every
    2 steps; returns the recipe's path."""
    import yaml

    from tiertune.finetune.demo import make_model

    model = work / "model"
    if not (model / "config.json").is_file():
        make_model(model, TEXTS, layers=3, hidden=64)
    data = work / "data.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    recipe = {
        "model": {"path": str(model), "dtype": "float32"},
        "data": {"path": str(data), "max_seq_len": 32},
        "training": {"output_dir": str(work / "runs" / "reference"), "max_steps": steps,
                     "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "learning_rate": "3e-3",
                     "lr_scheduler_type": "cosine", "warmup_steps": 2, "weight_decay": 0.01, "logging_steps": 1,
                     "save_steps": 2, "save_total_limit": 3, "report_to": "none"},
        "offload": {"disk_path": str(work / "nvme"), "params": "disk", "optimizer_states": "disk",
                    "device_budget": "4MiB", "host_budget": "1MiB"},
    }  # fmt: skip
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

    def differences(self, run_dir: Path) -> list[str]:
        """Why ``run_dir``'s finished run is not the reference (empty when it is)."""
        import torch

        if not (run_dir / "model.safetensors").is_file():
            return ["no model exported"]
        problems = []
        losses = _losses(run_dir)
        if [s for s, _ in losses] != [s for s, _ in self.losses]:
            problems.append(f"logged steps {[s for s, _ in losses]} (each step once expected)")
        elif any(abs(a - b) > 1e-6 * abs(b) for (_, a), (_, b) in zip(losses, self.losses)):
            problems.append("losses differ from the uninterrupted run")
        weights = _weights(run_dir)
        if set(weights) != set(self.weights) or any(
            not torch.allclose(weights[k], v, rtol=1e-6, atol=1e-7) for k, v in self.weights.items()
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
        args = [f"training.output_dir={run_dir}", f"offload.disk_path={self.work / 'nvme-runs' / run_dir.name}"]
        code = self.launcher.run(["train", str(self.recipe), "-q", *args], log.with_suffix(".again.log"))
        return [f"fresh start exit {code}"] if code else []

    def kill(self, i: int, judge: Judge) -> dict:
        run_dir, _disk, log, at, code = self._stopped(f"kill{i}", signal.SIGKILL)
        checkpoints = sorted(p.name for p in run_dir.glob("checkpoint-*")) if run_dir.is_dir() else []
        defects = [f"traceback before the kill ({log})"] if _traceback(log) else []
        defects += self._start_again(run_dir, log)
        more, resumes = self._finish(run_dir, f"kill{i}", judge)
        outcome = "finished before the kill" if code == 0 else "resumed" if checkpoints else "started over"
        return {"trial": "kill", "i": i, "at": at, "exit": code, "checkpoints_at_kill": checkpoints,
                "outcome": outcome, "resumes": resumes, "defects": defects + more}  # fmt: skip

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
            defects.append(f"exit {code} (143 expected){' (hung: stacks in ' + str(log) + ')' if code == -1 else ''}")
            outcome = "hung" if code == -1 else "unclean"
        defects += self._start_again(run_dir, log)
        more, resumes = self._finish(run_dir, f"term{i}", judge)
        return {"trial": "sigterm", "i": i, "at": at, "exit": code, "outcome": outcome,
                "resumes": resumes, "defects": defects + more}  # fmt: skip

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
        code = self.launcher.run(["train", str(run_dir / "recipe.yaml"), "-q", *recipe_args,
                                  f"training.resume_from_checkpoint={newest}"], log)  # fmt: skip
        text = log.read_text(errors="replace")
        if _traceback(log):
            defects.append(f"traceback ({log})")
        if code != 2 or "damaged" not in text:
            defects.append(f"explicit resume of the damaged checkpoint: exit {code} ({log})")
        elif target.name not in text and target.name != "checksums.json":  # a damaged table names a file it lists
            defects.append(f"the error does not name {target.name} ({log})")
        log = self.work / "logs" / f"damage{i}-auto.log"
        code = self.launcher.run(["train", str(run_dir / "recipe.yaml"), *recipe_args,
                                  "training.resume_from_checkpoint=auto"], log)  # fmt: skip
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
        return {"trial": "damage", "i": i, "kind": kind, "file": str(target.relative_to(run_dir)),
                "outcome": "fell back" if fell_back and code == 0 else "defect", "defects": defects}  # fmt: skip

    def disk_full(self, i: int, judge: Judge) -> dict:
        """The run directory on a small tmpfs that fills up at a random moment (another process's file): the
        run must stop with a DiskFullError (exit 2, no partial checkpoint or export left), and complete to the
        reference once space is freed. Needs root to mount; skipped otherwise."""
        mount = self.work / f"full{i}"
        mount.mkdir()
        size = 32 << 20
        if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
                          capture_output=True).returncode:  # fmt: skip
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
            return {"trial": "disk_full", "i": i, "at": f"step {k}, {left} bytes left", "exit": code,
                    "checkpoints": not i % 2,
                    "outcome": outcome, "resumes": resumes, "defects": defects + more}  # fmt: skip
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=".tiertune-faults", help="working directory (emptied first)")
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--sigterms", type=int, default=5)
    p.add_argument("--damage", type=int, default=10)
    p.add_argument("--disk-full", type=int, default=3, help="runs whose output_dir fills up (tmpfs; root)")
    p.add_argument("--steps", type=int, default=12, help="steps of the recipe (checkpoints every 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--spawn", action="store_true", help="start tiertune executables instead of forking")
    args = p.parse_args()
    work = Path(args.dir).resolve()
    shutil.rmtree(work, ignore_errors=True)
    (work / "logs").mkdir(parents=True)
    rng = random.Random(args.seed)
    recipe = setup(work, args.steps)
    trials = Trials(work, recipe, Launcher(args.spawn), args.steps, rng)
    began = time.monotonic()
    judge, seconds = trials.reference()
    print(json.dumps({"reference": {"steps": args.steps, "seconds": round(seconds, 2),
                                    "startup_s": round(trials.startup_s, 2), "step_s": round(trials.step_s, 3)}}),
          flush=True)  # fmt: skip
    results = []
    for i in range(args.kills):
        results.append(trials.kill(i, judge))
        print(json.dumps(results[-1]), flush=True)
    for i in range(args.sigterms):
        results.append(trials.sigterm(i, judge))
        print(json.dumps(results[-1]), flush=True)
    for i in range(args.disk_full):
        results.append(trials.disk_full(i, judge))
        print(json.dumps(results[-1]), flush=True)
    if args.damage:
        stopped = trials.stopped_run()
        for i in range(args.damage):
            results.append(trials.damage(i, judge, stopped))
            print(json.dumps(results[-1]), flush=True)
    summary: dict = {"machine": machine(), "launch": "spawn" if args.spawn else "fork", "seed": args.seed,
                     "seconds": round(time.monotonic() - began, 1)}  # fmt: skip
    for kind in ("kill", "sigterm", "disk_full", "damage"):
        mine = [r for r in results if r["trial"] == kind]
        outcomes: dict[str, int] = {}
        for r in mine:
            outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
        summary[kind] = {"trials": len(mine), "outcomes": outcomes,
                         "defects": sum(1 for r in mine if r["defects"])}  # fmt: skip
    all_defects = [d for r in results for d in r["defects"]]
    summary["silent_wrong_results"] = sum(
        1 for d in all_defects if "differ" in d or "each step once" in d or "without saying" in d
    )
    summary["tracebacks"] = sum(1 for d in all_defects if "traceback" in d)
    summary["defects"] = sum(1 for r in results if r["defects"])
    print(json.dumps({"summary": summary}), flush=True)
    sys.exit(1 if summary["defects"] else 0)


if __name__ == "__main__":
    main()
