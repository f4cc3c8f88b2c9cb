"""The optimizer updates the engine runs on one weight chunk at a time: AdamW (torch's fused CPU kernel),
bitsandbytes' 8-bit AdamW, and GaLore (Adam in a low-rank projection of each weight matrix's gradient,
32- or 8-bit).

Each update takes dicts of tensors by parameter name (the chunk's views: master weights, gradients, the
two moments and, for GaLore, the projections) and changes them in place, with exactly the arithmetic of
the reference implementation it names, so that a streamed run matches a plain in-memory run:

- ``adamw``: ``torch.optim.AdamW(fused=True)``, weight decay on tensors of two or more dimensions.
- ``adamw_8bit``: ``bitsandbytes.optim.AdamW8bit`` (blockwise 8-bit moments for tensors of 4096 elements
  or more, 32-bit below).
- ``galore_adamw``: ``galore_torch.GaLoreAdamW`` (Hugging Face-style AdamW, with the gradients of the
  targeted weight matrices projected to rank r by an SVD refreshed every ``update_proj_gap`` steps), or
  ``galore_torch.GaLoreAdamW8bit`` with 8-bit states. The projection is split from the update:
  ``GaLore.project`` runs where the gradient is made (the compute device, during backward: the SVD and the
  product there, so only the low-rank gradient travels to the optimizer), ``GaLore.update`` on the CPU.
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Container
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tiertune.errors import ConfigError
from tiertune.settings import SVD_METHODS, GaloreSettings

MIN_8BIT_SIZE = 4096  # bitsandbytes' min_8bit_size: smaller tensors keep 32-bit moments
BLOCK_8BIT = 256  # bitsandbytes' block size for 8-bit optimizer states

Entries = list[tuple[str, tuple[int, ...], torch.dtype]]


@dataclass(frozen=True)
class AdamStep:
    """The hyper-parameters of one optimizer step (``step`` counts from 1, as torch's optimizers do)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: int


def decays(tensor: torch.Tensor) -> bool:
    """Whether weight decay applies to a tensor: two or more dimensions (as the Hugging Face Trainer)."""
    return tensor.dim() >= 2


def moment_entries(entries: Entries, eight_bit: bool, whole: dict[str, int] | None = None) -> Entries:
    """Chunk entries of one Adam moment: fp32 like the weights, or in 8 bits (uint8 values plus a
    per-block absmax) for each tensor of ``MIN_8BIT_SIZE`` elements or more, as bitsandbytes lays them out.
    ``whole``: the elements of the whole tensors where entries are a rank's parts of them (ZeRO-3), which
    decide as the whole tensor does."""
    if not eight_bit:
        return [(name, shape, torch.float32) for name, shape, _ in entries]
    out: Entries = []
    for name, shape, _ in entries:
        numel = math.prod(shape)
        if (whole or {}).get(name, numel) >= MIN_8BIT_SIZE:
            out += [(name, shape, torch.uint8), (f"{name}.absmax", (-(-numel // BLOCK_8BIT),), torch.float32)]
        else:
            out.append((name, shape, torch.float32))
    return out


def adamw(
    names: list[str], master: dict, grads: dict, m: dict, v: dict, hp: AdamStep, decayed: Container[str]
) -> None:
    """torch's fused AdamW on the named tensors, with weight decay on those in ``decayed`` (``decays`` of the
    whole tensors: the tensors here may be a rank's flat parts of them)."""
    for decay in (True, False):
        chosen = [n for n in names if (n in decayed) == decay]
        if not chosen:
            continue
        step = torch.tensor(float(hp.step))
        torch._fused_adamw_(
            [master[n] for n in chosen],
            [grads[n] for n in chosen],
            [m[n] for n in chosen],
            [v[n] for n in chosen],
            [],
            [step.clone() for _ in chosen],
            lr=hp.lr,
            beta1=hp.beta1,
            beta2=hp.beta2,
            weight_decay=hp.weight_decay if decay else 0.0,
            eps=hp.eps,
            amsgrad=False,
            maximize=False,
        )


def adamw_stochastic(
    names: list[str], weights: dict, grads: dict, m: dict, v: dict, hp: AdamStep, decayed: Container[str]
) -> None:
    """AdamW on bf16 ``weights`` that are their own master copy: each tensor's update computed in fp32 by
    ``adamw`` (moments fp32) and rounded stochastically into it (``stochastic_round_``), so the expected
    weight is the fp32 update's and updates smaller than half a bf16 step are not lost. The random bits
    are a function of the tensor's name and the step alone: a run (and a resumed run) repeats them."""
    if not names:
        return
    wide = {n: weights[n].float() for n in names}
    adamw(names, wide, grads, m, v, hp, decayed)
    for n in names:
        seed = zlib.crc32(f"{n}:{hp.step}".encode())
        stochastic_round_(weights[n], wide[n], torch.Generator().manual_seed(seed))


def stochastic_round_(into: torch.Tensor, value: torch.Tensor, generator: torch.Generator) -> None:
    """``into`` (bf16) = fp32 ``value`` rounded to one of its two nearest bf16 neighbours, the upper with
    probability equal to the distance from the lower over their gap (unbiased): a uniform 16-bit integer added
    to the value's low 16 bits, which are then cut. ``value`` is used as scratch."""
    bits = value.view(torch.int32)
    noise = torch.randint(0, 1 << 16, value.shape, dtype=torch.int32, generator=generator)
    bits.add_(noise).bitwise_and_(-(1 << 16))
    into.copy_(value)  # exact: what is left is a bf16 value


def adamw_redo(
    names: list[str],
    sources: tuple[dict, dict],
    twins: tuple[dict, dict, dict],
    coef: torch.Tensor,
    hp: AdamStep,
) -> None:
    """Redo a speculative AdamW step with clipping coefficient ``coef``, from what the speculation left and
    without the gradients: ``sources`` (the moments m, v as they were before the step) and ``twins`` (the
    speculation's p_s, m_s, v_s, made with coefficient 1), whose values are replaced by the step's with
    ``coef`` = c. With g the gradient, m_s = b1 m + (1 - b1) g and v_s = b2 v + (1 - b2) g^2, so

        m' = b1 m + (1 - b1) c g   = c m_s + (1 - c) b1 m
        v' = b2 v + (1 - b2) c^2 g^2 = c^2 v_s + (1 - c^2) b2 v

    (for 0 < c <= 1 both weighted sums of non-negative weights: no cancellation); and with AdamW's
    p_s = p (1 - lr wd) - a m_s / d(v_s) (a = lr / (1 - b1^t), d(v) = sqrt(v) / sqrt(1 - b2^t) + eps, as torch's
    fused AdamW computes them), p' = p_s + a m_s / d(v_s) - a m' / d(v'): the weights before the step are not
    read either. Equal to clipping the gradient and stepping, to fp32 rounding. The engine runs the parts one
    at a time (``adam_move`` back, ``redo_moment`` twice, ``adam_move``), holding a source only while its twin
    is redone."""
    ps, ms, vs = ([d[n] for n in names] for d in twins)
    c = float(coef)
    adam_move(ps, ms, vs, hp, back=True)
    redo_moment(ms, [sources[0][n] for n in names], c, hp.beta1)
    redo_moment(vs, [sources[1][n] for n in names], c * c, hp.beta2)
    adam_move(ps, ms, vs, hp)


def redo_moment(twin: list[torch.Tensor], source: list[torch.Tensor], weight: float, beta: float) -> None:
    """``twin`` = ``weight`` x ``twin`` + (1 - ``weight``) x ``beta`` x ``source``: a moment of a speculative
    step (coefficient 1) made that of coefficient c (``weight`` c for the first moment, c^2 for the second)."""
    if twin:
        torch._foreach_mul_(twin, weight)
        torch._foreach_add_(twin, source, alpha=(1.0 - weight) * beta)


def adam_move(
    params: list[torch.Tensor], m: list[torch.Tensor], v: list[torch.Tensor], hp: AdamStep, back: bool = False
) -> None:
    """``params`` -= lr / (1 - b1^t) x m / (sqrt(v) / sqrt(1 - b2^t) + eps), AdamW's move as torch's fused
    AdamW computes it (its decay aside); ``back``: added instead (the move undone)."""
    if not params:
        return
    denom = torch._foreach_sqrt(v)
    torch._foreach_div_(denom, math.sqrt(1.0 - hp.beta2**hp.step))
    torch._foreach_add_(denom, hp.eps)
    size = hp.lr / (1.0 - hp.beta1**hp.step)
    torch._foreach_addcdiv_(params, m, denom, value=size if back else -size)


_QMAPS: dict[str, torch.Tensor] = {}


def _bnb_adam(
    param: torch.Tensor, grad: torch.Tensor, m: dict, v: dict, name: str, decay: float, hp: AdamStep
) -> None:
    """One tensor's bitsandbytes Adam update, as ``Optimizer2State.update_step`` calls its kernels."""
    import bitsandbytes.functional as BF

    if not _QMAPS:
        _QMAPS.update(signed=BF.create_dynamic_map(signed=True), unsigned=BF.create_dynamic_map(signed=False))
    if m[name].dtype == torch.uint8:
        BF.optimizer_update_8bit_blockwise(
            "adam",
            grad,
            param,
            m[name],
            v[name],
            hp.beta1,
            hp.beta2,
            0.0,
            0.0,
            hp.eps,
            hp.step,
            hp.lr,
            _QMAPS["signed"],
            _QMAPS["unsigned"],
            m[f"{name}.absmax"],
            v[f"{name}.absmax"],
            decay,
            gnorm_scale=1.0,
            skip_zeros=False,
        )
    else:
        BF.optimizer_update_32bit(
            "adam",
            grad,
            param,
            m[name],
            hp.beta1,
            hp.eps,
            hp.step,
            hp.lr,
            v[name],
            hp.beta2,
            0.0,
            0.0,
            decay,
            1.0,
            None,
            max_unorm=0.0,
            skip_zeros=False,
        )


def adamw_8bit(
    names: list[str], master: dict, grads: dict, m: dict, v: dict, hp: AdamStep, decayed: Container[str]
) -> None:
    """bitsandbytes' AdamW8bit on the named tensors, with weight decay on those in ``decayed``."""
    for n in names:
        _bnb_adam(master[n], grads[n], m, v, n, hp.weight_decay if n in decayed else 0.0, hp)


# ---------------------------------------------------------------------------------------------- GaLore


class GaLore:
    """GaLore's bookkeeping for a model: which weights are projected, the shapes of their low-rank moments
    and projections, and the update (galore-torch's ``proj_type: std``).

    For a gradient G of shape m x n and rank r (at most min(m, n)): if m >= n the projection P (r x n) is
    the top right singular vectors and the low-rank gradient is G Pᵀ (m x r); otherwise P (m x r) is the
    top left singular vectors and the low-rank gradient is Pᵀ G (r x n). Adam runs on the low-rank
    gradient; its normalized update is projected back and scaled by ``scale``.

    ``project`` (on the device the gradient is on) refreshes P when the step calls for it and returns the
    low-rank gradient; ``update`` (the CPU optimizer) takes low-rank gradients for the projected weights and
    full ones for the rest. Clipping scales a gradient by a positive number, which commutes with both the
    projection and the singular vectors, so projecting before the clipping coefficient is known computes
    galore-torch's step (to rounding).
    """

    def __init__(self, settings: GaloreSettings, layers: list[nn.Module], names: dict[int, str]) -> None:
        if settings.rank < 1:
            raise ConfigError(f"method.galore.rank must be >= 1, got {settings.rank}")
        if settings.update_proj_gap < 1:
            raise ConfigError(f"method.galore.update_proj_gap must be >= 1, got {settings.update_proj_gap}")
        if settings.svd not in SVD_METHODS:
            raise ConfigError(f"method.galore.svd must be {' or '.join(SVD_METHODS)}, got {settings.svd!r}")
        self.settings = settings
        self.targets = _targets(settings.target_modules, layers, names)
        if not self.targets:
            raise ConfigError(
                f"method.galore.target_modules {settings.target_modules!r} matches no linear layer of the "
                "decoder layers; use all-linear or names such as [q_proj, v_proj]"
            )

    def shapes(self, shape: tuple[int, ...]) -> tuple[tuple[int, int], tuple[int, int]]:
        """(low-rank moment shape, projection shape) of a projected weight of ``shape``."""
        rows, cols = shape
        r = min(self.settings.rank, rows, cols)
        return ((rows, r), (r, cols)) if rows >= cols else ((r, cols), (rows, r))

    def moment_entries(self, entries: Entries, eight_bit: bool) -> Entries:
        """Entries of one moment chunk: low-rank shapes for the projected weights, full ones for the rest."""
        low = [(n, self.shapes(s)[0] if n in self.targets else s, d) for n, s, d in entries]
        return moment_entries(low, eight_bit)

    def projection_entries(self, entries: Entries) -> Entries:
        """Entries of a chunk's projections (fp32), one per projected weight; empty if none is."""
        return [(n, self.shapes(s)[1], torch.float32) for n, s, _ in entries if n in self.targets]

    def gradient_entries(self, entries: Entries) -> Entries:
        """Entries of the gradients the optimizer receives (fp32): low-rank for the projected weights."""
        return [(n, self.shapes(s)[0] if n in self.targets else s, torch.float32) for n, s, _ in entries]

    def accumulator_entries(self, entries: Entries) -> Entries:
        """Entries of the full fp32 gradients of the projected weights, summed over a step's micro-batches
        (the norm and the SVD need the whole gradient); empty if none is projected."""
        return [(n, s, torch.float32) for n, s, _ in entries if n in self.targets]

    def refreshes(self, step: int) -> bool:
        """Whether optimizer step ``step`` (from 1) computes new projections, as galore-torch decides it from
        its per-parameter step counter."""
        return (step - 1) % self.settings.update_proj_gap == 0

    def project(self, grad: torch.Tensor, proj: torch.Tensor, refresh: bool, seed: int = 0) -> torch.Tensor:
        """The low-rank gradient of a projected weight's (fp32) gradient ``grad``, on its device; with
        ``refresh`` (a step that ``refreshes``) first writes the new projection into ``proj`` (its buffer, of
        the projection's shape). ``seed`` draws the randomized SVD's sketch (the same on a resumed run)."""
        right = grad.shape[0] >= grad.shape[1]
        if refresh:
            proj.copy_(orthogonal_basis(grad, proj.shape, right, self.settings.svd, seed))
        pm = _svd_layout(proj)
        return grad @ pm.t() if right else pm.t() @ grad

    def update(
        self,
        names: list[str],
        master: dict,
        grads: dict,
        m: dict,
        v: dict,
        proj: dict,
        hp: AdamStep,
        eight_bit: bool,
    ) -> None:
        """One GaLore AdamW step on the named tensors: ``grads`` holds the low-rank gradients of the projected
        weights (``project``'s, with the projections ``proj`` it used) and the full gradients of the rest."""
        for n in names:
            p, g = master[n], grads[n]
            decay = hp.weight_decay if decays(p) else 0.0
            if n not in self.targets:
                if eight_bit:
                    _bnb_adam(p, g, m, v, n, decay, hp)
                else:
                    _hf_adamw(p, g, m[n], v[n], hp)
                    if decay > 0:
                        p.add_(p, alpha=-hp.lr * decay)
                continue
            pm = _svd_layout(proj[n])
            if eight_bit:  # galore-torch: the 8-bit kernel updates zeros, its result is projected back
                delta = torch.zeros_like(g)
                _bnb_adam(delta, g, m, v, n, 0.0, hp)
                p.add_(self._back(delta, pm))
            else:
                p.add_(self._back(_hf_adamw(None, g, m[n], v[n], hp), pm), alpha=-_step_size(hp))
            if decay > 0:
                p.add_(p, alpha=-hp.lr * decay)

    def _back(self, low: torch.Tensor, proj: torch.Tensor) -> torch.Tensor:
        full = low @ proj if low.shape[0] >= low.shape[1] else proj @ low
        return full * self.settings.scale


def _targets(target_modules: Any, layers: list[nn.Module], names: dict[int, str]) -> set[str]:
    """Parameter names of the weights GaLore projects: ``all-linear`` (every ``nn.Linear`` in the decoder
    layers), a list of module names (matched as the last part of the module's path) or a regular
    expression the whole module path matches."""
    out = set()
    for layer in layers:
        for module in layer.modules():
            if not isinstance(module, nn.Linear):
                continue
            path = names[id(module)]
            if target_modules == "all-linear":
                chosen = True
            elif isinstance(target_modules, str):
                chosen = re.fullmatch(target_modules, path) is not None
            else:
                chosen = any(path == t or path.endswith(f".{t}") for t in target_modules)
            if chosen:
                out.add(f"{path}.weight")
    return out


def _step_size(hp: AdamStep) -> float:
    return hp.lr * math.sqrt(1.0 - hp.beta2**hp.step) / (1.0 - hp.beta1**hp.step)


def _hf_adamw(
    param: torch.Tensor | None, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, hp: AdamStep
) -> torch.Tensor:
    """Hugging Face-style AdamW (galore-torch's): the moments updated in place; returns the normalized
    update m / (sqrt(v) + eps), and applies it to ``param`` when one is given (weight decay not included)."""
    m.mul_(hp.beta1).add_(grad, alpha=1.0 - hp.beta1)
    v.mul_(hp.beta2).addcmul_(grad, grad, value=1.0 - hp.beta2)
    normalized = m / v.sqrt().add_(hp.eps)
    if param is not None:
        param.add_(normalized, alpha=-_step_size(hp))
    return normalized


def _svd_layout(proj: torch.Tensor) -> torch.Tensor:
    """A column-major copy of a stored (row-major) projection: the memory layout of the ``U[:, :r]`` or
    ``Vh[:r]`` that galore-torch keeps from ``torch.linalg.svd``. BLAS picks its kernel, so its summation
    order, by the operands' layout: with a row-major P the products can differ from galore-torch's in the
    last bits (MKL: ``G Pᵀ`` of tall and square weights at rank 8 or less), and those bits are enough to
    flip the signs of singular vectors, which LAPACK leaves arbitrary, at the next refresh, where the
    moments, kept across refreshes, see the flip: a different run, not a rounding difference."""
    return proj.t().contiguous().t()


OVERSAMPLING = 8  # extra sketch columns of the randomized SVD (Halko et al. suggest 5 to 10)
POWER_ITERATIONS = 2  # subspace iterations: a gradient's singular values decay slowly


def orthogonal_basis(
    grad: torch.Tensor, shape: torch.Size, right: bool, method: str = "exact", seed: int = 0
) -> torch.Tensor:
    """The top singular vectors of ``grad`` (right ones as rows, or left ones as columns) of ``shape``.

    ``exact``: ``torch.linalg.svd`` of the whole matrix (galore-torch's). ``randomized``: torch's
    ``svd_lowrank`` with the sketch drawn from ``seed`` (the global random state is left as it was, so
    dropout does not depend on the choice)."""
    grad = grad.float()
    rank = shape[0] if right else shape[1]
    if method == "exact":
        u, _, vh = torch.linalg.svd(grad, full_matrices=False)
        return vh[:rank] if right else u[:, :rank]
    q = min(rank + OVERSAMPLING, *grad.shape)
    devices = [grad.device] if grad.is_cuda else []
    with torch.random.fork_rng(devices=devices, device_type=grad.device.type):
        torch.manual_seed(seed)
        u, _, v = torch.svd_lowrank(grad, q=q, niter=POWER_ITERATIONS)
    return v[:, :rank].t() if right else u[:, :rank]
