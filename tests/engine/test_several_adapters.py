"""Several LoRA adapters over one NF4 base on disk (``StreamedTrainer.step_adapters``): a step runs every
adapter's micro-batches in one pass of the base's layers (each layer read and dequantized once for all of them),
and each adapter's losses, gradient norms and final weights are its solo run's: two learning rates, two ranks,
a DoRA adapter, different data and accumulation, and adapters that stop at different steps."""

import dataclasses

import pytest
import torch
from parity import LORA, _batches, assert_adam_trained_close, lora_config

from tiertune.engine import StreamedTrainer
from tiertune.methods.lora import adapter_name
from tiertune.offload.store import StoreConfig

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
]


def _store(where, name):
    return StoreConfig.resolve(
        device_budget="8MiB",
        host_budget="2MiB",
        disk_path=str(where / name),
        chunk_size="1MiB",
        prefetch_depth=1,
    )


def _config(lora, settings, accum, steps):
    return lora_config(
        lora=lora, params="disk", gradient_accumulation_steps=accum, max_steps=steps, **settings
    )


def _data(vocab, accum, seed, steps):
    return _batches(vocab, seed=seed, count=steps * accum)


def _solo(path, disk_dir, i, vocab):
    lora, settings, accum, seed, steps = ADAPTERS[i]
    trainer = StreamedTrainer(str(path), _store(disk_dir, f"solo-{i}"), _config(lora, settings, accum, steps))
    try:
        data = _data(vocab, accum, seed, steps)
        out, bytes_read = [], []
        for s in range(steps):
            before = _disk_read(trainer)
            loss = trainer.step(data[s * accum : (s + 1) * accum])
            out.append((loss, trainer.last_grad_norm))
            bytes_read.append(_disk_read(trainer) - before)
        return out, trainer.adapters.state_dict(), bytes_read
    finally:
        trainer.close()


def _disk_read(trainer):
    return sum(v for link, v in trainer.store_stats().bytes_moved.items() if link.startswith("disk->"))


def test_each_adapter_of_several_over_one_base_is_its_solo_run(tiny_model_dir, disk_dir, monkeypatch):
    from tiertune.engine import compute as compute_module

    real = compute_module.run_layer
    calls: list[int] = []

    def counted(layer, hidden, call):
        calls.append(hidden.shape[0])
        return real(layer, hidden, call)

    monkeypatch.setattr(compute_module, "run_layer", counted)  # what the step computes a layer with
    path, model = tiny_model_dir("llama")
    vocab = model.config.vocab_size
    configs = [_config(lora, settings, accum, steps) for lora, settings, accum, _, steps in ADAPTERS]
    first, *others = configs
    trainer = StreamedTrainer(
        str(path), _store(disk_dir, "several"), dataclasses.replace(first, others=tuple(others))
    )
    names = [adapter_name(i) for i in range(len(ADAPTERS))]
    assert trainer.adapters.names == names
    data = {name: _data(vocab, a[2], a[3], a[4]) for name, a in zip(names, ADAPTERS, strict=True)}
    got = {name: [] for name in names}
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
            for name, (loss, norm, _) in trainer.step_adapters(groups).items():
                got[name].append((loss, norm))
            bytes_read.append(_disk_read(trainer) - before)
            if (
                s == 0
            ):  # a visit's calls: the three plain adapters' 5 micro-batches as one, DoRA's 3 (peft mixes none)
                assert calls == [2 * 5, 2 * 3] * (2 * len(trainer.parts.layers))
        weights = {name: trainer.adapters.state_dict(name) for name in names}
    finally:
        trainer.close()
    for i, name in enumerate(names):
        solo, solo_weights, solo_read = _solo(path, disk_dir, i, vocab)
        assert len(got[name]) == len(solo) == ADAPTERS[i][4]
        torch.testing.assert_close(torch.tensor(got[name]), torch.tensor(solo), rtol=1e-5, atol=0)
        assert weights[name].keys() == solo_weights.keys()
        for key, value in solo_weights.items():
            assert_adam_trained_close(weights[name][key], value, f"{name} {key}")  # sums in another order
        if i == 0:  # the base once a step, for all the adapters: as one adapter's step reads it
            assert all(b <= 1.05 * solo_read[0] for b in bytes_read), (bytes_read, solo_read)
            assert bytes_read[0] >= 0.95 * solo_read[0]


def test_several_adapters_train_lora_with_sft_only_so_far(tiny_model_dir, disk_dir):
    from tiertune.errors import ConfigError
    from tiertune.settings import ObjectiveSettings

    path, _ = tiny_model_dir("llama")
    cfg = _config(LORA, {}, 1, 1)
    dpo = dataclasses.replace(cfg, objective=ObjectiveSettings(type="dpo"), others=(cfg,))
    with pytest.raises(ConfigError, match="objective.type: sft so far"):
        StreamedTrainer(str(path), _store(disk_dir, "dpo"), dpo)
