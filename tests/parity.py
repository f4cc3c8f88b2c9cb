"""The plain-loop oracle the parity tests compare the engine against (the same data order and hyper-parameters,
in memory, torch.optim or peft + bitsandbytes), and comparing weights trained two ways where the comparison is
well-posed on every x86 CPU, not only the one a tolerance was tuned on."""

import torch
from torch import nn

from tiertune.engine import EngineConfig
from tiertune.settings import LoraSettings

STEPS = 10
ACCUM = 2


def _batches(vocab, seed=0, count=STEPS * ACCUM):
    """``count`` (STEPS x ACCUM) micro-batches of 2 sequences, with padding (label -100) of varying length."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(0, vocab, (2, 12), generator=g)
        mask = torch.ones_like(ids)
        pad = int(torch.randint(0, 5, (1,), generator=g))
        if pad:
            mask[1, -pad:] = 0
        labels = ids.masked_fill(mask == 0, -100)
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def _config(**kw):
    base = dict(
        dtype=torch.float32,
        learning_rate=3e-3,
        weight_decay=0.1,
        max_grad_norm=0.5,
        lr_scheduler_type="cosine",
        warmup_steps=3,
        max_steps=STEPS,
        kernels="none",  # the model's own loss, op for op like the plain loop (the fused loss: its own test)
    )
    base.update(kw)
    return EngineConfig(**base)


def plain_training(model, opt, clipped, cfg, batches, steps=STEPS, accum=ACCUM, norms=None):
    """``steps`` steps the plain way: token-weighted loss over ``accum`` micro-batches, ``clip_grad_norm_``
    over ``clipped`` (skipped when max_grad_norm is 0, as the HF Trainer does), ``opt``, transformers'
    scheduler. Returns the losses; appends each step's gradient norm to ``norms`` when given."""
    from transformers import get_scheduler

    sched = get_scheduler(
        cfg.lr_scheduler_type, opt, num_warmup_steps=cfg.warmup_steps, num_training_steps=cfg.max_steps
    )
    losses = []
    for step in range(steps):
        loss = backward(model, batches[step * accum : (step + 1) * accum])
        if cfg.max_grad_norm > 0 or norms is not None:
            norm = torch.nn.utils.clip_grad_norm_(
                clipped, cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
            )
            if norms is not None:
                norms.append(float(norm))
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss)
    return losses


def backward(model, mbs) -> float:
    """A step's loss over micro-batches ``mbs``, back-propagated: each one's summed cross-entropy divided by
    the step's target tokens (token-weighted, as the engine and the HF Trainer). Returns the step's loss."""
    n = sum(int((mb["labels"][:, 1:] != -100).sum()) for mb in mbs)
    total = 0.0
    for mb in mbs:
        logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits
        loss = nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]),
            mb["labels"][:, 1:].reshape(-1),
            ignore_index=-100,
            reduction="sum",
        )
        (loss / n).backward()
        total += float(loss.detach())
    return total / n


def fused_adamw(params, cfg):
    """torch's fused AdamW over ``params`` with ``cfg``'s hyper-parameters, weight decay on matrices only."""
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        groups, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon, fused=True
    )


LORA = LoraSettings(r=4, alpha=8, dropout=0.0, seed=0)


