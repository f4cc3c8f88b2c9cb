"""Bases read as they ship: linear weights a checkpoint stores in a quantized format of its own (FP8 with
blockwise scales, as DeepSeek-V3, Kimi-K2, MiniMax-M2 and Qwen3's FP8 releases ship), kept in their chunks as
the file's own bytes and dequantized on the compute device at each use.

Nothing is converted on load and nothing is written: a frozen base homed on disk is read in place from the
checkpoint's safetensors (``loading.model``), so the disk tier holds no copy of it. A weight's chunk entries are
its checkpoint tensors::

    <name>          float8_e4m3fn (out, in)                   the weight's codes
    <name>.scale    fp32 or float8_e8m0fnu (ceil(out / b0), ceil(in / b1))   ``weight_scale_inv``

and element (r, c) is ``codes[r, c] * scale[r // b0, c // b1]``, as DeepSeek's own ``weight_dequant`` computes it:
an edge block (a 576-row ``kv_a_proj_with_mqa`` over 128-row blocks) uses its scale's row like any other.
(transformers' dequantizing loader derives the block from the scale grid instead, which is wrong there.)

The model's ``nn.Linear`` modules inside the decoder layers become ``ShippedLinear`` on the instance (peft
wraps them as any linear: it sees a placeholder weight of the compute dtype). Its forward is ``shipped_linear``:
the weight dequantized in the compute dtype, the product, and a backward that dequantizes it again for the
input's gradient (exact: the gradient through the dequantized weight); the base takes no gradient. Only one
weight is dequantized at a time, and none is kept for backward.

Mixture-of-experts layers: the checkpoint holds each expert's projections as modules of their own (their own
codes and scales), which transformers 5 fuses into 3-D weights. ``ShippedExperts`` keeps them as shipped, one
entry per expert and part (``gate`` and ``up`` of ``gate_up_proj``), and computes each routed expert from them
in ``quant.experts.experts_forward``, as it does for 4-bit experts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from tiertune.errors import ModelError
from tiertune.quant.bnb4 import SavedWeight
from tiertune.quant.experts import StoredExperts

if TYPE_CHECKING:
    from tiertune.loading.weights import Checkpoint

SCALE = "scale"  # the chunk entry of a weight's scales: ``<name>.scale``
SCALE_KEY = "_scale_inv"  # its checkpoint tensor: ``<key>_scale_inv`` (DeepSeek's and transformers' name)
SCALE_FORMATS = ("float", "ue8m0")


def e8m0_dtype() -> torch.dtype:
    """torch's dtype of 1-byte power-of-two scales (``ue8m0``)."""
    return torch.float8_e8m0fnu


def _named(dtype: torch.dtype, shape: Sequence[int]) -> str:
    """``float8_e4m3fn (576, 7168)``: a tensor's dtype and shape as an error names them."""
    return f"{str(dtype).removeprefix('torch.')} {tuple(shape)}"


def stored_otherwise(
    checkpoint: Checkpoint, key: str, shape: Sequence[int], dtype: torch.dtype
) -> str | None:
    """How checkpoint tensor ``key`` differs from a ``dtype`` tensor of ``shape`` (``missing``, or its own dtype
    and shape), or None when it is one."""
    found = checkpoint.entries.get(key)
    if found is None:
        return "missing"
    if found.dtype != dtype or tuple(found.shape) != tuple(shape):
        return _named(found.dtype, found.shape)
    return None


class LinearFormat:
    """What the formats that quantize linear weights one tensor each share (``FP8``, ``Compressed``): their layers'
    ``nn.Linear`` modules become ``ShippedLinear``, a weight binds as its codes and ``<name>.scale``, and an MoE's
    experts are each a module of their own in the checkpoint (``module_experts_*``)."""

    skip: tuple[str, ...]
    transposed_experts = False  # experts stored (experts, in, out) stay 16-bit (no such release ships them)

    def convert(self, module: nn.Module, prefix: str = "") -> None:
        """Replace the ``nn.Linear`` modules inside ``module`` (a decoder layer on the meta device, named
        ``prefix`` in the model) by ``ShippedLinear``, except those ``ignored``."""
        for path, sub in list(module.named_modules()):
            for name, child in list(sub.named_children()):
                where = ".".join(p for p in (prefix, path, name) if p)
                if type(child) is nn.Linear and not self.ignored(where):
                    sub._modules[name] = ShippedLinear.of(child, self)

    def ignored(self, module: str) -> bool:
        """Whether ``skip`` (the checkpoint's ``modules_to_not_convert`` or compressed-tensors' ``ignore``: names,
        or ``re:`` regular expressions) leaves ``module`` (its full name in the model, or as the checkpoint names
        it: ``saved_names``) unquantized."""
        import re

        for name in saved_names(module):
            for pattern in self.skip:
                if pattern.startswith("re:"):
                    if re.match(pattern[3:], name):
                        return True
                elif pattern and _names(name, pattern):
                    return True
        return False

    def parameter(self, name: str, shape: torch.Size, views: dict[str, torch.Tensor]) -> nn.Parameter:
        """The bound weight of ``name``: its codes over the chunk's memory, with its scales."""
        return ShippedWeight(views[name], self, views[f"{name}.{SCALE}"])

    def experts_entries(
        self, name: str, shape: tuple[int, ...]
    ) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        return module_experts_entries(self, name, shape)

    def experts_saved(
        self, name: str, shape: tuple[int, ...], pieces: Sequence[tuple[str, tuple]], checkpoint: Checkpoint
    ) -> SavedWeight | None:
        return module_experts_saved(self, name, shape, pieces, checkpoint)

    def expert(self, views: dict[str, torch.Tensor], name: str, e: int) -> ExpertWeight:
        return module_expert(self, views, name, e)


