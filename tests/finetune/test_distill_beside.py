"""Distillation with ``objective.top_k: 0``: the teacher beside the student in every step, over the whole
vocabulary (``finetune.teacher.TeacherBeside``): each step's loss against TRL's ``generalized_jsd_loss`` on the
two models' full logits, each model within its share of the budgets, the estimate's pricing of it."""

import json

import pytest
import torch

from tests.finetune.test_distill import OBJECTIVE, _recipe
from tiertune.config.recipe import load_recipe


@pytest.fixture(scope="module")
def models(cat_model):
    """A teacher (3 layers of 64) and a student (2 of 32) with the same tokenizer."""
    return cat_model(3, hidden=64), cat_model(2, hidden=32)


def _trl_loop(teacher_dir, student_dir, data_path, steps, batch, accum, o, lr):
    """A plain loop over the same batches (its losses and scored tokens a step): TRL's ``generalized_jsd_loss`` on the teacher's and the student's full
    logits (normalized by the step's scored tokens: TRL's ``num_items_in_batch``) plus ``alpha`` x the
    untempered cross-entropy, AdamW, clipping at 1 and the linear schedule as the run's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, get_scheduler
    from trl.experimental.gkd.gkd_trainer import GKDTrainer

    from tiertune.finetune.data import batches, load_data

    tok = AutoTokenizer.from_pretrained(student_dir)
    data = load_data(data_path, tok, "text", 32)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    student = AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(student.parameters(), lr=lr, weight_decay=0.0)
    sched = get_scheduler("linear", opt, num_warmup_steps=0, num_training_steps=steps)
    stream = batches(data, batch, tok.pad_token_id, shuffle=False, seed=0)
    losses, scored = [], []
    for _ in range(steps):
        micro = [next(stream) for _ in range(accum)]
        n = sum(int((mb["labels"][:, 1:] != -100).sum()) for mb in micro)
        total = 0.0
        for mb in micro:
            labels = mb["labels"][:, 1:]
            with torch.no_grad():
                t = teacher(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits[:, :-1]
            z = student(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits[:, :-1]
            kd = GKDTrainer.generalized_jsd_loss(
                z, t, labels, beta=o["beta"], temperature=o["temperature"], num_items_in_batch=n
            )
            ce = torch.nn.functional.cross_entropy(
                z.reshape(-1, z.shape[-1]), labels.reshape(-1), reduction="sum"
            )
            loss = o["alpha"] * ce / n + (1 - o["alpha"]) * kd
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(total)
        scored.append(n)
    return losses, scored


@pytest.mark.parametrize(
    "objective",
    [
        {"beta": 0.0, "temperature": 1.0, "alpha": 0.0},
        {"beta": 0.5, "temperature": 2.0, "alpha": 0.25},
        {"beta": 1.0, "temperature": 2.0, "alpha": 0.5},
    ],
    ids=["forward-kl", "jsd-t2", "reverse-kl-t2"],
)
def test_a_whole_vocabulary_run_is_trls_generalized_jsd_step_for_step(
    tmp_path, write_recipe, models, objective
):
    from tiertune.finetune.train import train

    o = {**objective, "top_k": 0}
    path = _recipe(tmp_path, write_recipe, models, **o)
    result = train(path, progress=False)
    records = [json.loads(line) for line in result.log_path.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert r["loss"] == pytest.approx(
            o["alpha"] * r["ce_loss"] + (1 - o["alpha"]) * r["kd_loss"], rel=1e-6
        )
        assert r["teacher_seconds"] > 0
    recipe = load_recipe(path)
    expected, scored = _trl_loop(
        models[0], models[1], recipe.data.path, 3, 2, 2, o, recipe.training.learning_rate
    )
    assert result.losses == pytest.approx(expected, rel=1e-5)
    passes = result.teacher_pass
    assert passes["waves"] == 3 and passes["wave_rows"] == 4  # a pass a step over its 2 x 2 rows
    assert passes["tokens"] == sum(scored)
    assert not (tmp_path / "run" / "teacher-topk").exists()  # nothing cached


def test_the_estimate_prices_the_teacher_beside_as_it_runs(tmp_path, write_recipe, models):
    from transformers import AutoConfig

    from tiertune.config.plan import plan
    from tiertune.estimates.report import estimate, format_estimate
    from tiertune.finetune.train import train
    from tiertune.settings import parse_size

    path = _recipe(
        tmp_path, write_recipe, models, top_k=0, teacher={"path": str(models[0]), "dtype": "float32"}
    )
    recipe = load_recipe(
        path, ["offload.params=disk", "offload.host_budget=64MiB", "offload.device_budget=64MiB"]
    )
    store, _ = plan(recipe)  # the student's store within half the budgets (the teacher's the other half)
    assert (store.host_budget, store.device_budget) == (parse_size("32MiB"), parse_size("32MiB"))
    est = estimate(recipe, gpu="cpu", measure=False)
    planned = est.teacher
    assert planned.beside and planned.cache_bytes == 0 and planned.wave_rows == 4
    ran = train(recipe, progress=False).teacher_pass
    # the teacher's passes replayed on its own ledger store: its weights at most once a step, what its half of the
    # budgets keeps staying (here all of it: the first step reads them, the later ones nothing), as its store read
    assert planned.pass_bytes is not None and planned.pass_bytes[0] >= planned.weight_bytes * 0.9
    assert planned.read_bytes == pytest.approx(ran["disk_bytes"], rel=0.02)
    config = AutoConfig.from_pretrained(models[0])
    assert planned.head_bytes == config.vocab_size * config.hidden_size * 4
    text = format_estimate(est, "distill")
    assert "teacher beside the student" in text and "teacher cache" not in text
    assert est.as_json()["teacher_pass"]["beside"] is True


@pytest.mark.parametrize("method", ["full", "lora"])
def test_a_run_killed_mid_way_resumes_as_an_uninterrupted_one(tmp_path, write_recipe, models, method):
    """kill -9 as the teacher scores the third step (``tests/signalling.py``): the resumed run's steps after its
    checkpoint, the teacher beside them again, are an uninterrupted run's."""
    import signal

    from tests.signalling import killed_run
    from tiertune.finetune.train import train

    def recipe(where):
        where.mkdir()
        return write_recipe(
            where,
            models[1],
            objective={**OBJECTIVE, "top_k": 0, "teacher": {"path": str(models[0]), "dtype": "float32"}},
            data={"shuffle": False, "max_seq_len": 32},
            method={"type": method, "lora": {"r": 4, "dropout": 0.0}},
            training={
                "max_steps": 4,
                "per_device_train_batch_size": 2,
                "gradient_accumulation_steps": 2,
                "learning_rate": 1e-2,
                "max_grad_norm": 1.0,
                "save_steps": 1,
            },
        )

    killed, clean = recipe(tmp_path / "killed"), recipe(tmp_path / "clean")
    stamp = tmp_path / "killed-at"
    at = "tiertune.finetune.teacher:TeacherBeside.figures:3"
    proc = killed_run(at, killed, stamp)
    assert proc.returncode == -signal.SIGKILL and stamp.exists(), proc.stderr[-2000:]
    resumed = train(load_recipe(killed, ["training.resume_from_checkpoint=auto"]), progress=False)
    assert resumed.first_step in (2, 3)  # after checkpoint-1 or checkpoint-2 (written behind the steps)
    assert resumed.teacher_pass["waves"] == 4 - resumed.first_step + 1  # no pass for the batches skipped
    whole = train(clean, progress=False)
    assert resumed.losses == pytest.approx(whole.losses[resumed.first_step - 1 :], rel=1e-6)


