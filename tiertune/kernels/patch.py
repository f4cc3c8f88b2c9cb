"""Puts tiertune's ops into one model *instance*, per architecture: its RMSNorm, gated MLP and attention
modules get forwards that call ``kernels.ops``, and so do peft's LoRA layers and bitsandbytes' NF4 layers.

Nothing is patched globally: other models of the same class, built before or after, keep transformers' own
code. The attention forward is transformers' own function, rebuilt with a namespace in which
``apply_rotary_pos_emb`` is ours, so it follows whatever the installed transformers version does around
the rotation. An architecture without module kernels in ``kernels.architectures`` keeps its modules (the
reference), said once.
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
import types
from collections import Counter
from typing import Any

import torch
from torch import nn

from tiertune.errors import ConfigError
from tiertune.kernels import KERNEL_CHOICES
from tiertune.kernels.architectures import ARCHITECTURES
from tiertune.kernels.ops.backend import default_backend, triton_available
from tiertune.kernels.ops.fp8 import fp8_linear
from tiertune.kernels.ops.lora import lora_branch
from tiertune.kernels.ops.mxfp4 import mxfp4_linear
from tiertune.kernels.ops.nf4 import nf4_linear
from tiertune.kernels.ops.rms_norm import rms_norm
from tiertune.kernels.ops.rope import apply_rope
from tiertune.kernels.ops.swiglu import GLU_ACTIVATIONS, glu

log = logging.getLogger("tiertune.kernels")


def resolve_backend(kernels: str, device: torch.device) -> str:
    """The backend a recipe's ``kernels`` setting means on ``device``: ``triton`` or ``torch``.

    ``auto`` is Triton on a CUDA device where it is installed, else the torch references; ``triton``
    insists (a CPU runs it only under ``TRITON_INTERPRET=1``, which is for tests)."""
    if kernels == "torch":
        return "torch"
    if kernels == "auto":
        return default_backend(device)
    if kernels == "triton":
        if not triton_available():
            why = "triton is not installed" if device.type == "cuda" else "there is no CUDA device"
            raise ConfigError(f"kernels: triton cannot run here ({why}); use kernels: auto or torch")
        return "triton"
    raise ValueError(
        f"resolve_backend takes one of {', '.join(KERNEL_CHOICES)} (a recipe's kernels), got {kernels!r}"
    )


def patch_model(model: nn.Module, backend: str, nf4: bool | None = None) -> Counter[str]:
    """Gives ``model``'s modules forwards that run tiertune's ops with ``backend`` (``torch``/``triton``).

    ``nf4``: whether bitsandbytes' NF4 layers run ours too (default: with Triton only, where our dequantize
    kernel replaces bitsandbytes'; on a CPU bitsandbytes' own path is the reference). Returns how many
    modules of each kind were patched; an architecture not in ``ARCHITECTURES`` is logged once."""
    counts: Counter[str] = Counter()
    config = getattr(model, "config", None)  # a multimodal class: its language model's architecture
    model_type = config.get_text_config(decoder=True).model_type if config is not None else None
    arch = ARCHITECTURES.get(model_type)
    if arch is not None and arch.norm is None:  # known (the fused loss), but no module kernels
        arch = None
    if arch is None:
        _say_once(f"kernels: {model_type} has no kernel table; its layers run transformers' own code")
    for module in model.modules():
        name = type(module).__name__
        if arch is not None and name == arch.norm:
            module.forward = functools.partial(_norm_forward, module, arch.norm_offset, backend)
            counts["rms_norm"] += 1
        elif arch is not None and name == arch.mlp and _patch_mlp(module, backend):
            counts["glu"] += 1
        elif arch is not None and name == arch.attention and _patch_attention(module, backend):
            counts["rope"] += 1
        elif _is_lora_linear(module) and _patch_lora(module, backend):
            counts["lora"] += 1
        elif _is_nf4(module) and (backend == "triton" if nf4 is None else nf4):
            module.forward = functools.partial(_nf4_forward, module, backend)
            counts["nf4"] += 1
        elif _is_fp8(module) and backend == "triton":
            module.forward = functools.partial(_fp8_forward, module)
            counts["fp8"] += 1
        elif module.__dict__.get("_tiertune_stored") and backend == "triton":  # experts kept one matrix each
            module.__dict__["_tiertune_expert_matmul"] = _shipped_expert  # quant.experts.FUSED_MATMUL
            counts["experts"] += 1
    log.debug("kernels (%s): %s", backend, describe(counts) or "none")
    return counts


def describe(counts: Counter[str]) -> str:
    """``patch_model``'s counts as the log and the banner show them: ``glu x3, rms_norm x7, rope x3``."""
    return ", ".join(f"{kind} x{n}" for kind, n in sorted(counts.items()))


