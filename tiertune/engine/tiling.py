"""Sequence tiling of a layer's MLP: the position-wise block computed ``tile`` tokens at a time, in forward and
again in backward, so that its intermediate activations (gate, up, their product: several times the hidden
size per token) exist for one tile at a time instead of the whole sequence.

Forward runs each tile without autograd and keeps only the block's input; backward recomputes each tile with
autograd and back-propagates that tile's output gradient, summing the parameters' gradients over the tiles.
Exact: every token's computation is the untiled one (a weight's gradient is the same sum in another order). A
block that draws random numbers (dropout in a LoRA branch) draws the same in the recomputation: each tile's
random state is kept from forward.

Applies to a decoder layer's ``mlp`` when it is position-wise and dense (no ``experts``: an MoE block's router
is per token too, but its logits feed the auxiliary loss outside the block), with the norm before it where the
architecture's table names one (``kernels.architectures``: ``mlp_norm``); and to the attention's input
projections (q, k, v) with the norm before them (``attention_norm``), each projection a block of its own over
the layer's input, so that the normed sequence they all read is not kept whole either."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from contextlib import nullcontext

import torch
from torch import nn

from tiertune.engine.micro import Rng
from tiertune.engine.stacking import draws_random
from tiertune.kernels.architectures import attention_fold, mlp_fold


def _in_tiles(forward: Callable, x: torch.Tensor, tile: int, rngs: list[Rng] | None = None) -> torch.Tensor:
    """``forward`` over ``x``'s tokens ``tile`` at a time (batch and sequence flattened), each output written into
    the whole one;
    ``rngs``: each tile's random state is appended to it first."""
    out: torch.Tensor | None = None  # in x's shape, not a view: its caller may add into it in place
    flat: torch.Tensor | None = None
    start = 0
    for part in x.reshape(1, -1, x.shape[-1]).split(tile, dim=1):
        if rngs is not None:
            rngs.append(Rng.now(x.device))
        y = forward(part)
        if out is None:  # each tile's output goes into the whole one as it comes (no list of them to join)
            out = y.new_empty(*x.shape[:-1], y.shape[-1])
            flat = out.view(1, -1, y.shape[-1])
        flat[:, start : start + part.shape[1]] = y  # type: ignore[index]
        start += part.shape[1]
        del y
    assert out is not None
    return out


class _Tiled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, forward: Callable, tile: int, random: bool, residual: bool, x: torch.Tensor, *params):
        ctx.forward, ctx.tile = forward, tile
        ctx.save_for_backward(x, *params)
        ctx.rngs = [] if random else None
        with torch.no_grad():
            return _adds_in_place(_in_tiles(forward, x, tile, ctx.rngs), residual)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, *params = ctx.saved_tensors
        wants_x = ctx.needs_input_grad[4]
        trained = [i for i, p in enumerate(params) if ctx.needs_input_grad[5 + i]]
        flat = x.reshape(1, -1, x.shape[-1])
        grads = grad.reshape(1, -1, grad.shape[-1])
        whole = (
            torch.empty(x.shape, dtype=x.dtype, device=x.device) if wants_x else None
        )  # no view: summed in place
        gx = whole.view(1, -1, x.shape[-1]) if whole is not None else None
        sums: list[torch.Tensor | None] = [None] * len(params)
        start = 0
        for t, (part, g) in enumerate(
            zip(flat.split(ctx.tile, dim=1), grads.split(ctx.tile, dim=1), strict=True)
        ):
            part = part.detach().requires_grad_(wants_x)
            with torch.enable_grad(), ctx.rngs[t].running(x.device) if ctx.rngs else nullcontext():
                out = ctx.forward(part)
            inputs = ([part] if wants_x else []) + [params[i] for i in trained]
            got = list(torch.autograd.grad(out, inputs, g, allow_unused=True)) if inputs else []
            if wants_x:
                gx[:, start : start + part.shape[1]] = got.pop(0)  # type: ignore[index]
            for i, gp in zip(trained, got, strict=True):
                if gp is not None:
                    sums[i] = gp if sums[i] is None else sums[i].add_(gp)
            start += part.shape[1]
        del gx
        return None, None, None, None, whole, *sums


