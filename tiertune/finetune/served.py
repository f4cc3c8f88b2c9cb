"""GRPO's rollouts from a server (``objective.rollout_engine``): llama-cpp-python's OpenAI-compatible server,
started by the run (``llama_cpp``), or a vLLM or SGLang server the user runs (``vllm``, ``sglang``:
``RemoteServer``), samples the completions; the run pushes its adapter to it before each generation and checks
that the served policy is the trained one.

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
import contextlib
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
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
CLOSE_S = 10.0
"""How long unloading the run's adapter from a user's server may take when the run ends."""
POLL_S = 0.2
"""How often the run looks for a stop (SIGINT, SIGTERM) while it waits for the server's answer."""
MODEL_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def fetch(
    request: urllib.request.Request | str,
    safe_point: Callable[[], None],
    timeout: float = REQUEST_S,
) -> bytes:
    """The body of the server's answer to ``request``, read on a thread of its own while this one calls
    ``safe_point`` every ``POLL_S``: a stop is raised there within that, however long the server takes (a read
    from a socket is not interrupted by a signal whose handler only records it). A stopped run leaves the request
    to its thread (a daemon: the process does not wait for it at exit) and its answer is dropped. The
    request's own errors (``urllib.error.URLError``, ``TimeoutError``, ...) are raised here as they came."""
    box: dict[str, Any] = {}
    done = threading.Event()

    def read() -> None:
        try:
            with urllib.request.urlopen(request, timeout=timeout) as answer:
                box["body"] = answer.read()
        except BaseException as exc:  # handed to the waiting thread, which raises it
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=read, name="tiertune-served-request", daemon=True).start()
    while not done.wait(POLL_S):
        safe_point()
    if "error" in box:
        raise box["error"]
    return box["body"]


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


def from_text(
    tokenizer: Any, choice: dict[str, Any], max_tokens: int, eos: Sequence[int]
) -> tuple[list[int], list[float]]:
    """A served completion (an OpenAI completion's choice) that comes back as text: its ids by the run's
    tokenizer (an EOS appended where the server stopped at one), and the served log-probabilities of its first
    tokens whose pieces are the server's (none where it gave none)."""
    completion = tokenizer(choice["text"], add_special_tokens=False)["input_ids"][:max_tokens]
    if choice.get("finish_reason") == "stop" and len(completion) < max_tokens and eos:
        completion.append(int(eos[0]))
    logprobs = choice.get("logprobs") or {}
    pieces, values = logprobs.get("tokens") or [], logprobs.get("token_logprobs") or []
    out: list[float] = []
    for token, piece, value in zip(completion, pieces, values, strict=False):
        if value is None or tokenizer.decode([token]) != piece:
            break
        out.append(float(value))
    return completion, out


class LlamaCppServer:
    """llama-cpp-python's server over the base of ``model_dir`` written as a GGUF in ``directory`` (see the
    module docstring): ``start`` it with the adapter's first version, ``push`` each later one (``save`` writes the
    adapter in PEFT format into a directory; it is served as a GGUF LoRA), ``sample`` a completion, ``close`` it
    (also at exit)."""

    name = "llama.cpp"
    mismatch = (
        "A base or GGUF type that rounds the weights does this: set objective.rollout_gguf_type: f32 (or bf16 for "
        "a bf16 base), train the base unquantized, or raise the tolerance"
    )

    def __init__(
        self,
        model_dir: Path,
        directory: Path,
        gguf_type: str,
        n_ctx: int,
        threads: int,
        tokenizer: Any,
        safe_point: Callable[[], None] | None = None,
    ) -> None:
        self.model_dir, self.directory, self.gguf_type = Path(model_dir), Path(directory), gguf_type
        self.n_ctx, self.threads, self.tokenizer = n_ctx, threads, tokenizer
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

    def start(self, save: Callable[[Path], None]) -> None:
        """Write the base (unless it is there, of these model files) and the adapter into the first slot, then
        start the server and wait until it answers (a ModelError with its log's end if it dies first)."""
        if _missing("llama_cpp.server") or _missing("uvicorn"):
            raise ConfigError(
                "objective.rollout_engine: llama_cpp needs llama-cpp-python's server: pip install 'tiertune[llama]'"
            )
        gguf.check(self.model_dir)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._write_base()
        self._write_slot(0, save)
        self._write_slot(1, save)  # both slots exist from the start: the server checks its files
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
                fetch(f"{self.url}/v1/models", self.safe_point, timeout=5)
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

    def push(self, save: Callable[[Path], None]) -> None:
        """The adapter as it is now into the slot not being served; the next request is served by it."""
        other = 1 - self.serving
        self._write_slot(other, save)
        self.serving = other
        self.pushes += 1

    def _write_slot(self, index: int, save: Callable[[Path], None]) -> None:
        """The adapter ``save`` writes, as a GGUF LoRA into slot ``index`` (a temporary name, then renamed)."""
        out_file = self.slot(index)
        with tempfile.TemporaryDirectory(dir=out_file.parent, prefix=".adapter-") as tmp:
            save(Path(tmp))
            part = out_file.with_name(f".{out_file.name}.tmp")
            gguf.write_gguf_lora(Path(tmp), self.model_dir, part, self.gguf_type)
            fsync_file(part)
            os.replace(part, out_file)

    def sample(
        self,
        prompt: list[int],
        max_tokens: int,
        temperature: float,
        top_p: float,
        top_k: int,
        seed: int,
        logprobs: bool,
        eos: Sequence[int],
    ) -> tuple[list[int], list[float]]:
        """A completion's ids of ``prompt`` (the server's text tokenized again by the run's tokenizer, an EOS
        appended where it stopped at one) and the served log-probabilities of its first tokens whose pieces are
        the server's."""
        choice = self.complete(
            self._prompt_text(prompt), max_tokens, temperature, top_p, top_k, seed, logprobs
        )
        return from_text(self.tokenizer, choice, max_tokens, eos)

    def _prompt_text(self, ids: list[int]) -> str:
        """The prompt as the server tokenizes it again: its text, without a leading BOS (the server adds its
        own where the model's tokenizer does)."""
        bos = self.tokenizer.bos_token_id
        if bos is not None and ids and ids[0] == bos:
            ids = ids[1:]
        return self.tokenizer.decode(ids, skip_special_tokens=False)

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
            return json.loads(fetch(request, self.safe_point))["choices"][0]
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