@dataclass
class FP8(LinearFormat):
    """Weights stored as FP8 e4m3 codes with one scale per ``block`` (rows, columns) of the matrix; the scales in
    fp32 (``scale_fmt`` float) or as 1-byte powers of two (ue8m0). ``skip`` names modules the checkpoint keeps
    unquantized (``modules_to_not_convert``). ``compute_dtype``: what weights dequantize to."""

    compute_dtype: torch.dtype = torch.float32
    block: tuple[int, int] = (128, 128)
    scale_fmt: str = "float"
    skip: tuple[str, ...] = ()
    kind: str = field(default="fp8", init=False)

    def __post_init__(self) -> None:
        if self.scale_fmt not in SCALE_FORMATS:
            raise ModelError(f"FP8 scales are {' or '.join(SCALE_FORMATS)}, got {self.scale_fmt!r}")
        self.block = (int(self.block[0]), int(self.block[1]))

    @property
    def scale_dtype(self) -> torch.dtype:
        return e8m0_dtype() if self.scale_fmt == "ue8m0" else torch.float32

    def settings(self) -> dict[str, object]:
        return {"quantize": "fp8", "block": list(self.block), "scale_fmt": self.scale_fmt}

    def scale_shape(self, shape: Sequence[int]) -> tuple[int, int]:
        """The scale grid of a weight of ``shape`` (out, in)."""
        return (-(-shape[0] // self.block[0]), -(-shape[1] // self.block[1]))

    def entries(self, name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """The chunk entries of weight ``name`` of ``shape`` (out, in): its codes, then its scales."""
        if len(shape) != 2:
            raise ModelError(f"{name}: an FP8 weight is a matrix, got shape {tuple(shape)}")
        return [
            (name, tuple(shape), torch.float8_e4m3fn),
            (f"{name}.{SCALE}", self.scale_shape(shape), self.scale_dtype),
        ]

    def saved_tensors(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> list[tuple]:
        """What the checkpoint stores for weight ``key`` of ``shape``: ``(key, shape, dtype, None)`` each (the
        layout a ledger counts on when only a config.json is at hand)."""
        return [
            (key, tuple(shape), torch.float8_e4m3fn, None),
            (f"{key}{SCALE_KEY}", self.scale_shape(shape), self.scale_dtype, None),
        ]

    def saved(
        self, name: str, key: str, shape: tuple[int, ...], checkpoint: Checkpoint
    ) -> SavedWeight | None:
        """Where weight ``name`` (saved as checkpoint tensor ``key``) has its codes and scales; None when the
        checkpoint stores it unquantized. Raises ModelError when its tensors are not this format's."""
        scale_key = f"{key}{SCALE_KEY}"
        stored = checkpoint.entries.get(key)
        if stored is None or (stored.dtype != torch.float8_e4m3fn and scale_key not in checkpoint):
            return None
        for entry_key, (_, eshape, edtype) in zip((key, scale_key), self.entries(name, shape), strict=True):
            got = stored_otherwise(checkpoint, entry_key, eshape, edtype)
            if got is not None:
                raise ModelError(
                    f"FP8 weight {key!r} in {stored.file}: {entry_key!r} is {got}, expected "
                    f"{_named(edtype, eshape)} (e4m3 codes with a scale per "
                    f"{self.block[0]} x {self.block[1]} block, {self.scale_fmt} scales, as the model's "
                    "quantization_config says)"
                )
        return SavedWeight({name: key, f"{name}.{SCALE}": scale_key})

    # ------------------------------------------------------------------ values
    def dequantize(
        self, codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """The weight's values: ``codes[r, c] * scale[r // b0, c // b1]`` in fp32, cast to ``dtype`` (the compute
        dtype by default)."""
        rows, cols = codes.shape
        s = (
            scale.float()
            .repeat_interleave(self.block[0], 0)[:rows]
            .repeat_interleave(self.block[1], 1)[:, :cols]
        )
        return (codes.float() * s).to(dtype or self.compute_dtype)

    def quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``weight`` (out, in) as this format stores it: e4m3 codes and a scale per block, the block's largest
        magnitude over e4m3's largest (a power of two at or above it for ue8m0). What a checkpoint's FP8 release
        holds; the tests write their checkpoints with it."""
        rows, cols = weight.shape
        b0, b1 = self.block
        grid = self.scale_shape(weight.shape)
        padded = torch.zeros(grid[0] * b0, grid[1] * b1, dtype=torch.float32)
        padded[:rows, :cols] = weight.float()
        amax = padded.reshape(grid[0], b0, grid[1], b1).abs().amax(dim=(1, 3)).clamp(min=1e-12)
        scale = amax / torch.finfo(torch.float8_e4m3fn).max
        if self.scale_fmt == "ue8m0":
            scale = torch.exp2(torch.ceil(torch.log2(scale)))
        full = scale.repeat_interleave(b0, 0).repeat_interleave(b1, 1)
        codes = (padded / full)[:rows, :cols].to(torch.float8_e4m3fn)
        return codes, scale.to(self.scale_dtype)


SAVED_PREFIXES = (  # transformers 5's module names of a multimodal model -> those of its checkpoints on the hub
    ("model.language_model.", "language_model.model."),
    ("model.vision_model.", "vision_model."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)


def saved_names(module: str) -> list[str]:
    """``module`` (a name in transformers 5's model) and the names the checkpoint's own files give it: a
    multimodal release (Llama 4's) names its text decoder ``language_model.model...``, and its skip list uses
    those names."""
    names = [module]
    for ours, theirs in SAVED_PREFIXES:
        if module.startswith(ours):
            names.append(theirs + module.removeprefix(ours))
    return names


def _names(path: str, skip: str) -> bool:
    """Whether module ``path`` is (or is inside) the module ``skip`` names (a dotted suffix of its path)."""
    return path == skip or path.endswith(f".{skip}") or f".{skip}." in f".{path}."


class ShippedWeight(nn.Parameter):
    """A frozen linear weight stored in a shipped format. In the model's skeleton (``placeholder``) a meta
    tensor of the logical shape and compute dtype, which is what peft reads; bound by the engine, its data is the
    weight's codes over the chunk's memory, and ``fmt`` and ``scale`` say how to read them."""

    def __new__(
        cls, data: torch.Tensor, fmt: FP8 | None = None, scale: torch.Tensor | None = None
    ) -> ShippedWeight:
        self = torch.Tensor._make_subclass(cls, data, False)
        self.fmt = fmt
        self.scale = scale
        return self

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight's values (bound weights only)."""
        if self.fmt is None or self.scale is None:
            raise RuntimeError("a shipped weight's placeholder, not bound to a chunk, has no values")
        return self.fmt.dequantize(self, self.scale, dtype)

    def __reduce_ex__(self, protocol: Any) -> Any:  # a plain tensor of its values (pickles)
        return torch.Tensor.__reduce_ex__(self.detach().as_subclass(torch.Tensor), protocol)

    def __deepcopy__(self, memo: dict) -> ShippedWeight:
        """A copy bound as this one is (its codes copied, its format and scales with them): ``nn.Parameter``'s
        own would pass ``requires_grad`` where this class takes its format."""
        if id(self) not in memo:
            scale = None if self.scale is None else self.scale.clone()
            memo[id(self)] = ShippedWeight(self.detach().as_subclass(torch.Tensor).clone(), self.fmt, scale)
        return memo[id(self)]


def is_shipped(param: object) -> bool:
    """Whether ``param`` is a weight kept in its shipped format (``ShippedWeight``)."""
    return isinstance(param, ShippedWeight)


class _ShippedLinear(torch.autograd.Function):
    """``x @ W.T + b`` with ``W`` (anything with ``dequantize(dtype)``) dequantized in the forward and again in the
    backward (nothing kept between)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: Any, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.weight = weight  # the chunk's codes: not saved through autograd (their version counter is shared)
        ctx.has_bias = bias is not None
        return F.linear(x, weight.dequantize(x.dtype), bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, torch.Tensor | None]:
        dx = grad @ ctx.weight.dequantize(grad.dtype) if ctx.needs_input_grad[0] else None
        db = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, None, db


def shipped_linear(x: torch.Tensor, weight: Any, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` over a shipped weight (``ShippedWeight``, or one expert's ``ExpertWeight``), computed in its
    format's compute dtype (the result in ``x``'s)."""
    compute = weight.fmt.compute_dtype
    b = bias.to(compute) if bias is not None else None
    return _ShippedLinear.apply(x.to(compute), weight, b).to(x.dtype)


class ShippedLinear(nn.Linear):
    """An ``nn.Linear`` whose weight is kept in a shipped format (``ShippedWeight``) and dequantized at use."""

    fmt: Any

    @classmethod
    def of(cls, linear: nn.Linear, fmt: Any) -> ShippedLinear:
        """``linear`` (on the meta device) made one: same shape and bias, the weight a placeholder."""
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.in_features, module.out_features = linear.in_features, linear.out_features
        module.fmt = fmt
        placeholder = torch.empty(tuple(linear.weight.shape), dtype=fmt.compute_dtype, device="meta")
        module.weight = ShippedWeight(placeholder)
        module.bias = linear.bias
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not is_shipped(self.weight) or self.weight.fmt is None:
            raise RuntimeError(f"{type(self).__name__}: its weight is not bound to a chunk")
        return shipped_linear(x, self.weight, self.bias)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- experts


def expert_parts(name: str) -> int:
    """How many checkpoint tensors make one expert's matrix of fused weight ``name`` in a checkpoint that keeps
    each expert a module of its own: ``gate_up_proj`` is each expert's ``gate_proj`` and ``up_proj`` stacked by
    rows, the others are one tensor."""
    return 2 if name.rsplit(".", 1)[-1] == "gate_up_proj" else 1


def part_entry(name: str, e: int, k: int) -> str:
    """The chunk entry of expert ``e``'s part ``k`` of fused weight ``name`` (the first is the weight's own name,
    which the group's units start with)."""
    return name if (e, k) == (0, 0) else f"{name}.{e}.{k}"


@dataclass
class ExpertWeight:
    """One expert's matrix (out, in) of a shipped fused weight: its parts' codes and scales, stacked by rows."""

    fmt: Any
    parts: list[tuple[torch.Tensor, torch.Tensor]]

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        values = [self.fmt.dequantize(codes, scale, dtype) for codes, scale in self.parts]
        return values[0] if len(values) == 1 else torch.cat(values, 0)


def module_experts_entries(
    fmt: Any, name: str, shape: tuple[int, ...]
) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """The chunk entries of fused expert weight ``name`` of ``shape`` (experts, out, in) kept as a release ships
    it with each expert a module of its own: each expert's parts, each part's entries as ``fmt`` stores a
    weight."""
    experts, rows, cols = shape
    parts = expert_parts(name)
    if rows % parts:
        raise ModelError(f"{name}: {rows} rows do not split into {parts} parts of an expert")
    return [
        entry
        for e in range(experts)
        for k in range(parts)
        for entry in fmt.entries(part_entry(name, e, k), (rows // parts, cols))
    ]


def module_experts_saved(
    fmt: Any, name: str, shape: tuple[int, ...], pieces: Sequence[tuple[str, tuple]], checkpoint: Checkpoint
) -> SavedWeight | None:
    """Where fused expert weight ``name`` of ``shape`` has its parts in a checkpoint that keeps each expert a
    module (``pieces``: one tensor per expert and part, as ``loading.model.TensorSource`` lists them); None when
    they are stored unquantized."""
    experts, rows, cols = shape
    parts = expert_parts(name)
    part = (rows // parts, cols)
    if not pieces or fmt.saved(part_entry(name, 0, 0), pieces[0][0], part, checkpoint) is None:
        return None  # stored unquantized (a checkpoint whose experts are 16-bit)
    if len(pieces) != experts * parts:
        raise ModelError(
            f"{name}: the checkpoint holds {len(pieces)} tensors for its {experts} experts, expected {parts} each "
            "(an expert's gate_proj and up_proj, or its one projection)"
        )
    tensors: dict[str, str] = {}
    for i, (key, index) in enumerate(pieces):
        e, k = divmod(i, parts)
        if index[:1] != (e,) or (parts > 1 and index[1] != slice(k * part[0], (k + 1) * part[0])):
            raise ModelError(f"{name}: checkpoint tensor {key!r} is not expert {e}'s part {k} where expected")
        found = fmt.saved(part_entry(name, e, k), key, part, checkpoint)
        if found is None:
            raise ModelError(f"{name}: expert {e}'s {key!r} is stored unquantized among quantized experts")
        tensors.update(found.tensors)
    return SavedWeight(tensors)


def module_expert(fmt: Any, views: dict[str, torch.Tensor], name: str, e: int) -> ExpertWeight:
    """Expert ``e``'s matrix of fused weight ``name`` from its parts' chunk entries."""
    entries = [part_entry(name, e, k) for k in range(expert_parts(name))]
    return ExpertWeight(fmt, [(views[entry], views[f"{entry}.{SCALE}"]) for entry in entries])


class ShippedExperts(StoredExperts):
    """A fused expert weight (experts, out, in) kept as the checkpoint ships it: one matrix per expert (of one or
    two parts for FP8, a slice of the fused blocks for MXFP4), each with its scales. Bound (``bind_experts``),
    ``matmul(e, x)`` computes expert ``e`` from them."""

    def matmul(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """``x @ W_e.T`` for expert ``e`` (W_e its (out, in) matrix), dequantized (and again in backward for
        ``x``'s gradient)."""
        fmt, views = self.quant, self.views
        if fmt is None or views is None:
            raise RuntimeError(
                f"{self.weight_name or 'an expert weight'} is a placeholder, not bound to a chunk"
            )
        return shipped_linear(x, fmt.expert(views, self.weight_name, e))


def bind_experts(fmt: Any, name: str, shape: torch.Size, views: dict[str, torch.Tensor]) -> ShippedExperts:
    """The bound ``ShippedExperts`` of fused expert weight ``name`` over the chunks' ``views``."""
    own = {k: v for k, v in views.items() if k == name or k.startswith(f"{name}.")}
    return ShippedExperts(views[name], fmt, name, shape, own)


def mark_experts(layer: nn.Module, fmt: Any) -> list[str]:
    """Mark the fused expert weights inside ``layer`` (meta) to be kept as shipped (``ShippedExperts``
    placeholders); returns their names relative to ``layer``. Experts ``fmt.skip`` names stay; so do experts
    stored transposed unless the format ships them so (MXFP4)."""
    from tiertune.quant.experts import mark_fused

    return mark_fused(layer, fmt.skip, ShippedExperts, transposed=fmt.transposed_experts)


# ---------------------------------------------------------------------- MXFP4

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The 16 values of an e2m1 code (OCP's microscaling FP4), by code; two codes a byte, the low nibble first."""
MX_GROUP = 32  # elements sharing one e8m0 scale


@dataclass
class MXFP4:
    """gpt-oss's experts as they ship (``quant_method: mxfp4``): each expert's (out, in) matrix as e2m1 codes in
    groups of 32 along ``in`` with one e8m0 scale (a power of two, biased by 127) per group, the layer's experts
    fused in the file: ``<key>_blocks`` uint8 (experts, out, in / 32, 16) and ``<key>_scales`` uint8 (experts,
    out, in / 32). Linear modules are not quantized (attention, router, embeddings stay 16-bit).

    Chunk entries: ``<name>`` the blocks, ``<name>.scale`` the scales, read in place (one tensor each)."""

    compute_dtype: torch.dtype = torch.float32
    skip: tuple[str, ...] = ()
    kind: str = field(default="mxfp4", init=False)
    transposed_experts = True  # gpt-oss's experts are (experts, in, out): their matrices ship as (out, in)

    def settings(self) -> dict[str, object]:
        return {"quantize": "mxfp4"}

    def convert(self, module: nn.Module, prefix: str = "") -> None:
        """No linear module is MXFP4: only the experts are (``mark_experts``)."""

    def entries(self, name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        raise ModelError(f"{name}: an MXFP4 checkpoint quantizes only the MoE experts")

    def experts_entries(
        self, name: str, shape: tuple[int, ...]
    ) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        experts, rows, cols = _as_out_in(shape)
        if cols % MX_GROUP:
            raise ModelError(f"{name}: {cols} inputs do not split into groups of {MX_GROUP}")
        groups = cols // MX_GROUP
        return [
            (name, (experts, rows, groups, 16), torch.uint8),
            (f"{name}.{SCALE}", (experts, rows, groups), torch.uint8),
        ]

    def saved_tensors(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> list[tuple]:
        """gpt-oss's saved layout of fused expert weight ``key`` (experts, in, out)."""
        return [(f"{key}_blocks", s, t, None) for (_, s, t) in self.experts_entries(key, shape)[:1]] + [
            (f"{key}_scales", s, t, None) for (_, s, t) in self.experts_entries(key, shape)[1:]
        ]

    def experts_saved(
        self, name: str, shape: tuple[int, ...], pieces: Sequence[tuple[str, tuple]], checkpoint: Checkpoint
    ) -> SavedWeight | None:
        key = pieces[0][0] if len(pieces) == 1 and not pieces[0][1] else None
        if key is None or not key.endswith("_blocks"):
            return None  # stored unquantized
        base = key.removesuffix("_blocks")
        tensors = {name: key, f"{name}.{SCALE}": f"{base}_scales"}
        for (entry, eshape, edtype), ckey in zip(
            self.experts_entries(name, shape), tensors.values(), strict=True
        ):
            got = stored_otherwise(checkpoint, ckey, eshape, edtype)
            if got is not None:
                raise ModelError(
                    f"MXFP4 experts {base!r}: {ckey!r} is {got}, expected uint8 {tuple(eshape)} ({entry})"
                )
        return SavedWeight(tensors)

    def expert(self, views: dict[str, torch.Tensor], name: str, e: int) -> ExpertWeight:
        return ExpertWeight(self, [(views[name][e], views[f"{name}.{SCALE}"][e])])

    def dequantize(
        self, blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """The (out, in) values of blocks (out, in / 32, 16) and scales (out, in / 32): code times 2^(scale - 127),
        as transformers' gpt-oss loader dequantizes them (before it transposes)."""
        lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
        codes = torch.stack(
            [lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1
        )  # (out, g, 16, 2)
        values = torch.ldexp(codes.reshape(*blocks.shape[:-1], 32), (scales.to(torch.int32) - 127)[..., None])
        return values.reshape(blocks.shape[0], -1).to(dtype or self.compute_dtype)

    def quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``weight`` (out, in) as gpt-oss ships it: each group of 32 scaled by the power of two that brings its
        largest magnitude within e2m1's 6, each value the nearest code. The tests write checkpoints with it."""
        rows, cols = weight.shape
        groups = weight.float().reshape(rows, cols // MX_GROUP, MX_GROUP)
        amax = groups.abs().amax(-1).clamp(min=2.0**-126)
        exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
        scaled = groups / torch.exp2(exponent)[..., None]
        lut = torch.tensor(FP4_VALUES)
        codes = (scaled[..., None] - lut).abs().argmin(-1).to(torch.uint8)  # (rows, g, 32)
        blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
        return blocks.contiguous(), (exponent + 127).to(torch.uint8)


def _as_out_in(shape: Sequence[int]) -> tuple[int, int, int]:
    """(experts, out, in) of a gpt-oss fused expert weight of ``shape`` (experts, in, out)."""
    experts, cols, rows = shape
    return experts, rows, cols


# ---------------------------------------------------------------------- FP8 per output channel (fbgemm)


@dataclass
class RowwiseFP8(LinearFormat):
    """FP8 with one fp32 scale per output channel, as Meta's FP8 releases ship (``quant_method: fbgemm_fp8``:
    Llama 4 Maverick's, Llama 3.1 405B's), made for fbgemm's rowwise kernels:

    - a linear weight: ``<key>`` float8_e4m3fn (out, in) and ``<key>_scale`` fp32 (out, 1);
    - Llama 4's fused experts, stored (experts, in, out) as the model holds them: ``gate_up_proj`` with
      ``gate_up_proj_scale`` (experts, 1, 2 x intermediate) and ``down_proj`` with ``down_proj_scale`` (experts,
      hidden, 1), one scale per output column either way.

    A value is its code times its channel's scale. fbgemm's kernels also quantize the activations per row at
    serving time (``activation_scale_ub``); training computes with them in the compute dtype. ``skip``: the
    checkpoint's ``modules_to_not_convert`` (Meta's list the attention and the layers kept 16-bit by name).

    Chunk entries: a weight's codes and ``<name>.scale``, read in place; a layer's fused experts as one tensor
    each (codes, scales), each expert's (out, in) matrix the transpose of its slice."""

    compute_dtype: torch.dtype = torch.float32
    skip: tuple[str, ...] = ()
    kind: str = field(default="fbgemm_fp8", init=False)
    transposed_experts = True  # Llama 4's experts are (experts, in, out) in the model and in the file

    def settings(self) -> dict[str, object]:
        return {"quantize": "fbgemm_fp8"}

    def entries(self, name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """The chunk entries of weight ``name`` of ``shape`` (out, in): its codes, then its scales."""
        if len(shape) != 2:
            raise ModelError(f"{name}: an FP8 weight is a matrix, got shape {tuple(shape)}")
        return [(name, tuple(shape), torch.float8_e4m3fn), (f"{name}.{SCALE}", (shape[0], 1), torch.float32)]

    def experts_entries(
        self, name: str, shape: tuple[int, ...]
    ) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """The chunk entries of fused expert weight ``name`` of ``shape`` (experts, in, out): its codes and its
        scales, shaped as transformers' fbgemm experts module holds them."""
        experts, _, cols = shape
        scale = (experts, 1, cols) if name.rsplit(".", 1)[-1] == "gate_up_proj" else (experts, cols, 1)
        return [(name, tuple(shape), torch.float8_e4m3fn), (f"{name}.{SCALE}", scale, torch.float32)]

    def saved_tensors(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> list[tuple]:
        """What the checkpoint stores for weight ``key`` (a matrix, or fused experts) of ``shape``."""
        made = self.entries(key, shape) if len(shape) == 2 else self.experts_entries(key, shape)
        return [(key, made[0][1], made[0][2], None), (f"{key}_scale", made[1][1], made[1][2], None)]

    def _found(
        self, entries: list[tuple[str, tuple[int, ...], torch.dtype]], key: str, checkpoint: Checkpoint
    ) -> SavedWeight | None:
        stored = checkpoint.entries.get(key)
        if stored is None or stored.dtype != torch.float8_e4m3fn:
            return None  # stored unquantized
        keys = (key, f"{key}_scale")
        for ckey, (_, eshape, edtype) in zip(keys, entries, strict=True):
            got = stored_otherwise(checkpoint, ckey, eshape, edtype)
            if got is not None:
                raise ModelError(
                    f"FP8 weight {key!r} in {stored.file}: {ckey!r} is {got}, expected "
                    f"{_named(edtype, eshape)} (e4m3 codes with an fp32 scale per "
                    "output channel, as quant_method fbgemm_fp8 says)"
                )
        return SavedWeight({entries[0][0]: keys[0], entries[1][0]: keys[1]})

    def saved(
        self, name: str, key: str, shape: tuple[int, ...], checkpoint: Checkpoint
    ) -> SavedWeight | None:
        """Where weight ``name`` (saved as ``key``) has its codes and scales; None when stored unquantized."""
        return self._found(self.entries(name, shape), key, checkpoint)

    def experts_saved(
        self, name: str, shape: tuple[int, ...], pieces: Sequence[tuple[str, tuple]], checkpoint: Checkpoint
    ) -> SavedWeight | None:
        """Where fused expert weight ``name`` has its codes and scales (one tensor each, as the model holds
        them); None when stored unquantized."""
        if len(pieces) != 1 or pieces[0][1]:
            return None  # one tensor per expert: a layout this format does not ship
        return self._found(self.experts_entries(name, shape), pieces[0][0], checkpoint)

    def expert(self, views: dict[str, torch.Tensor], name: str, e: int) -> ExpertWeight:
        """Expert ``e``'s (out, in) matrix: the transpose of its slice of the fused codes, with its scales."""
        return ExpertWeight(self, [(views[name][e].t(), views[f"{name}.{SCALE}"][e])])

    def dequantize(
        self, codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """The values of a matrix (out, in) whose scales are one per row, or of fused experts (experts, in, out)
        whose scales are one per expert and column: codes times scales, in fp32, cast to ``dtype``."""
        if codes.dim() == 3:
            s = scale.float().reshape(codes.shape[0], 1, codes.shape[2])
        else:
            s = scale.float().reshape(codes.shape[0], 1)
        return (codes.float() * s).to(dtype or self.compute_dtype)

    def quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``weight`` (out, in) as fbgemm's rowwise quantizer stores it: each row's largest magnitude over e4m3's
        largest as its scale (out, 1). The tests write their checkpoints with it."""
        top = torch.finfo(torch.float8_e4m3fn).max
        scale = (weight.float().abs().amax(1, keepdim=True) / top).clamp(min=1e-12)
        return (weight.float() / scale).to(torch.float8_e4m3fn), scale


# ---------------------------------------------------------------------- compressed-tensors


@dataclass
class Compressed(LinearFormat):
    """Linear weights as compressed-tensors ships them (``quant_method: compressed-tensors``, made by
    llm-compressor: Kimi-K2-Thinking's INT4, GLM's and Llama 4's FP8 releases), one scheme for the layers it
    targets:

    - ``pack-quantized``, symmetric integers of ``bits`` (4 or 8) with a scale per ``group`` of inputs (0: one per
      output channel): ``<key>_packed`` int32 (out, in x bits / 32), the values offset by 2^(bits - 1) and packed
      from the lowest bits up; ``<key>_scale`` (out, in / group); ``<key>_shape`` (the logical shape, not read);
    - ``float-quantized``, FP8 e4m3 ``<key>`` (out, in) with ``<key>_scale`` per output channel (out, 1) or per
      tensor (1,).

    A weight's values are its integers (or FP8 values) times their scale. ``ignore`` names modules left 16-bit
    (names, or ``re:`` regular expressions, as compressed-tensors matches them)."""

    compute_dtype: torch.dtype = torch.float32
    format: str = "pack-quantized"
    bits: int = 4
    group: int = 32  # inputs per scale; 0: one scale per output channel (strategy channel); -1: per tensor
    scale_dtype: torch.dtype = torch.bfloat16
    skip: tuple[str, ...] = ()
    kind: str = field(default="compressed-tensors", init=False)

    @property
    def packed(self) -> bool:
        return self.format == "pack-quantized"

    def settings(self) -> dict[str, object]:
        return {"quantize": self.kind, "format": self.format, "bits": self.bits, "group": self.group}

    def adopt(self, checkpoint: Checkpoint) -> None:
        """Take the scales' dtype from the checkpoint (llm-compressor saves them in the model's dtype or fp32; the
        config does not say): the first ``..._scale`` of a quantized weight."""
        for key, entry in checkpoint.entries.items():
            if key.endswith("_scale") and self.keys(key.removesuffix("_scale"))[0] in checkpoint:
                self.scale_dtype = entry.dtype
                return

    def codes_shape(self, shape: Sequence[int]) -> tuple[int, int]:
        rows, cols = shape
        return (rows, cols * self.bits // 32) if self.packed else (rows, cols)

    def scale_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        rows, cols = shape
        if self.group > 0:
            return (rows, cols // self.group)
        return (rows, 1) if self.group == 0 else (1,)

    def entries(self, name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        if len(shape) != 2:
            raise ModelError(f"{name}: a compressed weight is a matrix, got shape {tuple(shape)}")
        if (self.packed and shape[1] * self.bits % 32) or (self.group > 0 and shape[1] % self.group):
            raise ModelError(
                f"{name}: {shape[1]} inputs do not pack into whole 32-bit words of {self.bits}-bit values and "
                f"groups of {self.group}"
            )
        codes = torch.int32 if self.packed else torch.float8_e4m3fn
        return [
            (name, self.codes_shape(shape), codes),
            (f"{name}.{SCALE}", self.scale_shape(shape), self.scale_dtype),
        ]

    def keys(self, key: str) -> tuple[str, str]:
        """The checkpoint tensors of the weight saved as ``key`` (``...weight``): its codes and its scales."""
        return (f"{key}_packed" if self.packed else key), f"{key}_scale"

    def saved_tensors(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> list[tuple]:
        codes, scale = self.keys(key)
        (_, cshape, cdtype), (_, sshape, sdtype) = self.entries(key, shape)
        out = [(codes, cshape, cdtype, None), (scale, sshape, sdtype, None)]
        if self.packed:
            out.append((f"{key}_shape", (2,), torch.int64, torch.tensor(list(shape))))
        return out

    def saved(
        self, name: str, key: str, shape: tuple[int, ...], checkpoint: Checkpoint
    ) -> SavedWeight | None:
        """Where weight ``name`` (saved as ``key``: its codes, ``..._packed`` for packed integers) has its codes
        and scales; None when the checkpoint stores it unquantized."""
        base = key.removesuffix("_packed")
        codes_key, scale_key = self.keys(base)
        if codes_key not in checkpoint or scale_key not in checkpoint:
            return None
        for ckey, (entry, eshape, edtype) in zip(
            (codes_key, scale_key), self.entries(name, shape), strict=True
        ):
            got = stored_otherwise(checkpoint, ckey, eshape, edtype)
            if got is not None:
                raise ModelError(
                    f"compressed weight {base!r} in {checkpoint.entries[ckey].file}: {ckey!r} is {got}, expected "
                    f"{_named(edtype, eshape)} ({entry}; the {self.format} scheme of "
                    "the model's quantization_config)"
                )
        return SavedWeight({name: codes_key, f"{name}.{SCALE}": scale_key})

    def dequantize(
        self, codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """The weight's values: its integers (unpacked from the lowest bits of each word up, less the offset
        2^(bits - 1)) or FP8 values, times the scale of their group, channel or tensor, in fp32, cast to ``dtype``."""
        if self.packed:
            rows = codes.shape[0]
            raw = (
                codes.contiguous().view(torch.uint8).reshape(rows, -1)
            )  # little-endian words: lowest bits first
            if self.bits == 4:
                raw = torch.stack((raw & 0x0F, raw >> 4), dim=-1).reshape(rows, -1)
            values = raw.float() - (1 << (self.bits - 1))
        else:
            values = codes.float()
        s = scale.float()
        if self.group > 0:
            s = s.repeat_interleave(self.group, 1)
        return (values * s).to(dtype or self.compute_dtype)

    def quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``weight`` (out, in) as this scheme ships it (symmetric: each group's largest magnitude maps to the
        largest integer, or to e4m3's largest). The tests write their checkpoints with it."""
        rows, cols = weight.shape
        w = weight.float()
        if self.group > 0:
            groups = w.reshape(rows, cols // self.group, self.group)
        else:  # one scale per output channel, or one for the tensor
            groups = w.reshape(rows, 1, cols) if self.group == 0 else w.reshape(1, 1, rows * cols)
        top = float((1 << (self.bits - 1)) - 1) if self.packed else torch.finfo(torch.float8_e4m3fn).max
        scale = (groups.abs().amax(-1) / top).clamp(min=1e-12).to(self.scale_dtype)
        scaled = groups / scale.float()[..., None]
        if not self.packed:
            return scaled.reshape(rows, cols).to(torch.float8_e4m3fn), scale.reshape(
                self.scale_shape((rows, cols))
            )
        ints = scaled.round().clamp(-(1 << (self.bits - 1)), top).reshape(rows, cols).to(torch.int32)
        unsigned = (ints + (1 << (self.bits - 1))).to(torch.uint8)
        if self.bits == 4:
            unsigned = unsigned[:, 0::2] | (unsigned[:, 1::2] << 4)
        return unsigned.contiguous().view(torch.int32), scale.reshape(self.scale_shape((rows, cols)))


def compressed_settings(raw: dict[str, Any], where: str) -> dict[str, Any]:
    """The one scheme of a compressed-tensors ``quantization_config`` that tiertune reads, as ``Compressed``'s
    fields; ModelError naming what it cannot read."""
    fmt = raw.get("format")
    groups = list((raw.get("config_groups") or {}).values())
    weights = (groups[0] or {}).get("weights") or {} if len(groups) == 1 else {}
    kind, bits = weights.get("type"), weights.get("num_bits")
    strategy, group = weights.get("strategy"), weights.get("group_size")
    problem = ""
    if len(groups) != 1:
        problem = f"{len(groups)} config_groups (tiertune reads one scheme for all quantized layers)"
    elif fmt == "pack-quantized" and not (
        kind == "int" and bits in (4, 8) and weights.get("symmetric", True)
    ):
        problem = f"pack-quantized {kind} {bits}-bit weights (symmetric={weights.get('symmetric')})"
    elif fmt in ("float-quantized", "naive-quantized") and not (kind == "float" and bits == 8):
        problem = f"{fmt} {kind} {bits}-bit weights"
    elif fmt not in ("pack-quantized", "float-quantized", "naive-quantized"):
        problem = f"format {fmt!r}"
    elif strategy not in ("group", "channel", "tensor") or (
        strategy == "group" and not isinstance(group, int)
    ):
        problem = f"strategy {strategy!r} (group size {group!r})"
    if problem:
        raise ModelError(
            f"{where} is saved with compressed-tensors, {problem}; tiertune reads symmetric INT4/INT8 "
            "pack-quantized weights with a scale per group or channel, and FP8 float-quantized ones with a scale "
            "per channel or tensor"
        )
    return {
        "kind": "compressed-tensors",
        "format": "pack-quantized" if fmt == "pack-quantized" else "float-quantized",
        "bits": bits,
        "group": group if strategy == "group" else (0 if strategy == "channel" else -1),
        "skip": tuple(raw.get("ignore") or ()),
    }


def is_shipped_format(quant: object) -> bool:
    """Whether ``quant`` is a format read as checkpoints ship it (``FP8``, ``MXFP4``, ``RowwiseFP8``,
    ``Compressed``), not one
    made on load."""
    return isinstance(quant, FP8 | MXFP4 | RowwiseFP8 | Compressed)
