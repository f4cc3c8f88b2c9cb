"""GRPO's rollouts from a llama.cpp server (``objective.rollout_engine: llama_cpp``): llama-cpp-python's
OpenAI-compatible server, started by the run, samples the completions; the run pushes its adapter to it before
each generation and checks that the served policy is the trained one.

The base is written once as a GGUF (``rollout_gguf_type``) into ``served/`` of the run directory, and kept while
the model's files are unchanged (a resumed run does not write it again). The server holds two models over that
base, ``policy-a`` and ``policy-b``, each with its own GGUF LoRA file: a push writes the adapter as it is now into
the slot not being served (a temporary name, then a rename) and the next request names that slot, which the
server loads in place of the other (llama-cpp-python holds one model at a time). Each completion is one request
(``/v1/completions``: the prompt's text, its seed, the recipe's temperature, top-p and top-k, llama.cpp's other
samplers off) with the log-probability of each sampled token; its text is tokenized again by the run's tokenizer
(an EOS appended where the server stopped at one).

After a generation's first step (``ServedSampler.check``), the served log-probabilities are compared with the
step's own of the same tokens (the tokens whose pieces match the server's, from each completion's start): TRL's
``sampling/sampling_logp_difference/mean`` and ``/max``; above ``rollout_logp_tolerance`` the run stops. The
server's log-probabilities are of the raw logits: at a temperature other than 1 the step's are of the tempered
ones, and the check is not made (said once)."""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from tiertune.errors import ConfigError, ModelError
from tiertune.files import fsync_file, write_text_atomically
from tiertune.formats import gguf
from tiertune.kernels.ops.linear_ce import IGNORE_INDEX

log = logging.getLogger("tiertune.finetune")

SERVED_DIR = "served"
"""The run directory's folder of the server's files: the base GGUF, the adapter slots, its config and log."""
SLOTS = ("policy-a", "policy-b")
"""The server's two models over one base: a push writes the one not being served."""
SERVED_KEY = "served_logps"
"""The key of a micro-batch holding, per row, the server's log-probabilities of its first matching tokens."""
START_S = 300.0
"""How long the server may take to load the base before the run gives up."""
REQUEST_S = 900.0
"""How long one completion request may take."""
MODEL_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def _free_port() -> int:
    """A TCP port of this machine's loopback nobody listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


WITH_PARENT = """
import ctypes, os, runpy, signal, sys
try:  # SIGTERM when the run's process dies, however it dies (Linux's PR_SET_PDEATHSIG)
    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)
except Exception:
    pass
if os.getppid() != int(sys.argv[1]):  # it died before that was set
    sys.exit(0)
