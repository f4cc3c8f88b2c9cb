"""GRPO's objective (TRL 1.16's ``GRPOTrainer._compute_loss``, token-level importance sampling): a micro-batch of
completions' loss from its tokens' log-probabilities under the policy, the old policy (the one that sampled them;
the policy itself, detached, when each generation is used once) and the reference, and each completion's
advantage; with TRL's normalisation per ``loss_type`` and TRL's metrics.

Per completion token: ``ratio = exp(logp - old)``, ``-min(ratio * A, clamp(ratio, 1 - epsilon, 1 + epsilon_high)
* A)``, plus ``beta * (exp(ref - logp) - (ref - logp) - 1)`` (the k3 estimator of KL to the reference) when
``beta`` is not 0. A micro-batch's loss: ``grpo``: the mean over its completions of each one's mean over its
tokens, over the step's micro-batches; ``bnpo``: the mean over its tokens, over the micro-batches; ``dr_grpo``:
the sum over its tokens over (completions x ``max_completion_length``), over the micro-batches; ``dapo``: the sum
over its tokens over the generation batch's completion tokens (``items``). Like DPO's, the objective is a
function of the tokens' log-probabilities, so its gradient reaches the head as a weighted cross-entropy
(``engine.pairs``' way)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tiertune.errors import ConfigError
from tiertune.settings import GRPO_LOSS_TYPES

LOSS_TYPES = GRPO_LOSS_TYPES
"""GRPO's losses (TRL's ``loss_type``): how a micro-batch's token losses are normalised (module docstring)."""
CLIP_METRICS = (
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_max",
)
"""The clipped ratios' metrics, TRL's names: the share of completion tokens whose ratio the clip bounds from below
(advantage < 0), from above (advantage > 0), either; the least and most of one completion's shares."""


