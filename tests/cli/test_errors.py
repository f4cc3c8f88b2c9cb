"""Malformed input of every kind: a short, specific message, exit code 2, no traceback, no run directory
damaged."""

import json

import pytest
from typer.testing import CliRunner

from tiertune.cli.app import app
from tiertune.cli.demo import make_model

TEXTS = [f"the {a} cat sat on the {b} mat ." for a in ("red", "big", "old") for b in ("blue", "flat")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    made = make_model(tmp_path_factory.mktemp("model"), TEXTS, layers=2)
    _MODEL[:] = [made]
    return made


@pytest.fixture
def recipe(tmp_path, model_dir, write_recipe):
    return write_recipe(
        tmp_path,
        model_dir,
        texts=TEXTS,
        data={"max_seq_len": 16},
        training={"max_steps": 1, "per_device_train_batch_size": 2},
    )


def _file(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _bytes(tmp_path, name, data):
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


NOT_JSON = "{oops\n"
LATIN1 = b'{"text": "the red cat"}\n{"text": "caf\xe9"}\n'

# (name, overrides or a callable(tmp_path) returning them, expected message)
CASES = [
    ("unknown key", ["training.learnig_rate=1e-4"], "did you mean `training.learning_rate`"),
    ("unknown section", ["modle.path=x"], "did you mean `model`"),
    ("wrong type", ["training.max_steps=abc"], "must be int"),
    ("negative learning rate", ["training.learning_rate=-1"], "training.learning_rate must be >= 0"),
    ("not key=value", ["training"], "must look like section.key=value"),
    ("bad size", ["offload.host_budget=lots"], "cannot read 'lots' as a size"),
    ("unknown choice", ["model.quantize=nf5"], "must be one of none, nf4, fp4, int8"),
    ("missing model directory", ["model.path=/nonexistent/model"], "is not a Hugging Face model directory"),
    ("quantized full fine-tuning", ["model.quantize=nf4"], "freezes the base; use method.type: lora"),
    ("lora rank 0", ["method.lora.r=0"], "method.lora.r must be >= 1"),
    ("galore rank 0", ["method.type=galore", "method.galore.rank=0"], "method.galore.rank must be >= 1"),
    ("sequence too short", ["data.max_seq_len=1"], "data.max_seq_len must be >= 2"),
    (
        "unknown optimizer",
        ["training.optim=sgd"],
        "training.optim must be one of adamw_torch, adamw_bnb_8bit",
    ),
    (
        "disk without a path",
        ["offload.disk_path=null", "offload.params=disk"],
        "offload.disk_path is not set",
    ),
    ("dataset file missing", ["data.path=/nonexistent.jsonl"], "data file /nonexistent.jsonl does not exist"),
    ("unknown data file type", lambda t: [f"data.path={_file(t, 'd.xml', '<x/>')}"], "must end in .jsonl"),
    (
        "row without its field",
        lambda t: [f"data.path={_file(t, 'd.jsonl', json.dumps({'txt': 'a'}))}"],
        "row 1: expected a string field 'text', found no such field",
    ),
    ("empty dataset", lambda t: [f"data.path={_file(t, 'd.jsonl', '')}"], "holds no rows"),
    (
        "line that is not JSON",
        lambda t: [f"data.path={_file(t, 'd.jsonl', NOT_JSON)}"],
        "line 1: not valid JSON",
    ),
    ("chat without a template", ["data.format=chat"], "this tokenizer has none"),
    ("unwritable disk path", ["offload.disk_path=/proc/tiertune", "offload.params=disk"], "/proc/tiertune"),
    (
        "budget too small",
        ["offload.params=disk", "offload.host_budget=16KiB"],
        "checked before loading the model: the host tier needs",
    ),
    (
        "no checkpoint to resume",
        ["training.resume_from_checkpoint=/nonexistent/checkpoint-5"],
        "/nonexistent/checkpoint-5 does not exist; use auto",
    ),
    (
        "disk path on a special filesystem",
        ["offload.disk_path=/proc", "offload.params=disk"],
        "cannot create a file in /proc (No such file or directory)",
    ),
    (
        "data file not UTF-8",
        lambda t: [f"data.path={_bytes(t, 'd.jsonl', LATIN1)}"],
        "d.jsonl is not UTF-8 text: byte 0xe9 at byte offset 37 (line 2) cannot be decoded",
    ),
    (
        "data path a directory",
        lambda t: [f"data.path={t}"],
        "is a directory; point data.path at a .jsonl, .json, .parquet, .csv, .txt file in it; files there: data.jsonl",
    ),
    (
        "budget beyond the machine",
        ["offload.host_budget=100TiB"],
        "offload.host_budget is 100.00 TiB but this machine has",
    ),
    (
        "budget without a unit",
        ["offload.host_budget=64"],
        "offload.host_budget: 64 has no unit; write e.g. 64GiB (or 64B for bytes)",
    ),
    # found by the fault campaign of issue 26: each was a traceback, accepted nonsense or an unclear message
    (
        "override that is not YAML",
        ["training.learning_rate=[1e-4"],
        "override 'training.learning_rate=[1e-4' is not valid YAML at line 1",
    ),
    (
        "seed beyond 64 bits",
        ["training.seed=100000000000000000000000"],
        "training.seed must be in [0, 2**64)",
    ),
    ("negative weight decay", ["training.weight_decay=-0.1"], "training.weight_decay must be >= 0, got -0.1"),
    ("negative adam epsilon", ["training.adam_epsilon=-1e-8"], "training.adam_epsilon must be >= 0"),
    (
        "negative max_grad_norm",
        ["training.max_grad_norm=-1"],
        "training.max_grad_norm must be >= 0 (0: no clipping)",
    ),
    ("negative save_total_limit", ["training.save_total_limit=-2"], "training.save_total_limit must be >= 0"),
    (
        "a mapping where a list belongs",
        ["method.type=lora", "method.lora.target_modules={q_proj: 1}"],
        "method.lora.target_modules must be a string or a list of names; got {'q_proj': 1}",
    ),
    (
        "a section that is not a mapping",
        ["training=[1]"],
        "section training must be a mapping of settings (key: value, one per line), got a list",
    ),
    (
        "a JSON line that is not an object",
        lambda t: [f"data.path={_file(t, 'd.jsonl', TWO_ROWS_ONE_ARRAY)}"],
        "d.jsonl, line 2: an array, not a JSON object with the fields of data.format",
    ),
    (
        "text the tokenizer cannot represent",
        lambda t: [f"data.path={_file(t, 'd.jsonl', UNKNOWN_WORDS)}"],
        "row 1: the tokenizer transformers picked for this model (TokenizersBackend) keeps 0 of the row's 27 characters",
    ),
    (
        "model without a tokenizer",
        lambda t: [f"model.path={_without_tokenizer(t)}"],
        "has no tokenizer that transformers can load (no tokenizer.json or tokenizer_config.json)",
    ),
]

TWO_ROWS_ONE_ARRAY = json.dumps({"text": TEXTS[0]}) + "\n[1, 2]\n"
UNKNOWN_WORDS = json.dumps({"text": "zebras quietly juggle lanterns"}) + "\n"


def _without_tokenizer(tmp_path):
    import shutil

    model = tmp_path / "no-tokenizer"
    model.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(_MODEL[0] / name, model / name)
    return model


_MODEL: list = []  # the module's model directory, for cases that copy part of it


@pytest.mark.parametrize(("name", "overrides", "message"), CASES, ids=[c[0] for c in CASES])
def test_malformed_input_exits_2_with_a_specific_message(tmp_path, recipe, name, overrides, message):
    args = overrides(tmp_path) if callable(overrides) else overrides
    result = CliRunner().invoke(app, ["train", str(recipe), *args], env={"COLUMNS": "300"})
    assert result.exit_code == 2, result.output
    assert message in result.output, result.output
    assert "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output  # one line: the message, not a dump
    assert not (tmp_path / "run").exists()  # nothing made: no empty output_dir left behind


T5 = {
    "model_type": "t5",
    "architectures": ["T5ForConditionalGeneration"],
    "d_model": 32,
    "d_ff": 64,
    "num_layers": 1,
    "num_heads": 2,
    "vocab_size": 100,
    "is_encoder_decoder": True,
}


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("{oops", "config.json is not valid JSON (Expecting property name enclosed in double quotes at line"),
        ('{"hidden_size": 64}', 'config.json has no "model_type" key'),
        (json.dumps(T5), "tiertune fine-tunes decoder-only causal LMs (AutoModelForCausalLM);"),
    ],
    ids=["not json", "no model_type", "encoder-decoder"],
)
@pytest.mark.parametrize("command", [["train"], ["train", "--dry-run"], ["estimate", "--no-probe"]])
def test_a_model_tiertune_cannot_use_exits_2(tmp_path, model_dir, write_recipe, config, message, command):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(model_dir, model)
    (model / "config.json").write_text(config)
    recipe = write_recipe(tmp_path, model, texts=TEXTS)
    result = CliRunner().invoke(app, [command[0], str(recipe), *command[1:]], env={"COLUMNS": "300"})
    assert result.exit_code == 2, result.output
    assert message in result.output and str(model) in result.output, result.output
    assert "Traceback" not in result.output


