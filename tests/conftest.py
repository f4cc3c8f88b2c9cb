from __future__ import annotations

import contextlib
import logging
import os

# Under pytest-xdist (the README's ``-n auto``) each worker computes with its share of the cores: torch's default,
# a thread per core in every process, oversubscribes them (2 workers on 2 cores ran 2.9x slower than with a
# thread each). Set before torch is imported, so that the processes the tests start inherit it too.
_CORES = len(os.sched_getaffinity(0))
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, str(max(1, _CORES // _WORKERS)))

import pytest  # noqa: E402
import torch  # noqa: E402
from tiny import tiny_config  # noqa: E402

# Triton's kernels run in its interpreter on a CPU (fp32 only: its bf16 arithmetic is wrong). Triton reads
# this when it is first imported, which transformers, peft or torch may do at any point of a session.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: a worker per core, at most 4 (each starts its own processes: ranks, CLI runs); one where CUDA
    is (the GPU tests share one device)."""
    return 1 if torch.cuda.is_available() else max(1, min(4, _CORES))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def disk_dir(tmp_path):
    """A directory on the real disk (tmp_path lives on the root filesystem here, not tmpfs)."""
    d = tmp_path / "disk"
    d.mkdir()
    return d


@pytest.fixture(autouse=True)
def _offload_logs(caplog):
    caplog.set_level(logging.DEBUG, logger="tiertune.offload")


@pytest.fixture(autouse=True, scope="session")
def _temp_dir(tmp_path_factory):
    """Every temporary file of the session, this process's and its subprocesses' (torchrun's torchelastic_*
    directories, notebooks, launches), in the session's own temporary directory, which pytest removes (but
    for failed tests': ``tmp_path_retention_policy``): the tests leave nothing in the system's temp dir."""
    import tempfile

    path = str(tmp_path_factory.mktemp("tmp"))
    saved = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"], tempfile.tempdir = path, path
    yield
    if saved[0] is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = saved[0]
    tempfile.tempdir = saved[1]


@pytest.fixture(autouse=True, scope="session")
def _datasets_cache(tmp_path_factory):
    """The datasets library's cache (tokenized data) in the test session's temporary directory, not ~/.cache."""
    import os

    path = str(tmp_path_factory.mktemp("hf-datasets"))
    os.environ["HF_DATASETS_CACHE"] = path
    import datasets

    datasets.config.HF_DATASETS_CACHE = path


CAT_TEXTS = [
    f"the {a} cat sat on the {b} mat ." for a in ("red", "big", "old", "fat") for b in ("blue", "flat", "wet")
]
# preference pairs over the cat texts' words (``data.format: preference``)
CAT_PAIRS = [
    {"prompt": f"the {a} cat", "chosen": f" sat on the {b} mat .", "rejected": f" sat on the {c}"}
    for a, b, c in [
        ("red", "blue", "wet"),
        ("big", "flat", "blue"),
        ("old", "wet", "flat"),
        ("fat", "blue", "red"),
        ("red", "flat", "old"),
        ("big", "wet", "fat"),
        ("old", "blue", "big"),
        ("fat", "flat", "wet"),
    ]
]


@pytest.fixture(scope="session")
def cat_model(tmp_path_factory):
    """``cat_model(layers, hidden=64)``: a small random Llama with a tokenizer fitted to ``CAT_TEXTS``, saved
    once per shape for the session; returns its directory."""
    from tiertune.cli.demo import make_model

    made: dict = {}

    def make(layers: int, hidden: int = 64):
        if (layers, hidden) not in made:
            made[layers, hidden] = make_model(tmp_path_factory.mktemp("cat-model"), CAT_TEXTS, layers, hidden)
        return made[layers, hidden]

    return make


@pytest.fixture
def write_recipe():
    """``write_recipe(tmp_path, model_dir, texts=..., **sections)``: see ``_write_recipe``."""
    return _write_recipe


def _write_recipe(tmp_path, model_dir, name: str = "recipe", texts=CAT_TEXTS, **sections):
    """A recipe YAML for a tiny local model, the texts as its data, and run/offload paths under
    ``tmp_path``; ``sections`` (dicts by section name) are merged over the defaults. Returns its path."""
    import json

    import yaml

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    recipe = {
        "model": {"path": str(model_dir), "dtype": "float32"},
        "data": {"path": str(data), "max_seq_len": 32},
        "training": {
            "output_dir": str(tmp_path / "run"),
            "max_steps": 3,
            "per_device_train_batch_size": 4,
            "logging_steps": 1,
        },
        "offload": {"disk_path": str(tmp_path / "nvme"), "device_budget": "8MiB", "host_budget": "8MiB"},
    }
    for section, values in sections.items():
        recipe.setdefault(section, {}).update(values)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Save a tiny random model of a family as a sharded safetensors HF directory; returns (dir, model)."""
    from transformers import AutoModelForCausalLM

    made = {}

    def make(family: str, layers: int = 4, shard: str = "40KB"):
        key = (family, layers, shard)
        if key not in made:
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(tiny_config(family, layers))
            path = tmp_path_factory.mktemp(f"{family}-{layers}")
            model.save_pretrained(path, max_shard_size=shard)
            made[key] = (path, model)
        return made[key]

    return make


@pytest.fixture
def interrupted_after():
    """``with interrupted_after(n): train(...)``: the runs in the block stop with KeyboardInterrupt (as after
    Ctrl-C) when they start their step n + 1 (counted over all of them). A checkpoint still being written then
    completes however long the disk takes: a stop gives it only ``STOP_GRACE_S`` (on a busy disk the
    checkpoint of step n was dropped), and the tests that use this are about what the next run finds, not
    about how fast a stop is (``tests/cli/test_signals.py``)."""
    from tiertune.engine import StreamedTrainer
    from tiertune.finetune import train as train_module

    @contextlib.contextmanager
    def after(steps: int):
        step = StreamedTrainer.step
        grace = train_module.STOP_GRACE_S
        calls = []

        def interrupted(self, micro):
            if self.compute.ledger:  # the plan's step on a ledger, before the run (``engine.registered``)
                return step(self, micro)
            if len(calls) == steps:
                raise KeyboardInterrupt
            calls.append(1)
            return step(self, micro)

        StreamedTrainer.step = interrupted
        train_module.STOP_GRACE_S = 3600.0
        try:
            yield
        finally:
            StreamedTrainer.step = step
            train_module.STOP_GRACE_S = grace

    return after
