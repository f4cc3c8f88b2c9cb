"""Several LoRA adapters over one NF4 base on disk (``StreamedTrainer.step_adapters``): a step runs every
adapter's micro-batches in one pass of the base's layers (each layer read and dequantized once for all of them),
and each adapter's losses, gradient norms, metrics and final weights are its solo run's: two learning rates, two
ranks, a DoRA adapter, a DPO adapter (its reference, the base with adapters off, in the same visits; its
dropout alone off), different data and accumulation, and adapters that stop at different steps."""

import dataclasses

import pytest
import torch
from parity import LORA, _batches, assert_adam_trained_close, lora_config

from tiertune.engine import StreamedTrainer
from tiertune.methods.lora import adapter_name
from tiertune.offload.store import StoreConfig
from tiertune.settings import ObjectiveSettings

DPO = ObjectiveSettings(type="dpo", beta=0.2)

STEPS = 3
# (lora, engine settings, micro-batches a step, the data's seed, steps)
ADAPTERS = [
    (LORA, {"learning_rate": 1e-2}, 2, 1, STEPS),
    (LORA, {"learning_rate": 4e-3, "max_grad_norm": 0.0}, 2, 2, STEPS),
    (
        dataclasses.replace(LORA, r=8, alpha=16, seed=3),
        {"lr_scheduler_type": "linear", "warmup_steps": 0},
        1,
        3,
        2,
    ),
    (dataclasses.replace(LORA, use_dora=True, target_modules=["q_proj", "v_proj"]), {}, 3, 4, STEPS),
    (dataclasses.replace(LORA, dropout=0.1, seed=5), {"objective": DPO, "learning_rate": 5e-3}, 2, 5, STEPS),
]


def _store(where, name):
    return StoreConfig.resolve(
        device_budget="8MiB",
        host_budget="2MiB",
        disk_path=str(where / name),
        chunk_size="1MiB",
        prefetch_depth=1,
    )


def _config(lora, settings, accum, steps, stack=None):
    return lora_config(
        lora=lora,
        params="disk",
        gradient_accumulation_steps=accum,
        max_steps=steps,
        stack_tokens=stack,
        **settings,
    )


