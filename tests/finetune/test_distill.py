"""Distillation (``objective.type: distill``): the fused divergence against TRL's ``generalized_jsd_loss`` and its
own unfused oracle, the teacher pass's top-k and its cache (resumed after a stop mid-pass), and a run's every
step against a plain loop over the same teacher figures."""

import json
import math

import pytest
import torch

from tests.conftest import CAT_TEXTS
from tiertune.config.recipe import load_recipe
from tiertune.errors import ConfigError
from tiertune.kernels.ops.distill import (
    Full,
    TopK,
    linear_distill,
    linear_distill_reference,
    logits_distill,
    topk_logprobs,
)

BETAS = (0.0, 0.5, 1.0)
TEMPERATURES = (1.0, 2.0)


def _head(seed=0, tokens=37, hidden=16, vocab=50, teacher_hidden=24):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).requires_grad_()
    weight = torch.randn(vocab, hidden, generator=g).requires_grad_()
    bias = torch.randn(vocab, generator=g).requires_grad_()
    teacher = Full(
        torch.randn(tokens, teacher_hidden, generator=g), torch.randn(vocab, teacher_hidden, generator=g)
    )
    target = torch.randint(0, vocab, (tokens,), generator=g)
    target[3] = -100
    return x, weight, bias, teacher, target


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_the_whole_vocabulary_divergence_is_trls_generalized_jsd(beta, temperature):
    from trl.experimental.gkd.gkd_trainer import GKDTrainer

    x, weight, bias, teacher, target = _head()
    n = len(x)
    ones = torch.ones(n)
    total, ce, kd = linear_distill(
        x, weight, target, teacher, torch.zeros(n), ones / n, beta, temperature, bias, chunk_tokens=7
    )
    student_logits = (x @ weight.T + bias).unsqueeze(0)
    teacher_logits = (teacher.hidden @ teacher.weight.T).unsqueeze(0)
    labels = torch.zeros(1, n, dtype=torch.long)  # every token scored: TRL's mean over them
    trl = GKDTrainer.generalized_jsd_loss(
        student_logits, teacher_logits, labels, beta=beta, temperature=temperature
    )
    assert float(total) == pytest.approx(float(trl), rel=1e-5)
    assert float(kd.mean()) == pytest.approx(float(trl), rel=1e-5)
    # the cross-entropy term is the untempered one
    expected_ce = torch.nn.functional.cross_entropy(
        student_logits[0], target, ignore_index=-100, reduction="none"
    )
    torch.testing.assert_close(ce, expected_ce.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("top_k", [0, 5])
def test_the_fused_op_and_its_gradients_are_the_unfused_oracles(beta, temperature, softcap, top_k):
    x, weight, bias, full, target = _head(seed=1)
    teacher = full if top_k == 0 else topk_logprobs(full.hidden, full.weight, top_k, temperature)
    n = len(x)
    ce_w, kd_w = torch.full((n,), 0.3 / n), torch.full((n,), 0.7 / n)
    inputs = (x, weight, bias)
    total, _, _ = linear_distill(x, weight, target, teacher, ce_w, kd_w, beta, temperature, bias, softcap, 7)
    grads = torch.autograd.grad(total, inputs)
    oracle = linear_distill_reference(
        x, weight, target, teacher, ce_w, kd_w, beta, temperature, bias, softcap
    )
    expected = torch.autograd.grad(oracle, inputs)
    assert float(total) == pytest.approx(float(oracle), rel=1e-5)
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_the_top_k_divergence_is_the_full_one_restricted_to_the_k_tokens_and_the_tail():
    x, weight, bias, full, target = _head(seed=2)
    k, temperature, beta = 6, 2.0, 0.5
    teacher = topk_logprobs(full.hidden, full.weight, k, temperature)
    n = len(x)
    _, _, kd = linear_distill(
        x, weight, target, teacher, torch.zeros(n), torch.ones(n), beta, temperature, bias
    )
    # by hand, from the teacher's full logits: its top-k and the rest of its mass as one bucket, the student's
    # log-probabilities of the same tokens and of all others as one bucket
    t = torch.log_softmax(full.hidden @ full.weight.T / temperature, -1)
    s = torch.log_softmax((x @ weight.T + bias) / temperature, -1).detach()
    top = t.topk(k, -1).indices
    rest = torch.ones_like(t, dtype=torch.bool).scatter_(1, top, False)
    p = torch.cat([t.gather(1, top).exp(), (t.exp() * rest).sum(1, keepdim=True)], 1)
    q = torch.cat([s.gather(1, top).exp(), (s.exp() * rest).sum(1, keepdim=True)], 1)
    m = 0.5 * p + 0.5 * q
    expected = 0.5 * (p * (p / m).log()).sum(1) + 0.5 * (q * (q / m).log()).sum(1)
    torch.testing.assert_close(kd, expected, rtol=1e-4, atol=1e-6)


def test_the_teachers_top_k_keeps_its_largest_and_the_rest_of_its_mass():
    _, _, _, full, _ = _head(seed=3)
    topk = topk_logprobs(full.hidden, full.weight, 4, 1.5, chunk_tokens=5, vocab_limit=45)
    logps = torch.log_softmax(full.hidden @ full.weight.T / 1.5, -1)
    values, ids = logps[:, :45].topk(4, -1)
    assert torch.equal(topk.ids, ids.int())
    torch.testing.assert_close(topk.logps, values)
    # the tail holds every other token, the teacher's beyond the student's vocabulary too
    torch.testing.assert_close(topk.tail.exp() + topk.logps.exp().sum(1), torch.ones(len(ids)))
    with pytest.raises(ValueError, match="top_k"):
        topk_logprobs(full.hidden, full.weight, 50, 1.0)


# ---------------------------------------------------------------- runs


@pytest.fixture(scope="module")
def models(cat_model):
    """A teacher (3 layers of 64) and a student (2 of 32) with the same tokenizer."""
    return cat_model(3, hidden=64), cat_model(2, hidden=32)


OBJECTIVE = {"type": "distill", "beta": 0.5, "temperature": 2.0, "top_k": 8, "alpha": 0.25}


def _recipe(tmp_path, write_recipe, models, **objective):
    teacher, student = models
    return write_recipe(
        tmp_path,
        student,
        objective={**OBJECTIVE, "teacher": {"path": str(teacher), "dtype": "float32"}, **objective},
        data={"shuffle": False, "max_seq_len": 32},
        training={
            "max_steps": 3,
            "per_device_train_batch_size": 2,
            "gradient_accumulation_steps": 2,
            "learning_rate": 1e-2,
            "max_grad_norm": 1.0,
            "save_steps": 0,
        },
    )


def _plain(teacher_dir, student_dir, data_path, steps, batch, accum, o, lr):
    """A plain loop over the same batches: the teacher's top-k from its own logits, the student's loss from its
    logits (``logits_distill``), AdamW and the linear schedule as the run's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, get_scheduler

    from tiertune.finetune.data import batches, load_data

    tok = AutoTokenizer.from_pretrained(student_dir)
    data = load_data(data_path, tok, "text", 32)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32)
    student = AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(student.parameters(), lr=lr, weight_decay=0.0)
    sched = get_scheduler("linear", opt, num_warmup_steps=0, num_training_steps=steps)
    stream = batches(data, batch, tok.pad_token_id, shuffle=False, seed=0)
    losses = []
    for _ in range(steps):
        micro = [next(stream) for _ in range(accum)]
        n = sum(int((mb["labels"][:, 1:] != -100).sum()) for mb in micro)
        total = 0.0
        for mb in micro:
            scored = mb["labels"][:, 1:].reshape(-1) != -100
            target = mb["labels"][:, 1:].reshape(-1)[scored]
            with torch.no_grad():
                t = teacher(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits
                t = torch.log_softmax(t[:, :-1].reshape(-1, t.shape[-1])[scored] / o["temperature"], -1)
                values, ids = t.topk(o["top_k"], -1)
                tail = torch.logsumexp(t.scatter(1, ids, float("-inf")), -1)
            z = student(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits
            z = z[:, :-1].reshape(-1, z.shape[-1])[scored].float()
            m = len(target)
            loss, _, _ = logits_distill(
                z,
                target,
                TopK(ids, values, tail),
                torch.full((m,), o["alpha"]),
                torch.full((m,), 1 - o["alpha"]),
                o["beta"],
                o["temperature"],
            )
            (loss / n).backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(total / n)
    return losses


def test_a_distillation_run_is_the_plain_loops_step_for_step(tmp_path, write_recipe, models):
    from tiertune.finetune.train import train

    path = _recipe(tmp_path, write_recipe, models)
    result = train(path, progress=False)
    records = [json.loads(line) for line in result.log_path.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:  # loss = alpha ce + (1 - alpha) kd, each a mean over the step's scored tokens
        assert r["loss"] == pytest.approx(0.25 * r["ce_loss"] + 0.75 * r["kd_loss"], rel=1e-6)
    recipe = load_recipe(path)
    expected = _plain(
        models[0], models[1], recipe.data.path, 3, 2, 2, OBJECTIVE, recipe.training.learning_rate
    )
    assert result.losses == pytest.approx(expected, rel=1e-5)
    assert result.teacher_pass["rows"] == len(CAT_TEXTS) and result.teacher_pass["tokens"] > 0
    # a second run reads the teacher's figures from the cache
    again = train(load_recipe(path, ["training.overwrite_output_dir=true"]), progress=False)
    assert again.teacher_pass["rows"] == 0
    assert again.losses == result.losses


def test_a_teacher_pass_stopped_mid_way_continues_from_its_last_wave(tmp_path, write_recipe, models):
    from transformers import AutoTokenizer

    from tiertune.finetune.data import load_data
    from tiertune.finetune.teacher import teacher_figures

    recipe = load_recipe(
        _recipe(tmp_path, write_recipe, models, teacher={"path": str(models[0]), "wave_size": 2})
    )
    tok = AutoTokenizer.from_pretrained(models[1])
    data = load_data(recipe.data.path, tok, "text", 32)
    whole, stats = teacher_figures(recipe, data, tok.pad_token_id, len(tok))
    assert stats.waves == -(-len(data) // 2)
    for path in whole.directory.glob("wave-*"):
        path.unlink()

    class Stop(Exception):
        pass

    calls = {"n": 0}

    def stop_in_the_third_wave():
        calls["n"] += 1
        if calls["n"] > 2 * 6:  # each wave: its micro-batches' prefix, then each of the 3 layers
            raise Stop

    with pytest.raises(Stop):
        teacher_figures(recipe, data, tok.pad_token_id, len(tok), safe_point=stop_in_the_third_wave)
    kept = sorted(p.name for p in whole.directory.glob("wave-*.safetensors"))
    assert 0 < len(kept) < stats.waves and not list(whole.directory.glob(".*tmp"))
    resumed, again = teacher_figures(recipe, data, tok.pad_token_id, len(tok))
    assert again.rows == len(data) - 2 * len(kept)
    every = list(range(len(data)))
    for got, want in zip(resumed.of(every), whole.of(every), strict=True):
        assert torch.equal(got, want)


def test_a_teacher_with_another_tokenizer_is_refused_before_any_weight_is_read(
    tmp_path, write_recipe, models
):
    from tiertune.cli.demo import make_model
    from tiertune.finetune.train import train

    other = make_model(tmp_path / "other", ["a b c d", "e f g h"], 1, 32)
    path = _recipe(tmp_path, write_recipe, models, teacher={"path": str(other)})
    with pytest.raises(ConfigError, match="another tokenizer"):
        train(path, progress=False)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("setting", "says"),
    [
        ({"beta": 1.5}, "objective.beta"),
        ({"temperature": 0}, "objective.temperature"),
        ({"top_k": -1}, "objective.top_k"),
        ({"alpha": 2}, "objective.alpha"),
        ({"teacher": {"path": ""}}, "objective.teacher.path"),
        ({"teacher": {"path": "x", "quantize": "nf5"}}, "objective.teacher.quantize"),
    ],
)
def test_a_distillation_recipe_that_cannot_run_says_what_to_change(
    tmp_path, write_recipe, models, setting, says
):
    with pytest.raises(ConfigError, match=says.replace(".", r"\.")):
        load_recipe(_recipe(tmp_path, write_recipe, models, **setting))


def test_the_objectives_shared_settings_take_their_types_defaults():
    from tiertune.settings import ObjectiveSettings

    assert ObjectiveSettings(type="distill").beta == 0.5
    assert ObjectiveSettings(type="dpo").beta == 0.1
    assert ObjectiveSettings(type="distill", beta=0.0).beta == 0.0


def test_the_estimate_prices_the_teacher_pass_as_it_runs(tmp_path, write_recipe, models):
    from transformers import AutoTokenizer

    from tiertune.estimates.report import estimate, format_estimate
    from tiertune.finetune.data import load_data
    from tiertune.finetune.teacher import teacher_figures

    path = _recipe(
        tmp_path, write_recipe, models, teacher={"path": str(models[0]), "dtype": "float32", "wave_size": 4}
    )
    recipe = load_recipe(path, ["offload.params=disk"])
    est = estimate(recipe, gpu="cpu", measure=False)
    planned = est.teacher
    tok = AutoTokenizer.from_pretrained(models[1])
    data = load_data(recipe.data.path, tok, "text", 32)
    cache, ran = teacher_figures(recipe, data, tok.pad_token_id, len(tok))
    assert (planned.rows, planned.scored_tokens, planned.wave_rows) == (len(data), ran.tokens, ran.wave_rows)
    assert planned.waves == ran.waves
    # the weights once a wave, as the pass read them (its store's reads from disk)
    assert planned.read_bytes == pytest.approx(ran.disk_bytes, rel=0.02)
    held = sum(t.numel() * t.element_size() for t in cache.of(list(range(len(data)))))
    assert planned.cache_bytes == held == cache.disk_bytes
    text = format_estimate(est, "distill")
    assert "teacher pass:" in text and "teacher cache:" in text and "teacher reads a scored token" in text
    at = est.as_json()["teacher_pass"]["bytes_per_token_at_wave"]
    assert at["4"] == pytest.approx(planned.bytes_per_token, rel=1e-3)
    # the first wave reads the weights, a later one what the budgets do not keep (here nothing: they hold it all)
    assert planned.pass_bytes == (planned.read_bytes, 0, 0) and ran.disk_bytes == planned.read_bytes
    assert at["1"] == at["4"] == at["64"]
    assert est.as_json()["teacher_pass"]["bytes_per_token"] == pytest.approx(
        ran.disk_bytes / ran.tokens, rel=0.02
    )


def test_a_run_killed_during_its_teacher_pass_continues_it_and_trains_as_an_uninterrupted_one(
    tmp_path, write_recipe, models
):
    """kill -9 as the teacher pass writes its second wave (``tests/signalling.py``): the next run reads the
    first from the cache, scores the rest, and its losses are an uninterrupted run's."""
    import signal

    from tests.signalling import killed_run
    from tiertune.finetune.train import train

    teacher = {"path": str(models[0]), "dtype": "float32", "wave_size": 2}
    killed_dir, clean_dir = tmp_path / "killed", tmp_path / "clean"
    killed_dir.mkdir()
    clean_dir.mkdir()
    path = _recipe(killed_dir, write_recipe, models, teacher=teacher)
    stamp = killed_dir / "killed-at"
    at = "tiertune.finetune.teacher:TeacherCache.write:2"
    proc = killed_run(at, path, stamp)
    assert proc.returncode == -signal.SIGKILL and stamp.exists(), proc.stderr[-2000:]
    resumed = train(load_recipe(path, ["training.overwrite_output_dir=true"]), progress=False)
    rows = len(CAT_TEXTS)
    assert resumed.teacher_pass["rows"] == rows - 2  # the first wave of 2 rows was kept
    clean = train(_recipe(clean_dir, write_recipe, models, teacher=teacher), progress=False)
    assert clean.teacher_pass["rows"] == rows
    assert resumed.losses == clean.losses


def test_packed_rows_carry_their_teachers_figures_and_train(tmp_path, write_recipe, models):
    from transformers import AutoTokenizer

    from tiertune.finetune.data import batches, load_data
    from tiertune.finetune.teacher import teacher_figures, with_teacher
    from tiertune.finetune.train import train

    path = _recipe(tmp_path, write_recipe, models)
    recipe = load_recipe(path, ["data.packing=true"])
    tok = AutoTokenizer.from_pretrained(models[1])
    data = load_data(recipe.data.path, tok, "text", 32)
    cache, _ = teacher_figures(recipe, data, tok.pad_token_id, len(tok))
    stream = with_teacher(batches(data, 2, tok.pad_token_id, False, 0, packing=True, max_seq_len=32), cache)
    seen = set()
    for _ in range(4):  # over an epoch: every row once, its figures where the packed batch scores its tokens
        batch = next(stream)
        scored = batch["labels"][:, 1:] != -100
        assert len(batch["teacher_ids"]) == int(scored.sum())
        seen.update(int(r) for r in batch["row_ids"].reshape(-1) if r >= 0)
    assert seen == set(range(len(data)))
    result = train(recipe, progress=False)
    assert result.teacher_pass["rows"] == 0  # the figures above, from the cache
    assert all(math.isfinite(x) for x in result.losses)


def test_a_top_k_as_large_as_the_vocabulary_is_refused_before_loading(tmp_path, write_recipe, models):
    from tiertune.finetune.train import train

    path = _recipe(tmp_path, write_recipe, models, top_k=100_000)
    with pytest.raises(ConfigError, match="objective.top_k is 100000"):
        train(path, progress=False)


def test_a_full_disk_while_caching_the_teachers_figures_is_said_and_leaves_no_temporary(
    tmp_path, monkeypatch
):
    import errno

    import safetensors.torch

    from tiertune.errors import DiskFullError
    from tiertune.finetune.teacher import TeacherCache

    cache = TeacherCache(tmp_path / "cache", [2, 1], 4)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    ids, logps, tail = torch.zeros(3, 4, dtype=torch.int32), torch.zeros(3, 4), torch.zeros(3)
    with pytest.raises(DiskFullError, match="offload.disk_path"):
        cache.write(0, [2, 1], ids, logps, tail)
    assert list((tmp_path / "cache").iterdir()) == []


def test_a_rank_waiting_for_rank_0s_wave_stops_at_its_safe_point(tmp_path):
    """A rank that reads a wave rank 0 writes waits for its file up to the collective timeout; a stop (the safe
    point raising) ends the wait at once, and a wave written meanwhile is read."""
    from tiertune.errors import Signalled
    from tiertune.finetune.teacher import TeacherCache

    calls = []

    def safe_point():
        calls.append(1)
        if len(calls) == 3:
            raise Signalled(15)

    waiting = TeacherCache(tmp_path / "cache", [2, 1], 4, wait_s=3600.0, safe_point=safe_point)
    waiting.expect(0, [2, 1])
    with pytest.raises(Signalled):
        waiting.of([0])
    assert len(calls) == 3
    ids, logps, tail = torch.arange(12, dtype=torch.int32).reshape(3, 4), torch.zeros(3, 4), torch.zeros(3)
    TeacherCache(tmp_path / "cache", [2, 1], 4).write(0, [2, 1], ids, logps, tail)
    assert torch.equal(waiting.of([1])[0], ids[2:])


def test_a_teacher_quantized_by_bitsandbytes_needs_its_quantize_setting(tmp_path):
    from tiertune.finetune.teacher import check_quantization
    from tiertune.settings import TeacherSettings

    (tmp_path / "config.json").write_text(
        json.dumps({"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}})
    )
    with pytest.raises(ConfigError, match="objective.teacher.quantize: nf4"):
        check_quantization(TeacherSettings(path=str(tmp_path)))
    check_quantization(TeacherSettings(path=str(tmp_path), quantize="nf4"))


# ---------------------------------------------------------------- evaluation


def _held_out_loss(teacher_dir, student, held_out, o) -> dict[str, float]:
    """A distillation's loss over a held-out file as a plain loop computes it: each row alone, the teacher's and
    the student's logits at its scored tokens, the top-k divergence (``logits_distill`` over the teacher's top
    ``o["top_k"]`` and the rest's mass) or, with ``top_k: 0``, TRL's ``generalized_jsd_loss`` summed, plus
    ``alpha`` x the cross-entropy; each a sum over every scored token of the set divided by their number."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.experimental.gkd.gkd_trainer import GKDTrainer

    from tiertune.finetune.data import load_data

    tok = AutoTokenizer.from_pretrained(teacher_dir)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    student.eval()
    kd_sum, ce_sum, tokens = 0.0, 0.0, 0
    with torch.no_grad():
        for row in load_data(str(held_out), tok, "text", 32).rows:
            ids, labels = torch.tensor([row["input_ids"]]), torch.tensor([row["labels"]])
            scored = labels[0, 1:] != -100
            target = labels[0, 1:][scored]
            t = teacher(input_ids=ids).logits[0, :-1][scored].float()
            z = student(input_ids=ids).logits[0, :-1][scored].float()
            ce_sum += float(torch.nn.functional.cross_entropy(z, target, reduction="sum"))
            if o["top_k"]:
                t = torch.log_softmax(t / o["temperature"], -1)
                values, top = t.topk(o["top_k"], -1)
                tail = torch.logsumexp(t.scatter(1, top, float("-inf")), -1)
                m = len(target)
                _, _, kd = logits_distill(
                    z,
                    target,
                    TopK(top, values, tail),
                    torch.zeros(m),
                    torch.ones(m),
                    o["beta"],
                    o["temperature"],
                )
                kd_sum += float(kd.sum())
            else:
                kd_sum += float(
                    GKDTrainer.generalized_jsd_loss(
                        z, t, beta=o["beta"], temperature=o["temperature"], reduction="sum"
                    )
                )
            tokens += len(target)
    kd, ce = kd_sum / tokens, ce_sum / tokens
    return {"eval_loss": o["alpha"] * ce + (1 - o["alpha"]) * kd, "eval_kd_loss": kd, "eval_ce_loss": ce}


@pytest.mark.parametrize("top_k", [8, 0], ids=["cached-top-k", "teacher-beside"])
def test_a_distillations_held_out_loss_is_a_plain_loops_on_the_same_weights(
    tmp_path, write_recipe, models, top_k
):
    """``eval_loss`` (with ``eval_kd_loss``, ``eval_ce_loss``) before the first step and after the last equals a plain
    loop's over the held-out rows by the initial student and by the model the run exports; the teacher's figures
    of the held-out rows are cached beside the data's in the same pass (top-k), or made by the teacher beside in
    each evaluation's pass (``top_k: 0``)."""
    from transformers import AutoModelForCausalLM

    from tests.finetune.test_evaluation import _eval_file
    from tiertune.finetune.train import train

    held_out = _eval_file(tmp_path)
    path = _recipe(tmp_path, write_recipe, models, top_k=top_k)
    overrides = [
        f"data.eval_path={held_out}",
        "training.eval_strategy=steps",
        "training.eval_steps=3",
        "training.eval_on_start=true",
    ]
    result = train(load_recipe(path, overrides), progress=False)
    evaluated = result.evaluations
    assert [r["step"] for r in evaluated] == [0, 3]
    o = {**OBJECTIVE, "top_k": top_k}
    initial = AutoModelForCausalLM.from_pretrained(models[1], dtype=torch.float32)
    exported = AutoModelForCausalLM.from_pretrained(result.output_dir, dtype=torch.float32)
    for record, student in zip(evaluated, (initial, exported), strict=True):
        expected = _held_out_loss(models[0], student, held_out, o)
        for name, value in expected.items():
            assert record[name] == pytest.approx(value, rel=1e-5), (record["step"], name)
    assert evaluated[0]["eval_loss"] != evaluated[1]["eval_loss"]  # the weights moved between them
    from tests.finetune.test_evaluation import HELD_OUT

    passes = result.teacher_pass
    if top_k:  # one pass over the data's rows and the held-out set's, each cached apart
        assert passes["rows"] == len(CAT_TEXTS) + len(HELD_OUT)
        assert len(list((tmp_path / "nvme" / "teacher-topk").iterdir())) == 2
    else:  # a wave a step, and one a pass of each evaluation (7 rows: 4 batches of 2, two passes of 2 batches)
        assert passes["waves"] == 3 + 2 * 2 and passes["rows"] == 3 * 4 + 2 * len(HELD_OUT)
        assert not (tmp_path / "nvme" / "teacher-topk").exists()


def _as_read(planned: int, later: int, ran: int, teacher) -> bool:
    """Whether a teacher pass's run moved what the estimate says: the ledger counts the last wave's prefetch of
    the first layers of a wave that does not come (a later wave's reads at most), which the run may not have
    landed when its figures are taken (on a busy machine); and within a layer's bytes (of 4) beside that, a
    prefetch landing late leaving one more chunk cached."""
    slack = teacher.weight_bytes / 4
    return planned - later - slack <= ran <= planned + slack


@pytest.mark.parametrize("top_k", [8, 0], ids=["cached-top-k", "teacher-beside"])
def test_the_estimate_prices_a_distillations_evaluations_as_the_run_makes_them(
    tmp_path, write_recipe, models, cat_model, top_k
):
    """The teacher's bytes for the held-out set as the run reads them: its rows' waves after the data's in the one
    pass (cached top-k: the cache holds both sets' figures), or (the teacher beside, larger than its half of the
    budgets) a pass of its store before each of the student's, in the steps and in each evaluation; and the
    evaluations' count and passes."""
    from tests.finetune.test_evaluation import HELD_OUT, _eval_file
    from tiertune.estimates.report import estimate, format_estimate
    from tiertune.finetune.teacher import CACHE_DIR
    from tiertune.finetune.train import train

    teacher = cat_model(
        4, hidden=128
    )  # 1.7 MiB of fp32 weights: its half of the budgets (512 KiB) keeps part
    held_out = _eval_file(tmp_path)
    path = _recipe(
        tmp_path,
        write_recipe,
        (teacher, models[1]),
        top_k=top_k,
        teacher={"path": str(teacher), "wave_size": 4},
    )
    recipe = load_recipe(
        path,
        [
            f"data.eval_path={held_out}",
            "objective.teacher.dtype=float32",
            "training.eval_strategy=steps",
            "training.eval_steps=3",
            "training.eval_on_start=true",
            "offload.params=disk",
            f"offload.host_budget={'1MiB' if top_k else '2MiB'}",  # beside: half of it each
            "offload.device_budget=2MiB",
        ],
    )
    est = estimate(recipe, gpu="cpu", measure=False)
    planned, evaluation = est.teacher, est.evaluation
    assert (planned.held_out_rows, evaluation.rows) == (len(HELD_OUT), len(HELD_OUT))
    assert (evaluation.passes, evaluation.evaluations) == (2, 2)
    result = train(recipe, progress=False)
    ran = result.teacher_pass
    text = format_estimate(est, "distill")
    if top_k:
        caches = list((tmp_path / "nvme" / CACHE_DIR).iterdir())
        assert len(caches) == 2 and planned.waves == ran["waves"] == 3 + 2  # 12 rows, then 7, 4 a wave
        # the first wave reads the weights, each later one what the budgets did not keep: as the run read them
        assert 0 < planned.later_pass < planned.pass_bytes[0] and planned.read_bytes == planned.bytes_over(5)
        assert _as_read(planned.read_bytes, planned.later_pass, ran["disk_bytes"], planned), (
            planned.pass_bytes,
            ran,
        )
        at = est.as_json()["teacher_pass"]["bytes_per_token_at_wave"]
        assert at["1"] > at["4"] > at["64"]  # fewer waves, fewer bytes a token
        # and the copies to the device, each wave's as the run made them
        assert _as_read(
            planned.copied_bytes, planned.pass_copied[-1], ran["host_to_device_bytes"], planned
        ), (
            planned.pass_copied,
            ran,
        )
        held = sum(f.stat().st_size for c in caches for f in c.glob("wave-*.safetensors"))
        assert (
            planned.cache_bytes <= held < planned.cache_bytes * 1.5
        )  # the files' headers beside the figures
        assert "then the held-out set's" in text
        assert evaluation.teacher_pass_bytes is None
    else:  # a pass before each step (3) and each evaluation pass (2 x 2): the first reads it all, each later part
        assert (
            0 < planned.later_pass < planned.pass_bytes[0]
            and evaluation.teacher_pass_bytes == planned.later_pass
        )
        assert ran["waves"] == 3 + 2 * 2
        assert _as_read(planned.bytes_over(ran["waves"]), planned.later_pass, ran["disk_bytes"], planned), (
            planned.pass_bytes,
            ran,
        )
        assert "the teacher beside scores each pass's batches first" in text