class RemoteServer:
    """A vLLM or SGLang server the user runs over the base (``objective.rollout_url``), with LoRA adapters loaded at
    run time: vLLM with ``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` (its
    ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``), SGLang with ``--enable-lora`` (``/load_lora_adapter``,
    ``/unload_lora_adapter``). Each push writes the adapter in PEFT format into a directory of its own under
    ``directory`` (which the server must read: the same machine or a shared disk), loads it under a new name and
    unloads the one before; a completion is ``/v1/completions`` over the prompt's token ids, naming that adapter
    (vLLM: its name; SGLang: ``base:name``), with the sampled tokens' log-probabilities (vLLM gives their ids:
    ``return_tokens_as_token_ids``; SGLang's text is tokenized again, as llama.cpp's)."""

    mismatch = (
        "The server serves another base than model.path (or in a dtype that rounds it), or did not load the "
        "pushed adapter: start it over model.path in its dtype, or raise the tolerance"
    )

    def __init__(
        self,
        engine: str,
        url: str,
        directory: Path,
        tokenizer: Any,
        safe_point: Callable[[], None] | None = None,
    ) -> None:
        self.engine, self.url, self.directory, self.tokenizer = (
            engine,
            url.rstrip("/"),
            Path(directory),
            tokenizer,
        )
        self.safe_point = safe_point or (lambda: None)
        self.name = {"vllm": "vLLM", "sglang": "SGLang"}[engine]
        self.lora = "/v1" if engine == "vllm" else ""  # where its (un)load_lora_adapter endpoints are
        self.base = ""  # the served base model's id (``/v1/models``)
        self.prefix = f"tiertune-{os.getpid()}-{int(time.time())}"  # this run's adapters' names
        self.loaded: str | None = None
        self.pushes = 0

    def start(self, save: Callable[[Path], None]) -> None:
        """Ask the server for its base model (a ModelError that says how to start it, where it does not answer),
        then push the adapter's first version."""
        try:
            models = self._request("GET", "/v1/models")
            self.base = str(models["data"][0]["id"])
        except (ModelError, KeyError, IndexError, TypeError) as exc:
            start = (
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True vllm serve MODEL --enable-lora --max-lora-rank R"
                if self.engine == "vllm"
                else "python -m sglang.launch_server --model-path MODEL --enable-lora --max-lora-rank R "
                "--lora-target-modules all"
            )
            raise ModelError(
                f"objective.rollout_url {self.url}: no {self.name} server answers there ({exc}); start it over "
                f"model.path with runtime LoRA loading ({start}), or set objective.rollout_engine: tiertune"
            ) from None
        self.directory.mkdir(parents=True, exist_ok=True)
        self.push(save)
        log.info(
            "%s server at %s serving %s, the adapter pushed as %s",
            self.name,
            self.url,
            self.base,
            self.loaded,
        )

    def push(self, save: Callable[[Path], None]) -> None:
        """The adapter as it is now, written into a directory of its own and loaded under a new name; the one
        before unloaded and removed."""
        self.pushes += 1
        name = f"{self.prefix}-{self.pushes}"
        path = self.directory / name
        part = self.directory / f".{name}.tmp"
        shutil.rmtree(part, ignore_errors=True)
        save(part)
        os.replace(part, path)
        self._request(
            "POST", f"{self.lora}/load_lora_adapter", {"lora_name": name, "lora_path": str(path.resolve())}
        )
        before, self.loaded = self.loaded, name
        if before is not None:
            self._unload(before)

    def _unload(self, name: str, stopping: bool = False) -> None:
        self._request("POST", f"{self.lora}/unload_lora_adapter", {"lora_name": name}, stopping)
        shutil.rmtree(self.directory / name, ignore_errors=True)

    def sample(
        self,
        prompt: list[int],
        max_tokens: int,
        temperature: float,
        top_p: float,
        top_k: int,
        seed: int,
        logprobs: bool,
        eos: Sequence[int],
    ) -> tuple[list[int], list[float]]:
        """A completion's ids of ``prompt`` by the pushed adapter over the base, and the served log-probabilities
        of its tokens (of its first ones whose pieces are the server's, where the server gives text)."""
        body = {
            "model": self.loaded if self.engine == "vllm" else f"{self.base}:{self.loaded}",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k or -1,  # -1: off
            "seed": seed,
            "logprobs": 1,
            "skip_special_tokens": False,
            "stream": False,
        }
        if self.engine == "vllm":
            body["return_tokens_as_token_ids"] = True
        choice = self._request("POST", "/v1/completions", body)["choices"][0]
        served = choice.get("logprobs") or {}
        tokens, values = served.get("tokens") or [], served.get("token_logprobs") or []
        if tokens and all(str(t).startswith("token_id:") for t in tokens):
            ids = [int(str(t).removeprefix("token_id:")) for t in tokens][:max_tokens]
            return ids, [float(v) for v in values[: len(ids)]] if logprobs else []
        return from_text(
            self.tokenizer, choice if logprobs else {**choice, "logprobs": None}, max_tokens, eos
        )

    def _request(self, method: str, path: str, body: dict | None = None, stopping: bool = False) -> Any:
        """The server's answer to one request (JSON), a ModelError with its reason where it fails. A stop is
        raised while it waits, except when the run is ``stopping`` (its clean-up: 10 s at most then)."""
        request = urllib.request.Request(
            f"{self.url}{path}",
            data=None if body is None else json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method=method,
        )
        try:
            if stopping:
                text = fetch(request, lambda: None, timeout=CLOSE_S)
            else:
                text = fetch(request, self.safe_point)
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            detail = (
                exc.read().decode(errors="replace")[-500:] if isinstance(exc, urllib.error.HTTPError) else ""
            )
            raise ModelError(
                f"the {self.name} server at {self.url} failed {method} {path}: {exc} {detail}"
            ) from None
        try:
            return json.loads(text) if text.strip() else {}
        except ValueError:
            return {"text": text.decode(errors="replace")}

    def close(self) -> None:
        """Unload this run's adapter (the server keeps running: it is the user's)."""
        loaded, self.loaded = self.loaded, None
        if loaded is not None:
            with contextlib.suppress(ModelError):
                self._unload(loaded, stopping=True)