def _pairs(vocab, seed, count, pairs=2, length=12, prompt=4):
    """``count`` micro-batches of ``pairs`` preference pairs (chosen rows, then rejected; each pair's prompt its
    own, not a target), a rejected row padded."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(0, vocab, (2 * pairs, length), generator=g)
        ids[pairs:, :prompt] = ids[:pairs, :prompt]
        mask = torch.ones_like(ids)
        mask[-1, -3:] = 0
        labels = ids.masked_fill(mask == 0, -100)
        labels[:, :prompt] = -100
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels, "pairs": torch.tensor(pairs)})
    return out


def _data(vocab, i):
    _, settings, accum, seed, steps = ADAPTERS[i]
    if "objective" in settings:
        return _pairs(vocab, seed, steps * accum)
    return _batches(vocab, seed=seed, count=steps * accum)


def _solo(path, disk_dir, i, vocab, stack=None):
    lora, settings, accum, _, steps = ADAPTERS[i]
    config = _config(lora, settings, accum, steps, stack)
    trainer = StreamedTrainer(str(path), _store(disk_dir, f"solo-{i}-{stack}"), config)
    try:
        data = _data(vocab, i)
        out, bytes_read, metrics = [], [], []
        for s in range(steps):
            before = _disk_read(trainer)
            loss = trainer.step(data[s * accum : (s + 1) * accum])
            out.append((loss, trainer.last_grad_norm))
            metrics.append(trainer.last_metrics)
            bytes_read.append(_disk_read(trainer) - before)
        return out, trainer.adapters.state_dict(), bytes_read, metrics
    finally:
        trainer.close()


def _disk_read(trainer):
    return sum(v for link, v in trainer.store_stats().bytes_moved.items() if link.startswith("disk->"))


@pytest.mark.parametrize("stack", [None, 0], ids=["stacked", "one-at-a-time"])
def test_each_adapter_of_several_over_one_base_is_its_solo_run(tiny_model_dir, disk_dir, monkeypatch, stack):
    """Stacked (a quantized base's default: micro-batches of several adapters in one batch, the weights' gradient
    sums in another order than a solo run's, so Adam's weights are compared as ``assert_adam_trained_close``
    does), and one micro-batch at a time (the sums in a solo run's order: weights rel 1e-5 too)."""
    from tiertune.engine import compute as compute_module

    real = compute_module.run_layer
    calls: list[int] = []

    def counted(layer, hidden, call):
        calls.append(hidden.shape[0])
        return real(layer, hidden, call)

    monkeypatch.setattr(compute_module, "run_layer", counted)  # what the step computes a layer with
    path, model = tiny_model_dir("llama")
    vocab = model.config.vocab_size
    configs = [_config(lora, settings, accum, steps, stack) for lora, settings, accum, _, steps in ADAPTERS]
    first, *others = configs
    trainer = StreamedTrainer(
        str(path), _store(disk_dir, f"several-{stack}"), dataclasses.replace(first, others=tuple(others))
    )
    names = [adapter_name(i) for i in range(len(ADAPTERS))]
    assert trainer.adapters.names == names
    data = {name: _data(vocab, i) for i, name in enumerate(names)}
    got = {name: [] for name in names}
    got_metrics = {name: [] for name in names}
    bytes_read = []
    try:
        for s in range(STEPS):
            groups = {
                name: data[name][s * a[2] : (s + 1) * a[2]]
                for name, a in zip(names, ADAPTERS, strict=True)
                if s < a[4]  # an adapter whose steps are done takes no part
            }
            before = _disk_read(trainer)
            calls.clear()
            for name, out in trainer.step_adapters(groups).items():
                got[name].append((out.loss, out.grad_norm))
                got_metrics[name].append(out.metrics)
            bytes_read.append(_disk_read(trainer) - before)
            # a layer's visits: the plain and DPO adapters' 7 micro-batches as one, DoRA's 3 (peft mixes none);
            # in forward the DPO adapter's reference too (its 2 micro-batches of 2 pairs)
            layers = len(trainer.parts.layers)
            if s == 0 and stack is None:
                assert calls == [2 * 5 + 4 * 2, 4 * 2, 2 * 3] * layers + [2 * 5 + 4 * 2, 2 * 3] * layers
        weights = {name: trainer.adapters.state_dict(name) for name in names}
    finally:
        trainer.close()
    for i, name in enumerate(names):
        solo, solo_weights, solo_read, solo_metrics = _solo(path, disk_dir, i, vocab, stack)
        assert len(got[name]) == len(solo) == ADAPTERS[i][4]
        torch.testing.assert_close(
            torch.tensor(got[name]),
            torch.tensor(solo),
            rtol=1e-5,
            atol=0,
            msg=lambda m, name=name: f"{name}: {m}",
        )
        assert [m.keys() for m in got_metrics[name]] == [m.keys() for m in solo_metrics]
        for mine, theirs in zip(got_metrics[name], solo_metrics, strict=True):
            for key, value in theirs.items():
                assert mine[key] == pytest.approx(value, rel=1e-5, abs=1e-7), (name, key)
        if "objective" in ADAPTERS[i][1]:
            assert "rewards/margins" in solo_metrics[0]
        assert weights[name].keys() == solo_weights.keys()
        for key, value in solo_weights.items():
            if stack is None:  # sums in another order
                assert_adam_trained_close(weights[name][key], value, f"{name} {key}")
            else:
                torch.testing.assert_close(weights[name][key], value, rtol=1e-5, atol=1e-7)
        if i == 0:  # the base once a step, for all the adapters: as one adapter's step reads it
            assert all(b <= 1.05 * solo_read[0] for b in bytes_read), (bytes_read, solo_read)
            assert bytes_read[0] >= 0.95 * solo_read[0]


def _dropouts(trainer, name):
    return {
        m.lora_dropout[name].p
        for layer in trainer.parts.layers
        for m in layer.layer.modules()
        if hasattr(m, "lora_dropout") and isinstance(m.lora_dropout[name], torch.nn.Dropout)
    }


def test_a_preference_objective_disables_its_adapters_dropout_alone(tiny_model_dir, disk_dir):
    """TRL's ``disable_dropout`` reaches the streamed layers' LoRA dropout: the whole model's for one DPO
    adapter; of several, the DPO adapter's, the SFT adapter's kept."""
    path, _ = tiny_model_dir("llama")
    dropping = dataclasses.replace(LORA, dropout=0.1)
    dpo = _config(dropping, {"objective": DPO}, 1, 1)
    solo = StreamedTrainer(str(path), _store(disk_dir, "solo"), dpo)
    try:
        assert _dropouts(solo, adapter_name(0)) == {0.0}
    finally:
        solo.close()
    sft = _config(dropping, {}, 1, 1)
    both = StreamedTrainer(str(path), _store(disk_dir, "both"), dataclasses.replace(sft, others=(dpo,)))
    try:
        assert _dropouts(both, adapter_name(0)) == {0.1}
        assert _dropouts(both, adapter_name(1)) == {0.0}
    finally:
        both.close()


def test_several_adapters_refuse_what_they_do_not_run(tiny_model_dir, disk_dir):
    from tiertune.errors import ConfigError

    path, _ = tiny_model_dir("llama")
    cfg = _config(LORA, {}, 1, 1)
    # the teacher beside the student (top_k 0) and GRPO train alone; a distillation from cached figures does not
    for name, objective in (
        ("beside", ObjectiveSettings(type="distill", top_k=0)),
        ("grpo", ObjectiveSettings(type="grpo")),
    ):
        alone = dataclasses.replace(cfg, objective=objective, others=(cfg,))
        with pytest.raises(ConfigError, match="sft, dpo, simpo, orpo, kto or distill with a top_k"):
            StreamedTrainer(str(path), _store(disk_dir, name), alone)
