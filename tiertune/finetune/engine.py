"""The streamed training engine: full fine-tuning of an unmodified Hugging Face causal LM whose weights,
gradients and optimizer states live in a ``ChunkStore`` across device, host and disk.

How a step runs (all on the caller's thread unless said otherwise):

- Forward: the model's own ``forward`` runs unchanged. Each decoder layer of the *instance* is replaced
  by a ``StreamedLayer`` that, through ``_LayerFunction``, acquires the layer's chunk (prefetched from
  the second step on), binds its tensors as the layer's parameters, computes without keeping activations,
  releases the chunk and saves only the layer's input. Embeddings, final norm and a separate head are
  bound for the whole micro-batch.
- Loss: summed cross-entropy over the micro-batch's target tokens, divided by the number of target tokens
  in the whole step (all micro-batches), so the accumulated gradient is the token-weighted mean.
- Backward: layer by layer in reverse, each acquires its chunk again, recomputes its forward with the
  saved input (RNG state restored, so dropout matches), back-propagates, and adds its parameter
  gradients into fp32 gradient chunks on the host.
- Optimizer (after the last micro-batch): the global gradient norm is known exactly from the accumulated
  gradients (one pass that costs no extra I/O: it is summed as each layer's last gradient lands), so
  clipping is exact. Then, group by group: fp32 master weights and Adam moments are acquired on the host
  (from disk if they live there), updated by torch's fused AdamW, and the compute-dtype weights are written
  back to their home tier. When compute is fp32 the weights are their own master copy.

Numerics match a plain PyTorch loop: ``torch.optim.AdamW`` with weight decay on tensors of two or more
dimensions, ``clip_grad_norm_`` and the same transformers LR scheduler.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tiertune.errors import ConfigError, DataError
from tiertune.finetune.model import (
    ModelParts,
    ParamGroup,
    build_skeleton,
    load_into_store,
    split_model,
)
from tiertune.finetune.weights import Checkpoint
from tiertune.offload.chunk import Chunk
from tiertune.offload.store import ChunkStore, StoreConfig
from tiertune.offload.tiers import Tier

IGNORE_INDEX = -100


@dataclass
class EngineConfig:
    """Hyper-parameters and placements of the streamed engine (names as Hugging Face TrainingArguments)."""

    dtype: torch.dtype = torch.float32  # compute dtype of the weights
    learning_rate: float = 5e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0  # 0 or less: no clipping
    lr_scheduler_type: str = "linear"
    warmup_steps: int = 0
    max_steps: int = 1
    params: str = "host"  # home tier of the compute-dtype weights
    optimizer_states: str = "host"  # home tier of the fp32 master weights and Adam moments
    gradients: str = "host"  # home tier of the fp32 gradient accumulators

    def __post_init__(self) -> None:
        for name in ("params", "optimizer_states", "gradients"):
            value = getattr(self, name)
            if value not in ("device", "host", "disk"):
                raise ConfigError(f"offload.{name} must be device, host or disk, got {value!r}")
        if self.learning_rate < 0:
            raise ConfigError(f"training.learning_rate must be >= 0, got {self.learning_rate}")
        if self.max_steps < 1:
            raise ConfigError(f"training.max_steps must be >= 1, got {self.max_steps}")


@dataclass
class _Slot:
    """Where one parameter is bound in the model instance (a tied weight has several slots)."""

    module: nn.Module
    attr: str


class _GroupState:
    """A parameter group's chunks: weights (compute dtype), fp32 gradients, master weights and moments."""

    def __init__(self, group: ParamGroup) -> None:
        self.group = group
        self.weights: list[Chunk] = group.chunks
        self.grads: list[Chunk] = []
        self.master: list[Chunk] = []  # empty when the weights are fp32 (their own master copy)
        self.exp_avg: list[Chunk] = []
        self.exp_avg_sq: list[Chunk] = []


