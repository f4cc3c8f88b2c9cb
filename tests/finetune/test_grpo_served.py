"""GRPO with its rollouts from a llama.cpp server (``objective.rollout_engine: llama_cpp``): the run starts
llama-cpp-python's server over its base written as a GGUF, pushes the adapter to it as a GGUF LoRA before each
generation, and checks every generation that the served policy is the trained one (the sampled tokens'
log-probabilities, the server's against the step's); an adapter that is not pushed is caught; the server ends
with the run; a recipe the server cannot serve is refused with what to change."""

import json
import os

import pytest

from tests.conftest import CAT_TEXTS
from tiertune.config.recipe import load_recipe
from tiertune.errors import ConfigError, ModelError
from tiertune.finetune import served
from tiertune.finetune.train import train

pytest.importorskip("llama_cpp.server")

REWARDS = '''
def letters(prompts, completions, **kwargs):
    """The share of a completion's characters that are letters (a random model's completions vary in it)."""
    return [sum(ch.isalpha() for ch in c) / max(1, len(c)) for c in completions]
'''
STEPS = 3


@pytest.fixture(scope="module")
def bpe_model(tmp_path_factory):
    from tiertune.cli.demo import make_model

    return make_model(tmp_path_factory.mktemp("bpe-model"), CAT_TEXTS, layers=2, hidden=64, tokenizer="bpe")


def _recipe(tmp_path, write_recipe, model_dir, objective=None, method=None, training=None, data=None):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": " ".join(t.split()[:2])}) + "\n" for t in CAT_TEXTS[:8]))
    (tmp_path / "rewards.py").write_text(REWARDS)
    return write_recipe(
        tmp_path,
        model_dir,
        data={"path": str(prompts), "format": "prompt", "shuffle": False, "max_seq_len": 32, **(data or {})},
        method=method or {"type": "lora", "lora": {"r": 4, "dropout": 0.0}},
        objective={
            "type": "grpo",
            "num_generations": 4,
            "max_completion_length": 8,
            "reward_funcs": [f"{tmp_path / 'rewards.py'}:letters"],
            "rollout_engine": "llama_cpp",
            "rollout_gguf_type": "f32",
            "rollout_logp_tolerance": 1e-3,
            **(objective or {}),
        },
        training={
            "max_steps": STEPS,
            "per_device_train_batch_size": 4,
            "gradient_accumulation_steps": 2,
            "learning_rate": 5e-2,
            "save_steps": 0,
            **(training or {}),
        },
    )


@pytest.fixture
def servers(monkeypatch):
    """The servers the runs start (their processes' ids, once up)."""
    started = []
    start = served.LlamaCppServer.start

    def recorded(self, write_adapter):
        start(self, write_adapter)
        started.append(self.process.pid)

    monkeypatch.setattr(served.LlamaCppServer, "start", recorded)
    return started


