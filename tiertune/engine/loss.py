"""The training loss of a causal LM: the summed cross-entropy of a micro-batch's targets, fused with the head
where the architecture allows (the [tokens x vocab] logits never exist)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from tiertune.errors import DataError
from tiertune.kernels.architectures import FUSED_LOSS
from tiertune.kernels.ops.distill import Full, TopK, linear_distill, logits_distill, topk_logprobs
from tiertune.kernels.ops.linear_ce import (
    IGNORE_INDEX,
    linear_cross_entropy,
    token_cross_entropy,
    token_cross_entropy_and_entropy,
)
from tiertune.structure import text_decoder

T = TypeVar("T")

log = logging.getLogger("tiertune.engine")


class CausalLMLoss:
    """``loss(ids, extra, target)``: the micro-batch's summed cross-entropy over ``target`` (the labels shifted
    by one), through ``kernels.ops.linear_ce`` with ``backend`` when ``fuse`` and the architecture allows,
    else the model's logits and ``F.cross_entropy`` (said once). ``model_kwargs`` go to every forward: an
    MoE's router logits are collected by the engine (``RouterAux``), not by the model's own output hooks."""

    def __init__(self, model: nn.Module, fuse: bool, backend: str) -> None:
        self.model, self.backend = model, backend
        moe = hasattr(model.config, "output_router_logits")
        self.model_kwargs = {"output_router_logits": False} if moe else {}
        self.fused = fuse and self._fusable()
        self.temperature = 1.0  # the logits are divided by it inside ``tempered`` (GRPO's, as TRL's)

    @contextmanager
    def tempered(self, temperature: float) -> Iterator[None]:
        """Inside, ``__call__`` and ``token_losses`` score ``softmax(logits / temperature)`` (GRPO's
        log-probabilities, as TRL computes them at its sampling temperature): fused, the hidden states and the
        head's bias divided by it; with a logit cap (applied before the division) on the model's logits."""
        before, self.temperature = self.temperature, temperature
        try:
            yield
        finally:
            self.temperature = before

    def _fusable(self) -> bool:
        model_type = self.model.config.get_text_config(
            decoder=True
        ).model_type  # a multimodal class: its decoder's
        head = self.model.get_output_embeddings()
        if model_type not in FUSED_LOSS or not isinstance(head, nn.Linear):
            log.info(
                "kernels: %s is not in the fused-loss list; the loss runs unfused (full logits)", model_type
            )
            return False
        log.debug("kernels: fused linear + cross-entropy (%s, chunked) for %s", self.backend, model_type)
        return True

    def __call__(
        self,
        ids: torch.Tensor,
        extra: dict,
        target: torch.Tensor,
        token_weight: torch.Tensor | None = None,
        rows_out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The summed cross-entropy of ``target``'s tokens (``token_weight``: each token's weight in the sum;
        ``rows_out``: each token's own loss written there, 0 where ignored)."""
        if self._fused_now:
            h, bias = self._tempered(ids, extra)
            return linear_cross_entropy(
                h,
                self.model.get_output_embeddings().weight,
                target.reshape(-1),
                bias,
                IGNORE_INDEX,
                "sum",
                backend=self.backend,
                softcap=self._softcap,
                token_weight=token_weight,
                rows_out=rows_out,
            )
        losses = F.cross_entropy(
            self._logits(ids, extra) / self.temperature,
            target.reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="none",
        )
        if rows_out is not None:
            rows_out.copy_(losses.detach())
        return (losses if token_weight is None else losses * token_weight).sum()

    @torch.no_grad()
    def token_losses(self, ids: torch.Tensor, extra: dict, target: torch.Tensor) -> torch.Tensor:
        """Each target token's cross-entropy ([rows, length - 1], 0 where ``target`` is ``IGNORE_INDEX``), without
        autograd and, fused, without the whole logits."""
        if self._fused_now:
            out = self._fused_figures(token_cross_entropy, ids, extra, target)
        else:
            out = F.cross_entropy(
                self._logits(ids, extra) / self.temperature,
                target.reshape(-1),
                ignore_index=IGNORE_INDEX,
                reduction="none",
            )
        return out.view(target.shape)

    @torch.no_grad()
    def token_losses_and_entropies(
        self, ids: torch.Tensor, extra: dict, target: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``token_losses`` and, from the same logits, each target token's entropy of the (tempered) softmax
        ([rows, length - 1] each, 0 where ``target`` is ``IGNORE_INDEX``): GRPO's ``entropy``."""
        if self._fused_now:
            losses, entropies = self._fused_figures(token_cross_entropy_and_entropy, ids, extra, target)
        else:
            logp = torch.log_softmax(self._logits(ids, extra).float() / self.temperature, dim=-1)
            flat = target.reshape(-1)
            valid = flat != IGNORE_INDEX
            losses = -logp.gather(1, flat.clamp_min(0).unsqueeze(1)).squeeze(1) * valid
            entropies = -(logp.exp() * logp).sum(-1) * valid
        return losses.view(target.shape), entropies.view(target.shape)

    def _fused_figures(
        self, figures: Callable[..., T], ids: torch.Tensor, extra: dict, target: torch.Tensor
    ) -> T:
        """``figures`` (``token_cross_entropy``, or with the entropies) of the head over the tempered hidden
        states, a chunk of logits at a time."""
        h, bias = self._tempered(ids, extra)
        weight = self.model.get_output_embeddings().weight
        return figures(h, weight, target.reshape(-1), bias, IGNORE_INDEX, softcap=self._softcap)

    @torch.no_grad()
    def teacher_topk(
        self, ids: torch.Tensor, extra: dict, target: torch.Tensor, k: int, temperature: float, vocab: int
    ) -> TopK:
        """A teacher's ``TopK`` at each scored token (``target`` not ``IGNORE_INDEX``; row by row, in order):
        ``log_softmax(logits / temperature)``'s ``k`` largest among the first ``vocab`` tokens (the student's)
        and the log of the rest's mass, a chunk of logits at a time (``kernels.ops.distill.topk_logprobs``)."""
        scored = target.reshape(-1) != IGNORE_INDEX
        h = self._hidden(ids, extra)[scored]
        head = self.model.get_output_embeddings()
        return topk_logprobs(h, head.weight, k, temperature, head.bias, self._softcap, vocab_limit=vocab)

    @torch.no_grad()
    def teacher_hidden(self, ids: torch.Tensor, extra: dict, target: torch.Tensor) -> Full:
        """A teacher's last hidden states at each scored token (as ``teacher_topk``'s) with its head: its
        logits made beside the student's (``objective.top_k: 0``)."""
        scored = target.reshape(-1) != IGNORE_INDEX
        head = self.model.get_output_embeddings()
        return Full(self._hidden(ids, extra)[scored], head.weight, head.bias, self._softcap)

    def distill(
        self,
        ids: torch.Tensor,
        extra: dict,
        target: torch.Tensor,
        teacher: TopK | Full,
        beta: float,
        temperature: float,
        alpha: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A distillation's summed loss over ``target``'s scored tokens (``alpha`` x each one's cross-entropy +
        (1 - ``alpha``) x its divergence from ``teacher``, given at those tokens, row by row), and the summed
        cross-entropy and divergence (no autograd): fused with the head (``kernels.ops.distill``), else on the
        model's logits."""
        scored = target.reshape(-1) != IGNORE_INDEX
        picked = target.reshape(-1)[scored]
        n = int(scored.sum())
        covered = len(teacher.hidden if isinstance(teacher, Full) else teacher.ids)
        if covered != n:
            raise DataError(
                f"the teacher's figures cover {covered} tokens where the batch scores {n}: the teacher's cache "
                "is not this data's (remove it to compute it again)"
            )
        ce_w = torch.full((n,), alpha, device=picked.device)
        kd_w = torch.full((n,), 1.0 - alpha, device=picked.device)
        head = self.model.get_output_embeddings()
        if self.fused:
            h = self._hidden(ids, extra)[scored]
            total, ce, kd = linear_distill(
                h, head.weight, picked, teacher, ce_w, kd_w, beta, temperature, head.bias, self._softcap
            )
            return total, ce.sum(), kd.sum()
        total, ce, kd = logits_distill(
            self._logits(ids, extra)[scored], picked, teacher, ce_w, kd_w, beta, temperature
        )
        return total, ce.sum(), kd.sum()

    @property
    def _fused_now(self) -> bool:
        """Whether the loss runs fused with the head now (a temperature and a logit cap do not fold together)."""
        return self.fused and (self.temperature == 1.0 or self._softcap is None)

    def _tempered(self, ids: torch.Tensor, extra: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The hidden states and the head's bias the fused loss takes, divided by the temperature: (h W + b) / T
        is (h / T) W + b / T."""
        h, bias = self._hidden(ids, extra), self.model.get_output_embeddings().bias
        if self.temperature == 1.0:
            return h, bias
        return h / self.temperature, None if bias is None else bias / self.temperature

    @property
    def _softcap(self) -> float | None:
        # the class's own: Gemma 3's ForConditionalGeneration caps no logits (its text config's cap is for its CausalLM)
        return getattr(self.model.config, "final_logit_softcapping", None)

    def _hidden(self, ids: torch.Tensor, extra: dict) -> torch.Tensor:
        """The decoder's last hidden states before each target ([rows x (length - 1), hidden]), times the
        logit scale (Cohere: (h W^T) * s computed as (s h) W^T)."""
        hidden = text_decoder(self.model)(input_ids=ids, **extra, **self.model_kwargs).last_hidden_state
        h = hidden[:, :-1].reshape(-1, hidden.shape[-1])
        scale = getattr(self.model.config, "logit_scale", None)
        return h * scale if scale is not None and scale != 1 else h

    def _logits(self, ids: torch.Tensor, extra: dict) -> torch.Tensor:
        """The model's own logits before each target, in fp32 ([rows x (length - 1), vocabulary]). A multimodal
        class's are its language model's, through its head (and its cap), as its forward computes them for text:
        its forward also wires the tower's outputs, which transformers 5.24's Llama 4 class fails to do when no
        image is given (``image_outputs`` of the language model's output)."""
        if self.model.config.get_text_config(decoder=True) is not self.model.config:
            head = self.model.get_output_embeddings()
            logits = F.linear(self._hidden(ids, extra), head.weight, head.bias).float()
            cap = self._softcap
            return torch.tanh(logits / cap) * cap if cap else logits
        logits = self.model(input_ids=ids, **extra, **self.model_kwargs).logits
        return logits[:, :-1].float().reshape(-1, logits.shape[-1])