class StreamedTrainer:
    """Full fine-tuning with every state in a chunk store. ``step(micro_batches)`` runs one optimizer step.

    ``micro_batches`` are dicts with ``input_ids``, optional ``attention_mask`` and optional ``labels``
    (defaults to ``input_ids``; ``-100`` marks tokens without loss). Returns the step's loss: the mean over
    all target tokens of all its micro-batches.
    """

    def __init__(self, model_dir: str, store_config: StoreConfig, config: EngineConfig) -> None:
        self.config = config
        self.store = ChunkStore(store_config)
        self.device = self.store.device
        self.model = build_skeleton(model_dir, config.dtype)
        self.model.config.use_cache = False
        self.parts: ModelParts = split_model(self.model)
        homes = {"embed": config.params, "layer": config.params, "rest": config.params, "head": config.params}
        checkpoint = Checkpoint(model_dir)
        self._source = load_into_store(self.parts, checkpoint, self.store, homes, config.dtype)
        self._slots = self._find_slots()
        self._meta = dict(self.model.named_parameters())  # the skeleton's placeholders, put back by unbind
        self._param_order = [n for n, _ in self.model.named_parameters()]
        self._states = [self._add_states(g, checkpoint) for g in self.parts.groups]
        self._layer_index = [i for i, s in enumerate(self._states) if s.group.kind == "layer"]
        for i, layer in enumerate(self.parts.layers):
            self.parts.layers[i] = StreamedLayer(self, i, layer)
        for module in self.model.modules():  # buffers (rotary caches) to the device; parameters stay meta
            for name, buf in module.named_buffers(recurse=False):
                module._buffers[name] = buf.to(self.device)
        self.step_count = 0
        # seconds per step part, cumulative: io_wait (blocked in acquire), optimizer (not hidden), step
        self.times: defaultdict[str, float] = defaultdict(float)
        self._norms: dict[str, torch.Tensor] = {}
        self._last_micro = False
        self._lr = _Schedule(config)

    # ------------------------------------------------------------------ setup

    def _find_slots(self) -> dict[str, list[_Slot]]:
        slots: dict[str, list[_Slot]] = {}
        by_id = {id(p): n for n, p in self.model.named_parameters()}
        for module in self.model.modules():
            for attr, param in module.named_parameters(recurse=False):
                slots.setdefault(by_id[id(param)], []).append(_Slot(module, attr))
        return slots

    def _add_states(self, group: ParamGroup, checkpoint: Checkpoint) -> _GroupState:
        state = _GroupState(group)
        cfg = self.config
        for chunk in group.chunks:
            entries = [(s.name, s.shape, torch.float32) for s in chunk.tensors]
            state.grads += self.store.add(entries, home=cfg.gradients, name=f"{chunk.name}.grad")
            if cfg.dtype != torch.float32:
                masters = self.store.add(entries, home=cfg.optimizer_states, name=f"{chunk.name}.master")
                state.master += masters
                # from the checkpoint, not from the rounded weights: an fp32 checkpoint keeps its precision
                with self.store.writing(masters[0]) as views:
                    for name, view in views.items():
                        checkpoint.read_into(self._source[name], view)
            state.exp_avg += self.store.add(entries, home=cfg.optimizer_states, name=f"{chunk.name}.exp_avg")
            state.exp_avg_sq += self.store.add(
                entries, home=cfg.optimizer_states, name=f"{chunk.name}.exp_avg_sq"
            )
        if any(len(x) != len(group.chunks) for x in (state.grads, state.exp_avg, state.exp_avg_sq)):
            raise ConfigError(
                f"offload.chunk_size is too small to hold the fp32 states of group {group.name} in one chunk "
                "per weight chunk; raise it"
            )
        return state

    # ------------------------------------------------------------------ binding

    def bind(
        self, chunk: Chunk, views: dict[str, torch.Tensor], requires_grad: bool
    ) -> dict[str, torch.Tensor]:
        """Make the chunk's tensors the model's parameters; returns the bound leaf tensors by name."""
        bound = {}
        for name, view in views.items():
            param = nn.Parameter(view, requires_grad=requires_grad)
            for slot in self._slots[name]:
                slot.module._parameters[slot.attr] = param
            bound[name] = param
        return bound

    def unbind(self, names: Sequence[str]) -> None:
        """Put meta placeholders back, so no module keeps a reference to released chunk memory."""
        for name in names:
            for slot in self._slots[name]:
                slot.module._parameters[slot.attr] = self._meta[name]

    @contextmanager
    def bound_group(self, state: _GroupState, requires_grad: bool) -> Iterator[dict[str, torch.Tensor]]:
        """Acquire a group's weight chunks on the device and bind them for the duration of the block."""
        bound: dict[str, torch.Tensor] = {}
        acquired: list[Chunk] = []
        try:
            for chunk in state.weights:
                began = time.perf_counter()
                views = self.store.acquire(chunk, Tier.DEVICE)
                self.times["io_wait"] += time.perf_counter() - began
                acquired.append(chunk)
                bound.update(self.bind(chunk, views, requires_grad))
            yield bound
        finally:
            self.unbind(list(bound))
            for chunk in acquired:
                self.store.release(chunk)

    # ------------------------------------------------------------------ gradients

    def add_grads(self, state: _GroupState, grads: dict[str, torch.Tensor | None]) -> None:
        """Add a micro-batch's gradients into the group's fp32 accumulators (and the norm on the last one)."""
        for chunk in state.grads:
            began = time.perf_counter()
            views = self.store.acquire(chunk, Tier.HOST)
            self.times["io_wait"] += time.perf_counter() - began
            for name, acc in views.items():
                g = grads.get(name)
                if g is not None:
                    acc.add_(g.detach().to(device="cpu", dtype=torch.float32))
                if self._last_micro:  # this accumulator is final: its norm, as clip_grad_norm_ computes it
                    self._norms[name] = torch.linalg.vector_norm(acc)
            self.store.release(chunk, dirty=True)

    # ------------------------------------------------------------------ the step

    def step(self, micro_batches: Sequence[dict[str, torch.Tensor]]) -> float:
        """One optimizer step over ``micro_batches`` (gradient accumulation); returns the step's loss."""
        step_began = time.perf_counter()
        labels = [mb.get("labels", mb["input_ids"]) for mb in micro_batches]
        n_tokens = sum(int((lab[:, 1:] != IGNORE_INDEX).sum()) for lab in labels)
        if n_tokens == 0:
            raise DataError(
                "a training step has no target tokens (every label is -100); check the data and max_seq_len"
            )
        total = 0.0
        self._norms = {}
        others = [s for s in self._states if s.group.kind != "layer"]
        for k, (mb, lab) in enumerate(zip(micro_batches, labels, strict=True)):
            self._last_micro = k == len(micro_batches) - 1
            with ExitStack() as stack:
                bound = {}
                for state in others:
                    bound[id(state)] = stack.enter_context(self.bound_group(state, requires_grad=True))
                ids = mb["input_ids"].to(self.device)
                mask = mb.get("attention_mask")
                logits = self.model(
                    input_ids=ids, attention_mask=None if mask is None else mask.to(self.device)
                ).logits
                target = lab[:, 1:].to(self.device)
                loss_sum = F.cross_entropy(
                    logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                    target.reshape(-1),
                    ignore_index=IGNORE_INDEX,
                    reduction="sum",
                )
                (loss_sum / n_tokens).backward()
                total += float(loss_sum.detach())
                for state in others:
                    self.add_grads(state, {n: p.grad for n, p in bound[id(state)].items()})
        began = time.perf_counter()
        self._optimizer_step()
        self.times["optimizer"] += time.perf_counter() - began
        self.store.mark_step()
        self.step_count += 1
        self.times["step"] += time.perf_counter() - step_began
        return total / n_tokens

    def _optimizer_step(self) -> None:
        cfg = self.config
        # exactly torch.nn.utils.clip_grad_norm_: fp32 per-tensor norms stacked in parameter order, the
        # coefficient an fp32 tensor clamped at 1 and multiplied into every gradient
        norms = [self._norms[n] for n in self._param_order if n in self._norms]
        total = torch.linalg.vector_norm(torch.stack(norms))
        coef = None
        if cfg.max_grad_norm and cfg.max_grad_norm > 0:
            coef = torch.clamp(cfg.max_grad_norm / (total + 1e-6), max=1.0)
        self.last_grad_norm = float(total)
        lr = self._lr.lr(self.step_count)
        self.last_lr = lr
        step_t = torch.tensor(float(self.step_count + 1))
        for state in self._states:
            for i, weight_chunk in enumerate(state.weights):
                self._adamw(state, i, weight_chunk, coef, lr, step_t)

    def _adamw(
        self,
        state: _GroupState,
        i: int,
        weight_chunk: Chunk,
        coef: torch.Tensor | None,
        lr: float,
        step_t: torch.Tensor,
    ) -> None:
        cfg = self.config
        store = self.store
        master_chunk = state.master[i] if state.master else weight_chunk
        grads = store.acquire(state.grads[i], Tier.HOST)
        master = store.acquire(master_chunk, Tier.HOST)
        m = store.acquire(state.exp_avg[i], Tier.HOST)
        v = store.acquire(state.exp_avg_sq[i], Tier.HOST)
        names = list(grads)
        if coef is not None:
            torch._foreach_mul_([grads[n] for n in names], coef)
        for decay in (True, False):
            chosen = [n for n in names if (master[n].dim() >= 2) == decay]
            if not chosen:
                continue
            torch._fused_adamw_(
                [master[n] for n in chosen],
                [grads[n] for n in chosen],
                [m[n] for n in chosen],
                [v[n] for n in chosen],
                [],
                [step_t.clone() for _ in chosen],
                lr=lr,
                beta1=cfg.adam_beta1,
                beta2=cfg.adam_beta2,
                weight_decay=cfg.weight_decay if decay else 0.0,
                eps=cfg.adam_epsilon,
                amsgrad=False,
                maximize=False,
            )
        for n in names:
            grads[n].zero_()
        store.release(state.grads[i], dirty=True)
        store.release(state.exp_avg[i], dirty=True)
        store.release(state.exp_avg_sq[i], dirty=True)
        if state.master:
            with store.writing(weight_chunk) as weights:
                for n in names:
                    weights[n].copy_(master[n])
        store.release(master_chunk, dirty=True)

    # ------------------------------------------------------------------ export

    def weights(self) -> Iterator[dict[str, torch.Tensor]]:
        """The current weights, one chunk at a time (CPU copies by parameter name): for streaming export."""
        for state in self._states:
            for chunk in state.weights:
                yield self.store.read(chunk)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """All current weights by parameter name, on the CPU (small models, tests)."""
        out: dict[str, torch.Tensor] = {}
        for part in self.weights():
            out.update(part)
        return out

    def close(self) -> None:
        self.store.close()


