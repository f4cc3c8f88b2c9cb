"""Several LoRA adapters over one base (``EngineConfig.others``; ``methods.lora.Adapters``' names): a step of
each runs in one pass of the base's layers, each layer read (and dequantized) once for all of them.

Each micro-batch carries its adapter (``Micro.adapter``) and its adapter's step's target tokens (``Micro.tokens``,
what its loss is divided by). A layer's visit stacks micro-batches of different adapters where peft's mixed-batch
forward takes them (``shares``: not DoRA): the base's product once for every row, each row's own adapter's
term added (``route``: ``Adapters.mix``); a stack of one adapter runs with that adapter active. The suffix
stacks them alike, the head's pass once for the stack, each token weighted by 1 / its adapter's tokens
(``backward``). After backward each adapter is clipped and stepped by its own optimizer at its own schedule's
learning rate (``step_adapters``): the adapters' parameters are disjoint, so each one's gradients, and so
its whole run, are what it would be alone."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from tiertune.engine import objective
from tiertune.engine.objective import step_metrics, targets
from tiertune.errors import ConfigError, DataError, NonFiniteError

if TYPE_CHECKING:
    from tiertune.engine.micro import Micro
    from tiertune.methods.lora import Adapters


def shares(adapters: Adapters | None, head: Micro, mb: Micro) -> bool:
    """Whether ``mb`` may join ``head``'s stack in a layer's visit, by their adapters: the same one, or two that
    peft's mixed batches take (``Adapters.mixes``)."""
    if mb.adapter == head.adapter:
        return True
    return adapters is not None and adapters.mixes(head.adapter) and adapters.mixes(mb.adapter)


def route(
    adapters: Adapters | None, mb: Micro, micro: Sequence[Micro] = (), group: Sequence[int] = ()
) -> None:
    """``mb``'s adapter the one the model adds (``Adapters.activate``); a stack of ``group``'s micro-batches of
    several adapters: each row its own (``Adapters.mix``). Nothing for a micro-batch of the one adapter."""
    if mb.adapter is None:
        return
    assert adapters is not None
    if any(micro[j].adapter != mb.adapter for j in group):
        adapters.mix([micro[j].adapter for j in group for _ in range(micro[j].shape[0])])  # type: ignore[misc]
    else:
        adapters.activate(mb.adapter)


def backward(
    engine: Any,
    leaf: torch.Tensor,
    batch: tuple[torch.Tensor, dict, torch.Tensor],
    parts: Sequence[Micro],
    n_tokens: int,
    loss_sum: torch.Tensor | None,
    losses: dict[str, float],
) -> float:
    """A suffix stack's loss back-propagated and its summed value returned: ``loss_sum`` (else the stack's
    cross-entropy of ``batch``: ids, extra, target) over the step's ``n_tokens``, or, of several adapters, each
    one's over its own tokens (``Micro.tokens``), in one pass of the head for a stack that mixes them (each token
    weighted 1 / its adapter's tokens, each one's loss read back for its adapter's sum in ``losses``)."""
    compute, head = engine.compute, parts[0]
    if loss_sum is None and any(mb.adapter != head.adapter for mb in parts):
        sizes = [mb.target.numel() for mb in parts]
        weight = torch.cat(
            [
                torch.full((k,), 1.0 / mb.tokens, device=leaf.device)
                for k, mb in zip(sizes, parts, strict=True)
            ]
        )
        rows = torch.zeros(sum(sizes), device=leaf.device)
        compute.loss(engine.loss, leaf, *batch, token_weight=weight, rows_out=rows).backward()
        total = 0.0
        for mb, part in zip(parts, rows.split(sizes), strict=True):
            value = compute.value(part.sum())
            losses[mb.adapter] = losses.get(mb.adapter, 0.0) + value  # type: ignore[index]
            total += value
        return total
    if loss_sum is None:
        loss_sum = compute.loss(engine.loss, leaf, *batch)
    (loss_sum / (head.tokens or n_tokens)).backward()
    value = compute.value(loss_sum.detach())
    if head.adapter is not None:
        losses[head.adapter] = losses.get(head.adapter, 0.0) + value
    return value