class ServedSampler:
    """The sampler of ``finetune.grpo.Rollouts`` when a server samples (``LlamaCppServer``, ``RemoteServer``): called as
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
        self.trainer = trainer
        self.tolerance = o.rollout_logp_tolerance
        self.checked = self.tolerance is not None and o.temperature == 1.0
        if self.tolerance is not None and not self.checked:
            log.warning(
                "objective.rollout_logp_tolerance: not checked at temperature %s (the server's log-probabilities "
                "are of the raw logits)",
                o.temperature,
            )
        self.server: LlamaCppServer | RemoteServer
        if o.rollout_engine == "llama_cpp":
            self.server = LlamaCppServer(
                Path(model_dir),
                run_dir / SERVED_DIR,
                o.rollout_gguf_type,
                recipe.data.max_seq_len + 8,
                max(1, torch.get_num_threads()),
                tokenizer,
                safe_point,
            )
        else:
            self.server = RemoteServer(
                o.rollout_engine, str(o.rollout_url), run_dir / SERVED_DIR, tokenizer, safe_point
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
            self.server.start(self.trainer.save_adapter)
            self.started = True
        else:
            self.server.push(self.trainer.save_adapter)
        self.push_seconds = time.perf_counter() - began
        out, self.served = [], []
        for i, ids in enumerate(prompts):
            completion, served = self.server.sample(
                list(ids),
                max_new_tokens,
                temperature,
                top_p,
                top_k,
                seed + i if isinstance(seed, int) else int(seed[i]),
                self.checked,
                eos_token_id,
            )
            out.append(completion)
            self.served.append(served)
            self.safe_point()
        return out

    def check(self, micro: Sequence[dict[str, Any]]) -> dict[str, float]:
        """After a step: the served log-probabilities of its micro-batches (``SERVED_KEY``, put there by the
        rollouts on a generation's first step) against the step's own (``logps``), TRL's metrics; a ModelError
        above the tolerance. Nothing on a generation's later steps."""
        deltas, compared, tokens = [], 0, 0
        for mb in micro:
            served = mb.pop(SERVED_KEY, None)
            # the step's own figures, or (a generation that feeds several steps) the sampling policy's
            logps = mb.get("logps", mb.get("old_logps"))
            if served is None or logps is None:
                continue
            labels = mb["labels"]
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
                f"{mean:.4g} on average (at most {worst:.4g}, over {compared} tokens) between the {self.server.name} "
                f"server and the step, above objective.rollout_logp_tolerance {self.tolerance}. {self.server.mismatch}"
            )
        return metrics

    def close(self) -> None:
        """End the server."""
        self.server.close()


__all__ = ["SERVED_DIR", "SERVED_KEY", "SLOTS", "LlamaCppServer", "ServedSampler"]