@pytest.mark.parametrize("top_k", [8, 0])
def test_a_qlora_student_learns_from_an_nf4_teacher(tmp_path, write_recipe, models, top_k):
    """QLoRA: the student's base and the teacher both NF4 (quantized on load), homed on disk; the run trains its
    adapters, logs both terms and reads the teacher's weights at NF4's size (0.12-0.15 of fp32's here)."""
    from tiertune.finetune.train import train

    def run(name, quantize):
        where = tmp_path / name
        where.mkdir()
        path = write_recipe(
            where,
            models[1],
            model={"path": str(models[1]), "dtype": "float32", "quantize": "nf4"},
            method={"type": "lora", "lora": {"r": 4, "dropout": 0.0}},
            objective={
                **OBJECTIVE,
                "top_k": top_k,
                "teacher": {"path": str(models[0]), "dtype": "float32", "quantize": quantize, "wave_size": 4},
            },
            data={"shuffle": False, "max_seq_len": 32},
            training={"max_steps": 2, "per_device_train_batch_size": 2, "save_steps": 0},
            offload={"params": "disk"},
        )
        return train(path, progress=False)

    quantized, plain = run("nf4", "nf4"), run("fp32", "none")
    records = [json.loads(line) for line in quantized.log_path.read_text().splitlines()]
    for r in records:
        assert r["loss"] == pytest.approx(0.25 * r["ce_loss"] + 0.75 * r["kd_loss"], rel=1e-6)
    assert (quantized.output_dir / "adapter_model.safetensors").is_file()
    read, full = quantized.teacher_pass["disk_bytes"], plain.teacher_pass["disk_bytes"]
    assert 0 < read < full / 3  # the decoder layers' weights at 4 bits and a scale a block, the rest fp32
    # the divergence is from the quantized teacher: close to the fp32 teacher's, not the same
    assert records[0]["kd_loss"] != pytest.approx(
        json.loads(plain.log_path.read_text().splitlines()[0])["kd_loss"], rel=1e-6
    )
