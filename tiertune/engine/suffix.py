"""The step's suffix (``engine.schedule``): the final norm, the head and the loss on the last layer's output of a
wave's micro-batches, back-propagated to it.

A micro-batch's objective is its own (``Micro.objective``: of several adapters over one base, its adapter's;
else the engine's): micro-batches of a preference objective run the paired suffix one at a time
(``PairedPasses``), GRPO's completions the rollout suffix one at a time (``engine.grpo``'s objective, the
head's per-token weights its derivative, as the paired suffix's), the rest in stacks (the head's pass once per
stack; a distillation's divergence from its teacher's figures, the cross-entropy otherwise)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from tiertune.engine import several
from tiertune.engine.grpo import PER_ITEM, high_entropy
from tiertune.engine.micro import Micro, harvest, stacked_inputs
from tiertune.engine.objective import add_metric
from tiertune.engine.pairs import PairedPasses
from tiertune.engine.stacking import first_fit
from tiertune.engine.streaming import Suffix
from tiertune.engine.teacher import cat_teachers
from tiertune.errors import StateError
from tiertune.kernels.ops.linear_ce import IGNORE_INDEX
from tiertune.settings import ObjectiveSettings


class Suffixes(PairedPasses):
    """``LayerMajor``'s suffix passes (it inherits them), with the preference passes."""

    layers: list[torch.nn.Module]
    adapter_losses: dict[str, float]
    adapter_metrics: dict[str, dict[str, tuple[float, float]]]

    def objective_of(self, mb: Micro) -> ObjectiveSettings:
        """What ``mb``'s loss is: its adapter's objective, or the engine's."""
        return mb.objective or self.engine.objective

    def refers(self, mb: Micro) -> bool:
        """Whether ``mb``'s forward runs the reference beside the policy (the base, adapters off): its objective
        has one and the base is frozen (a full fine-tune's reference log-probabilities come with the batch)."""
        return self.engine.adapters is not None and self.objective_of(mb).reference

    def metrics_of(self, mb: Micro) -> dict[str, tuple[float, float]]:
        """Where ``mb``'s objective's metrics are summed: the step's, or of several adapters its adapter's."""
        if mb.adapter is None:
            return self.metrics
        return self.adapter_metrics.setdefault(mb.adapter, {})

    def _suffix(
        self,
        micro: list[Micro],
        outs: list[torch.Tensor],
        n_tokens: int,
        micro_batches: int,
        bound: dict,
        summed: dict,
    ) -> tuple[float, float]:
        """The wave's micro-batches' losses on the last layer's output (``outs``, boundary L, held),
        back-propagated to it, each divided by the step's ``n_tokens`` targets (of several adapters: its
        adapter's, ``Micro.tokens``); returns the wave's summed loss and router auxiliary losses' sum."""
        engine = self.engine
        paired = [j for j, mb in enumerate(micro) if self.objective_of(mb).paired]
        rollouts = [j for j, mb in enumerate(micro) if self.objective_of(mb).rollouts]
        total = aux_total = 0.0
        if paired:
            total, aux_total = self._paired_suffix(
                micro, paired, outs, n_tokens, micro_batches, bound, summed
            )
        for j in rollouts:
            value, aux_value = self._rollout_suffix(micro[j], j, outs[j], n_tokens, micro_batches)
            total, aux_total = total + value, aux_total + aux_value
            harvest(bound, summed)
        aux = engine.router_aux
        alone = set(paired) | set(rollouts)
        for group in self._suffix_stacks(micro, [j for j in range(len(micro)) if j not in alone]):
            parts = [micro[j] for j in group]
            several.route(engine.adapters, parts[0], micro, group)
            one = len(group) == 1
            leaf = (outs[group[0]] if one else torch.cat([outs[j] for j in group])).detach().requires_grad_()
            engine.visit = Suffix(len(self.layers) - 1, leaf)
            # its gradient joins each layer's backward (a stack of one: ``_suffix_stacks``)
            if aux is not None:
                aux_total += aux.finish(group[0], parts[0].extra.get("attention_mask"), 1.0 / micro_batches)
            ids, extra, target = stacked_inputs(parts)
            # none: the cross-entropy (``several.backward``: of several adapters, each over its own tokens)
            loss_sum = None
            if self.objective_of(parts[0]).distills:
                teacher = parts[0].teacher if one else cat_teachers([mb.teacher for mb in parts])
                loss_sum = self._distill_loss(leaf, ids, extra, target, teacher, parts[0])
            total += several.backward(
                engine, leaf, (ids, extra, target), parts, n_tokens, loss_sum, self.adapter_losses
            )
            if leaf.grad is None:
                raise StateError("the loss does not depend on the last decoder layer's output")
            for mb, grad in zip(parts, leaf.grad.split([mb.shape[0] for mb in parts]), strict=True):
                mb.grad = grad
            harvest(bound, summed)
        engine.visit = None
        self.stash.close(len(self.layers), keep=False)
        return total, aux_total

    def _rollout_suffix(
        self, mb: Micro, j: int, out: torch.Tensor, n_tokens: int, micro_batches: int
    ) -> tuple[float, float]:
        """A micro-batch of GRPO's completions (``Micro.rollout``): its tokens' log-probabilities under the policy
        (and, with ``beta``, the reference's: from its own hidden states, or with the batch), the clipped objective
        (``engine.grpo.grpo_loss``, normalised per ``loss_type`` as TRL's; ``dapo`` by the step's ``n_tokens``
        completion tokens), back-propagated through the head as a weighted cross-entropy. Its loss times
        ``n_tokens`` is returned (the step divides its sum by them: the step's loss is TRL's, the sum of its
        micro-batches'), with the router auxiliary loss; the policy's log-probabilities are written into the
        micro-batch's dict (``logps``: a later iteration's ``old_logps``)."""
        engine = self.engine
        objective = self.objective_of(mb)
        rollout = mb.rollout
        if rollout is None:
            raise StateError("a GRPO micro-batch carries no advantages (finetune.grpo makes them)")
        last = len(self.layers)
        ref_logps = mb.ref_logps  # a full fine-tune's: scored by the initial weights beside the policy
        if mb.ref is not None:
            engine.visit = Suffix(last - 1, mb.ref)
            with engine.reference(), engine.loss.tempered(objective.temperature):
                ref_logps = -engine.compute.token_losses(engine.loss, mb.ref, mb.ids, mb.extra, mb.target)
            mb.ref = None
        leaf = out.detach().requires_grad_()
        engine.visit = Suffix(last - 1, leaf)
        aux_value = 0.0
        if engine.router_aux is not None:
            aux_value = engine.router_aux.finish(j, mb.extra.get("attention_mask"), 1.0 / micro_batches)
        with engine.loss.tempered(objective.temperature):  # the sampling's distribution, as TRL's
            token_losses, entropies = engine.compute.token_losses_and_entropies(
                engine.loss, leaf, mb.ids, mb.extra, mb.target
            )
        token_losses.requires_grad_()
        old = rollout.get("old_logps")
        completion = mb.target != IGNORE_INDEX
        selected = None
        if objective.top_entropy_quantile < 1.0 and not engine.compute.ledger:  # the highest-entropy tokens
            selected = high_entropy(entropies, completion, objective.top_entropy_quantile)
        loss, metrics = engine.compute.grpo_loss(
            -token_losses.float(),
            completion,
            rollout["advantages"].to(leaf.device),
            None if old is None else old.to(leaf.device),
            ref_logps,
            objective,
            micro_batches,
            float(rollout.get("items", n_tokens)),  # (a generation feeding several steps: its share, TRL's)
            selected,
        )
        # the losses but dapo's and cispo's are each process's own, averaged over the processes (as DDP averages
        # TRL's); those two are over every process's tokens already
        processes = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        share = 1.0 if objective.loss_type in PER_ITEM else 1.0 / processes
        (slope,) = torch.autograd.grad(loss * share, token_losses)  # d loss / d each token's loss
        weight = slope.reshape(-1)
        with engine.loss.tempered(objective.temperature):
            engine.compute.loss(engine.loss, leaf, mb.ids, mb.extra, mb.target, weight).backward()
        if old is None and not engine.compute.ledger:  # the old policy's, for the generation's later steps
            rollout["logps"] = -token_losses.detach().float().cpu()
        if leaf.grad is None:
            raise StateError("the loss does not depend on the last decoder layer's output")
        mb.grad = leaf.grad
        if not engine.compute.ledger:  # the policy's mean entropy over the completion tokens (TRL's)
            metrics["entropy"] = float((entropies * completion).sum() / completion.sum().clamp(min=1))
        into = self.metrics_of(mb)
        for name, value in metrics.items():
            if value == value:  # a NaN (no completion token clipped or not) counts nothing, as TRL's nanmean
                add_metric(into, name, value, 1.0)
        return engine.compute.value(loss.detach()) * share * n_tokens, aux_value

    def _distill_loss(
        self,
        leaf: torch.Tensor,
        ids: torch.Tensor,
        extra: dict,
        target: torch.Tensor,
        teacher: Any,
        head: Micro,
    ) -> torch.Tensor:
        """A distillation's summed loss of a stack of micro-batches of one adapter (``head``'s: its objective's
        settings; ``CausalLMLoss.distill``), its cross-entropy and divergence added to the step's metrics (of
        several adapters, that adapter's: ``ce_loss``, ``kd_loss``, by token)."""
        engine = self.engine
        o = self.objective_of(head)
        into = self.metrics_of(head)
        if teacher is None and not engine.compute.ledger:  # a ledger's step computes nothing
            raise StateError("a distillation step's micro-batch carries no teacher figures")
        loss_sum, ce, kd = engine.compute.distill(
            engine.loss, leaf, ids, extra, target, teacher, o.beta, o.temperature, o.alpha
        )
        count = engine.compute.value((target != IGNORE_INDEX).sum())
        for name, value in (("ce_loss", ce), ("kd_loss", kd)):
            add_metric(into, name, engine.compute.value(value), count)
        return loss_sum

    def _suffix_stacks(self, micro: Sequence[Micro], among: Sequence[int]) -> list[list[int]]:
        """The micro-batches ``among`` (indices into ``micro``) the final norm, head and loss run on together: as
        ``stacks`` (at most ``stack_limit`` tokens, no router loss per micro-batch), those of one sequence
        length with the same inputs beside the ids (an attention mask in all or in none); a distillation's
        micro-batches only with those of their own adapter (its loss and divisor are one adapter's)."""
        limit = self.engine.config.stack_limit
        if limit <= 0 or self.engine.router_aux is not None:
            return [[j] for j in among]
        groups = first_fit(
            [micro[j] for j in among],
            limit,
            lambda head, mb: (
                several.shares(self.engine.adapters, head, mb)
                and (
                    mb.adapter == head.adapter
                    or not (self.objective_of(head).distills or self.objective_of(mb).distills)
                )
                and (mb.shape[1:], sorted(mb.extra)) == (head.shape[1:], sorted(head.extra))
            ),
        )
        return [[among[k] for k in group] for group in groups]


__all__ = ["Suffixes"]