@functools.cache
def _say_once(message: str) -> None:
    log.info(message)


# ---------------------------------------------------------------------------------------------- RMSNorm


def _norm_forward(module: nn.Module, offset: float, backend: str, x: torch.Tensor) -> torch.Tensor:
    eps = module.variance_epsilon if hasattr(module, "variance_epsilon") else module.eps
    if offset:  # Gemma: (x * (1 + w)) in fp32, then cast; transformers' GemmaRMSNorm
        return rms_norm(x.float(), module.weight.float(), eps, offset, backend).type_as(x)
    return rms_norm(x, module.weight, eps, 0.0, backend)


# ---------------------------------------------------------------------------------------------- gated MLP


def _patch_mlp(module: nn.Module, backend: str) -> bool:
    act = getattr(module, "act_fn", None) or getattr(module, "activation_fn", None)
    activation = _glu_activation(act)
    if activation is None:
        _say_once(f"kernels: {type(module).__name__}'s activation {type(act).__name__} has no fused kernel")
        return False
    if hasattr(module, "gate_up_proj"):
        module.forward = functools.partial(_fused_gate_up_forward, module, activation, backend)
    else:
        module.forward = functools.partial(_mlp_forward, module, activation, backend)
    return True


def _glu_activation(act: object) -> str | None:
    """Our name for the activation module ``act`` (None: no kernel for it), matched by class."""
    from transformers.activations import ACT2CLS

    for hf_name, ours in GLU_ACTIVATIONS.items():
        if type(act) is ACT2CLS.get(hf_name):
            return ours
    return None


def _mlp_forward(module: nn.Module, activation: str, backend: str, x: torch.Tensor) -> torch.Tensor:
    return module.down_proj(glu(module.gate_proj(x), module.up_proj(x), activation, backend))


def _fused_gate_up_forward(module: nn.Module, activation: str, backend: str, x: torch.Tensor) -> torch.Tensor:
    gate, up = module.gate_up_proj(x).chunk(2, dim=-1)
    return module.down_proj(glu(gate, up, activation, backend))


# ---------------------------------------------------------------------------------------------- RoPE


def _patch_attention(module: nn.Module, backend: str) -> bool:
    cls = type(module)
    if "apply_rotary_pos_emb" not in inspect.unwrap(cls.forward).__code__.co_names:
        _say_once(f"kernels: {cls.__name__}.forward does not call apply_rotary_pos_emb; RoPE stays unfused")
        return False
    forward = _with_global(cls.forward, "apply_rotary_pos_emb", functools.partial(_rope, backend))
    module.forward = types.MethodType(forward, module)
    return True


def _with_global(fn: types.FunctionType, name: str, value: object) -> types.FunctionType:
    """A copy of ``fn`` whose global ``name`` is ``value``. Decorators made with ``functools.wraps`` (such as
    transformers' ``deprecate_kwarg`` on attention forwards) are kept: the function they wrap is copied and
    put in place of the original in a copy of the wrapper."""
    inner = getattr(fn, "__wrapped__", None)
    if inner is None:
        namespace = {**fn.__globals__, name: value}
        copy = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)
    else:
        new_inner = _with_global(inner, name, value)
        cells = fn.__closure__ or ()
        closure = tuple(types.CellType(new_inner) if _holds(c, inner) else c for c in cells)
        if closure == cells:
            raise RuntimeError(f"{fn.__qualname__}: the function it wraps is not in its closure")
        copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, closure)
        copy.__wrapped__ = new_inner  # type: ignore[attr-defined]
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__ = fn.__qualname__
    return copy


def _holds(cell: types.CellType, value: object) -> bool:
    try:
        return cell.cell_contents is value
    except ValueError:  # an empty cell
        return False