def test_bad_recipe_files(tmp_path):
    bad = _file(tmp_path, "bad.yaml", "model:\n  path: [unclosed\n")
    latin1 = _bytes(tmp_path, "latin1.yaml", b"model:\n  path: caf\xe9\n")
    twice = _file(
        tmp_path, "twice.yaml", "training:\n  max_steps: 3\n  learning_rate: 1e-4\n  max_steps: 5\n"
    )
    (tmp_path / "recipes").mkdir()
    cases = [
        (bad, "not valid YAML at line"),
        (str(tmp_path / "nope.yaml"), "does not exist"),
        (latin1, "latin1.yaml is not UTF-8 text: byte 0xe9 at byte offset 18 (line 2) cannot be decoded"),
        (twice, "twice.yaml: `max_steps` is given twice in one section (lines 2 and 4); keep one"),
        (str(tmp_path / "recipes"), "recipes is a directory; give a YAML recipe file"),
    ]
    for path, message in cases:
        for command in (["train", path], ["estimate", path, "--no-probe"]):
            result = CliRunner().invoke(app, command, env={"COLUMNS": "300"})
            assert result.exit_code == 2, result.output
            assert message in result.output and "Traceback" not in result.output, result.output
            assert len(result.output.strip().splitlines()) == 1, result.output