def assert_frozen_linear(op, weight, rows, seed=1):
    """``op(x)``, a product with a frozen (quantized) matrix, against ``F.linear(x, weight)`` with ``weight`` its
    values in fp32: the output and the input's gradient of ``rows`` random inputs (rel and abs 1e-5)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, weight.shape[1], generator=g)
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    expected, got = nn.functional.linear(x1, weight), op(x2)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    dy = torch.randn(rows, weight.shape[0], generator=g)
    expected.backward(dy)
    got.backward(dy)
    torch.testing.assert_close(x2.grad, x1.grad, rtol=1e-5, atol=1e-5)


def peft_lora(model, lora=LORA, experts=False):
    """peft's ``LoraConfig`` adapting in ``model`` (transformers' own, in memory) what tiertune's ``all-linear``
    adapts, written independently of tiertune: every linear layer of the decoder layers by its full name but the
    routers; the MLPs' projections (a shared expert's, a dense layer's) as parameters, which peft adapts alike
    (W + s B A, the same keys), because peft 0.21 takes module targets ending in gate_proj, up_proj or down_proj
    for routed experts on the DeepSeek, GLM and Qwen3-MoE families (huggingface/peft#3711). ``experts``: the
    routed experts' fused weights and the routers' too (``all-linear``, ``experts``, ``routers``)."""
    from peft import LoraConfig

    mlp = ("gate_proj", "up_proj", "down_proj")
    linear = [
        n
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)
        and ".layers." in n
        and "experts" not in n.split(".")
        and n.rsplit(".", 1)[-1] not in ("gate", "router")
        and "vision" not in n
    ]
    parameters = [f"{n}.weight" for n in linear if n.rsplit(".", 1)[-1] in mlp]
    if experts:
        parameters += ["mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"]
    return LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=[n for n in linear if n.rsplit(".", 1)[-1] not in mlp],
        target_parameters=parameters or None,
        task_type="CAUSAL_LM",
    )


def lora_config(**kw):
    base = dict(
        dtype=torch.float32,
        method="lora",
        quantize="nf4",
        lora=LORA,
        learning_rate=1e-2,
        weight_decay=0.1,
        max_grad_norm=0.05,
        lr_scheduler_type="cosine",
        warmup_steps=3,
        max_steps=STEPS,
    )
    base.update(kw)
    return EngineConfig(**base)


def assert_same_safetensors(actual, expected) -> None:
    """Two safetensors files hold the same tensors under the same names, to the bit."""
    from safetensors.torch import load_file

    mine, theirs = load_file(actual), load_file(expected)
    assert mine.keys() == theirs.keys(), (sorted(mine), sorted(theirs))
    for key in mine:
        assert torch.equal(mine[key], theirs[key]), key


def assert_adam_trained_close(actual: torch.Tensor, expected: torch.Tensor, name: str = "") -> None:
    """Adam divides each gradient entry by its own running magnitude: an entry whose gradient is nearly zero
    turns float rounding (which differs between CPUs, MKL's last bits) into a step of up to the learning rate.
    So the tensor is compared as a whole (the difference's norm <= 1e-4 of the tensor's), and element by element
    (rtol 1e-4, atol 1e-5) for all but 0.5% of its entries: a wrong gradient or update fails both."""
    actual, expected = actual.detach().float(), expected.detach().float()
    assert actual.shape == expected.shape, (name, actual.shape, expected.shape)
    scale = float(expected.norm()) or 1.0
    assert float((actual - expected).norm()) <= 1e-4 * scale, (name, float((actual - expected).norm()), scale)
    beyond = ~torch.isclose(actual, expected, rtol=1e-4, atol=1e-5)
    assert int(beyond.sum()) <= max(1, actual.numel() // 200), (name, int(beyond.sum()), actual.numel())


TRL_AS_TIERTUNE = dict(
    logging_steps=1,
    report_to="none",
    bf16=False,
    gradient_checkpointing=False,
    use_cpu=True,
    lr_scheduler_type="linear",
    warmup_steps=0,
    max_grad_norm=1.0,
    weight_decay=0.0,
    optim="adamw_torch",
    seed=0,
    save_strategy="no",
)
"""A TRL trainer's arguments that train as a tiertune recipe's defaults do (fp32 on the CPU, AdamW, a linear
schedule without warmup, clipping at 1.0, no weight decay), logging every step and saving nothing."""


def trl_lora():
    """The peft ``LoraConfig`` of the TRL side of the parity tests: ``all-linear``, r 4, alpha 8, no dropout."""
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")


def seed_lora(model, seed: int) -> None:
    """``model``'s LoRA adapters initialized again as tiertune initializes its own (peft's init, seeded by
    ``method.lora.seed``), the global generator left as it was."""
    from peft.tuners.lora import LoraLayer

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for module in model.modules():
            if isinstance(module, LoraLayer):
                for adapter in module.active_adapters:
                    module.reset_lora_parameters(adapter, init_lora_weights=True)