def _rope(
    backend: str,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    unsqueeze_dim: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    if unsqueeze_dim != 1:
        raise NotImplementedError("tiertune's RoPE takes q and k as [batch, heads, seq, head_dim]")
    return apply_rope(q, k, cos, sin, backend)


# ---------------------------------------------------------------------------------------------- LoRA


def _is_lora_linear(module: nn.Module) -> bool:
    from peft.tuners.lora import LoraLayer
    from peft.tuners.lora.layer import ParamWrapper

    # a ParamWrapper adapts a parameter (MoE experts, routers), not its module's output: peft's own forward
    return (
        isinstance(module, LoraLayer)
        and not isinstance(module, ParamWrapper)
        and isinstance(getattr(module, "base_layer", None), nn.Module)
    )


def _patch_lora(module: nn.Module, backend: str) -> bool:
    """peft's LoRA layer whose adapters are plain (no DoRA, no bias, not merged): base output + each active
    adapter's fused branch (of several over one base, ``methods.lora.Adapters``: the one activated, or each
    row's own in a mixed batch)."""
    adapters = list(module.lora_A)
    plain = not module.merged and all(
        not module.use_dora.get(name, False)
        and isinstance(module.lora_A[name], nn.Linear)
        and isinstance(module.lora_dropout[name], nn.Dropout | nn.Identity)
        and not getattr(module, "lora_bias", {}).get(name, False)
        for name in adapters
    )
    if not plain:
        _say_once(f"kernels: {type(module).__name__} with a DoRA adapter or bias keeps peft's forward")
        return False
    module.forward = functools.partial(_lora_forward, module, backend)
    return True


def _lora_forward(module: nn.Module, backend: str, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    rows = kwargs.pop("adapter_names", None)  # a mixed batch (``methods.lora.Adapters.mix``)
    result = module.base_layer(x, *args, **kwargs)
    if module.disable_adapters:
        return result
    # the adapters this module adds: the active ones, or of a mixed batch those its rows name (in their order)
    names = module.active_adapters if rows is None else list(dict.fromkeys(rows))
    for name in names:
        if name not in module.lora_A:  # an adapter that does not target this module adds nothing
            continue
        own = None if rows is None else [i for i, n in enumerate(rows) if n == name]
        dropout = module.lora_dropout[name]
        p = dropout.p if isinstance(dropout, nn.Dropout) else 0.0
        a, b = module.lora_A[name].weight, module.lora_B[name].weight
        # computes in A's dtype (x cast tile by tile), returns the base output's
        delta = lora_branch(
            x if own is None else x[own],
            a,
            b,
            module.scaling[name],
            p,
            module.training,
            backend,
            out_dtype=result.dtype,
        )
        if own is not None:
            result = result.index_add(0, torch.tensor(own, device=result.device), delta)
        elif result._is_view():
            # autograd forbids adding in place to a view a custom Function made (bitsandbytes' 4-bit matmul)
            result = result + delta
        else:
            # into the base output (its op keeps its inputs, not its output): no third output-sized tensor
            result = result.add_(delta)
    return result


# ---------------------------------------------------------------------------------------------- NF4


def _is_nf4(module: nn.Module) -> bool:
    if "bitsandbytes" not in sys.modules:
        return False
    import bitsandbytes as bnb

    weight = getattr(module, "weight", None)
    return isinstance(module, bnb.nn.Linear4bit) and getattr(weight, "quant_type", None) == "nf4"


def _is_fp8(module: nn.Module) -> bool:
    """Whether ``module`` is a linear layer whose weight is read as an FP8 blockwise release ships it
    (``quant.shipped.ShippedLinear``)."""
    return (
        type(module).__name__ == "ShippedLinear"
        and getattr(getattr(module, "fmt", None), "kind", None) == "fp8"
    )


def _fp8_forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``ShippedLinear.forward`` through the fused FP8 kernel: the codes and block scales bound to the weight,
    multiplied in the format's compute dtype."""
    weight = module.weight
    fmt = weight.fmt  # type: ignore[union-attr]
    if fmt is None:
        raise RuntimeError(f"{type(module).__name__}: its weight is not bound to a chunk")
    codes = weight.detach().as_subclass(torch.Tensor)
    h = x.to(fmt.compute_dtype)
    return fp8_linear(h, codes, weight.scale, fmt.block, module.bias, "triton").to(x.dtype)  # type: ignore[union-attr]


def _shipped_expert(weight: Any, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert ``e``'s ``x @ W_e.T`` of a fused expert weight kept as a release ships it (``ShippedExperts``): by
    the fused FP8 or MXFP4 kernel, its parts' products side by side; any other stored weight by its own
    ``matmul``."""
    fmt = weight.quant
    kind = getattr(fmt, "kind", None)
    if (
        kind not in ("fp8", "mxfp4") or weight.views is None
    ):  # fp8_linear takes blocks its kernel cannot itself
        return weight.matmul(e, x)
    h = x.to(fmt.compute_dtype)
    parts = fmt.expert(weight.views, weight.weight_name, e).parts
    if kind == "mxfp4":
        ys = [mxfp4_linear(h, codes, scale, "triton") for codes, scale in parts]
    else:
        ys = [fp8_linear(h, codes, scale, fmt.block, None, "triton") for codes, scale in parts]
    return (ys[0] if len(ys) == 1 else torch.cat(ys, -1)).to(x.dtype)


def _nf4_forward(module: nn.Module, backend: str, x: torch.Tensor) -> torch.Tensor:
    """bitsandbytes' Linear4bit.forward with our dequantize: compute in the module's compute dtype."""
    weight = module.weight
    h = x.to(module.compute_dtype) if module.compute_dtype is not None else x
    return nf4_linear(h, weight.data, weight.quant_state, module.bias, backend).to(x.dtype)