sys.argv = sys.argv[2:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""
"""``python -c WITH_PARENT <the run's pid> <module> <its arguments>``: the module run as ``python -m`` does, ended
with the run's process. Set in the child itself, not by a ``preexec_fn``: that makes ``subprocess`` fork the
whole run (a process with a large address space: the fork can fail for memory, and a fork of a threaded process
may deadlock) where it otherwise uses vfork."""


class LlamaCppServer:
    """llama-cpp-python's server over the base of ``model_dir`` written as a GGUF in ``directory`` (see the
    module docstring): ``start`` it with the adapter's first version, ``push`` each later one, ``complete`` a
    prompt, ``close`` it (also at exit)."""

    def __init__(
        self,
        model_dir: Path,
        directory: Path,
        gguf_type: str,
        n_ctx: int,
        threads: int,
        safe_point: Callable[[], None] | None = None,
    ) -> None:
        self.model_dir, self.directory, self.gguf_type = Path(model_dir), Path(directory), gguf_type
        self.n_ctx, self.threads = n_ctx, threads
        self.safe_point = safe_point or (lambda: None)
        self.process: subprocess.Popen | None = None
        self.url = ""
        self.serving = 0  # the slot the next request names
        self.pushes = 0

    @property
    def base(self) -> Path:
        """The base model's GGUF file."""
        return self.directory / f"base.{self.gguf_type}.gguf"

    def slot(self, index: int) -> Path:
        """The GGUF LoRA file of adapter slot ``index``."""
        return self.directory / f"{SLOTS[index]}.gguf"

    def start(self, write_adapter: Callable[[Path], None]) -> None:
        """Write the base (unless it is there, of these model files) and the adapter into the first slot, then
        start the server and wait until it answers (a ModelError with its log's end if it dies first)."""
        if _missing("llama_cpp.server") or _missing("uvicorn"):
            raise ConfigError(
                "objective.rollout_engine: llama_cpp needs llama-cpp-python's server: pip install 'tiertune[llama]'"
            )
        gguf.check(self.model_dir)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._write_base()
        write_adapter(self.slot(0))
        write_adapter(self.slot(1))  # both slots exist from the start: the server checks its files
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        models = [
            {
                "model": str(self.base),
                "model_alias": alias,
                "lora_path": str(self.slot(i)),
                "n_ctx": self.n_ctx,
                "n_batch": min(512, self.n_ctx),
                "n_threads": self.threads,
                "n_threads_batch": self.threads,
                "logits_all": True,
                "verbose": False,
            }
            for i, alias in enumerate(SLOTS)
        ]
        config = self.directory / "server.json"
        write_text_atomically(
            config, json.dumps({"host": "127.0.0.1", "port": port, "models": models}, indent=2)
        )
        with open(self.directory / "server.log", "ab") as out:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    WITH_PARENT,
                    str(os.getpid()),
                    "llama_cpp.server",
                    "--config_file",
                    str(config),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # a terminal's Ctrl-C reaches the run, which ends the server itself
            )
        atexit.register(self.close)
        began = time.monotonic()
        while True:
            self.safe_point()
            if self.process.poll() is not None:
                raise ModelError(f"the llama.cpp server stopped while loading the base ({self._log_tail()})")
            try:
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=5) as answer:
                    if answer.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() - began > START_S:
                self.close()
                raise ModelError(
                    f"the llama.cpp server did not answer within {START_S:.0f} s ({self._log_tail()})"
                )
            time.sleep(0.2)
        log.info("llama.cpp server at %s over %s (%s)", self.url, self.base, self.gguf_type)

    def push(self, write_adapter: Callable[[Path], None]) -> None:
        """The adapter as it is now into the slot not being served; the next request is served by it."""
        other = 1 - self.serving
        write_adapter(self.slot(other))
        self.serving = other
        self.pushes += 1

    def complete(
        self,
        prompt: str,
        max_tokens: int,
        temperature: float,
        top_p: float,
        top_k: int,
        seed: int,
        logprobs: bool,
    ) -> dict[str, Any]:
        """One completion of ``prompt`` by the served policy (the response's first choice)."""
        body = {
            "model": SLOTS[self.serving],
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,  # 0: off, as tiertune's
            "min_p": 0.0,
            "typical_p": 1.0,
            "repeat_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "mirostat_mode": 0,
            "seed": seed,
            "logprobs": 1 if logprobs else None,
            "stream": False,
        }
        request = urllib.request.Request(
            f"{self.url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_S) as answer:
                return json.loads(answer.read())["choices"][0]
        except (urllib.error.URLError, ConnectionError, TimeoutError, KeyError, ValueError) as exc:
            detail = (
                exc.read().decode(errors="replace")[-500:] if isinstance(exc, urllib.error.HTTPError) else ""
            )
            raise ModelError(
                f"the llama.cpp server failed a completion ({type(exc).__name__}: {exc} {detail}; {self._log_tail()})"
            ) from None

    def close(self) -> None:
        """End the server (SIGTERM, then SIGKILL after 10 s); nothing if it is not running."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def _write_base(self) -> None:
        """The base GGUF, written to a temporary name and renamed, unless the one there is of these files."""
        stamp_file = self.base.with_suffix(".json")
        stamp = json.dumps(self._stamp(), sort_keys=True)
        if self.base.is_file() and stamp_file.is_file() and stamp_file.read_text() == stamp:
            return
        tmp = self.base.with_name(f".{self.base.name}.tmp")
        began = time.perf_counter()
        gguf.write_gguf(self.model_dir, tmp, self.gguf_type)
        fsync_file(tmp)
        os.replace(tmp, self.base)
        write_text_atomically(stamp_file, stamp)
        log.info("wrote the served base %s in %.1f s", self.base, time.perf_counter() - began)

    def _stamp(self) -> dict[str, Any]:
        """What the base GGUF was written from: the model's files, their sizes and times, and the type."""
        files = sorted(
            p for p in self.model_dir.iterdir() if p.suffix == ".safetensors" or p.name in MODEL_FILES
        )
        return {
            "model": str(self.model_dir.resolve()),
            "type": self.gguf_type,
            "files": {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in files},
        }

    def _log_tail(self) -> str:
        """The server log's last lines, for an error."""
        path = self.directory / "server.log"
        if not path.is_file():
            return "no server log"
        lines = path.read_text(errors="replace").strip().splitlines()[-8:]
        return f"the end of {path}: " + " | ".join(lines)


def _missing(module: str) -> bool:
    """Whether ``module`` cannot be imported here (found without importing it)."""
    import importlib.util

    try:
        return importlib.util.find_spec(module) is None
    except ModuleNotFoundError:
        return True


class ServedSampler:
    """The sampler of ``finetune.grpo.Rollouts`` when a llama.cpp server samples: called as
    ``StreamedTrainer.generate`` is, it pushes the adapter (from the second generation on), asks the server for
    each completion and keeps, per completion, the served log-probabilities of its first tokens that match
    (``served``, in order); ``check`` compares them with a step's own."""

    def __init__(
        self,
        trainer: Any,
        recipe: Any,
        tokenizer: Any,
        run_dir: Path,
        model_dir: Path,
        safe_point: Callable[[], None] | None = None,
    ) -> None:
        o = recipe.objective
        self.trainer, self.tokenizer, self.gguf_type = trainer, tokenizer, o.rollout_gguf_type
        self.model_dir = Path(model_dir)
        self.tolerance = o.rollout_logp_tolerance
        self.checked = self.tolerance is not None and o.temperature == 1.0
        if self.tolerance is not None and not self.checked:
            log.warning(
                "objective.rollout_logp_tolerance: not checked at temperature %s (the server's log-probabilities "
                "are of the raw logits)",
                o.temperature,
            )
        self.server = LlamaCppServer(
            self.model_dir,
            run_dir / SERVED_DIR,
            o.rollout_gguf_type,
            recipe.data.max_seq_len + 8,
            max(1, torch.get_num_threads()),
            safe_point,
        )
        self.safe_point = safe_point or (lambda: None)
        self.started = False
        self.served: list[list[float]] = []
        self.push_seconds = 0.0

    def __call__(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        top_k: int,
        seed: int | Sequence[int],
        eos_token_id: Sequence[int],
        pad_token_id: int,
    ) -> list[list[int]]:
        """The completions' ids of ``prompts`` (each its own request, seeded by its own of ``seed``'s, or by
        ``seed`` + its index)."""
        began = time.perf_counter()
        if not self.started:
            self.server.start(self._write_adapter)
            self.started = True
        else:
            self.server.push(self._write_adapter)
        self.push_seconds = time.perf_counter() - began
        out, self.served = [], []
        for i, ids in enumerate(prompts):
            choice = self.server.complete(
                self._prompt_text(list(ids)),
                max_new_tokens,
                temperature,
                top_p,
                top_k,
                seed + i if isinstance(seed, int) else int(seed[i]),
                self.checked,
            )
            completion = self.tokenizer(choice["text"], add_special_tokens=False)["input_ids"][
                :max_new_tokens
            ]
            if choice.get("finish_reason") == "stop" and len(completion) < max_new_tokens and eos_token_id:
                completion.append(int(eos_token_id[0]))
            out.append(completion)
            self.served.append(self._matching(completion, choice.get("logprobs")))
            self.safe_point()
        return out

    def _prompt_text(self, ids: list[int]) -> str:
        """The prompt as the server tokenizes it again: its text, without a leading BOS (the server adds its
        own where the model's tokenizer does)."""
        bos = self.tokenizer.bos_token_id
        if bos is not None and ids and ids[0] == bos:
            ids = ids[1:]
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _matching(self, completion: list[int], logprobs: dict | None) -> list[float]:
        """The served log-probabilities of the completion's first tokens whose pieces are the server's."""
        if not logprobs:
            return []
        pieces, values = logprobs.get("tokens") or [], logprobs.get("token_logprobs") or []
        out = []
        for token, piece, value in zip(completion, pieces, values, strict=False):
            if value is None or self.tokenizer.decode([token]) != piece:
                break
            out.append(float(value))
        return out

    def _write_adapter(self, out_file: Path) -> None:
        """The trainer's adapter as it is now, as a GGUF LoRA at ``out_file`` (a temporary name, then renamed)."""
        with tempfile.TemporaryDirectory(dir=out_file.parent, prefix=".adapter-") as tmp:
            self.trainer.save_adapter(tmp)
            part = out_file.with_name(f".{out_file.name}.tmp")
            gguf.write_gguf_lora(Path(tmp), self.model_dir, part, self.gguf_type)
            fsync_file(part)
            os.replace(part, out_file)

    def check(self, micro: Sequence[dict[str, Any]]) -> dict[str, float]:
        """After a step: the served log-probabilities of its micro-batches (``SERVED_KEY``, put there by the
        rollouts on a generation's first step) against the step's own (``logps``), TRL's metrics; a ModelError
        above the tolerance. Nothing on a generation's later steps."""
        deltas, compared, tokens = [], 0, 0
        for mb in micro:
            served = mb.pop(SERVED_KEY, None)
            if served is None or "logps" not in mb:
                continue
            logps, labels = mb["logps"], mb["labels"]
            for row, (prompt_length, values) in enumerate(served):
                scored = labels[row, prompt_length:] != IGNORE_INDEX
                tokens += int(scored.sum())
                if not values or not bool(scored[0]):
                    continue  # a completion left out of the loss (mask_truncated_completions)
                trained = logps[row, prompt_length - 1 : prompt_length - 1 + len(values)]
                deltas.append((trained - torch.tensor(values)).abs())
                compared += len(values)
        if not tokens:
            return {}
        metrics = {"sampling/compared_share": compared / tokens, "push_seconds": round(self.push_seconds, 4)}
        if not deltas:
            return metrics
        delta = torch.cat(deltas)
        mean, worst = float(delta.mean()), float(delta.max())
        metrics |= {
            "sampling/sampling_logp_difference/mean": mean,
            "sampling/sampling_logp_difference/max": worst,
        }
        if self.tolerance is not None and mean > self.tolerance:
            raise ModelError(
                f"the served policy is not the trained one: the sampled tokens' log-probabilities differ by "
                f"{mean:.4g} on average (at most {worst:.4g}, over {compared} tokens) between the llama.cpp server "
                f"and the step, above objective.rollout_logp_tolerance {self.tolerance}. A base or GGUF type "
                f"({self.gguf_type}) that rounds the weights does this: set objective.rollout_gguf_type: f32 (or "
                "bf16 for a bf16 base), train the base unquantized, or raise the tolerance"
            )
        return metrics

    def close(self) -> None:
        """End the server."""
        self.server.close()


__all__ = ["SERVED_DIR", "SERVED_KEY", "SLOTS", "LlamaCppServer", "ServedSampler"]
