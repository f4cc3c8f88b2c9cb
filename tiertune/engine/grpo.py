"""GRPO's objective (TRL 1.16's ``GRPOTrainer._compute_loss``): a micro-batch of completions' loss from its tokens'
log-probabilities under the policy, the old policy (the one that sampled them; the policy itself, detached, when
each generation is used once) and the reference, and each completion's advantage; with TRL's normalisation per
``loss_type`` and TRL's metrics.

The importance weight ``w`` is each token's ``exp(logp - old)`` (``importance_sampling_level: token``) or one a
completion, ``exp`` of the mean of its tokens' log-ratios (``sequence``: GSPO). Per completion token, by
``loss_type``: ``grpo``, ``bnpo``, ``dr_grpo``, ``dapo``, ``luspo``: ``-min(w' * A, clamp(w, 1 - epsilon, 1 +
epsilon_high) * A)``, ``w'`` being ``w`` bounded above by ``delta`` where it is set (INTELLECT-2's two-sided clip;
else ``w``); ``cispo`` (MiniMax-M1): ``-min(w, epsilon_high) * A * logp``, the weight detached; ``sapo``:
``-sigmoid(tau * (w - 1)) * 4 / tau * A``, ``tau`` ``sapo_temperature_pos`` for a positive advantage and
``sapo_temperature_neg`` otherwise. Plus ``beta * (exp(ref - logp) - (ref - logp) - 1)`` (the k3 estimator of KL
to the reference, times ``w`` with ``use_bias_correction_kl``) when ``beta`` is not 0. A micro-batch's loss:
``grpo``, ``sapo``: the mean over its completions of each one's mean over its tokens, over the step's
micro-batches; ``bnpo``: the mean over its tokens, over the micro-batches; ``dr_grpo``: the sum over its tokens
over (completions x ``max_completion_length``), over the micro-batches; ``luspo``: the mean over its completions
of each one's sum over its tokens, over the micro-batches; ``dapo``, ``cispo``: the sum over its tokens over the
generation batch's completion tokens (``items``). Like DPO's, the objective is a function of the tokens'
log-probabilities, so its gradient reaches the head as a weighted cross-entropy (``engine.pairs``' way)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from tiertune.errors import ConfigError
from tiertune.settings import AGGREGATIONS, GRPO_LOSS_TYPES, IMPORTANCE_SAMPLING_LEVELS, SCALE_REWARDS

LOSS_TYPES = GRPO_LOSS_TYPES
"""GRPO's losses (TRL's ``loss_type``): what a token's loss is and how a micro-batch's are normalised (module
docstring)."""
CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
"""The losses of PPO's clipped ratio, whose clipped shares are logged (``CLIP_METRICS``)."""
PER_ITEM = ("dapo", "cispo")
"""The losses normalised by the generation batch's completion tokens over every process (``items``): not
averaged over the processes again."""
CLIP_METRICS = (
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_max",
)
"""The clipped ratios' metrics, TRL's names: the share of completion tokens (of completions, at the sequence level)
whose ratio the clip bounds from below (advantage < 0), from above (advantage > 0), either; the least and most of
one completion's shares."""
CISPO_METRICS = ("cispo_clip_ratio",)
"""CISPO's metric, TRL's name: the share of completion tokens whose weight its bound caps (advantage > 0)."""


def metric_names(objective: Any) -> tuple[str, ...]:
    """The metrics a GRPO step logs, each a micro-batch's value, their mean (TRL's): ``kl`` with ``beta``,
    ``entropy``, then the loss type's."""
    kl = ("kl",) if objective.beta != 0 else ()
    kl += (
        "entropy",
    )  # the policy's over the completion tokens (``engine.suffix``: the head's pass gives it)
    if objective.loss_type in CLIPPED:
        return kl + CLIP_METRICS
    return kl + (CISPO_METRICS if objective.loss_type == "cispo" else ())


