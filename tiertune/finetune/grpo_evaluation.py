"""GRPO's evaluation (``objective.type: grpo`` with ``training.eval_strategy``; TRL 1.16's ``GRPOTrainer``
evaluating its ``eval_dataset``): the held-out prompts (``data.eval_path``, ``data.format: prompt``) sampled by
the model as it is after the step, ``num_generations_eval`` completions of each, scored by the run's reward
functions.

Every held-out prompt is taken, in the file's order, each ``num_generations_eval`` times in a row; the
completions are sampled a step's generation at a time (``per_device_train_batch_size x
gradient_accumulation_steps`` of them: the budgets were planned for those; the last may hold fewer), by the
run's sampler (the streamed model, or the server a run pushes its adapter to), each from a generator seeded by
the run's seed and the completion's place in the set: every evaluation samples with the same seeds, so two
evaluations differ by the weights alone. The set is then scored as TRL scores one evaluation batch that holds
all of it (``per_device_eval_batch_size`` the set's completions): the rewards (TRL's call, ``trainer_state``
the step), the advantages over each prompt's group (``scale_rewards``; ``batch``: the set's), and
``eval_loss``, GRPO's loss of the set's completions at the policy that sampled them (the ratio 1: each token's
``-A``, with ``beta`` the KL term to the reference), normalised per ``loss_type`` over the whole set (``grpo``:
the mean over completions of each one's mean over its tokens; ``bnpo``, ``dapo``: over the set's completion
tokens; ``dr_grpo``: over completions x ``max_completion_length``). The policy's log-probabilities come from
passes of the layers without autograd (``gradient_accumulation_steps`` micro-batches a pass); the reference's,
with ``beta``, from the base with the adapters off (LoRA) or the initial weights beside the policy (a full
fine-tune's ``ReferenceBeside``).

The record is TRL's with ``eval_`` before each name: ``eval_loss``, ``eval_reward``, ``eval_reward_std``,
``eval_frac_reward_zero_std``, ``eval_rewards/<function>/mean`` and ``/std``, ``eval_completions/...``, the
metrics the reward functions log, ``eval_entropy`` (the policy's over the completion tokens), ``eval_kl`` and the
loss type's metrics (the clip ratios: 0 at the ratio 1), with the Trainer's
``eval_runtime``, ``eval_samples_per_second`` (completions) and ``eval_steps_per_second``, and ``bytes_moved``.
Of several processes each evaluates the whole set (the sharded weights are gathered by every rank alike): the
record is the same on each. A sample of the completions goes to ``completions.jsonl`` with ``"eval": true``.
Early stopping and ``load_best_model_at_end`` may compare ``eval_reward`` (higher is better:
``training.metric_for_best_model``)."""

from __future__ import annotations

import time
from typing import Any

import torch

from tiertune.engine.grpo import (
    advantages,
    grpo_loss,
    high_entropy,
    token_logps_and_entropies_head,
    token_logps_head,
)
from tiertune.errors import DataError
from tiertune.finetune.grpo import Generation, Rollouts, generation_seed
from tiertune.kernels.ops.linear_ce import IGNORE_INDEX

EVAL_GENERATION = -1
"""The generation number an evaluation's completions are seeded with (``generation_seed``): none of the run's."""