def tile_mlp(layer: nn.Module, tile: int, model_type: str | None = None) -> bool:
    """Give ``layer``'s ``mlp`` a forward that runs in tiles of ``tile`` tokens when it sees more; True if it
    did (a dense, position-wise block), False if the layer keeps its own (none, or an MoE block).

    What ``kernels.architectures`` knows of ``model_type``'s layers: its ``mlp_norm`` (the norm whose output
    only the MLP reads) joins the tiled block (the MLP computes ``mlp(norm(x))`` a tile at a time and the norm
    module passes its input through), so the normed sequence is never kept whole: backward recomputes it per
    tile from the norm's input, which the layer holds anyway (its residual); with ``mlp_residual`` the layer's
    residual sum goes into the block's output in place (``_Residual``)."""
    norm, adds = mlp_fold(model_type) if model_type else (None, False)
    mlp = getattr(layer, "mlp", None)
    if (
        tile <= 0
        or not isinstance(mlp, nn.Module)
        or any(n.endswith("experts") for n, _ in mlp.named_modules())
    ):
        return False
    inner = mlp.forward
    modules = [mlp]
    normed = getattr(layer, norm, None) if norm else None
    if isinstance(normed, nn.Module):
        applied = normed.forward

        def block(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            return inner(applied(x), *args, **kwargs)

        normed.forward = _passes_through
        modules.append(normed)
    else:
        block = inner
    random = any(draws_random(m) for m in modules)  # dropout probabilities, fixed once built
    residual = adds and isinstance(normed, nn.Module)

    def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if args or kwargs or _tokens(x) <= tile:
            return block(x, *args, **kwargs)
        if not torch.is_grad_enabled():  # a pass without backward: tiles too, nothing to keep
            return _adds_in_place(_in_tiles(block, x, tile), residual)
        return _tiled(block, modules, tile, mlp.training and random, residual, x)

    mlp.forward = forward
    return True


PROJECTIONS = (("q_proj", "k_proj", "v_proj"), ("qkv_proj",))
"""The attention's input projections, by name: separate, or fused in one (Phi-3)."""


def tile_projections(layer: nn.Module, tile: int, model_type: str | None = None) -> bool:
    """Fold ``layer``'s attention input norm (``kernels.architectures``: ``attention_norm``) into its q/k/v
    projections: with autograd on and more than ``tile`` tokens, the norm passes the layer's input through and
    each projection computes ``proj(norm(x))`` as a tiled block over it, so that no whole-length normed sequence
    is kept for backward (each projection's backward recomputes it per tile from the layer's input, which the
    layer holds anyway: its residual). Shorter inputs and passes without autograd take the norm once, as
    without the fold. True if it folded, False where the table names no such norm or the attention has none of
    ``PROJECTIONS``."""
    name = attention_fold(model_type) if model_type else None
    norm = getattr(layer, name, None) if name else None
    attention = getattr(layer, "self_attn", None)
    if tile <= 0 or not isinstance(norm, nn.Module) or not isinstance(attention, nn.Module):
        return False
    names = next(
        (ns for ns in PROJECTIONS if all(isinstance(getattr(attention, n, None), nn.Module) for n in ns)),
        None,
    )
    if names is None:
        return False
    applied = norm.forward
    passed: list[weakref.ref | None] = [None]  # the input the norm last passed through, for the projections

    def norm_forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        passed[0] = None
        if args or kwargs or not torch.is_grad_enabled() or _tokens(x) <= tile:
            return applied(x, *args, **kwargs)
        passed[0] = weakref.ref(x)
        return x

    norm.forward = norm_forward
    for n in names:
        _fold_into(getattr(attention, n), norm, applied, passed, tile)
    return True


def _fold_into(proj: nn.Module, norm: nn.Module, normed: Callable, passed: list, tile: int) -> None:
    """``proj``'s forward computes ``proj(normed(x))`` tiled over an input the norm passed through."""
    inner = proj.forward
    modules = [proj, norm]
    random = any(draws_random(m) for m in modules)

    def block(x: torch.Tensor) -> torch.Tensor:
        return inner(normed(x))

    def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        held = passed[0]() if passed[0] is not None else None
        if held is None:
            return inner(x, *args, **kwargs)
        if held is not x or args or kwargs:  # the norm's output went elsewhere first: not the table's layer
            raise RuntimeError(
                f"{type(proj).__name__} got another input than its attention's input norm passed through; this "
                "architecture's layer does not read its attention's input as kernels.architectures says (set "
                "offload.sequence_tile: 0 to run it untiled, and report it)"
            )
        return _tiled(block, modules, tile, proj.training and random, False, x)

    proj.forward = forward


def tile_layer(layer: nn.Module, tile: int, model_type: str | None = None) -> None:
    """Both of a decoder layer's sequence tilings: its MLP (``tile_mlp``) and its attention's input
    projections (``tile_projections``)."""
    tile_mlp(layer, tile, model_type)
    tile_projections(layer, tile, model_type)


def _tokens(x: torch.Tensor) -> int:
    """The tokens of a block's input (batch and sequence together): what is compared with the tile."""
    return x.numel() // x.shape[-1]


def _tiled(
    block: Callable, modules: list[nn.Module], tile: int, random: bool, residual: bool, x: torch.Tensor
) -> torch.Tensor:
    """``block`` over ``x`` in tiles of ``tile`` tokens, keeping only ``x`` (and ``modules``' trained
    parameters) for backward."""
    params = [p for m in modules for p in m.parameters() if p.requires_grad]
    return _Tiled.apply(block, tile, random, residual, x, *params)


class _Residual(torch.Tensor):
    """The tiled block's output where the layer adds it to its residual at once and reads it no more (Llama's
    ``hidden_states = residual + hidden_states``): the sum goes into it in place (``residual + out`` calls
    ``out.__radd__`` first: a subclass's reflected method), so the layer's output and the block's do not exist
    at once. The sum is a plain tensor again (an alias), as is what any other op makes of it."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __radd__(self, other):
        if isinstance(other, torch.Tensor) and other.shape == self.shape and other.dtype == self.dtype:
            return torch.Tensor.add_(self, other).as_subclass(torch.Tensor)
        return torch.Tensor.__add__(self.as_subclass(torch.Tensor), other)


def _adds_in_place(out: torch.Tensor, residual: bool) -> torch.Tensor:
    return torch.Tensor._make_subclass(_Residual, out) if residual else out


def _passes_through(x: torch.Tensor) -> torch.Tensor:
    """A norm folded into its MLP's tiled block: the block normalises each tile itself."""
    return x
