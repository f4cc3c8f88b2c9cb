"""The layer-major step (``engine.schedule``): each decoder layer visited once per wave of micro-batches in
forward and once in backward, so a step of k micro-batches moves the weights as often as a step of one; the
same losses, gradients and weights as a plain PyTorch loop and as the micro-batch-at-a-time schedule."""

import json

import pytest
import torch
from parity import LORA, _batches, _config, lora_config, plain_training

from tiertune.engine import StreamedTrainer
from tiertune.offload.store import StoreConfig

K = 8  # micro-batches per step
STEPS = 3


def _store(disk_dir, host="2MiB"):
    return StoreConfig.resolve(
        device_budget="8MiB", host_budget=host, disk_path=str(disk_dir), chunk_size="1MiB", prefetch_depth=1
    )


def _visits(trainer):
    """Count the acquisitions of each decoder layer's weights."""
    counts = [0] * len(trainer.parts.layers)
    acquire = trainer.layer_weights

    def counted(index, requires_grad):
        counts[index] += 1
        return acquire(index, requires_grad)

    trainer.layer_weights = counted
    return counts


def _train(path, disk_dir, batches, cfg, host="2MiB"):
    trainer = StreamedTrainer(str(path), _store(disk_dir, host), cfg)
    try:
        visits = _visits(trainer)
        losses, norms = [], []
        for s in range(STEPS):
            losses.append(trainer.step(batches[s * K : (s + 1) * K]))
            norms.append(trainer.last_grad_norm)
        return losses, norms, trainer.state_dict(), visits, trainer.schedule.waves(K)
    finally:
        trainer.close()


@pytest.mark.parametrize(
    ("activations", "wave"),
    [("device", 0), ("host", 0), ("host", 3)],
    ids=["one wave, boundaries on the device", "one wave, boundaries on the host", "waves of 3, 3 and 2"],
)
def test_eight_micro_batches_match_a_plain_loop(tiny_model_dir, disk_dir, activations, wave):
    """Full fine-tuning, weights and states on disk under a 2 MiB host budget, tied embeddings (their gradient
    sums the head's and the embeddings' parts), clipping on: the losses and gradient norms of every step are
    the plain loop's to 1e-6, the weights to 1e-5; each layer is acquired twice per wave."""
    from transformers import AutoModelForCausalLM

    path, _ = tiny_model_dir("llama")
    cfg = _config(
        params="disk",
        optimizer_states="disk",
        gradients="disk",
        max_steps=STEPS,
        activations=activations,
        activation_tokens=24,
        gradient_accumulation_steps=K,
        wave_size=wave,
    )
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    reference.config.use_cache = False
    reference.train()
    params = dict(reference.named_parameters())
    groups = [
        {"params": [p for p in params.values() if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params.values() if p.dim() < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(
        groups, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon, fused=True
    )
    batches = _batches(reference.config.vocab_size, count=STEPS * K)
    norms_expected: list[float] = []
    expected = plain_training(reference, opt, list(params.values()), cfg, batches, STEPS, K, norms_expected)

    losses, norms, weights, visits, waves = _train(path, disk_dir, batches, cfg)
    assert [len(w) for w in waves] == ([K] if not wave else [3, 3, 2])
    assert visits == [2 * len(waves) * STEPS] * len(visits)  # forward and backward, once per wave
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-6, atol=0)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(norms_expected), rtol=1e-6, atol=0)
    assert set(weights) == set(params)
    for name, p in params.items():
        worst = float((weights[name] - p.detach()).abs().max() / p.detach().abs().max().clamp_min(1e-12))
        assert worst <= 1e-5, name


def test_dropout_is_each_micro_batch_s_however_the_step_is_cut(tiny_model_dir, disk_dir):
    """LoRA with dropout on a 4-bit base: each micro-batch draws its own random stream, so one wave of 8, waves
    of 3 and the micro-batch-at-a-time schedule (waves of 1) give the same losses and adapters."""
    path, _ = tiny_model_dir("llama")
    lora = LORA.__class__(r=4, alpha=8, dropout=0.2, seed=0)
    batches = _batches(211, count=STEPS * K)
    runs = []
    for wave in (0, 3, 1):
        cfg = lora_config(
            lora=lora, params="disk", max_steps=STEPS, gradient_accumulation_steps=K, wave_size=wave
        )
        torch.manual_seed(7)
        losses, norms, _, visits, waves = _train(path, disk_dir, batches, cfg)
        assert visits == [2 * len(waves) * STEPS] * len(visits)
        runs.append((losses, norms))
    (l8, n8), (l3, n3), (l1, n1) = runs
    torch.testing.assert_close(torch.tensor(l8), torch.tensor(l1), rtol=1e-6, atol=0)
    torch.testing.assert_close(torch.tensor(l3), torch.tensor(l1), rtol=1e-6, atol=0)
    torch.testing.assert_close(torch.tensor(n8), torch.tensor(n1), rtol=1e-6, atol=0)
    torch.testing.assert_close(torch.tensor(n3), torch.tensor(n1), rtol=1e-6, atol=0)


CASES = {
    # full fine-tuning: weights, gradients and states on disk, the host budget below the model's states
    "full, params and states on disk": (
        4,
        128,
        ["offload.params=disk", "offload.optimizer_states=disk", "offload.host_budget=3MiB"],
    ),
    # QLoRA: the NF4 base (~1.9 MB) on disk, host and device budgets of 1 MiB
    "qlora, base on disk": (
        6,
        256,
        [
            "model.quantize=nf4",
            "method.type=lora",
            "offload.params=disk",
            "offload.host_budget=1MiB",
            "offload.device_budget=1MiB",
        ],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_step_of_eight_micro_batches_moves_what_a_step_of_one_moves(
    tmp_path, cat_model, write_recipe, case
):
    """The store's counters over a run's last step, at 1 and at 8 micro-batches per step (the same
    micro-batch size): at most 1.25x the bytes in all (the weights cross disk and PCIe once per step, the
    gradients go to the host once), and on each link, give or take two layers' chunks: where the host budget
    binds, which copies it keeps while the optimizer's and the I/O threads work varies from run to run (the
    full fine-tune's device->host bytes at one micro-batch were 1,187,840 in one run, 1,781,760 in another;
    at eight, 2,375,680 in a run beside the other tests' worker: 1.5 layers over 1.25x the first figure)."""
    from tiertune.config.recipe import load_recipe
    from tiertune.finetune.train import train

    layers, hidden, overrides = CASES[case]
    moved = {}
    for k in (1, K):
        run = tmp_path / f"k{k}"
        run.mkdir()
        path = write_recipe(
            run,
            cat_model(layers, hidden=hidden),
            training={"gradient_accumulation_steps": k, "max_steps": 3},
            offload={"device_budget": "64MiB", "host_budget": "64MiB"},
        )
        log = [
            json.loads(line) for line in train(load_recipe(path, overrides), progress=False).log_path.open()
        ]
        before, after = log[-2]["bytes_moved"], log[-1]["bytes_moved"]
        moved[k] = {link: n - before.get(link, 0) for link, n in after.items()}
    assert sum(moved[1].values()) > 1 << 20  # the weights do stream: budgets are below the model
    assert sum(moved[K].values()) <= 1.25 * sum(moved[1].values()), moved
    layer = (
        4 * 12 * hidden * hidden
    )  # a layer's fp32 weights, about (its chunk's size, as the store lays it out)
    for link in set(moved[1]) | set(moved[K]):
        assert moved[K].get(link, 0) <= 1.25 * moved[1].get(link, 0) + 2 * layer, (link, moved)
