"""4-bit expert weights of mixture-of-experts layers: each expert's matrix quantized on its own, exactly as
bitsandbytes quantizes a linear weight, and each routed expert computed from its 4 bits.

transformers 5 builds the experts of an MoE layer as one module holding fused 3-D weights: ``gate_up_proj`` of
shape (experts, 2 x intermediate, hidden) and ``down_proj`` (experts, hidden, intermediate), or ``up_proj``
where the experts have no gate. bitsandbytes' ``load_in_4bit`` only converts ``nn.Linear`` modules, so these
stay in full precision, although they are most of an MoE's bytes. Here each expert's 2-D slice is quantized
separately by the base's quantizer (``NF4.quantize_into``: its own blocks, double-quantized scales and offset,
the bytes of ``bitsandbytes.functional.quantize_4bit`` of that slice), and the layer's chunk holds the entries
of one slice with a leading expert dimension::

    <name>          uint8 (E, out*in/2, 1)
    <name>.absmax   uint8 (E, out*in/64)        fp32 without double quantization
    <name>.absmax2  fp32  (E, ceil(out*in/64/256))
    <name>.offset   fp32  (E,)

The forward is an experts implementation registered with transformers (``ExpertsInterface``, chosen with the
model's ``set_experts_implementation``): the router, the routing weights and the rest of the MoE block stay
transformers' own, and ``experts_forward`` is transformers' per-expert loop (the ``eager`` experts forward of
Mixtral, Qwen3-MoE and DeepSeek-V3, with the gate, activation, bias and post-expert norm that the module's
``use_experts_implementation`` flags describe) in which each routed expert's matmul runs through
``bitsandbytes.matmul_4bit`` with that expert's ``QuantState``. bitsandbytes dequantizes the expert in the
matmul and again in backward; no more than one expert's weight is ever dequantized at a time.

LoRA on the experts: peft adapts a fused expert weight as a parameter (``target_parameters``, its
``ParamWrapper``) by adding ``scaling * B_e @ A_e`` to each expert's weight through a parametrization, which a
4-bit weight cannot take. The wrapper leaves the weight as it is instead (see ``tiertune.methods.lora``) and
``add_lora`` hands its factors here: ``experts_forward`` adds ``scaling * B_e (A_e x)`` to each routed expert's
output, which is peft's ``(W_e + scaling * B_e A_e) x`` with ``W_e`` the dequantized weight.

Experts stored transposed (``is_transposed``: (experts, in, out): gpt-oss's, Llama 4's) are stored as each
expert's (out, in) matrix, quantized as a linear weight is; LoRA on them is refused. The experts under an 8-bit
base stay unquantized (bitsandbytes' 8-bit matmul has no per-expert form).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tiertune.quant.bnb4 import NF4, STATS

log = logging.getLogger("tiertune.quant")

EXPERT_WEIGHTS = ("gate_up_proj", "up_proj", "down_proj")
IMPLEMENTATION = "tiertune_4bit"  # the name our experts forward is registered under in transformers

# one LoRA adapter of a fused expert weight: B (E, out, r), A (E, r, in) and the scaling
LoraFactors = tuple[torch.Tensor, torch.Tensor, float]


class StoredExperts(nn.Parameter):
    """A fused expert weight (experts, out, in) stored one matrix per expert in a form of its own (4-bit here,
    FP8 as shipped in ``quant.shipped``), computed expert by expert (``matmul``) in ``experts_forward``.

    In the model's skeleton it is a meta placeholder of the logical shape and compute dtype that marks the
    weight (peft reads its shape). Bound by the engine, its data is the first expert's storage over the chunk's
    memory, ``views`` the weight's chunk entries, and ``quant`` the quantizer that reads them.
    """

    def __new__(
        cls,
        data: torch.Tensor,
        quant: Any = None,
        name: str = "",
        shape: Sequence[int] | None = None,
        views: dict[str, torch.Tensor] | None = None,
        transposed: bool = False,
    ) -> StoredExperts:
        self = torch.Tensor._make_subclass(cls, data, False)
        self.quant = quant
        self.weight_name = name
        self.logical_shape = torch.Size(shape if shape is not None else data.shape)
        self.views = views
        self.states: dict[int, Any] = {}
        # logically (experts, in, out): each expert stored as its (out, in) matrix
        self.transposed = transposed
        return self

    def matmul(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """``x @ W_e.T`` for expert ``e``."""
        raise NotImplementedError


class Experts4bit(StoredExperts):
    """A fused expert weight stored as one 4-bit matrix per expert: bound, its data is the packed 4-bit codes
    (experts, out*in/2, 1), and ``expert(e)`` gives expert ``e``'s codes and ``QuantState``, built on first use.
    """

    def expert(self, e: int) -> tuple[torch.Tensor, Any]:
        """Expert ``e``'s packed codes and ``QuantState`` (bound weights only)."""
        if self.views is None or self.quant is None:
            raise RuntimeError(
                f"{self.weight_name or 'an expert weight'} is a placeholder, not bound to a chunk"
            )
        if e not in self.states:
            name = self.weight_name
            views = {k: v[e] for k, v in self.views.items()}
            shape = self.logical_shape[1:] if not self.transposed else self.logical_shape[1:][::-1]
            self.states[e] = self.quant.parameter(name, torch.Size(shape), views).quant_state
        return self.views[self.weight_name][e], self.states[e]

    def matmul(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """``x @ W_e.T`` for expert ``e``, as ``bnb.nn.Linear4bit`` computes it (in the compute dtype)."""
        import bitsandbytes as bnb

        packed, state = self.expert(e)
        return bnb.matmul_4bit(x.to(self.quant.compute_dtype), packed, quant_state=state).to(x.dtype)  # type: ignore[union-attr]


def is_quantized_experts(param: object) -> bool:
    """Whether ``param`` is a fused expert weight stored one matrix per expert (4-bit, or as shipped)."""
    return isinstance(param, StoredExperts)


def is_experts_module(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers experts module (``use_experts_implementation``) with fused weights."""
    return (
        hasattr(module, "is_transposed")
        and hasattr(module, "has_gate")
        and any(
            isinstance(module._parameters.get(n), nn.Parameter) and module._parameters[n].dim() == 3
            for n in EXPERT_WEIGHTS
        )
    )


def convert_experts(layer: nn.Module, quant: object) -> list[str]:
    """Mark the fused expert weights inside ``layer`` (a decoder layer on the meta device) to be stored 4-bit
    when ``quant`` is a 4-bit quantizer, as ``NF4.convert`` does for its linear modules (a shipped format's are
    marked by ``quant.shipped.mark_experts``; ``tiertune.quant.store_experts`` picks). Returns the names of the
    weights marked, relative to ``layer``; transposed experts and modules in ``quant.skip`` are left."""
    if not isinstance(quant, NF4):
        return []
    return mark_fused(layer, quant.skip, Experts4bit, transposed=True)


def mark_fused(
    layer: nn.Module, skip: Sequence[str], kind: type[StoredExperts], transposed: bool = False
) -> list[str]:
    """Give the fused expert weights inside ``layer`` (meta) placeholders of ``kind`` (their logical shape and
    dtype), which mark them stored one matrix per expert, and their modules the experts forward; returns the
    names marked now, relative to ``layer`` (``fused_weights`` says which: ``skip``, ``transposed``)."""
    marked = []
    for path, module, name, p in fused_weights(layer, skip, transposed):
        module.__dict__["_tiertune_stored"] = True
        if isinstance(p, kind):
            continue
        where = f"{path}." if path else ""
        placeholder = torch.empty(tuple(p.shape), dtype=p.dtype, device="meta")
        module._parameters[name] = kind(
            placeholder, name=f"{where}{name}", transposed=bool(module.is_transposed)
        )
        marked.append(f"{where}{name}")
    return marked


def fused_weights(
    root: nn.Module, skip: Sequence[str], transposed: bool = False
) -> Iterator[tuple[str, nn.Module, str, torch.Tensor]]:
    """The fused 3-D expert weights in ``root`` that are stored one matrix per expert: (module path, experts
    module, weight name, weight), for the experts modules ``_storable`` admits (``transposed``: experts stored
    (experts, in, out) too)."""
    for path, module in root.named_modules():
        if not _storable(path, module, skip, transposed):
            continue
        for name in EXPERT_WEIGHTS:
            p = module._parameters.get(name)
            if p is not None and p.dim() == 3:
                yield path, module, name, p


def _storable(path: str, module: nn.Module, skip: Sequence[str], transposed: bool) -> bool:
    """Whether ``module`` (at ``path``) is an experts module whose fused weights are stored one per expert."""
    if not is_experts_module(module):
        return False
    if (module.is_transposed and not transposed) or any(s and s in path for s in skip):
        why = "stored transposed" if module.is_transposed else "in the base's skip list"
        log.info("%s (%s) stays unquantized: %s", path, type(module).__name__, why)
        return False
    return True


def round_trip(model: nn.Module, quant: object) -> list[str]:
    """Set the fused expert weights of ``model`` (in memory, unquantized, as transformers loads them even with
    ``load_in_4bit``) to the values their 4-bit storage gives: each expert quantized as ``convert_experts``
    stores it and dequantized. What an adapter trained on the 4-bit experts was trained against (a merge adds
    it to these). Returns the names of the weights set; none unless ``quant`` is 4-bit."""
    import bitsandbytes.functional as bnb_f

    if not isinstance(quant, NF4):
        return []
    done = []
    for path, module, name, p in fused_weights(model, quant.skip, transposed=True):
        flip = bool(module.is_transposed)  # (experts, in, out): each expert's (out, in) matrix quantized
        shape = tuple(p.shape[1:])[::-1] if flip else tuple(p.shape[1:])
        with torch.no_grad():
            for e in range(p.shape[0]):
                views = {n: torch.empty(s, dtype=dt) for n, s, dt in quant.entries(name, shape)}
                matrix = p[e].T if flip else p[e]
                quant.quantize_into(name, matrix.to(quant.compute_dtype).contiguous(), views)
                state = quant.parameter(name, torch.Size(shape), views).quant_state
                values = bnb_f.dequantize_4bit(views[name], state)
                p[e].copy_(values.T if flip else values)
        done.append(f"{path}.{name}")
    return done


def use_4bit_experts(model: nn.Module) -> None:
    """Make ``model`` (a transformers model whose experts ``convert_experts`` marked) run its experts through
    ``experts_forward``: registered as an experts implementation and selected as transformers selects one."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(IMPLEMENTATION, experts_forward)
    model.set_experts_implementation(IMPLEMENTATION)  # type: ignore[operator]


def entries(quant: NF4, name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """The chunk entries of fused expert weight ``name`` of ``shape`` (experts, out, in): those of one expert's
    4-bit matrix, each with a leading expert dimension."""
    experts = shape[0]
    return [(n, (experts, *s), dtype) for n, s, dtype in quant.entries(name, tuple(shape[1:]))]


def quantize_into(
    quant: NF4,
    name: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    pieces: Sequence[tuple[str, tuple]],
    read: Callable[[str, torch.Tensor], None],
    views: dict[str, torch.Tensor],
    transposed: bool = False,
) -> None:
    """Quantize fused expert weight ``name`` one expert at a time into its chunk entries (``views``).

    ``pieces`` say where its values are in the checkpoint, as ``TensorSource.pieces``: ``(key, index)`` with
    ``index`` starting with the expert (per-expert tensors, read one expert at a time), or a single piece
    with no index (a checkpoint that holds the fused tensor, read whole). ``read(key, out)`` reads a
    checkpoint tensor into ``out`` in ``dtype``, the dtype a plain load quantizes from."""
    experts = shape[0]
    own = _own(name, views)
    fused = None
    if any(not index for _, index in pieces):
        fused = torch.empty(shape, dtype=dtype)
        for key, index in pieces:
            read(key, fused[index] if index else fused)
    weight = torch.empty(shape[1:], dtype=dtype)
    for e in range(experts):
        if fused is None:
            for key, index in pieces:
                if index[0] == e:
                    read(key, weight[index[1:]])
        expert = fused[e] if fused is not None else weight
        if transposed:  # stored (experts, in, out): its (out, in) matrix quantized, as a linear weight is
            expert = expert.T.contiguous()
        quant.quantize_into(name, expert, {k: v[e] for k, v in own.items()})


def bind(
    quant: NF4, name: str, shape: torch.Size, views: dict[str, torch.Tensor], transposed: bool = False
) -> Experts4bit:
    """The bound ``Experts4bit`` of fused expert weight ``name`` (logical ``shape``) over its chunk entries."""
    return Experts4bit(views[name], quant, name, shape, _own(name, views), transposed)


def _own(name: str, views: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The entries of weight ``name`` among a chunk's ``views``: the codes and their statistics."""
    return {k: v for k, v in views.items() if k == name or k in {f"{name}.{s}" for s in STATS}}


def add_lora(module: nn.Module, name: str, factors: Callable[[], list[LoraFactors]]) -> None:
    """Add a LoRA adapter to fused expert weight ``name`` of experts module ``module``: ``factors()`` returns
    its active adapters' ``(B, A, scaling)`` at each forward (none while adapters are disabled)."""
    module.__dict__.setdefault("_tiertune_lora", {}).setdefault(name, []).append(factors)


def stored_matmul(module: nn.Module, weight: StoredExperts, e: int, x: torch.Tensor) -> torch.Tensor:
    """``x @ W_e.T`` for expert ``e`` of ``weight``, a stored fused weight of experts ``module``: by the op
    ``kernels.patch`` gave the module (``FUSED_MATMUL``: a fused dequantize-matmul kernel), else its own."""
    fused = module.__dict__.get(FUSED_MATMUL)
    return fused(weight, e, x) if fused is not None else weight.matmul(e, x)


FUSED_MATMUL = "_tiertune_expert_matmul"
"""The experts module's attribute that holds the kernel ``stored_matmul`` computes with (set by ``kernels.patch``)."""


def _expert_linear(module: nn.Module, name: str, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert ``e``'s projection ``name`` of ``x``: 4-bit or not, plus its bias and LoRA adapters."""
    weight = module._parameters[name]
    if isinstance(weight, StoredExperts):
        y = stored_matmul(module, weight, e, x)
    else:
        y = x @ weight[e] if module.is_transposed else F.linear(x, weight[e])
    if module.has_bias:
        y = y + getattr(module, f"{name}_bias")[e]
    for factors in module.__dict__.get("_tiertune_lora", {}).get(name, ()):
        for b, a, scaling in factors():
            y = y + scaling * F.linear(F.linear(x, a[e].to(x.dtype)), b[e].to(x.dtype))
    return y


def experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' experts forward (the per-expert loop of its ``eager`` implementation) with each routed
    expert's projections computed from its 4-bit weight. Experts modules that ``convert_experts`` left
    unquantized run transformers' own eager forward."""
    if not self.__dict__.get("_tiertune_stored", False):
        return type(self).forward.__wrapped__(self, hidden_states, top_k_index, top_k_weights)
    final_hidden_states = torch.zeros_like(hidden_states)
    with torch.no_grad():
        expert_mask = F.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
    up = "gate_up_proj" if self.has_gate else "up_proj"
    for expert_idx in expert_hit:
        e = int(expert_idx[0])
        if e == self.num_experts:  # the slot of tokens routed to no local expert (expert parallelism)
            continue
        top_k_pos, token_idx = torch.where(expert_mask[e])
        current = hidden_states[token_idx]
        h = _expert_linear(self, up, e, current)
        h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
        h = _expert_linear(self, "down_proj", e, h)
        if self.has_post_expert_norm:
            h = self.post_expert_norm(h)
        h = h * top_k_weights[token_idx, top_k_pos, None]
        final_hidden_states.index_add_(0, token_idx, h.to(final_hidden_states.dtype))
    return final_hidden_states
