"""export (a run or checkpoint as a model or adapter) and merge (an adapter folded into its base)."""

import json
from pathlib import Path

import pytest
import torch

from tiertune.errors import ConfigError
from tiertune.export.commands import export, merge
from tiertune.finetune.train import train


@pytest.fixture(scope="module")
def model_dir(cat_model):
    return cat_model(2)


@pytest.fixture
def run(tmp_path, model_dir, write_recipe):
    """Train the tiny model 4 steps (checkpoints at 2) with ``overrides``; returns the TrainResult."""
    path = write_recipe(
        tmp_path,
        model_dir,
        training={"max_steps": 4, "learning_rate": "3e-3", "save_steps": 2, "report_to": "none"},
        offload={"params": "disk"},
        method={"lora": {"r": 4, "dropout": 0.0}},
    )
    return lambda *overrides: train(path, overrides, progress=False)


def _logits(model):
    with torch.no_grad():
        return model(torch.tensor([[3, 4, 5, 6, 7]])).logits


def test_a_checkpoint_exports_as_the_model_of_its_step(tmp_path, run):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    result = run()
    checkpoint = result.output_dir / "checkpoint-2"
    out, what = export(checkpoint, tmp_path / "exported")
    assert "step 2" in what
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    saved = {}  # the weight chunks (moments and master weights have the same tensor names in other files)
    for f in (checkpoint / "state").glob("*.safetensors"):
        if not f.stem.endswith((".exp_avg", ".exp_avg_sq", ".master", ".proj")):
            saved.update(load_file(f))
    state = model.state_dict()
    assert saved and all(torch.equal(state[name], value) for name, value in saved.items())
    final = AutoModelForCausalLM.from_pretrained(result.output_dir, dtype=torch.float32)
    assert not torch.equal(_logits(model), _logits(final))  # step 2, not the end
    with pytest.raises(ConfigError, match="export it as hf"):
        export(checkpoint, tmp_path / "x", "peft")


@pytest.mark.parametrize("quantize", ["none", "nf4"])
def test_merge_folds_the_adapter_into_its_base(tmp_path, model_dir, run, quantize):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tiertune.quant import make_quantizer

    result = run("method.type=lora", f"model.quantize={quantize}")
    adapter, what = export(result.output_dir, tmp_path / "adapter")
    assert "PEFT adapter" in what and (adapter / "adapter_config.json").is_file()
    out, what = merge(result.output_dir, tmp_path / "merged", dtype="float32")
    assert ("dequantized nf4" in what) == (quantize == "nf4")
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    quant = make_quantizer(quantize, torch.float32)
    kwargs = {} if quant is None else {"quantization_config": quant.config()}
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, device_map="cpu", **kwargs)
    peft_model = PeftModel.from_pretrained(base, result.output_dir)
    peft_model.train()  # bitsandbytes' CPU eval path computes in bf16; the training path is fp32 (no dropout here)
    # the merged weights are the (dequantized) base plus the adapter: the same function as base + adapter
    torch.testing.assert_close(_logits(merged), _logits(peft_model), rtol=1e-4, atol=1e-4)
    assert not any("lora" in n for n in merged.state_dict())