def grpo_loss(
    logps: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    loss_type: str,
    beta: float,
    epsilon: float,
    epsilon_high: float | None,
    accumulation: int,
    max_completion_length: int,
    items: float,
    bias_correction: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """A micro-batch's loss (autograd through ``logps``) and its metrics (``kl`` with ``beta``, ``CLIP_METRICS``,
    each this micro-batch's value: TRL logs their mean over micro-batches) from its completion tokens'
    log-probabilities ``logps`` ([completions, tokens]; ``mask`` 1 at a completion's tokens), the old policy's
    and the reference's (None: the policy's own, detached; no KL term), each completion's advantage; the step's
    ``accumulation`` micro-batches, ``max_completion_length``, and ``items`` (the generation batch's completion
    tokens over the processes, scaled to one step: ``dapo``'s normaliser)."""
    if loss_type not in LOSS_TYPES:
        raise ConfigError(
            f"objective.loss_type {loss_type!r} is not a GRPO loss; one of {', '.join(LOSS_TYPES)}"
        )
    mask = mask.to(logps.dtype)
    adv = advantages.to(logps.dtype).unsqueeze(1)
    old = logps.detach() if old_logps is None else old_logps.to(logps.dtype)
    ratio = torch.exp(logps - old)
    low, high = epsilon, epsilon if epsilon_high is None else epsilon_high
    clipped = torch.clamp(ratio, 1 - low, 1 + high)
    per_token = -torch.min(ratio * adv, clipped * adv)
    kl = None
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("GRPO with beta != 0 needs the reference's log-probabilities")
        gap = ref_logps.to(logps.dtype) - logps
        kl = torch.exp(gap) - gap - 1
        if bias_correction:
            kl = kl * ratio
        per_token = per_token + beta * kl
    tokens = mask.sum()
    if loss_type == "grpo":
        loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / accumulation
    elif loss_type == "bnpo":
        loss = (per_token * mask).sum() / tokens.clamp(min=1.0) / accumulation
    elif loss_type == "dr_grpo":
        loss = (per_token * mask).sum() / (per_token.size(0) * max_completion_length) / accumulation
    else:  # dapo
        loss = (per_token * mask).sum() / max(items, 1.0)
    metrics: dict[str, float] = {}
    with torch.no_grad():

        def masked_mean(x: torch.Tensor) -> float:
            return float((x * mask).sum() / tokens.clamp(min=1.0))

        def per_completion(x: torch.Tensor) -> torch.Tensor:  # NaN for a completion without tokens, as TRL's
            return (x * mask).sum(-1) / mask.sum(-1)

        if kl is not None:
            metrics["kl"] = masked_mean(kl)
        low_clip = ((ratio < 1 - low) & (adv < 0)).to(logps.dtype)
        high_clip = ((ratio > 1 + high) & (adv > 0)).to(logps.dtype)
        metrics["clip_ratio/low_mean"] = masked_mean(low_clip)
        metrics["clip_ratio/high_mean"] = masked_mean(high_clip)
        metrics["clip_ratio/region_mean"] = masked_mean(torch.maximum(low_clip, high_clip))
        lows, highs = per_completion(low_clip), per_completion(high_clip)
        metrics["clip_ratio/low_min"] = (
            float(lows[~lows.isnan()].min()) if (~lows.isnan()).any() else float("nan")
        )
        metrics["clip_ratio/high_max"] = (
            float(highs[~highs.isnan()].max()) if (~highs.isnan()).any() else float("nan")
        )
    return loss, metrics


def _nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The standard deviation (Bessel-corrected) of ``x``'s values that are not NaN (TRL's ``nanstd``)."""
    mean = torch.nanmean(x, dim=dim, keepdim=dim is not None)
    variance = torch.nanmean((x - mean) ** 2, dim=dim)
    count = (~torch.isnan(x)).sum(dim=dim) if dim is not None else (~torch.isnan(x)).sum()
    return torch.sqrt(variance * count / (count - 1))


def advantages(
    rewards_per_func: torch.Tensor, weights: torch.Tensor, generations: int, scale_rewards: str = "group"
) -> tuple[torch.Tensor, dict[str, float]]:
    """Each completion's advantage (TRL's ``sum_then_normalize``) from each reward function's reward
    (``rewards_per_func``: [completions, functions], each prompt's ``generations`` completions in a row, NaN where
    a function gave none) and the functions' ``weights``: the weighted sum (NaN for a completion no function
    scored, whose advantage is then 0) minus its group's mean, over the group's standard deviation
    (``scale_rewards`` group; ``batch``: the whole batch's; ``none``: not scaled) + 1e-4; and TRL's metrics
    ``reward``, ``reward_std``, ``frac_reward_zero_std`` and each function's ``rewards/<i>/mean`` and ``std``
    (by its index here: the caller names them)."""
    if scale_rewards not in ("group", "batch", "none"):
        raise ConfigError(f"objective.scale_rewards must be group, batch or none; got {scale_rewards!r}")
    count = rewards_per_func.shape[0]
    if generations < 1 or count % generations:
        raise ConfigError(f"{count} completions are not whole groups of num_generations {generations}")
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable] = torch.nan
    grouped = rewards.view(-1, generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(generations)
    if scale_rewards == "batch":
        std = _nanstd(rewards).expand_as(rewards) if count > 1 else torch.zeros_like(rewards)
    else:  # (``none`` too: for the zero-std share logged)
        std = (
            _nanstd(grouped, dim=1).repeat_interleave(generations)
            if generations > 1
            else torch.zeros_like(rewards)
        )
    out = rewards - mean
    if scale_rewards != "none":
        out = out / (std + 1e-4)
    out = torch.nan_to_num(out, nan=0.0)
    metrics = {
        "reward": float(torch.nanmean(rewards)),
        "reward_std": float(_nanstd(rewards)),
        "frac_reward_zero_std": float(torch.isclose(std, torch.zeros_like(std)).float().mean()),
    }
    for i in range(rewards_per_func.shape[1]):
        metrics[f"rewards/{i}/mean"] = float(torch.nanmean(rewards_per_func[:, i]))
        metrics[f"rewards/{i}/std"] = float(_nanstd(rewards_per_func[:, i]))
    return out, metrics


def token_logps_head(temperature: float) -> Callable[[Any, Any, torch.Tensor], torch.Tensor]:
    """A frozen pass's head (``StreamedTrainer.sequence_logps``) that keeps each target token's log-probability
    under ``softmax(logits / temperature)`` ([rows, length - 1], 0 off the targets; fp32, on the host): GRPO's
    reference of a full fine-tune, scored by the initial weights beside the policy (``finetune.reference``)."""

    def head(engine: Any, mb: Any, last: torch.Tensor) -> torch.Tensor:
        with engine.loss.tempered(temperature):
            losses = engine.compute.token_losses(engine.loss, last, mb.ids, mb.extra, mb.target)
        return -losses.float() if engine.compute.ledger else -losses.float().cpu()

    return head


__all__ = ["CLIP_METRICS", "LOSS_TYPES", "advantages", "grpo_loss", "token_logps_head"]
