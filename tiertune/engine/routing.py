"""MoE blocks computed per routed expert where transformers computes every expert on every token.

transformers 5.24's Llama 4 block (``Llama4TextMoe``) scales each token's input by its router score (0 for the
experts not among its top-k) and runs all of the layer's experts on all tokens: 16 times the routed work for
Scout's experts, 128 times for Maverick's. The block's ``forward`` here runs each expert on the tokens routed to
it alone. An expert's output on a zero input is zero (no bias, SiLU(0) = 0), so this is the same function: the
router, its scores, the shared expert and the summation are transformers' own; only the order of the sums
differs. What the estimate counts (top-k of the experts' FLOPs) is then what a step computes.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from tiertune.quant.experts import StoredExperts, stored_matmul


def route_experts(model: nn.Module) -> int:
    """Give each MoE block of ``model`` that transformers computes densely its routed forward; returns how many
    blocks got it."""
    count = 0
    for module in model.modules():
        forward = ROUTED.get(type(module).__name__)
        if forward is not None:
            module.forward = functools.partial(forward, module)
            # its experts described as transformers describes its other experts modules (stored (experts, in,
            # out), a gate, no bias), so that a 4-bit base stores them one NF4 matrix per expert
            module.experts.__dict__.update(is_transposed=True, has_gate=True, has_bias=False)
            count += 1
    return count


def _llama4_moe(self: nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``Llama4TextMoe.forward``, each expert on its routed tokens: ``sum_e expert_e(x * s_e)`` over the
    experts e among a token's top-k (``s_e`` its sigmoid score), plus the shared expert."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    scores, logits = self.router(hidden_states)  # scores: (tokens, experts), 0 off each token's top-k
    out = self.shared_expert(hidden_states)
    experts = self.experts
    gate_up, down = experts.gate_up_proj, experts.down_proj  # (E, hidden, 2 I), (E, I, hidden): read once
    with torch.no_grad():
        _, chosen = torch.topk(logits, self.top_k, dim=1)
    if hidden_states.device.type == "meta":  # traced for its memory: each expert with its share of the tokens
        share = torch.arange(math.ceil(len(hidden_states) * self.top_k / self.num_experts), device="meta")
        routed = [(e, share) for e in range(self.num_experts)]
    else:
        routed = [(e, (chosen == e).any(dim=1).nonzero().squeeze(1)) for e in torch.unique(chosen).tolist()]
    for e, tokens in routed:
        x = hidden_states[tokens] * scores[tokens, e, None]
        gate, up = _expert(experts, gate_up, e, x).chunk(2, dim=-1)
        out = out.index_add(0, tokens, _expert(experts, down, e, up * experts.act_fn(gate)).to(out.dtype))
    return out, logits


def _expert(module: nn.Module, weight: torch.Tensor, e: int, x: torch.Tensor) -> torch.Tensor:
    """``x`` times expert ``e``'s matrix of a fused weight of ``module`` stored (experts, in, out): 16-bit, or one
    4-bit matrix per expert (``quant.experts``)."""
    if isinstance(weight, StoredExperts):
        return stored_matmul(module, weight, e, x)
    return x @ weight[e]


ROUTED = {"Llama4TextMoe": _llama4_moe}
"""The MoE blocks transformers computes densely, by class name, and their routed forward."""


__all__ = ["ROUTED", "route_experts"]
