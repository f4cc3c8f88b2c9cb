"""The training loss of a causal LM: the summed cross-entropy of a micro-batch's targets, fused with the head
where the architecture allows (the [tokens x vocab] logits never exist)."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from tiertune.kernels.architectures import FUSED_LOSS
from tiertune.kernels.ops.linear_ce import IGNORE_INDEX, linear_cross_entropy

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

    def _fusable(self) -> bool:
        model_type = self.model.config.model_type
        head = self.model.get_output_embeddings()
        if model_type not in FUSED_LOSS or not isinstance(head, nn.Linear):
            log.info(
                "kernels: %s is not in the fused-loss list; the loss runs unfused (full logits)", model_type
            )
            return False
        log.debug("kernels: fused linear + cross-entropy (%s, chunked) for %s", self.backend, model_type)
        return True

    def __call__(self, ids: torch.Tensor, extra: dict, target: torch.Tensor) -> torch.Tensor:
        if self.fused:
            decoder = self.model.get_decoder()
            hidden = decoder(input_ids=ids, **extra, **self.model_kwargs).last_hidden_state
            head = self.model.get_output_embeddings()
            h = hidden[:, :-1].reshape(-1, hidden.shape[-1])
            scale = getattr(self.model.config, "logit_scale", None)
            if scale is not None and scale != 1:  # Cohere: (h W^T) * s computed as (s h) W^T
                h = h * scale
            return linear_cross_entropy(
                h,
                head.weight,
                target.reshape(-1),
                head.bias,
                IGNORE_INDEX,
                "sum",
                backend=self.backend,
                softcap=getattr(self.model.config, "final_logit_softcapping", None),
            )
        logits = self.model(input_ids=ids, **extra, **self.model_kwargs).logits
        return F.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.shape[-1]),
            target.reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
