"""The streamed training engine: full fine-tuning of an unmodified Hugging Face causal LM whose weights,
gradients and optimizer states live in a ``ChunkStore`` across device, host and disk.

``StreamedTrainer`` builds the parts (``tiertune.engine``'s docstring says how a step runs through them)
and wires them; ``step`` shows a step from the loop's side.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from functools import partial
from typing import Any

import torch

from tiertune.distributed.world import World, usable_cores
from tiertune.engine import several
from tiertune.engine.adapter_update import AdapterUpdate
from tiertune.engine.binding import Binder
from tiertune.engine.compute import Compute, Ledger
from tiertune.engine.config import EngineConfig
from tiertune.engine.gradients import GradientSink
from tiertune.engine.layout import (
    GroupState,
    add_accumulator,
    add_states,
    add_twins,
    state_chunks,
)
from tiertune.engine.loaded import load_model
from tiertune.engine.loss import CausalLMLoss
from tiertune.engine.objective import step_metrics, targets
from tiertune.engine.router_aux import RouterAux
from tiertune.engine.rows import InputRows
from tiertune.engine.schedule import LayerMajor
from tiertune.engine.stash import ChunkStash, DeviceStash, Stash, stash_slots
from tiertune.engine.step import LRSchedule, StepContext
from tiertune.engine.streaming import StreamedLayer, Visit
from tiertune.engine.tiling import tile_layer
from tiertune.engine.update import Updater
from tiertune.engine.views import StepReport, TrainerViews, step_parts
from tiertune.errors import ConfigError, DataError
from tiertune.kernels.ops.attention import use_segment_attention
from tiertune.kernels.patch import patch_model, resolve_backend
from tiertune.loading.weights import Checkpoint
from tiertune.methods.lora import Adapters
from tiertune.methods.optim import GaLore
from tiertune.offload.chunk import Chunk
from tiertune.offload.store import ChunkStore, StoreConfig

log = logging.getLogger("tiertune.engine")


class StreamedTrainer(TrainerViews):
    """Full fine-tuning with every state in a chunk store. ``step(micro_batches)`` runs one optimizer step.

    ``micro_batches`` are dicts with ``input_ids``, optional ``attention_mask``, optional ``position_ids``
    (packed rows) and optional ``labels`` (defaults to ``input_ids``; ``-100`` marks tokens without loss). Returns the step's loss: the mean over
    all target tokens of all its micro-batches.
    """

    def __init__(
        self,
        model_dir: str,
        store_config: StoreConfig,
        config: EngineConfig,
        safe_point: Callable[[], None] | None = None,
        world: World | None = None,
        compute: Compute | None = None,
    ) -> None:
        """``world``: this process among several (ZeRO-3, ``engine.sharding``; the process group joined and
        ``store_config.num_shards`` its size); each rank's ``step`` gets its own part of the global batch.
        ``compute``: the substrate (``engine.compute``): by default the real one, or over a ledger store
        (``StoreConfig.ledger``) a ``Ledger`` whose steps are not clipped. On a ledger the trainer's tensors
        are on the meta device and nothing is read from the model's files: its chunks are registered, its
        steps make a run's store calls (``engine.replay``, ``engine.registered``)."""
        several.check(config)  # several adapters over the base: what they can run
        self.config = config
        self.objective = config.objective  # what a step minimizes (engine.objective)
        self.world = world or World()
        if self.world.size > 1 and store_config.num_shards != self.world.size:
            raise ConfigError(
                f"a store for {self.world.size} ranks splits chunks into {self.world.size} shards "
                f"(StoreConfig.num_shards is {store_config.num_shards})"
            )
        # called on the compute thread where the work may be abandoned, no chunk half acquired there: after
        # each group loaded, at each micro-batch's start, each decoder layer's forward and backward; it may
        # raise to stop the run (a signal, train's StopOnSignals.check)
        self.safe_point = safe_point
        self.store = ChunkStore(store_config)
        ledger = self.store.ledger
        self.compute = compute or (Ledger((), config.max_grad_norm) if ledger else Compute())
        # where its tensors are; ``store.device`` is what the run computes on (on a ledger: the one estimated)
        self.device = torch.device("meta") if ledger else self.store.device
        target = self.store.device
        # a layer's gradients handed on after the next layer's backward is launched (1) or at once (0)
        self.handoff_lag = config.lag(target)
        self.times: defaultdict[str, float] = defaultdict(float)  # seconds per step part, cumulative
        loaded = load_model(model_dir, self.store, config, self.world, self.times, safe_point)
        self.model, self.parts, self.quant = loaded.model, loaded.parts, loaded.quant
        self.sharding, self.quant_cache, self._source = loaded.sharding, loaded.quant_cache, loaded.source
        checkpoint = loaded.checkpoint
        # binds chunk tensors as the instance's parameters (the skeleton's placeholders back after)
        self.binder = Binder(self.model, self.quant)
        self._param_order = [n for n, _ in self.model.named_parameters()]
        paths = {id(m): n for n, m in self.model.named_modules()}
        self.galore = GaLore(config.galore, self.parts.layers, paths) if config.method == "galore" else None
        trained = config.trains_base
        read_master = partial(self._read_master, checkpoint)
        self.states = [
            add_states(self.store, g, config, self.galore, read_master, self.sharding.full)
            if trained
            else GroupState(g)
            for g in self.parts.groups
        ]
        # LoRA: peft wraps the instance's linear modules (before the layers are replaced by streamed ones)
        self.adapters = (
            Adapters(self.model, config.lora, self.device, config.optim, tuple(c.lora for c in config.others))
            if config.method == "lora"
            else None
        )
        if self.adapters is not None:  # bound as tensors of their own (Binder.parametrized)
            self.binder.parametrize(self.adapters.parametrized())
        self._layer_index = [i for i, s in enumerate(self.states) if s.group.kind == "layer"]
        # the step in progress, as backward's callbacks and the optimizer see it
        self.step_ctx = StepContext()
        if self.adapters is not None and self.adapters.pending_dora:
            self._init_dora()
        self._layer_adapters = [
            self.adapters.in_module(layer) if self.adapters else [] for layer in self.parts.layers
        ]
        # the ops of kernels.ops in this instance's modules (none: transformers' and peft's own forwards)
        self.kernel_backend = resolve_backend("torch" if config.kernels == "none" else config.kernels, target)
        # (a ledger computes nothing: its model's modules stay transformers' own)
        self.kernel_counts = (
            Counter() if config.kernels == "none" or ledger else patch_model(self.model, self.kernel_backend)
        )
        # packed and padded rows as causal segments, never a sequence x sequence mask (None: it does; else why not)
        self.attention_kept = (
            "kernels: none" if config.kernels == "none" else use_segment_attention(self.model)
        )
        # the hidden states at the layer boundaries of a wave of micro-batches: with activations on the host,
        # a chunk per boundary with a slot per micro-batch of a wave
        self.stash: Stash = DeviceStash(self.device, config.dtype)
        if config.activations == "host":
            slot = config.activation_tokens * self.model.config.get_text_config(decoder=True).hidden_size
            self.stash = ChunkStash.add(
                self.store, len(self.parts.layers), slot, stash_slots(config), config.dtype, self.times
            )
        # after the stash: the twins take what room is left (as estimate lays them out)
        self.overlap = add_twins(self.store, self.states, config) if trained else False
        # MoE: the router's auxiliary loss, where transformers computes one and the config asks for it (a
        # ledger's layers compute no router logits)
        self.router_aux = None if ledger else RouterAux.of(self.model, self.parts.layers)
        # before the layers are streamed ones (the model's modules then no longer hold them) and the schedule
        # (which layers draw random numbers, and so stack, is known after)
        several.disable_dropout(self.model, self.adapters, config)
        for i, layer in enumerate(self.parts.layers):
            tile_layer(
                layer, config.sequence_tile, self.model.config.get_text_config(decoder=True).model_type
            )
            self.parts.layers[i] = StreamedLayer(self, i, layer)
        self.visit: Visit | None = None  # the decoder's pass in progress inside a step (``engine.streaming``)
        self.schedule = LayerMajor(self, self.stash)
        for module in self.model.modules():  # buffers (rotary caches) to the device; parameters stay meta
            for name, buf in module.named_buffers(recurse=False):
                module._buffers[name] = buf.to(self.device)
        self.step_count = 0
        # optimizer steps by how they ran: confirmed speculation, speculation redone (clipping was active),
        # run after backward (overlap off, or the last step was clipped)
        self.optimizer_counts = {"speculative": 0, "redone": 0, "after_backward": 0}
        # the CPU optimizer of the trained groups, its units in the order backward finishes them (not a head of
        # its own first: the worker's plan would prefetch the layers' states from disk ahead, which on a full
        # host evicts gradients homed on disk: 4 GiB more written a step in the 8B DPO recipe)
        layers = [self.states[i] for i in reversed(self._layer_index)]
        others = [s for s in self.states if s.group.kind != "layer"]
        units = [(s, j) for s in layers + others for j in range(len(s.weights))]
        # the update: the CPU optimizer of the trained groups' chunks, or the adapters' own (LoRA)
        self.updater: Updater | AdapterUpdate = (
            Updater(
                self.store,
                config,
                self.states,
                units,
                self._param_order,
                self.step_ctx,
                self.times,
                target,
                self.galore,
                self.optimizer_counts,
                self.sharding,
                self.compute,
                # once backward is done the compute thread only waits: the rank's share of the cores
                tail_threads=self.world.threads(usable_cores()),
            )
            if self.adapters is None
            else AdapterUpdate(
                self.adapters, config, self.step_ctx, self.optimizer_counts, self.sharding, self.compute
            )
        )
        # a trained input embedding's backward through the rows each wave reads (none: the module's own)
        self.input_rows = (
            InputRows.of(self.parts.embed, self.states, self.binder, self.compute) if trained else None
        )
        shapes = {n: p.shape for n, p in self.binder.meta.items()}
        self.gradients = GradientSink(
            self.store,
            self.step_ctx,
            self.times,
            self.updater,
            self.galore,
            self.device,
            shapes,
            self._add_accumulator,
            self.sharding,
            self.compute,
        )
        self.last_grad_norm = float("nan")
        self._lr = LRSchedule(
            config.learning_rate, config.lr_scheduler_type, config.warmup_steps, config.max_steps
        )
        # of several adapters over one base: each one's settings, schedule, steps taken and random generator
        # (``engine.several``)
        self.adapter_config, self.adapter_lr, self.adapter_steps, self.adapter_rng = several.schedules(
            config, self.adapters
        )
        # the loss, fused with the head where the architecture allows (kernels.ops.linear_ce)
        self.loss = CausalLMLoss(self.model, config.kernels != "none", self.kernel_backend)
        # a preference objective's last step's metrics (TRL's names: engine.objective)
        self.last_metrics: dict[str, float] = {}
        # the weighted auxiliary loss in the last step's loss (None when it has none: router_aux is None)
        self.last_router_aux_loss: float | None = None
        self.last_report: StepReport | None = None  # the last step, as the loop and the benchmarks read it

    # ------------------------------------------------------------------ setup

    def _init_dora(self) -> None:
        """DoRA's magnitudes from the base weights: one pass over the layers, outside the trace."""
        self.step_ctx.traced = False
        try:
            for i, layer in enumerate(self.parts.layers):
                with self.bound_group(self.states[self._layer_index[i]], requires_grad=False):
                    self.compute.run(self.adapters.init_dora, layer)  # type: ignore[union-attr]
        finally:
            self.step_ctx.traced = True
        self.compute.run(self.adapters.collect)  # type: ignore[union-attr]

    def _read_master(self, checkpoint: Checkpoint, name: str, view: torch.Tensor) -> None:
        """Parameter ``name``'s fp32 master weights from the checkpoint (not from the rounded weights: an
        fp32 checkpoint keeps its precision); a rank of several reads its elements of them."""
        read = partial(self._source[name].read_into, checkpoint)
        self.compute.run(self.sharding.read_part, name, read, view, tuple(self.binder.meta[name].shape))

    def _add_accumulator(self, state: GroupState, j: int) -> Chunk | None:
        """GaLore's full-gradient accumulator of weight chunk ``j`` (None when it projects no weight there)."""
        return add_accumulator(self.store, state, j, self.galore, self.config.gradients)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ streamed layers (LayerEngine)

    def layer_state(self, index: int) -> GroupState:
        """The state of decoder layer ``index``'s group."""
        return self.states[self._layer_index[index]]

    def layer_weights(
        self, index: int, requires_grad: bool
    ) -> AbstractContextManager[dict[str, torch.Tensor]]:
        return self.bound_group(self.layer_state(index), requires_grad)

    def sequence_logps(
        self, micro_batches: Sequence[dict[str, torch.Tensor]], head: Any = None, repeat: bool = False
    ) -> list[Any]:
        """Each micro-batch's rows' log-probabilities of their labels (or ``head``'s figures: a teacher's), by
        the weights as they are, in one pass of the layers without autograd (``LayerMajor.sequence_logps``): a
        pass the store schedules apart and then forgets (``ChunkStore.begin_pass``, ``forget_pass``), or with
        ``repeat`` (a frozen trainer making only such passes) ends as a step: the first pass's accesses become
        the trace, what the budgets keep stays."""
        if not repeat:
            self.store.begin_pass()
        try:
            return self.schedule.sequence_logps(micro_batches, head)
        finally:
            self.store.mark_step() if repeat else self.store.forget_pass()

    @contextmanager
    def reference(self) -> Iterator[None]:
        """The model as a preference objective's reference for the block: the base, its adapters off."""
        assert self.adapters is not None  # a full fine-tune's reference comes with its micro-batches
        with torch.no_grad(), self.adapters.disabled():
            yield

    def layer_trainable(self, index: int) -> bool:
        return self.layer_state(index).trainable

    def layer_adapters(self, index: int) -> list[torch.Tensor]:
        return self._layer_adapters[index]

    def layer_grads(self, index: int, grads: dict[str, torch.Tensor | None], ready: Any = None) -> None:
        self.add_grads(self.layer_state(index), grads, ready)

    # ------------------------------------------------------------------ binding

    @contextmanager
    def bound_group(self, state: GroupState, requires_grad: bool) -> Iterator[dict[str, torch.Tensor]]:
        """Acquire a group's weight chunks on the device and bind them for the duration of the block."""
        bound: dict[str, torch.Tensor] = {}
        with ExitStack() as held:  # closed after the unbinding below: the chunks released, or gathers freed
            try:
                views: dict[str, torch.Tensor] = {}
                for chunk in state.weights:  # of several ranks: the whole chunk gathered from their shards
                    views.update(held.enter_context(self.sharding.gathered(chunk, self.step_ctx.traced)))
                # bound once all are acquired: a weight read in place may have its statistics in another chunk
                bound.update(self.binder.bind(views, requires_grad))
                yield bound
            finally:
                self.binder.unbind(list(bound))

    # ------------------------------------------------------------------ gradients

    def add_grads(self, state: GroupState, grads: dict[str, torch.Tensor | None], ready: Any = None) -> None:
        """A micro-batch's weight gradients of ``state``'s group, finished (``GradientSink.add``; ``ready``:
        the ``Compute.mark`` they wait for)."""
        self.gradients.add(state, grads, ready)

    def embedding_parts(self) -> tuple[bool, bool]:
        """Whether this wave hands the trained input embedding's gradient on in two parts, and whether its
        update is split (``GradientSink.embedding_parts``)."""
        return self.gradients.embedding_parts(self.input_rows)

    def add_outside(self, rows: InputRows, dense: torch.Tensor | None, split: bool) -> None:
        """The embedding's gradient outside the wave's rows is final (``GradientSink.add_outside``)."""
        self.gradients.add_outside(rows, dense, split)

    # ------------------------------------------------------------------ the step

    def step(self, micro_batches: Sequence[dict[str, torch.Tensor]]) -> float:
        """One optimizer step over ``micro_batches`` (gradient accumulation); returns the step's loss: the mean
        over its target tokens, or, for a preference objective, over its pairs (micro-batches with ``pairs``:
        their first ``pairs`` rows the chosen sequences, the next ``pairs`` the rejected ones)."""
        step_began = time.perf_counter()
        moved, sent = self.store.stats().bytes_moved, self.wire_sent()  # before the step
        times_before = dict(self.times)
        labels = [mb.get("labels", mb["input_ids"]) for mb in micro_batches]
        # the global batch's: every rank divides by it
        n_tokens = int(self.sharding.total(targets(self.objective, micro_batches, labels), torch.int64))
        if n_tokens == 0 and self.objective.rollouts:
            n_tokens = 1  # GRPO: every completion masked (truncated), a step of no loss
        if n_tokens == 0:
            raise DataError(
                "a training step has no target tokens (every label is -100); check the data and max_seq_len"
            )
        self.schedule.metrics = {}
        cfg = self.config
        clipping = cfg.clips
        # speculate unless the last step was clipped: then this one likely is too, and waiting for the norm
        # costs less than a redo (such a step holds all its gradients until the norm is known)
        self.step_ctx.speculating = self.overlap and not (
            clipping and self.last_grad_norm > cfg.max_grad_norm
        )
        self.step_ctx.lr = self._lr.lr(self.step_count)
        self.step_ctx.number = self.step_count + 1
        # (a split update of the embedding, when the step speculates, starts before backward: its twins first)
        rows = self.input_rows
        self.updater.start([rows.state] if rows is not None and self.updater.splits(rows.state) else [])
        total = 0.0
        aux_total = 0.0
        waves = self.schedule.waves(len(micro_batches))
        for w, wave in enumerate(waves):
            self.step_ctx.first_wave = w == 0
            self.step_ctx.last_wave = w == len(waves) - 1
            batches = [micro_batches[k] for k in wave]
            loss_sum, aux_sum = self.schedule.run(
                batches, [labels[k] for k in wave], n_tokens, len(micro_batches)
            )
            total += loss_sum
            aux_total += aux_sum
        total = float(self.sharding.total(total))
        loss = total / n_tokens
        # each metric's sum over the ranks over what it counts there (engine.objective)
        self.last_metrics = step_metrics(self.objective, self.schedule.metrics, self.sharding.total)
        if self.router_aux is not None:
            self.last_router_aux_loss = self.router_aux.coef * aux_total / len(micro_batches)
            loss += self.last_router_aux_loss
        began = time.perf_counter()
        self._finish_step(loss)
        self.end_step(loss, began, step_began, times_before, moved, sent)
        return loss

    def end_step(
        self, loss: float, update_began: float, began: float, times: dict, moved: dict, sent: dict
    ) -> None:
        """A step's update done (begun at ``update_began``; the step at ``began``, the parts' times, bytes moved
        and sent before it ``times``, ``moved``, ``sent``): counted, timed, and its report made."""
        self.times["optimizer"] += time.perf_counter() - update_began
        self.store.mark_step()
        self.step_count += 1
        seconds = time.perf_counter() - began
        self.times["step"] += seconds
        self.last_report = self.report(loss, seconds, moved, sent, step_parts(seconds, self.times, times))

    def step_adapters(
        self, groups: dict[str, Sequence[dict[str, torch.Tensor]]]
    ) -> dict[str, several.AdapterStep]:
        """One step of each adapter named in ``groups`` over one pass of the base (``engine.several``); returns
        each adapter's loss, gradient norm, learning rate and metrics."""
        return several.step_adapters(self, groups)

    @property
    def before_update(self) -> Callable[[tuple[Chunk, ...]], None] | None:
        """Called with the chunks the optimizer is about to change (a checkpoint in the background)."""
        return self.updater.before_update

    @before_update.setter
    def before_update(self, hook: Callable[[tuple[Chunk, ...]], None] | None) -> None:
        self.updater.before_update = hook

    def _finish_step(self, loss: float) -> None:
        """After backward: the update (the CPU optimizer's confirm / redo / run, or the adapters' step)."""
        self.last_lr = self.step_ctx.lr
        self.last_grad_norm = self.updater.finish(loss)

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The model's logits for a batch with the current weights (and adapters), streamed layer by layer
        between training steps (outside the scheduler's trace)."""
        others = [s for s in self.states if s.group.kind != "layer"]
        self.step_ctx.traced = False
        with ExitStack() as stack:
            stack.callback(setattr, self.step_ctx, "traced", True)
            for state in others:
                stack.enter_context(self.bound_group(state, requires_grad=False))
            mask = None if attention_mask is None else attention_mask.to(self.device)
            ids = input_ids.to(self.device)
            return (
                self.model(input_ids=ids, attention_mask=mask, **self.loss.model_kwargs).logits.float().cpu()
            )

    def state_chunks(self, in_update_order: bool = False) -> list[Chunk]:
        """The chunks holding the training state between steps (``layout.state_chunks``), in model order or
        in the order the optimizer changes them."""
        units = self.updater.units if in_update_order else None
        return state_chunks(self.states, units)

    def close(self) -> None:
        if hasattr(self, "updater"):  # a layout-only build has none
            self.updater.close()
        self.store.close()