def test_bad_command_options(tmp_path):
    cases = [
        (
            ["demo", "--steps", "0", "--workdir", str(tmp_path / "demo")],
            "--steps must be >= 1 (the steps to train), got 0",
        ),
        (
            ["recipes", "demo", "--to", "/proc/no/such/dir/demo.yaml"],
            "cannot write /proc/no/such/dir/demo.yaml",
        ),
        (["recipes", "nope"], "no built-in recipe 'nope'"),
    ]
    for command, message in cases:
        result = CliRunner().invoke(app, command, env={"COLUMNS": "300"})
        assert result.exit_code == 2, result.output
        assert message in result.output and "Traceback" not in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1, result.output
    assert not (tmp_path / "demo").exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("launcher", ["torchrun", "accelerate"])
def test_a_multi_process_launch_starts_and_stops_with_a_clear_message(tmp_path, recipe, launcher):
    """What a sharded run cannot do yet (GaLore) stops every rank before training, with what to change."""
    import subprocess
    import sys
    from pathlib import Path

    bin_dir = Path(sys.executable).parent
    cmd = {
        "torchrun": [str(bin_dir / "torchrun"), "--nproc_per_node", "2"],
        "accelerate": [str(bin_dir / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2"],
    }[launcher]
    done = subprocess.run(
        [*cmd, "-m", "tiertune.cli", "train", str(recipe), "method.type=galore"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    out = done.stdout + done.stderr
    assert done.returncode != 0
    # each rank stops before training; the launcher may kill the second before it prints
    assert "method.type: galore does not run sharded yet" in out
    assert not (tmp_path / "run").exists()  # nothing was trained