def _dtypes(model_dir):
    from safetensors import safe_open

    with safe_open(model_dir / "model.safetensors", "pt") as f:
        return {f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118 (a safe_open has no __iter__)


def test_merge_writes_the_base_models_dtype_unless_told_otherwise(tmp_path, run):
    from typer.testing import CliRunner

    from tiertune.cli.app import app

    result = run("method.type=lora")
    merged = CliRunner().invoke(app, ["merge", str(result.output_dir), "--out", str(tmp_path / "merged")])
    assert merged.exit_code == 0, merged.output
    assert _dtypes(tmp_path / "merged") == {"F32"}  # the base is fp32
    assert "written in float32, the base model's dtype" in " ".join(merged.output.split())
    asked = CliRunner().invoke(
        app, ["merge", str(result.output_dir), "--out", str(tmp_path / "bf16"), "--dtype", "bfloat16"]
    )
    assert asked.exit_code == 0, asked.output
    assert _dtypes(tmp_path / "bf16") == {"BF16"} and "written in bfloat16" in asked.output


def test_base_dtype_is_the_configs_else_the_weights(tmp_path, model_dir):
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from tiertune.export.commands import base_dtype

    assert base_dtype(model_dir)[0] == "float32"
    copy = tmp_path / "base"
    shutil.copytree(model_dir, copy)
    config = json.loads((copy / "config.json").read_text())
    config.pop("dtype", None), config.pop("torch_dtype", None)
    (copy / "config.json").write_text(json.dumps(config))
    weights = load_file(copy / "model.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in weights.items()}, copy / "model.safetensors")
    assert base_dtype(copy) == ("bfloat16", "its safetensors weights")


def test_a_lora_run_and_its_merge_emit_no_future_warning(tmp_path, run):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run("method.type=lora")
        merge(result.output_dir, tmp_path / "merged")
    assert [str(w.message) for w in caught if issubclass(w.category, FutureWarning)] == []


# ---------------------------------------------------------------- faults around export (issue 26)


def _full_run(tmp_path, model_dir, write_recipe):
    path = write_recipe(
        tmp_path,
        model_dir,
        name="full",
        training={"max_steps": 4, "learning_rate": "3e-3", "save_steps": 2, "report_to": "none"},
    )
    return train(path, progress=False)


def _cli(*args):
    from typer.testing import CliRunner

    from tiertune.cli.app import app

    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "300"})


def _flip(path, at=-16):
    data = bytearray(path.read_bytes())
    for k in range(4):
        data[at + k] ^= 0xFF
    path.write_bytes(bytes(data))