@dataclass(frozen=True)
class AdapterStep:
    """One adapter's step of several over one base: its loss, gradient norm (nan: not clipped), learning rate
    and its objective's metrics (TRL's names: ``engine.objective.metric_names``)."""

    loss: float
    grad_norm: float
    learning_rate: float
    metrics: dict[str, float] = field(default_factory=dict)
    # why this adapter's step was not taken (its loss or gradient norm not finite: NonFiniteError's message);
    # the adapter is as it was before the step, the others stepped
    error: str | None = None


def check(config: Any) -> None:
    """ConfigError where several adapters over one base (``config.others``) cannot run yet: an adapter not LoRA,
    or whose objective is neither SFT, a preference objective nor a distillation from cached figures."""
    if not config.others:
        return
    for c in config.adapter_configs:
        o = c.objective
        if c.method != "lora" or not (o.type == "sft" or o.paired or (o.distills and not o.beside)):
            raise ConfigError(
                "several adapters over one base train LoRA adapters with objective.type sft, dpo, simpo, orpo, kto "
                f"or distill with a top_k (this one: method.type {c.method}, objective.type {o.type}); train it "
                "alone"
            )


def disable_dropout(model: torch.nn.Module, adapters: Adapters | None, config: Any) -> None:
    """Dropout off where an objective asks (TRL's ``disable_dropout``, preference and distillation objectives):
    the whole model's for one adapter (or none); of several, each asking adapter's own, and the base's only if
    every adapter asks (ConfigError where the base drops and the adapters disagree: each would not be its solo
    run)."""
    asks = [
        (c.objective.paired or c.objective.distills) and c.objective.disable_dropout
        for c in config.adapter_configs
    ]
    if all(asks):
        objective.disable_dropout(model)
        return
    if not any(asks):
        return
    if objective.base_drops(model):
        raise ConfigError(
            "the base drops (its config's dropout rates above 0) and some adapters' objectives disable dropout "
            "(objective.disable_dropout) while others keep it: set objective.disable_dropout alike in every "
            "recipe, or train them apart"
        )
    assert adapters is not None
    for name, asked in zip(adapters.names, asks, strict=True):
        if asked:
            adapters.drop_nothing(name)


def schedules(config: Any, adapters: Adapters | None) -> tuple[dict, dict, dict, dict]:
    """Of the adapters over the base (``step_adapters``; one of them too: what is left of a run of several):
    each one's settings, learning-rate schedule, steps taken and random generator (its micro-batches' streams:
    ``EngineConfig.seed``), by name (empty without adapters; ``check`` has passed)."""
    from tiertune.engine.step import LRSchedule

    if adapters is None:
        return {}, {}, {}, {}
    configs = dict(zip(adapters.names, config.adapter_configs, strict=True))
    lrs = {
        name: LRSchedule(c.learning_rate, c.lr_scheduler_type, c.warmup_steps, c.max_steps)
        for name, c in configs.items()
    }
    rngs = {name: torch.Generator().manual_seed(c.seed) for name, c in configs.items()}
    return configs, lrs, dict.fromkeys(adapters.names, 0), rngs


def adapter_state(trainer: Any, name: str) -> dict[str, Any]:
    """What adapter ``name``'s next step depends on (its weights and optimizer state, steps taken, random
    generator): a checkpoint of it alone (``load_adapter_state`` puts it back)."""
    return {
        "training": trainer.adapters.training_state(name),
        "steps": trainer.adapter_steps[name],
        "rng": trainer.adapter_rng[name].get_state(),
    }


def load_adapter_state(trainer: Any, name: str, state: dict[str, Any]) -> None:
    """Adapter ``name`` as ``adapter_state`` took it (the others untouched)."""
    cfg = trainer.adapter_config[name]
    betas = (cfg.adam_beta1, cfg.adam_beta2)
    trainer.adapters.load_training_state(state["training"], cfg.weight_decay, betas, cfg.adam_epsilon, name)
    trainer.adapter_steps[name] = int(state["steps"])
    trainer.adapter_rng[name].set_state(state["rng"])


