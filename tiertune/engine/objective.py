"""Preference objectives: the loss of a micro-batch of pairs (its chosen sequences, then its rejected ones) from
its tokens' losses, with TRL's names and formulas (1.16: ``DPOTrainer``; ``CPOTrainer`` with ``loss_type:
simpo``; ``ORPOTrainer``).

A sequence's log-probability is the sum of its completion tokens' log-probabilities (SimPO and ORPO: their
mean) under the policy (the model being trained) and, for DPO, under the reference (the base with its adapters
off, run in the same layer visit as the policy: ``engine.schedule``; a full fine-tune's initial weights,
computed before training: ``finetune.reference``). The objective is a function of the tokens' losses, so its
gradient reaches the head as a weighted cross-entropy: each token's weight is the derivative of the
micro-batch's loss by that token's loss. The head runs twice, both times fused and tiled
(``kernels.ops.linear_ce``): once without autograd for the tokens' losses, once with the weights for the
gradients; the [tokens x vocabulary] logits never exist.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from tiertune.errors import DataError
from tiertune.kernels.ops.linear_ce import IGNORE_INDEX
from tiertune.settings import DPO_LOSS_TYPES, ObjectiveSettings

LOSS_TYPES = DPO_LOSS_TYPES
"""DPO's losses (TRL's ``loss_type``), by ``beta * delta``, where ``delta`` is the chosen sequence's log-ratio
(policy over reference) minus the rejected one's: ``sigmoid``: ``-log sigmoid(beta * delta)``; ``hinge``:
``relu(1 - beta * delta)``; ``ipo``: ``(delta' - 1 / (2 beta))^2`` with each log-ratio divided by its
completion's tokens (TRL's length normalization)."""
METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)
"""What every preference step logs (TRL's names): a mean over the step's pairs (KTO's: over its micro-batches, of
each micro-batch's means over its desirable and its undesirable rows, as TRL logs them)."""
EXTRA_METRICS = {
    "simpo": ("nll_loss",),
    "orpo": ("nll_loss", "log_odds_ratio", "log_odds_chosen"),
    "kto": ("kl",),
}
"""What an objective logs beside ``METRICS``, each a mean over the step's micro-batches (TRL's)."""


DISTILL_METRICS = ("kd_loss", "ce_loss")
"""What a distillation step logs: its scored tokens' mean divergence from the teacher and mean cross-entropy on
the data (``loss`` is ``alpha`` x the second + (1 - ``alpha``) x the first)."""


def metric_names(settings: ObjectiveSettings) -> tuple[str, ...]:
    """The metrics a step of the objective logs (every rank sums the same ones, in this order)."""
    if settings.distills:
        return DISTILL_METRICS
    if settings.rollouts:  # each a micro-batch's value, their mean logged (TRL's)
        from tiertune.engine.grpo import metric_names as grpo_metrics

        return grpo_metrics(settings)
    if not settings.paired:
        return ()
    names = METRICS if settings.type != "kto" else tuple(m for m in METRICS if m != "rewards/accuracies")
    return names + EXTRA_METRICS.get(settings.type, ())


def add_metric(sums: dict[str, tuple[float, float]], name: str, value: float, count: float) -> None:
    """Add ``value``, over ``count`` of what it is a mean of, into ``sums``'s ``name`` (a sum and a count, as
    ``step_metrics`` reads them)."""
    before = sums.get(name, (0.0, 0.0))
    sums[name] = (before[0] + value, before[1] + count)


def step_metrics(
    settings: ObjectiveSettings, sums: dict[str, tuple[float, float]], total: Callable[[float], Any]
) -> dict[str, float]:
    """A step's metrics of the objective (``metric_names``) from their sums and counts in this process
    (``sums``), each summed over the ranks by ``total`` (a collective: every rank calls it for the same names in
    the same order) and divided by its count; a metric that counted nothing is left out."""
    out: dict[str, float] = {}
    for name in metric_names(settings):
        value, count = sums.get(name, (0.0, 0.0))
        count = float(total(count))
        if count:
            out[name] = float(total(value)) / count
    return out


def pair_losses(
    settings: ObjectiveSettings,
    token_losses: torch.Tensor,
    completion: torch.Tensor,
    ref_logps: torch.Tensor | None,
    targets: torch.Tensor | None = None,
    desirable: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, tuple[float, float]]]:
    """Each pair's loss and the micro-batch's metrics (``metric_names``: each a sum and what it counts) from its
    sequences' per-token losses (``token_losses``, [2 x pairs, length - 1]: chosen rows, then
    rejected; autograd flows through them; 0 where a token has no target), which of those tokens are the
    completions' (``completion``), which are targets at all (``targets``: ORPO's, the prompts' too) and the
    reference's sequence log-probabilities (``ref_logps``, None without a reference). KTO's "pairs" are a row
    and its KL sequence (``data``: its prompt, another row's completion), ``desirable`` its rows' labels. A pair without a target in either sequence (a rank's padding: ``finetune.ranks``) has no loss
    and no metrics. A term that TRL takes as a mean over the micro-batch (SimPO's and ORPO's cross-entropy) is
    split evenly over its pairs, so the step's mean over pairs is TRL's mean over micro-batches."""
    completion = completion.to(token_losses.dtype)
    tokens = completion.sum(1)
    valid = counted(tokens).to(token_losses.dtype)
    pairs = valid.sum().clamp(min=1.0)
    logps = -(token_losses.float() * completion).sum(1)
    kind, beta = settings.type, settings.beta
    extra: dict[str, torch.Tensor] = {}
    if kind in ("simpo", "orpo"):  # the completions' mean log-probabilities
        logps = logps / tokens.clamp(min=1.0)
    chosen, rejected = logps.chunk(2)
    if kind == "kto":
        return _kto(settings, chosen, rejected, ref_logps, valid, desirable)
    if kind == "dpo":
        zero = torch.zeros_like(chosen)
        ref_chosen, ref_rejected = (zero, zero) if ref_logps is None else ref_logps.float().chunk(2)
        chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
        delta = chosen_ratio - rejected_ratio
        if settings.loss_type == "sigmoid":
            losses = -F.logsigmoid(beta * delta)
        elif settings.loss_type == "hinge":
            losses = torch.relu(1 - beta * delta)
        elif settings.loss_type == "ipo":
            chosen_tokens, rejected_tokens = tokens.clamp(min=1.0).chunk(2)
            losses = (chosen_ratio / chosen_tokens - rejected_ratio / rejected_tokens - 1 / (2 * beta)) ** 2
        else:
            raise ValueError(f"no DPO loss {settings.loss_type!r} (the recipe checks objective.loss_type)")
        chosen_rewards, rejected_rewards = beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
    elif kind == "simpo":  # TRL's CPOTrainer, loss_type simpo (no label smoothing)
        losses = -F.logsigmoid(beta * (chosen - rejected) - settings.simpo_gamma)
        if settings.cpo_alpha:  # the chosen completions' mean cross-entropy over the micro-batch
            chosen_completion = completion.chunk(2)[0] * valid.unsqueeze(1)
            nll = (token_losses.chunk(2)[0] * chosen_completion).sum() / chosen_completion.sum().clamp(
                min=1.0
            )
            losses = losses + settings.cpo_alpha * nll
            extra["nll_loss"] = nll.detach()
        chosen_rewards, rejected_rewards = beta * chosen.detach(), beta * rejected.detach()
    elif kind == "orpo":  # the chosen sequences' mean cross-entropy, every token (the prompt's too)
        if targets is None:
            raise ValueError("ORPO's cross-entropy needs every target of the chosen sequences (targets)")
        chosen_all = targets.chunk(2)[0].to(token_losses.dtype) * valid.unsqueeze(1)
        nll = (token_losses.chunk(2)[0] * chosen_all).sum() / chosen_all.sum().clamp(min=1.0)
        log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
        ratio = F.logsigmoid(log_odds)
        losses = nll - beta * ratio
        extra = {
            "nll_loss": nll.detach(),
            "log_odds_ratio": (ratio.detach() * valid).sum() / pairs,
            "log_odds_chosen": (log_odds.detach() * valid).sum() / pairs,
        }
        chosen_rewards, rejected_rewards = beta * chosen.detach(), beta * rejected.detach()
    else:
        raise ValueError(f"no preference objective {kind!r} (the recipe checks objective.type)")
    n = float(valid.sum())
    metrics = {
        "rewards/chosen": (float((chosen_rewards * valid).sum()), n),
        "rewards/rejected": (float((rejected_rewards * valid).sum()), n),
        "rewards/accuracies": (float(((chosen_rewards > rejected_rewards).float() * valid).sum()), n),
        "rewards/margins": (float(((chosen_rewards - rejected_rewards) * valid).sum()), n),
        "logps/chosen": (float((chosen.detach() * valid).sum()), n),
        "logps/rejected": (float((rejected.detach() * valid).sum()), n),
    }
    metrics.update(
        {k: (float(v), float(n > 0)) for k, v in extra.items()}
    )  # a micro-batch's mean, counted once
    return losses * valid, metrics


def _kto(
    settings: ObjectiveSettings,
    logps: torch.Tensor,
    kl_logps: torch.Tensor,
    ref_logps: torch.Tensor | None,
    valid: torch.Tensor,
    desirable: torch.Tensor | None,
) -> tuple[torch.Tensor, dict[str, tuple[float, float]]]:
    """KTO (TRL's ``KTOTrainer``, loss_type kto): each row's loss against the micro-batch's KL estimate (its KL
    sequences' mean log-ratio, no gradient, at least 0); the metrics as TRL logs them, each micro-batch's mean
    over its desirable rows and over its undesirable ones."""
    if ref_logps is None or desirable is None:
        raise ValueError("KTO needs the reference's log-probabilities and each row's label")
    ref, ref_kl = ref_logps.float().chunk(2)
    ratio = logps - ref
    rows = valid.sum().clamp(min=1.0)
    kl = (((kl_logps.detach() - ref_kl) * valid).sum() / rows).clamp(min=0)
    beta = settings.beta
    good = desirable.bool() & valid.bool()
    bad = ~desirable.bool() & valid.bool()
    losses = torch.where(
        good,
        settings.desirable_weight * (1 - torch.sigmoid(beta * (ratio - kl))),
        settings.undesirable_weight * (1 - torch.sigmoid(beta * (kl - ratio))),
    )
    rewards = beta * ratio.detach()
    metrics: dict[str, tuple[float, float]] = {"kl": (float(kl), float(valid.sum() > 0))}
    means = {}
    for name, rows_of in (("chosen", good), ("rejected", bad)):
        if rows_of.any():
            means[name] = float(rewards[rows_of].mean())
            metrics[f"rewards/{name}"] = (means[name], 1.0)
            metrics[f"logps/{name}"] = (float(logps.detach()[rows_of].mean()), 1.0)
    if len(means) == 2:
        metrics["rewards/margins"] = (means["chosen"] - means["rejected"], 1.0)
    return losses * valid, metrics


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, stable on both sides of ``-ln 2``."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def counted(tokens: torch.Tensor) -> torch.Tensor:
    """Which pairs of a micro-batch count (a target in both sequences), from each sequence's target tokens
    ([2 x pairs]: chosen, then rejected)."""
    chosen, rejected = tokens.chunk(2)
    return (chosen > 0) & (rejected > 0)


def targets(
    settings: ObjectiveSettings,
    micro_batches: Sequence[dict[str, torch.Tensor]],
    labels: Sequence[torch.Tensor],
) -> int:
    """What a step's loss is the mean over in this process: its target tokens, or, for a preference objective,
    its pairs with targets in both sequences (a rank's padding pair has none); each micro-batch of pairs
    checked to hold them as ``pairs`` says (of GRPO's completions, each micro-batch checked to hold their
    ``advantages``: its completion tokens, ``dapo``'s normaliser)."""
    if settings.rollouts and not all(
        "advantages" in mb and len(mb["advantages"]) == len(mb["input_ids"]) for mb in micro_batches
    ):
        raise DataError(
            "objective.type grpo trains on scored completions: each micro-batch needs 'advantages', one a row "
            "(finetune.grpo makes them)"
        )
    if not settings.paired:
        return sum(int((lab[:, 1:] != IGNORE_INDEX).sum()) for lab in labels)
    if not all("pairs" in mb and 2 * int(mb["pairs"]) == len(mb["input_ids"]) for mb in micro_batches):
        raise DataError(
            f"objective.type {settings.type} trains on pairs: each micro-batch needs 'pairs' and twice "
            "as many rows (chosen, then rejected; data.format: preference)"
        )
    return sum(int(counted((lab[:, 1:] != IGNORE_INDEX).sum(1)).sum()) for lab in labels)


CONFIG_RATES = ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "attn_pdrop", "embd_pdrop")
"""The dropout rates a model's config may hold (``disable_dropout`` sets them to 0)."""


def base_drops(model: torch.nn.Module) -> bool:
    """Whether ``model`` outside its LoRA adapters drops anything in training: a dropout module or a rate of its
    config above 0."""
    config = getattr(model, "config", None)
    if any(isinstance(getattr(config, n, None), float) and getattr(config, n) > 0 for n in CONFIG_RATES):
        return True
    return any(
        isinstance(m, torch.nn.Dropout) and m.p > 0 and "lora_dropout" not in name
        for name, m in model.named_modules()
    )


def disable_dropout(model: torch.nn.Module) -> None:
    """Every dropout module of ``model`` (its adapters' among them) set to drop nothing (TRL's
    ``disable_dropout``); attention dropout rates in the model's config too."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    config = getattr(model, "config", None)
    for name in CONFIG_RATES:
        if isinstance(getattr(config, name, None), float):
            setattr(config, name, 0.0)
    for module in model.modules():  # transformers' attention modules keep their own copy of the rate
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


__all__ = [
    "CONFIG_RATES",
    "DISTILL_METRICS",
    "EXTRA_METRICS",
    "LOSS_TYPES",
    "METRICS",
    "base_drops",
    "counted",
    "disable_dropout",
    "metric_names",
    "pair_losses",
    "step_metrics",
]