def evaluate_rollouts(rollouts: Rollouts, data: Any, step: int) -> dict[str, float]:
    """The held-out prompts of ``data`` sampled, rewarded and scored by ``rollouts``' model as it is after step
    ``step`` (0: before the first): the record (see the module docstring), without ``epoch`` and ``step``,
    which the run adds."""
    began = time.perf_counter()
    trainer, o = rollouts.trainer, rollouts.objective
    trainer.settle()  # a delayed update in flight done, as a checkpoint waits for it
    model = trainer.model
    was_training = model.training
    generations = o.generations_eval
    rows = [row for row in data.rows for _ in range(generations)]
    if not rows:
        raise DataError("the evaluation set has no prompts: check data.eval_path")
    seed = rollouts.recipe.training.seed
    prompt_ids: list[list[int]] = []
    completion_ids: list[list[int]] = []
    prompts: list[Any] = []
    completions: list[Any] = []
    truncated: list[bool] = []
    rewards = []
    logged_metrics: dict[str, list[float]] = {}
    logged: dict[str, list[Any]] = {}
    model.eval()
    try:
        for start in range(0, len(rows), rollouts.completions):  # a step's generation at a time
            chunk = rows[start : start + rollouts.completions]
            seeds = [generation_seed(seed, EVAL_GENERATION, start + r) for r in range(len(chunk))]
            ids, done, asked, said, cut = rollouts.sample(chunk, seeds)
            rewards.append(rollouts.score(chunk, asked, said, done, step, logged_metrics, logged))
            prompt_ids += ids
            completion_ids += done
            prompts += asked
            completions += said
            truncated += cut
        scored = torch.cat(rewards)
        adv, metrics = advantages(
            scored, rollouts.rewards.weights, generations, o.scale_rewards, o.multi_objective_aggregation
        )
        metrics = rollouts.named(metrics, logged_metrics)
        metrics.update(rollouts.completion_metrics(prompt_ids, completion_ids, truncated, trained=False))
        batch = Generation(rows, prompt_ids, completion_ids, truncated, adv, scored, completions, metrics)
        loss, loss_metrics = _loss(rollouts, batch)
    finally:
        model.train(was_training)
    metrics.update(loss_metrics)
    rollouts.write_samples(batch, prompts, {"step": step, "eval": True}, logged)
    runtime = time.perf_counter() - began
    micro = -(-len(rows) // rollouts.recipe.training.per_device_train_batch_size)
    return {
        "eval_loss": loss,
        **{f"eval_{name}": value for name, value in metrics.items()},
        "eval_runtime": round(runtime, 4),
        "eval_samples_per_second": round(len(rows) / runtime, 3),
        "eval_steps_per_second": round(micro / runtime, 3),
        # per link since the store started, as a step's
        "bytes_moved": dict(rollouts.trainer.store_stats().bytes_moved),
    }


def _loss(rollouts: Rollouts, batch: Generation) -> tuple[float, dict[str, float]]:
    """GRPO's loss of the set's completions as one batch at the ratio 1 (the module docstring), and its metrics
    (``kl`` with ``beta``, the loss type's, ``entropy``)."""
    o, trainer = rollouts.objective, rollouts.trainer
    micro = rollouts.micro_batches(batch)
    passes = rollouts.step_groups(micro)
    scored = [
        pair
        for group in passes
        for pair in trainer.sequence_logps(group, token_logps_and_entropies_head(o.temperature))
    ]
    policy = [logps for logps, _ in scored]
    head = token_logps_head(o.temperature)
    reference: list[torch.Tensor] | None = None
    if o.beta != 0.0:
        if rollouts.reference is not None:  # a full fine-tune's: the initial weights beside the policy
            for group in passes:
                rollouts.reference.score(group)
            reference = [mb.pop("ref_logps") for mb in micro]
        else:  # LoRA's: the base, its adapters off
            with trainer.reference():
                reference = [logps for group in passes for logps in trainer.sequence_logps(group, head)]
    width = max(int(mb["input_ids"].shape[1]) for mb in micro) - 1

    def padded(parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([torch.nn.functional.pad(p.float().cpu(), (0, width - p.shape[1])) for p in parts])

    mask = padded([(mb["labels"][:, 1:] != IGNORE_INDEX).float() for mb in micro])
    entropies = padded([e for _, e in scored])
    entropy = float((entropies * mask).sum() / mask.sum().clamp(min=1.0))
    selected = None
    if o.top_entropy_quantile < 1.0:  # the set's highest-entropy tokens, as TRL's evaluation batch
        selected = high_entropy(entropies, mask, o.top_entropy_quantile, gathered=False)  # (every rank: all)
    loss, metrics = grpo_loss(
        padded(policy),
        mask,
        batch.advantages,
        None,
        padded(reference) if reference is not None else None,
        o,
        1,
        float(mask.sum()),
        selected,
    )
    return float(loss), {**metrics, "entropy": entropy}


__all__ = ["EVAL_GENERATION", "evaluate_rollouts"]