def step_adapters(
    trainer: Any, groups: dict[str, Sequence[dict[str, torch.Tensor]]]
) -> dict[str, AdapterStep]:
    """One step of each adapter named in ``groups`` (``Adapters.names``; its micro-batches), all of them in one
    pass of the base's layers (each layer read and dequantized once, each micro-batch through its own
    adapter, stacked across adapters where peft mixes them: ``shares``); each adapter's loss divided by its own
    target tokens (its pairs, for a preference objective), its gradients clipped and stepped by its own optimizer at
    its own schedule's learning rate, exactly as it would be alone. An adapter whose loss or gradient norm is not
    finite is not stepped (``AdapterStep.error``); the others are."""
    if not trainer.adapter_config:
        raise ConfigError("step_adapters trains LoRA adapters over the base (method.type lora)")
    step_began = time.perf_counter()
    moved, sent = trainer.store.stats().bytes_moved, trainer.wire_sent()
    times_before = dict(trainer.times)
    tokens: dict[str, int] = {}
    batches: list[dict[str, torch.Tensor]] = []
    labels: list[torch.Tensor] = []
    for name, micro in groups.items():
        own = [mb.get("labels", mb["input_ids"]) for mb in micro]
        aim = trainer.adapter_config[name].objective
        tokens[name] = int(trainer.sharding.total(targets(aim, micro, own), torch.int64))
        if tokens[name] == 0:
            raise DataError(
                f"a training step of adapter {name} has no target tokens (every label is -100); check its "
                "data and max_seq_len"
            )
        seeds = torch.randint(0, 2**62, (len(micro),), generator=trainer.adapter_rng[name]).tolist()
        batches += [
            {
                **mb,
                "adapter": name,
                "adapter_tokens": tokens[name],
                "adapter_objective": aim,
                "stream_seed": seed,
            }
            for mb, seed in zip(micro, seeds, strict=True)
        ]
        labels += own
    schedule = trainer.schedule
    schedule.metrics, schedule.adapter_losses, schedule.adapter_metrics = {}, {}, {}
    waves = trainer.schedule.waves(len(batches))
    for w, wave in enumerate(waves):
        trainer.step_ctx.first_wave, trainer.step_ctx.last_wave = w == 0, w == len(waves) - 1
        trainer.schedule.run(
            [batches[k] for k in wave], [labels[k] for k in wave], sum(tokens.values()), len(batches)
        )
    began = time.perf_counter()
    adapters = trainer.adapters
    assert adapters is not None
    trainer.sharding.all_reduce_grads(adapters.params)
    out: dict[str, AdapterStep] = {}
    for name in groups:
        cfg = trainer.adapter_config[name]
        loss = float(trainer.sharding.total(schedule.adapter_losses.get(name, 0.0))) / tokens[name]
        lr = trainer.adapter_lr[name].lr(trainer.adapter_steps[name])
        clip = cfg.max_grad_norm if cfg.clips else None
        betas = (cfg.adam_beta1, cfg.adam_beta2)
        try:  # (every rank alike: the loss and the norm are the ranks' totals)
            if not math.isfinite(loss):
                adapters.zero_grad(name)
                raise NonFiniteError(f"the loss is {loss}")
            norm = trainer.compute.run(
                adapters.step, lr, cfg.weight_decay, betas, cfg.adam_epsilon, clip, name
            )
        except NonFiniteError as exc:  # this adapter's run stops; the others' steps are taken
            out[name] = AdapterStep(loss, float("nan"), lr, error=str(exc))
            continue
        trainer.adapter_steps[name] += 1
        metrics = step_metrics(cfg.objective, schedule.adapter_metrics.get(name, {}), trainer.sharding.total)
        out[name] = AdapterStep(loss, float(norm) if norm is not None else float("nan"), lr, metrics)
    first = next(iter(out.values()))  # the report's: the first adapter's of the step
    trainer.last_lr, trainer.last_grad_norm = first.learning_rate, first.grad_norm
    trainer.end_step(first.loss, began, step_began, times_before, moved, sent)
    return out


__all__ = [
    "AdapterStep",
    "backward",
    "check",
    "disable_dropout",
    "route",
    "schedules",
    "shares",
    "step_adapters",
]
