"""Distillation with ``objective.top_k: 0``: the teacher beside the student in every step, over the whole
vocabulary (``finetune.teacher.TeacherBeside``): each step's loss against TRL's ``generalized_jsd_loss`` on the
two models' full logits, each model within its share of the budgets, the estimate's pricing of it."""

import json

import pytest
import torch

from tests.finetune.test_distill import _recipe
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