class StreamedLayer(nn.Module):
    """Stands in for decoder layer ``index`` of the model instance; streams it through ``_LayerFunction``."""

    def __init__(self, trainer: StreamedTrainer, index: int, layer: nn.Module) -> None:
        super().__init__()
        self._trainer = [trainer]  # lists keep them out of the module tree: names and .to() stay the model's
        self._layer = [layer]
        self.index = index

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        if args:
            hidden, rest = args[0], args[1:]
        else:
            hidden, rest = kwargs.pop("hidden_states"), ()
        return _LayerFunction.apply(hidden, self._trainer[0], self.index, self._layer[0], rest, kwargs)


class _LayerFunction(torch.autograd.Function):
    """Forward without keeping activations (the input is saved); backward recomputes, then frees."""

    @staticmethod
    def forward(ctx, hidden, trainer, index, layer, args, kwargs):
        state = trainer._states[trainer._layer_index[index]]
        ctx.trainer, ctx.index, ctx.layer, ctx.args, ctx.kwargs = trainer, index, layer, args, kwargs
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_rng = torch.cuda.get_rng_state(hidden.device) if hidden.is_cuda else None
        with torch.no_grad(), trainer.bound_group(state, requires_grad=False):
            out = layer(hidden, *args, **kwargs)
        ctx.save_for_backward(hidden)
        return out[0] if isinstance(out, tuple) else out

    @staticmethod
    def backward(ctx, grad_out):
        (hidden,) = ctx.saved_tensors
        trainer = ctx.trainer
        state = trainer._states[trainer._layer_index[ctx.index]]
        devices = [hidden.device] if hidden.is_cuda else []
        with torch.random.fork_rng(devices=devices), trainer.bound_group(state, requires_grad=True) as params:
            torch.set_rng_state(ctx.cpu_rng)
            if ctx.cuda_rng is not None:
                torch.cuda.set_rng_state(ctx.cuda_rng, hidden.device)
            with torch.enable_grad():
                x = hidden.detach().requires_grad_(hidden.requires_grad)
                out = ctx.layer(x, *ctx.args, **ctx.kwargs)
                out = out[0] if isinstance(out, tuple) else out
                inputs = [x, *params.values()] if hidden.requires_grad else list(params.values())
                grads = torch.autograd.grad(out, inputs, grad_out, allow_unused=True)
            grad_x = grads[0] if hidden.requires_grad else None
            param_grads = dict(zip(params, grads[1:] if hidden.requires_grad else grads, strict=True))
            trainer.add_grads(state, param_grads)
        return grad_x, None, None, None, None, None


class _Schedule:
    """The learning rate of each step, from transformers' own scheduler (as the HF Trainer computes it)."""

    def __init__(self, config: EngineConfig) -> None:
        from transformers import get_scheduler

        self._param = nn.Parameter(torch.zeros(1))
        self._opt = torch.optim.SGD([self._param], lr=config.learning_rate)
        self._sched = get_scheduler(
            config.lr_scheduler_type,
            self._opt,
            num_warmup_steps=config.warmup_steps,
            num_training_steps=config.max_steps,
        )
        self._at = 0

    def lr(self, step: int) -> float:
        while self._at < step:
            self._opt.step()
            self._sched.step()
            self._at += 1
        return float(self._opt.param_groups[0]["lr"])