def _gone(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_the_served_policy_is_the_trained_one_each_step(bpe_model, tmp_path, write_recipe, servers):
    result = train(load_recipe(_recipe(tmp_path, write_recipe, bpe_model)), progress=False)
    log = [json.loads(line) for line in result.log_path.read_text().splitlines()]
    assert len(log) == STEPS and len(servers) == 1
    for record in log:  # each step a generation, sampled by the server after its push
        assert record["sampling/sampling_logp_difference/mean"] < 1e-3, record
        assert record["sampling/sampling_logp_difference/max"] < 1e-2, record
        # the tokens compared: each completion's first ones whose pieces are the server's (a random model's
        # completions hold bytes that are no text alone, which the server's text drops: 10-30% here)
        assert record["sampling/compared_share"] > 0.05, record
        assert {"reward", "rewards/letters/mean", "completions/mean_length"} <= set(record)
    directory = result.output_dir / served.SERVED_DIR
    assert {"base.f32.gguf", "policy-a.gguf", "policy-b.gguf", "server.json"} <= {
        p.name for p in directory.iterdir()
    }
    assert not list(directory.glob(".*.tmp"))  # every file renamed into place
    assert _gone(servers[0])  # the server ended with the run
    samples = (result.output_dir / "completions.jsonl").read_text().splitlines()
    assert len(samples) == STEPS * 8


def test_a_served_run_evaluates_its_held_out_prompts_by_the_server(
    bpe_model, tmp_path, write_recipe, servers
):
    """The held-out prompts sampled by the server (the adapter pushed first), before the first step, after the
    second and the last; the steps' served log-probabilities still checked against their own."""
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("".join(json.dumps({"prompt": f"the {a} cat"}) + "\n" for a in ("red", "old", "fat")))
    path = _recipe(
        tmp_path,
        write_recipe,
        bpe_model,
        objective={"num_generations_eval": 2},
        training={"eval_strategy": "steps", "eval_steps": 2, "eval_on_start": True},
        data={"eval_path": str(held_out)},
    )
    result = train(load_recipe(path), progress=False)
    log = [json.loads(line) for line in result.log_path.read_text().splitlines()]
    evaluated = [r for r in log if "eval_loss" in r]
    assert [r["step"] for r in evaluated] == [0, 2, STEPS] and len(servers) == 1
    for record in evaluated:
        assert 0 <= record["eval_reward"] <= 1 and record["eval_completions/mean_length"] > 0, record
    steps = [r for r in log if "loss" in r]
    assert len(steps) == STEPS
    for record in steps:
        assert record["sampling/sampling_logp_difference/mean"] < 1e-3, record
    held = [json.loads(line) for line in (result.output_dir / "completions.jsonl").read_text().splitlines()]
    assert {r["step"] for r in held if r.get("eval")} == {0, 2, STEPS}


def test_an_adapter_not_pushed_stops_the_run(bpe_model, tmp_path, write_recipe, servers, monkeypatch):
    """The server keeps the first adapter: from the second generation its policy is not the trained one."""
    monkeypatch.setattr(served.LlamaCppServer, "push", lambda self, write_adapter: None)
    with pytest.raises(ModelError, match="the served policy is not the trained one"):
        train(load_recipe(_recipe(tmp_path, write_recipe, bpe_model)), progress=False)
    log = [json.loads(line) for line in (tmp_path / "run" / "trainer_log.jsonl").read_text().splitlines()]
    assert (
        log[0]["sampling/sampling_logp_difference/mean"] < 1e-3
    )  # the first generation's adapter was served
    assert _gone(servers[0])


@pytest.mark.parametrize(
    ("method", "objective", "match"),
    [
        ({"type": "full"}, {}, "needs method.type lora"),
        ({"type": "lora", "lora": {"use_dora": True}}, {}, "without use_dora"),
        (None, {"rollout_logp_tolerance": 0}, "rollout_logp_tolerance must be > 0"),
        (None, {"rollout_engine": "vllm"}, "objective.rollout_url must be the vllm server's address"),
        (None, {"rollout_engine": "trtllm"}, "rollout_engine"),
        (None, {"rollout_gguf_type": "q4_0"}, "rollout_gguf_type"),
    ],
)
def test_a_recipe_the_server_cannot_serve_is_refused(
    bpe_model, tmp_path, write_recipe, method, objective, match
):
    with pytest.raises(ConfigError, match=match):
        load_recipe(_recipe(tmp_path, write_recipe, bpe_model, objective, method))


def test_the_server_ends_when_the_run_is_killed(bpe_model, tmp_path, write_recipe):
    """SIGKILL of the run's process (no clean-up of its own runs): the server, started with the run's death as
    its own end (PR_SET_PDEATHSIG, set in the server's process), ends within seconds."""
    import time

    import psutil

    from tests.signalling import killed_run

    recipe = _recipe(tmp_path, write_recipe, bpe_model)
    config = str(tmp_path / "run" / served.SERVED_DIR / "server.json")
    done = killed_run("tiertune.finetune.served:LlamaCppServer.push:1", recipe, tmp_path / "stamp")
    assert done.returncode == -9, done.stderr[-3000:]

    def running():
        return [
            p
            for p in psutil.process_iter(["cmdline"])
            if config in (p.info["cmdline"] or []) and p.is_running()
        ]

    deadline = time.monotonic() + 20
    while running() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not running()
