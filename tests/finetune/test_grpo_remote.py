"""GRPO with its rollouts from a vLLM or SGLang server the user runs (``objective.rollout_engine: vllm | sglang``,
``rollout_url``): before each generation the run writes its adapter in PEFT format and loads it through the
server's runtime LoRA endpoint (the one before unloaded), samples each completion from it over the prompt's token
ids, and checks that the served policy is the trained one. Neither server installs on a machine without a GPU:
``lora_server.py`` stands in for them, serving their documented endpoints with transformers, each pushed adapter
loaded by peft itself."""

import http.server
import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import ClassVar

import pytest
from typer.testing import CliRunner

from tests.conftest import CAT_TEXTS
from tiertune.cli.app import app
from tiertune.config.recipe import load_recipe
from tiertune.errors import ModelError
from tiertune.finetune import served
from tiertune.finetune.train import train

REWARDS = '''
def cats(prompts, completions, **kwargs):
    """The share of a completion's words that are "cat"."""
    return [c.split().count("cat") / max(1, len(c.split())) for c in completions]
'''
STEPS = 3


@pytest.fixture(scope="module")
def model_dir(cat_model):
    return cat_model(2, hidden=64)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(params=["vllm", "sglang"])
def server(request, model_dir):
    """The stand-in server of ``request.param``'s flavor over ``model_dir``: (flavor, its URL)."""
    port = _port()
    script = str(Path(__file__).with_name("lora_server.py"))
    process = subprocess.Popen(
        [sys.executable, script, "--model", str(model_dir), "--flavor", request.param, "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=2):
                break
        except OSError:
            assert process.poll() is None, process.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the stand-in server did not start"
            time.sleep(0.2)
    yield request.param, url
    process.kill()
    process.wait()


def _models(url):
    with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as answer:
        return [m["id"] for m in json.loads(answer.read())["data"]]


def _recipe(tmp_path, write_recipe, model_dir, flavor, url, objective=None):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": " ".join(t.split()[:2])}) + "\n" for t in CAT_TEXTS[:8]))
    (tmp_path / "rewards.py").write_text(REWARDS)
    return write_recipe(
        tmp_path,
        model_dir,
        data={"path": str(data), "format": "prompt", "shuffle": False, "max_seq_len": 32},
        method={"type": "lora", "lora": {"r": 4, "dropout": 0.0}},
        objective={
            "type": "grpo",
            "num_generations": 4,
            "max_completion_length": 8,
            "reward_funcs": [f"{tmp_path / 'rewards.py'}:cats"],
            "rollout_engine": flavor,
            "rollout_url": url,
            "rollout_logp_tolerance": 1e-3,
            **(objective or {}),
        },
        training={
            "max_steps": STEPS,
            "per_device_train_batch_size": 4,
            "gradient_accumulation_steps": 2,
            "learning_rate": 5e-2,
            "save_steps": 0,
        },
    )


def test_the_served_policy_is_the_trained_one_each_step(
    model_dir, tmp_path, write_recipe, server, monkeypatch
):
    flavor, url = server
    pushed = []
    push = served.RemoteServer.push

    def recorded(self, save):
        push(self, save)
        pushed.append((self.loaded, _models(url)))

    monkeypatch.setattr(served.RemoteServer, "push", recorded)
    result = train(load_recipe(_recipe(tmp_path, write_recipe, model_dir, flavor, url)), progress=False)
    log = [json.loads(line) for line in result.log_path.read_text().splitlines()]
    assert len(log) == STEPS and len(pushed) == STEPS  # a push a generation
    for record in log:  # peft's adapter over transformers' base against the step's own, fp32
        assert record["sampling/sampling_logp_difference/mean"] < 1e-4, record
        assert record["sampling/sampling_logp_difference/max"] < 1e-3, record
        # vLLM gives the sampled tokens' ids: every one compared; SGLang's text: its first whole pieces
        assert (
            record["sampling/compared_share"] == 1.0
            if flavor == "vllm"
            else record["sampling/compared_share"] > 0
        )
    for name, models in pushed:  # each push loaded under a new name, the one before unloaded
        assert models[1:] == [name]
    assert len({name for name, _ in pushed}) == STEPS
    assert _models(url)[1:] == []  # the run's last adapter unloaded at its end; the server goes on
    assert not [
        p for p in (result.output_dir / served.SERVED_DIR).iterdir() if p.name.startswith("tiertune-")
    ]


def test_an_adapter_not_pushed_stops_the_run(model_dir, tmp_path, write_recipe, server, monkeypatch):
    """The server keeps the first adapter: from the second generation its policy is not the trained one."""
    flavor, url = server
    push = served.RemoteServer.push
    monkeypatch.setattr(
        served.RemoteServer, "push", lambda self, save: push(self, save) if self.loaded is None else None
    )
    with pytest.raises(ModelError, match="the served policy is not the trained one"):
        train(load_recipe(_recipe(tmp_path, write_recipe, model_dir, flavor, url)), progress=False)
    assert _models(url)[1:] == []


def test_a_server_that_does_not_answer_is_named_with_how_to_start_it(model_dir, tmp_path, write_recipe):
    path = _recipe(tmp_path, write_recipe, model_dir, "vllm", f"http://127.0.0.1:{_port()}")
    result = CliRunner().invoke(app, ["train", str(path)])
    assert result.exit_code != 0 and "Traceback" not in result.output
    said = " ".join(result.output.split())
    assert (
        "no vLLM server answers there" in said and "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True vllm serve" in said
    )
    missing = _recipe(tmp_path, write_recipe, model_dir, "sglang", None)
    result = CliRunner().invoke(app, ["train", str(missing)])
    assert result.exit_code == 2 and "objective.rollout_url must be the sglang server's address" in " ".join(
        result.output.split()
    )


class _Hanging(http.server.BaseHTTPRequestHandler):
    """A vLLM that loads adapters but never answers a completion (a hung server): ``seen`` is set when a
    completion is asked for, ``unloaded`` lists the adapters unloaded."""

    seen = threading.Event()
    release = threading.Event()
    unloaded: ClassVar[list[str]] = []

    def log_message(self, *args):
        pass

    def _answer(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._answer({"data": [{"id": "base"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/v1/completions":
            _Hanging.seen.set()
            _Hanging.release.wait(120)
        elif self.path == "/v1/unload_lora_adapter":
            _Hanging.unloaded.append(body["lora_name"])
        self._answer({})


@pytest.mark.parametrize("signame", ["TERM", "INT"])
def test_a_stop_while_the_server_samples_ends_the_run_within_seconds(
    model_dir, tmp_path, write_recipe, signame
):
    """SIGTERM or SIGINT while a completion request waits on a server that never answers: the run stops at once
    (it waited for the request, up to 900 s), unloads its adapter and says how to resume."""
    _Hanging.seen.clear(), _Hanging.release.clear(), _Hanging.unloaded.clear()
    hung = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hanging)
    threading.Thread(target=hung.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{hung.server_address[1]}"
        path = _recipe(tmp_path, write_recipe, model_dir, "vllm", url)
        run = subprocess.Popen(
            [sys.executable, "-m", "tiertune.cli", "train", str(path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert _Hanging.seen.wait(300), run.communicate(timeout=60)[0][-3000:]
        time.sleep(0.5)  # the run is inside the request
        sent = time.monotonic()
        run.send_signal(getattr(signal, f"SIG{signame}"))
        try:
            output, _ = run.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            run.kill()
            pytest.fail(f"the run did not stop within 60 s of SIG{signame}: {run.communicate()[0][-2000:]}")
        took = time.monotonic() - sent
    finally:
        _Hanging.release.set()
        hung.shutdown()
    assert run.returncode == 128 + getattr(signal, f"SIG{signame}"), output[-3000:]
    assert took < 30, f"{took:.1f} s to stop"  # a bound on a hang, not a timing: the request waits 120 s
    assert "Traceback" not in output
    assert _Hanging.unloaded and _Hanging.unloaded[-1].startswith("tiertune-"), "the adapter was not unloaded"