def grpo_loss(
    logps: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    objective: Any,
    accumulation: int,
    items: float,
    entropy_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """A micro-batch's loss (autograd through ``logps``) and its metrics (``metric_names``, each this
    micro-batch's value: TRL logs their mean over micro-batches) from its completion tokens' log-probabilities
    ``logps`` ([completions, tokens]; ``mask`` 1 at a completion's tokens), the old policy's and the reference's
    (None: the policy's own, detached; no KL term), each completion's advantage; ``objective`` GRPO's settings
    (``ObjectiveSettings``: ``loss_type``, ``beta``, ``epsilon``, ``epsilon_high``, ``delta``,
    ``importance_sampling_level``, the SAPO temperatures, ``max_completion_length``, ``use_bias_correction_kl``),
    the step's ``accumulation`` micro-batches, and ``items`` (the generation batch's completion tokens over the
    processes, scaled to one step: ``dapo``'s and ``cispo``'s normaliser); ``entropy_mask`` (``high_entropy``:
    ``top_entropy_quantile``), the tokens whose policy term counts (the KL term counts at every token, the
    normalisers are unchanged: TRL's)."""
    o = objective
    if o.loss_type not in LOSS_TYPES:
        raise ConfigError(
            f"objective.loss_type {o.loss_type!r} is not a GRPO loss; one of {', '.join(LOSS_TYPES)}"
        )
    if o.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ConfigError(
            f"objective.importance_sampling_level must be token or sequence, got {o.importance_sampling_level!r}"
        )
    mask = mask.to(logps.dtype)
    adv = advantages.to(logps.dtype).unsqueeze(1)
    old = logps.detach() if old_logps is None else old_logps.to(logps.dtype)
    log_ratio = logps - old
    if o.importance_sampling_level == "sequence":  # GSPO: one weight a completion, [completions, 1]
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    ratio = torch.exp(log_ratio)
    low, high = o.epsilon, o.epsilon if o.epsilon_high is None else o.epsilon_high
    kl = None
    if o.beta != 0.0:
        if ref_logps is None:
            raise ValueError("GRPO with beta != 0 needs the reference's log-probabilities")
        gap = ref_logps.to(logps.dtype) - logps
        kl = torch.exp(gap) - gap - 1
        if o.use_bias_correction_kl:
            kl = kl * ratio
    if o.loss_type == "cispo":
        per_token = -torch.clamp(ratio, max=high).detach() * adv * logps
    elif o.loss_type == "sapo":
        tau = torch.where(adv > 0, o.sapo_temperature_pos, o.sapo_temperature_neg).to(logps.dtype)
        per_token = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * adv
    else:
        clipped = torch.clamp(ratio, 1 - low, 1 + high)
        if o.delta is not None:  # the unclipped side bounded too (TRL's clip ratios are of this one)
            ratio = torch.clamp(ratio, max=o.delta)
        per_token = -torch.min(ratio * adv, clipped * adv)
    if entropy_mask is not None:
        per_token = per_token * entropy_mask.to(logps.dtype)
    if kl is not None:
        per_token = per_token + o.beta * kl
    per_token = per_token * mask  # [completions, tokens]: a sequence-level loss broadcast over its tokens
    tokens = mask.sum()
    if o.loss_type in ("grpo", "sapo"):
        loss = (per_token.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / accumulation
    elif o.loss_type == "bnpo":
        loss = per_token.sum() / tokens.clamp(min=1.0) / accumulation
    elif o.loss_type == "dr_grpo":
        loss = per_token.sum() / (per_token.size(0) * o.max_completion_length) / accumulation
    elif o.loss_type == "luspo":
        loss = per_token.sum(-1).mean() / accumulation
    else:  # dapo, cispo
        loss = per_token.sum() / max(items, 1.0)
    with torch.no_grad():
        metrics = _metrics(ratio, adv, mask, kl, o, low, high)
    return loss, metrics


def high_entropy(
    entropies: torch.Tensor, mask: torch.Tensor, quantile: float, gathered: bool = True
) -> torch.Tensor:
    """The completion tokens (``mask``) whose entropy is at least the ``1 - quantile`` quantile of every
    completion token's of the micro-batch, on every process (TRL's ``get_high_entropy_mask``: each process's
    micro-batch at the same place in the step; not ``gathered``: this process's alone), as a bool mask; none
    where no process has a token."""
    local = entropies[mask.bool()].float()
    every = local
    if gathered and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, local.cpu())
        every = torch.cat(parts).to(local.device)
    if every.numel() == 0:
        return torch.zeros_like(mask, dtype=torch.bool)
    threshold = torch.quantile(every, 1.0 - quantile)
    return (entropies * mask.to(entropies.dtype) >= threshold) & mask.bool()


def _metrics(
    ratio: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    kl: torch.Tensor | None,
    o: Any,
    low: float,
    high: float,
) -> dict[str, float]:
    """A micro-batch's ``metric_names``, as TRL takes them (a sequence-level share over completions)."""
    tokens = mask.sum()

    def masked_mean(x: torch.Tensor) -> float:
        if x.shape[1] == 1:  # one value a completion
            return float(x.sum() / max(1, x.shape[0]))
        return float((x * mask).sum() / tokens.clamp(min=1.0))

    def per_completion(x: torch.Tensor) -> torch.Tensor:  # NaN for a completion without tokens, as TRL's
        return x.squeeze(1) if x.shape[1] == 1 else (x * mask).sum(-1) / mask.sum(-1)

    metrics: dict[str, float] = {}
    if kl is not None:
        metrics["kl"] = masked_mean(kl)
    if o.loss_type == "cispo":
        metrics["cispo_clip_ratio"] = masked_mean(((ratio > high) & (adv > 0)).to(mask.dtype))
    if o.loss_type not in CLIPPED:
        return metrics
    low_clip = ((ratio < 1 - low) & (adv < 0)).to(mask.dtype)
    high_clip = ((ratio > 1 + high) & (adv > 0)).to(mask.dtype)
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
    return metrics


def _nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The standard deviation (Bessel-corrected) of ``x``'s values that are not NaN (TRL's ``nanstd``)."""
    mean = torch.nanmean(x, dim=dim, keepdim=dim is not None)
    variance = torch.nanmean((x - mean) ** 2, dim=dim)
    count = (~torch.isnan(x)).sum(dim=dim) if dim is not None else (~torch.isnan(x)).sum()
    return torch.sqrt(variance * count / (count - 1))


def advantages(
    rewards_per_func: torch.Tensor,
    weights: torch.Tensor,
    generations: int,
    scale_rewards: str = "group",
    aggregation: str = "sum_then_normalize",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Each completion's advantage from each reward function's reward (``rewards_per_func``: [completions,
    functions], each prompt's ``generations`` completions in a row, NaN where a function gave none) and the
    functions' ``weights`` (TRL's ``multi_objective_aggregation``): ``sum_then_normalize``, the weighted sum (NaN
    for a completion no function scored, whose advantage is then 0) minus its group's mean, over the group's
    standard deviation (``scale_rewards`` group; ``batch``: the whole batch's; ``none``: not scaled) + 1e-4;
    ``normalize_then_sum`` (GDPO), each function's reward normalised within its group first, their weighted sum
    then normalised over the batch. TRL's metrics: ``reward``, ``reward_std`` (of the weighted sums of the raw
    rewards), ``frac_reward_zero_std`` and each function's ``rewards/<i>/mean`` and ``std`` (by its index here:
    the caller names them)."""
    if scale_rewards not in SCALE_REWARDS:
        raise ConfigError(f"objective.scale_rewards must be group, batch or none; got {scale_rewards!r}")
    if aggregation not in AGGREGATIONS:
        raise ConfigError(
            f"objective.multi_objective_aggregation must be {' or '.join(AGGREGATIONS)}; got {aggregation!r}"
        )
    count = rewards_per_func.shape[0]
    if generations < 1 or count % generations:
        raise ConfigError(f"{count} completions are not whole groups of num_generations {generations}")
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    raw = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
    raw[unscorable] = torch.nan
    if aggregation == "normalize_then_sum":
        grouped = rewards_per_func.view(-1, generations, rewards_per_func.shape[1])
        mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
        std_k = _nanstd(grouped, dim=1).unsqueeze(1) if generations > 1 else torch.zeros_like(mean_k)
        each = ((grouped - mean_k) / (std_k + 1e-4)).view(-1, rewards_per_func.shape[1])
        rewards = (each * weights.unsqueeze(0)).nansum(dim=1)
        rewards[unscorable] = torch.nan
        std = _nanstd(rewards).expand_as(rewards) if count > 1 else torch.zeros_like(rewards)
        out = (rewards - torch.nanmean(rewards)) / (std + 1e-4)
    else:
        rewards = raw
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
        "reward": float(torch.nanmean(raw)),
        "reward_std": float(_nanstd(raw)),
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


def token_logps_and_entropies_head(temperature: float) -> Callable[[Any, Any, torch.Tensor], Any]:
    """``token_logps_head``'s figures and each target token's entropy of the tempered softmax, as a pair (fp32,
    on the host): GRPO's evaluation of the policy (``finetune.grpo_evaluation``)."""

    def head(engine: Any, mb: Any, last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with engine.loss.tempered(temperature):
            losses, entropies = engine.compute.token_losses_and_entropies(
                engine.loss, last, mb.ids, mb.extra, mb.target
            )
        if engine.compute.ledger:
            return -losses.float(), entropies.float()
        return -losses.float().cpu(), entropies.float().cpu()

    return head


__all__ = [
    "CISPO_METRICS",
    "CLIPPED",
    "CLIP_METRICS",
    "LOSS_TYPES",
    "PER_ITEM",
    "advantages",
    "grpo_loss",
    "high_entropy",
    "metric_names",
    "token_logps_and_entropies_head",
    "token_logps_head",
]
