"""Preference objectives: the loss of a micro-batch of pairs (its chosen sequences, then its rejected ones) from
each sequence's log-probability of its completion, with TRL's names and formulas (``DPOTrainer`` 1.16).

A sequence's log-probability is the sum of its completion tokens' log-probabilities under the policy (the
model being trained) and, for DPO, under the reference (the base with its adapters off, run in the same layer
visit as the policy: ``engine.schedule``). The objective is a function of those sums, so its gradient reaches
the head as a weighted cross-entropy: each token's weight is the derivative of the micro-batch's loss by its
sequence's log-probability (negated). The head runs twice, both times fused and tiled
(``kernels.ops.linear_ce``): once without autograd for the sums, once with the weights for the gradients; the
[tokens x vocabulary] logits never exist.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tiertune.settings import DPO_LOSS_TYPES, ObjectiveSettings

LOSS_TYPES = DPO_LOSS_TYPES
"""DPO's losses (TRL's ``loss_type``), by ``beta * delta``, where ``delta`` is the chosen sequence's log-ratio
(policy over reference) minus the rejected one's: ``sigmoid``: ``-log sigmoid(beta * delta)``; ``hinge``:
``relu(1 - beta * delta)``; ``ipo``: ``(delta' - 1 / (2 beta))^2`` with each log-ratio divided by its
completion's tokens (TRL's length normalization)."""
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")  # fmt: skip
"""What a preference step logs (TRL's names), each a mean over the step's pairs."""


def pair_losses(settings: ObjectiveSettings, logps: torch.Tensor, ref_logps: torch.Tensor | None,
                tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:  # fmt: skip
    """Each pair's loss and the micro-batch's metric sums (``METRICS``, summed over its pairs) from its
    sequences' log-probabilities ``logps`` ([2 x pairs]: chosen, then rejected; autograd flows through them),
    the reference's (``ref_logps``, None when the objective has no reference) and each sequence's completion
    tokens (``tokens``). A pair without a target in either sequence (a rank's padding: ``finetune.ranks``)
    has no loss and no metrics (``counted``)."""
    valid = counted(tokens).float()
    logps = logps.float()
    chosen, rejected = logps.chunk(2)
    ref_chosen, ref_rejected = (torch.zeros_like(chosen),) * 2 if ref_logps is None else ref_logps.float().chunk(2)
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    delta = chosen_ratio - rejected_ratio
    beta = settings.beta
    if settings.loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * delta)
    elif settings.loss_type == "hinge":
        losses = torch.relu(1 - beta * delta)
    elif settings.loss_type == "ipo":
        chosen_tokens, rejected_tokens = tokens.float().clamp(min=1.0).chunk(2)
        losses = (chosen_ratio / chosen_tokens - rejected_ratio / rejected_tokens - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"no DPO loss {settings.loss_type!r} (the recipe checks objective.loss_type)")
    chosen_rewards, rejected_rewards = beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
    metrics = {
        "rewards/chosen": float((chosen_rewards * valid).sum()),
        "rewards/rejected": float((rejected_rewards * valid).sum()),
        "rewards/accuracies": float(((chosen_rewards > rejected_rewards).float() * valid).sum()),
        "rewards/margins": float(((chosen_rewards - rejected_rewards) * valid).sum()),
        "logps/chosen": float((chosen.detach() * valid).sum()),
        "logps/rejected": float((rejected.detach() * valid).sum()),
    }
    return losses * valid, metrics


def counted(tokens: torch.Tensor) -> torch.Tensor:
    """Which pairs of a micro-batch count (a target in both sequences), from each sequence's target tokens
    ([2 x pairs]: chosen, then rejected)."""
    chosen, rejected = tokens.chunk(2)
    return (chosen > 0) & (rejected > 0)


def disable_dropout(model: torch.nn.Module) -> None:
    """Every dropout module of ``model`` (its adapters' among them) set to drop nothing (TRL's
    ``disable_dropout``); attention dropout rates in the model's config too."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    config = getattr(model, "config", None)
    for name in ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "attn_pdrop", "embd_pdrop"):
        if isinstance(getattr(config, name, None), float):
            setattr(config, name, 0.0)
    for module in model.modules():  # transformers' attention modules keep their own copy of the rate
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


__all__ = ["LOSS_TYPES", "METRICS", "counted", "disable_dropout", "pair_losses"]