def test_export_verifies_the_checkpoint_first(tmp_path, model_dir, write_recipe):
    """4 flipped bytes in a weight file, a state file swapped for another checkpoint's, an edited index, a
    truncated recipe.yaml: each is exit 2 naming the file, and nothing is written (before: exit 0 and a model
    that is not the checkpoint's)."""
    import shutil

    result = _full_run(tmp_path, model_dir, write_recipe)
    run_dir = result.output_dir
    cases = {}
    flipped = tmp_path / "flipped"
    shutil.copytree(run_dir, flipped)
    _flip(flipped / "checkpoint-4" / "state" / "model.layers.1.safetensors")
    cases["flipped"] = (flipped, "state/model.layers.1.safetensors does not match its checksum")
    swapped = tmp_path / "swapped"
    shutil.copytree(run_dir, swapped)
    shutil.copy(swapped / "checkpoint-2" / "state" / "embed.safetensors", swapped / "checkpoint-4" / "state")
    cases["swapped"] = (swapped, "state/embed.safetensors does not match its checksum")
    edited = tmp_path / "edited"
    shutil.copytree(run_dir, edited)
    index = edited / "checkpoint-4" / "state" / "index.json"
    index.write_text(index.read_text().replace('"shape": [', '"shape": [2, ', 1))
    cases["edited index"] = (edited, "state/index.json has")
    cut = tmp_path / "cut-recipe"  # read before the checksums: its damage is named, not a YAML error
    shutil.copytree(run_dir, cut)
    recipe = cut / "checkpoint-4" / "recipe.yaml"
    text = recipe.read_bytes()
    recipe.write_bytes(text[: text.index(b"\n  ", len(text) // 2) + 4])  # mid-key: not YAML any more
    cases["cut recipe"] = (cut, "recipe.yaml has")
    for name, (run, message) in cases.items():
        out = tmp_path / f"out-{name}"
        done = _cli("export", run / "checkpoint-4", "--out", out)
        assert done.exit_code == 2, (name, done.output)
        assert message in done.output and "damaged" in done.output, (name, done.output)
        assert "Traceback" not in done.output and len(done.output.strip().splitlines()) == 1
        assert not out.exists() and not list(tmp_path.glob(f".out-{name}*"))


def test_an_edited_index_that_passes_its_checksums_is_refused(tmp_path, model_dir, write_recipe):
    """An index whose moment pieces point at the other moment's files (checksums recomputed by hand) would resume
    a step on the wrong state, or export the wrong tensors: refused naming the index (IntegrityError, exit 2)."""
    from tiertune.errors import IntegrityError
    from tiertune.finetune.checkpoint import CHECKSUMS, write_checksums
    from tiertune.finetune.state_index import StateReader

    result = _full_run(tmp_path, model_dir, write_recipe)
    checkpoint = result.output_dir / "checkpoint-4"
    index_file = checkpoint / "state" / "index.json"
    original = index_file.read_text()
    edits = {
        "moment read from the other moment's file": lambda key, p: (
            p.__setitem__(0, p[0].replace(".exp_avg.", ".exp_avg_sq."))
            if key.startswith("exp_avg/")
            else None
        ),
        "weight read from a moment's file": lambda key, p: (
            p.__setitem__(0, p[0].replace(".safetensors", ".exp_avg.safetensors"))
            if key.startswith("weights/")
            else None
        ),
        "a file outside the state directory": lambda key, p: (
            p.__setitem__(0, "../" + p[0]) if key.startswith("weights/") else None
        ),
        "a piece naming another tensor": lambda key, p: (
            p.__setitem__(1, "lm_head.weight") if key == "weights/model.embed_tokens.weight" else None
        ),
    }
    for name, edit in edits.items():
        index = json.loads(original)
        for key, entry in index["tensors"].items():
            for piece in entry["pieces"]:
                edit(key, piece)
        index_file.write_text(json.dumps(index))
        (checkpoint / CHECKSUMS).unlink()
        write_checksums(checkpoint)
        with pytest.raises(IntegrityError, match="index.json: .*the checkpoint is damaged"):
            StateReader(checkpoint, {})
        done = _cli("export", checkpoint, "--out", tmp_path / "out")
        assert done.exit_code == 2 and "index.json" in done.output, (name, done.output)
        resumed = _cli(
            "train",
            result.output_dir / "recipe.yaml",
            f"training.resume_from_checkpoint={checkpoint}",
            "training.max_steps=6",
            "-q",
        )
        assert resumed.exit_code == 2 and "index.json" in resumed.output, (name, resumed.output)
    # a piece whose stored tensor is not what the index says (dtype or size) is found when it is read
    index = json.loads(original)
    piece = index["tensors"]["weights/lm_head.weight"]["pieces"][0]
    index["tensors"]["weights/lm_head.weight"]["dtype"] = "bfloat16"
    index_file.write_text(json.dumps(index))
    (checkpoint / CHECKSUMS).unlink()
    write_checksums(checkpoint)
    done = _cli("export", checkpoint, "--out", tmp_path / "out")
    assert done.exit_code == 2 and f"{piece[1]} is F32" in done.output, done.output


def test_export_never_writes_over_a_model_or_a_run(tmp_path, model_dir, write_recipe):
    """--out over an earlier export, a run, the recipe's model.path or the run itself is refused (exit 2, nothing
    changed); --overwrite replaces an earlier export or another run whole, never model.path nor the run exported."""
    import hashlib

    def digest(directory):
        return {
            p.relative_to(directory): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*"))
            if p.is_file()
        }

    result = _full_run(tmp_path, model_dir, write_recipe)
    run_dir, checkpoint = result.output_dir, result.output_dir / "checkpoint-2"
    other = train(
        write_recipe(
            tmp_path,
            model_dir,
            name="other",
            training={"max_steps": 1, "output_dir": str(tmp_path / "other")},
        ),
        progress=False,
    ).output_dir
    assert _cli("export", checkpoint, "--out", tmp_path / "first").exit_code == 0
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    before = {p: digest(p) for p in (model_dir, run_dir, other, tmp_path / "first", tmp_path / "notes")}
    refused = {
        tmp_path / "first": "holds a model; choose a new or empty directory, or pass --overwrite",
        other: "holds a tiertune run",
        model_dir: "is the model the run trained (model.path)",
        model_dir / "sub": "is inside the model the run trained (model.path)",
        run_dir: "is the run being exported",
        tmp_path / "notes": "holds files that are neither a model nor a run (todo.txt)",
    }
    for out, message in refused.items():
        done = _cli("export", checkpoint, "--out", out)
        assert done.exit_code == 2 and message in done.output, (out, done.output)
    for out in (model_dir, run_dir, run_dir / "checkpoint-4", tmp_path, tmp_path / "notes"):
        done = _cli("export", checkpoint, "--out", out, "--overwrite")
        assert done.exit_code == 2, (out, done.output)
    assert {p: digest(p) for p in before} == before  # nothing changed
    for out in (tmp_path / "first", other):  # replaced whole, by the model of step 2
        done = _cli("export", checkpoint, "--out", out, "--overwrite")
        assert done.exit_code == 0, done.output
        assert sorted(p.name for p in out.iterdir()) == [
            "config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
        ]
    assert digest(tmp_path / "first")[Path("model.safetensors")] == digest(other)[Path("model.safetensors")]


def test_export_to_a_full_disk_leaves_nothing(tmp_path, model_dir, write_recipe, monkeypatch):
    """The filesystem fills while the weights are written: exit 2 saying so, and neither --out nor a partial
    directory beside it (before: a SafetensorError traceback and a config.json, the file that marks a model
    complete, left in --out)."""
    import errno
    import shutil

    import safetensors.torch

    result = _full_run(tmp_path, model_dir, write_recipe)

    def full(src, dst, *args, **kwargs):  # half the file written, then the disk is full
        if str(src).endswith(".safetensors") or isinstance(src, dict):
            Path(dst).write_bytes(b"\0" * 100)
            raise OSError(errno.ENOSPC, "No space left on device")
        return copy2(src, dst, *args, **kwargs)

    copy2 = shutil.copy2
    monkeypatch.setattr(safetensors.torch, "save_file", full)
    monkeypatch.setattr(shutil, "copy2", full)
    for source in (result.output_dir / "checkpoint-4", result.output_dir):
        out = tmp_path / "exports" / "model"
        done = _cli("export", source, "--out", out)
        assert done.exit_code == 2, done.output
        assert "no room to write" in done.output and "Traceback" not in done.output, done.output
        assert not out.exists() and list((tmp_path / "exports").iterdir()) == []


def test_merge_never_writes_over_its_base_or_another_model(tmp_path, model_dir, run):
    result = run("method.type=lora")
    assert _cli("export", result.output_dir, "--out", tmp_path / "adapter").exit_code == 0
    for out, message in [
        (model_dir, "is the base model"),
        (result.output_dir, "is the adapter"),
        (tmp_path / "adapter", "holds a model"),
    ]:
        done = _cli("merge", result.output_dir, "--out", out)
        assert done.exit_code == 2 and message in done.output, done.output
    assert _cli("merge", result.output_dir, "--out", tmp_path / "adapter", "--overwrite").exit_code == 0
    assert (tmp_path / "adapter" / "model.safetensors").is_file()
    assert not (tmp_path / "adapter" / "adapter_config.json").exists()  # replaced whole


# ---------------------------------------------------------------- serving (issue 32)


def test_a_peft_export_says_how_vllm_serves_it_or_why_it_will_not(tmp_path, run):
    from tiertune.export.serving import vllm_notes

    result = run("method.type=lora", "method.lora.r=32")
    printed = _cli("export", result.output_dir, "--format", "peft", "--out", tmp_path / "adapter")
    assert printed.exit_code == 0, printed.output
    assert "vLLM: rank 32 is above its default --max-lora-rank (16)" in printed.output
    assert f"--lora-modules adapter={tmp_path / 'adapter'} --max-lora-rank 32" in printed.output
    base = "base"
    assert vllm_notes({"r": 16}, base, Path("a")) == [
        "vLLM: vllm serve base --enable-lora --lora-modules adapter=a"
    ]
    assert "--max-lora-rank 64" in vllm_notes({"r": 16, "rank_pattern": {"q_proj": 48}}, base, Path("a"))[0]
    for config, what in (
        ({"r": 8, "use_dora": True}, "DoRA"),
        ({"r": 8, "modules_to_save": ["lm_head"]}, "modules_to_save (lm_head)"),
    ):
        (note,) = vllm_notes(config, base, Path("a"))
        assert f"vLLM does not load adapters with {what}" in note and "--format hf" in note
    assert "up to 512" in vllm_notes({"r": 1024}, base, Path("a"))[0]


def test_a_lora_runs_hf_export_is_the_streamed_merge(tmp_path, run):
    result = run("method.type=lora")
    out, what = export(result.output_dir, tmp_path / "hf", "hf")
    assert (
        what.startswith("Hugging Face model: the adapter added to the weights of") and "in memory" not in what
    )
    merged, _ = merge(result.output_dir, tmp_path / "merged")
    from safetensors.torch import load_file

    exported, reference = load_file(out / "model.safetensors"), load_file(merged / "model.safetensors")
    assert exported.keys() == reference.keys() and all(
        torch.equal(exported[k], reference[k]) for k in reference
    )
