"""The update side of a step: the CPU optimizer of full fine-tuning and GaLore with exact clipping
(``Updater``; the worker thread that runs it one weight chunk at a time behind backward is
``engine.worker.OptimizerWorker``); the step in progress and its learning rate are ``engine.step``'s."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from tiertune.engine.layout import cpu_tier
from tiertune.engine.rows import Inside, Outside, update_part
from tiertune.engine.worker import OptimizerWorker, Unit
from tiertune.errors import NonFiniteError, StateError
from tiertune.methods.optim import (
    AdamStep,
    adam_move,
    adamw,
    adamw_8bit,
    adamw_stochastic,
    redo_moment,
)
from tiertune.offload.chunk import Chunk
from tiertune.offload.store import ChunkStore
from tiertune.offload.tiers import Tier

if TYPE_CHECKING:
    from tiertune.engine.compute import Compute
    from tiertune.engine.config import EngineConfig
    from tiertune.engine.layout import GroupState
    from tiertune.engine.sharding import Sharding
    from tiertune.engine.step import StepContext
    from tiertune.methods.optim import GaLore


class Updater:
    """The update of a full fine-tuning (or GaLore) step, on the CPU: AdamW one weight chunk at a time on
    the worker thread, the gradient clipped exactly as ``clip_grad_norm_`` does, and the speculate / confirm
    / redo protocol (the engine's module docstring tells it).

    The gradient side fills ``norms`` on a step's last micro-batch (each parameter's fp32 gradient norm) and,
    when the step speculates, hands each finished group to ``worker``; ``finish`` computes the coefficient
    and confirms, redoes or runs the update. ``counts`` counts the steps by how their update ran (the
    caller's dict); ``before_update``, when set, is called with the chunks about to change (a checkpoint
    being written in the background needs them as they were).
    """

    def __init__(
        self,
        store: ChunkStore,
        config: EngineConfig,
        states: list[GroupState],
        units: list[Unit],
        param_order: list[str],
        ctx: StepContext,
        times: dict[str, float],
        device: torch.device,
        galore: GaLore | None,
        counts: dict[str, int],
        sharding: Sharding,
        compute: Compute,
        tail_threads: int = 0,
    ) -> None:
        """``device``: what the run computes on (it decides the tier the optimizer reads a chunk on);
        ``compute``: the substrate (``engine.compute``): on a ledger the worker runs each unit as it is
        submitted, on the caller's thread. ``tail_threads``: the torch threads of the units that start once
        the step's backward is done (``StepContext.tail``; 0: the threads of the caller, as during backward),
        when the compute thread's cores are free; the attribute of that name may be set later (the estimate
        measures the units at backward's threads)."""
        self.store, self.config, self.states, self.units = store, config, states, units
        self.compute = compute
        self.sharding = sharding  # ZeRO-3: the norms are this rank's elements', the clipping norm all-reduced
        self.param_order, self.ctx, self.device, self.galore, self.counts = (
            param_order,
            ctx,
            device,
            galore,
            counts,
        )
        self.norms: dict[str, torch.Tensor] = {}
        self.before_update: Callable[[tuple[Chunk, ...]], None] | None = None
        self._redoing = False  # the units submitted now redo a speculative step (``finish``)
        self._filled: set[int] = set()  # this step's twins (chunk ids) that hold their sources' values
        self._fills: list[Unit] = []  # the units whose twins are still to be filled ahead (``start``)
        # a delayed update: the groups (ids) whose weights are one update behind their master weights
        self._behind: set[int] = set()
        self._delayed: AdamStep | None = None  # its units' hyper-parameters (``hparams``)
        during = torch.get_num_threads()  # the worker's during backward: the compute thread's setting
        self.tail_threads = tail_threads
        self.worker = OptimizerWorker(
            store,
            lambda unit, coef, part: self.unit(*unit, coef, part),
            times,
            inline=compute.ledger,
            threads=lambda: max(during, self.tail_threads) if ctx.tail else during,
            trace=compute.trace,
        )

    @property
    def redoes_from_twins(self) -> bool:
        """Whether a speculative step that clips is redone from its twins and sources alone
        (``methods.optim.adamw_redo``: AdamW's moments, not 8-bit nor GaLore's low-rank ones), so a unit's
        gradients are dropped as soon as its speculative update has read them: the host holds the gradients
        of the layers in flight, not a step's."""
        cfg = self.config
        # (bf16 weights that are their own master were rounded stochastically: AdamW's move cannot be undone)
        return (
            cfg.redo == "twins"
            and self.galore is None
            and cfg.optim != "adamw_bnb_8bit"
            and cfg.master_weights == "float32"
        )

    def in_memory(self, state: GroupState, j: int) -> bool:
        """Whether unit ``j`` of ``state`` has its sources and twins homed in memory (a second visit is free)."""
        chunks = (*state.sources(j), *(state.twins[j] if state.twins else ()))
        return all(Tier(c.home) is not Tier.DISK for c in chunks)

    def splits(self, state: GroupState) -> bool:
        """Whether a speculative step may update ``state``'s one tensor in two parts, the rows outside a set
        first (``Outside`` pieces, in the background) and those rows last (``Inside``): torch's AdamW (its
        arithmetic is per element), the tensor whole in this process, its sources and twins in memory (on
        disk a second visit would read them twice)."""
        cfg = self.config
        if self.galore is not None or cfg.optim != "adamw_torch" or cfg.master_weights != "float32":
            return False
        if len(state.weights) != 1:
            return False
        return self.in_memory(state, 0)

    def start(self, early: Sequence[GroupState] = ()) -> None:
        """A step begins: no norms yet; the worker prefetches along the units' order. A speculative step's twins
        homed in memory are filled from their sources in the background, ``FILL_AHEAD`` units ahead of the
        worker (in the units' order, ``early``'s first: a split update's, whose pieces start before backward):
        what it copies while it waits for backward's next gradients, a unit does not copy before its AdamW
        (on a 2-core CPU the copy took longer than the update), and at most that many units' twins are filled
        before their update needs them."""
        self.norms = {}
        self.ctx.tail = False
        self._filled = set()
        self.worker.start_step(self.units)
        self._fills = []
        if self.ctx.speculating:
            # in the order the units run: ``early``'s, a head's of its own (handed on after the loss), the rest
            first = [*early, *(s for s in self.states if s.group.kind == "head" and s not in early)]
            order = [(s, j) for s in first for j in range(len(s.weights))]
            order += [u for u in self.units if u[0] not in first]
            self._fills = [(s, j) for s, j in order if s.twins and self.in_memory(s, j)]
        self._fill_ahead(FILL_AHEAD)

    def _fill_ahead(self, count: int) -> None:
        """Hand the worker the fills of the next ``count`` units' twins (``start``), as background pieces."""
        fills, self._fills = self._fills[:count], self._fills[count:]
        self.worker.submit_background([(s, j, FILL) for s, j in fills])

    def finish(self, loss: float) -> float:
        """After backward: the exact clipping coefficient; confirm, redo or run the optimizer; commit. Returns
        the gradient norm. A loss or norm that is not finite raises NonFiniteError, with the step not applied
        where it had not been yet (speculative or after backward: the states are those of the last step)."""
        cfg = self.config
        # the compute thread only waits from here: the units that start now take its cores too (not sooner:
        # a unit on every core while the compute thread still hands gradients on oversubscribes the cores;
        # nor when they run during the next step, delayed)
        self.ctx.tail = not cfg.delay_update
        if self.ctx.tail:
            self.compute.note("tail")
        # exactly torch.nn.utils.clip_grad_norm_: fp32 per-tensor norms stacked in parameter order, the
        # coefficient an fp32 tensor clamped at 1 and multiplied into every gradient
        # (GaLore's projected weights have theirs on the compute device: one copy each, after backward)
        norms = [self.norms[n].cpu() for n in self.param_order if n in self.norms]
        total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())
        total = self.sharding.global_norm(total)
        coef = None
        if cfg.clips:
            coef = torch.clamp(cfg.max_grad_norm / (total + 1e-6), max=1.0)
        norm = float(total)
        if not (math.isfinite(loss) and math.isfinite(norm)):
            self.abandon()
            raise NonFiniteError(f"the loss is {loss} and the gradient norm {norm}")
        order = self.units
        if cfg.delay_update:  # the last step's update is done (joined here); this one runs during the next
            self.worker.join()
            self._delayed = None
            self._delayed = self.hparams  # this step's, for its units
            self.counts["after_backward"] += 1
            # in the order the next step's backward hands the groups on: a head of its own (or a tied
            # embedding's head) after its loss, the layers last to first, the rest
            # (``behind``: a ledger's run at the next hand-off, beside what the compute thread holds then)
            first = [s for s in self.states if s.group.kind == "head" and s.trainable] or [
                s for s in self.states if s.group.kind == "embed" and s.trainable
            ]
            for state, j in [u for u in order if u[0] in first] + [u for u in order if u[0] not in first]:
                self.worker.submit(state, coef, j, behind=True, wait=False)
            self._behind = {id(s) for s, _ in order}
            return norm
        if self.ctx.speculating:
            self.worker.join()  # the speculative step used coefficient 1: exact if that is the coefficient
            redo = coef is not None and float(coef) != 1.0
            self.counts["redone" if redo else "speculative"] += 1
            if redo:
                self.worker.start_step(order)
                self._redoing = True
                try:
                    self._submit_all(order, coef)
                finally:
                    self._redoing = False
        else:
            # after backward (the step before clipped): nothing to redo, the sources updated in place (through the
            # twins it moved a second copy of the states: the demo, every step clipped, 40 MB read a step, not 9.6)
            self.counts["after_backward"] += 1
            self._submit_all(order, coef)
        for state in self.states:  # the twins hold the new states: exchange them in (no bytes copied)
            for j, twins in enumerate(state.twins):
                if self.ctx.speculating:
                    for chunk, twin in zip(state.sources(j), twins, strict=True):
                        self.store.exchange(chunk, twin)
                        self.store.discard(twin)
                self.store.discard(state.grads[j])  # consumed: their memory is free until the next step
        return norm

    def _submit_all(self, order: Sequence[Unit], coef: torch.Tensor | None) -> None:
        for state, j in order:
            self.worker.submit(state, coef, j)
        self.worker.join()

    @property
    def hparams(self) -> AdamStep:
        """The hyper-parameters of the step the units run for: the step in progress's, or, delayed, the step
        before's (its units run during this one: ``finish``)."""
        if self._delayed is not None:
            return self._delayed
        cfg = self.config
        return AdamStep(
            self.ctx.lr, cfg.adam_beta1, cfg.adam_beta2, cfg.adam_epsilon, cfg.weight_decay, self.ctx.number
        )

    def before_gradients(self, state: GroupState) -> float:
        """The compute thread is about to write this step's gradients of ``state``: with a delayed update,
        once the last step's update of it has read its gradients there (returns the seconds waited)."""
        return self.worker.wait_state(state) if id(state) in self._behind else 0.0

    def after_gradients(self, state: GroupState) -> None:
        """This step's gradients of ``state`` are handed on, its weights released: with a delayed update, the
        last step's update of it is done, and its weights are written from the master weights now (on the
        worker: the next step computes on them)."""
        if id(state) in self._behind:
            self._behind.discard(id(state))
            for j in range(len(state.weights)):
                self.worker.submit(state, None, j, part=WEIGHTS, wait=False)

    def settle(self, weights: bool = False) -> None:
        """Wait for a delayed update in flight (its master weights and moments are then the step's, as a
        checkpoint keeps them); ``weights``: write every group's weights from them too (the model as trained so
        far, for export; the next step then computes on these, not the step before's)."""
        self.worker.join()
        if weights:
            for state in [s for s, _ in self.units if id(s) in self._behind]:
                self.after_gradients(state)
            self.worker.join()

    @property
    def weights_behind(self) -> bool:
        """Whether the weights are one delayed update behind the master weights (a checkpoint keeps it)."""
        return bool(self._behind)

    @weights_behind.setter
    def weights_behind(self, behind: bool) -> None:  # (a resumed run's, as it was saved)
        self._behind = {id(s) for s, _ in self.units} if behind else set()

    def abandon(self) -> None:
        """Drop a step's gradients and speculative twins: its update is not applied (an update already made
        in place during backward, without clipping, stays: the run stops without saving it)."""
        with contextlib.suppress(BaseException):
            self.worker.join()
        chunks = [
            c
            for s in self.states
            for c in (*s.grads, *(a for a in s.accum if a is not None), *(t for ts in s.twins for t in ts))
        ]
        for chunk in chunks:
            with contextlib.suppress(StateError):  # the run stops: a chunk still held is left as it is
                self.store.discard(chunk)

    def unit(
        self,
        state: GroupState,
        j: int,
        coef: torch.Tensor | None,
        part: Fill | Outside | Inside | None = None,
    ) -> None:
        """AdamW on weight chunk ``j`` of ``state`` (runs on the optimizer worker's thread); ``part``: one part
        of a split update (``splits``: ``Outside``, ``Inside``), or the twins' fill (``Fill``), instead.

        Reads the gradients and the sources (master weights, moments); writes the new values into the
        twins in a speculative step (the sources stay as they were, for a redo), else in place; then writes the
        compute-dtype weights from the new master weights. Accesses are outside the scheduler's trace: the
        worker's timing varies, the compute thread's order must not.
        """
        store = self.store
        if part is WEIGHTS:  # a delayed update's weights, from its master weights
            if self.before_update is not None:  # a checkpoint being written needs them as they were
                self.before_update((state.weights[j],))
            master = store.acquire(state.master[j], cpu_tier(state.master[j], self.device), traced=False)
            try:
                with store.writing(state.weights[j]) as weights:
                    self.compute.run(_copy, weights, master, list(weights))
            finally:
                store.release(state.master[j])
            return
        if isinstance(part, Fill):
            # not the twin of weights that are their own master: the compute thread may hold them on the
            # device tier now (the layer it back-propagates), and the fill would wait for it; the unit copies it
            for twin, source in zip(state.twins[j], state.sources(j), strict=True):
                if source is not state.weights[j] and twin.id not in self._filled:
                    store.acquire(twin, cpu_tier(twin, self.device), traced=False, copy_from=source)
                    store.release(twin, dirty=True)
                    self._filled.add(twin.id)
            return
        held: list[tuple[Chunk, bool]] = []
        guard = self.before_update
        if guard is not None:  # a checkpoint being written needs these chunks as they were
            guard((state.weights[j], *state.sources(j)))

        def get(chunk: Chunk, source: Chunk | None = None, dirty: bool = True) -> dict[str, torch.Tensor]:
            views = store.acquire(chunk, cpu_tier(chunk, self.device), traced=False, copy_from=source)
            held.append((chunk, dirty))
            return views

        redo = self._redoing and bool(state.twins) and self.redoes_from_twins
        try:
            if redo:  # the speculation's values in the twins, the sources as they were: no gradients
                self._redo(state, j, coef, get)
                return
            grads = get(state.grads[j], dirty=False)
            if state.twins and self.ctx.speculating:
                # the sources' bytes handed to (or copied into) the twins, the sources untouched: unless filled
                # this step already (``start``, or a part before); a redo from gradients fills them again
                views = []
                for twin, source in zip(state.twins[j], state.sources(j), strict=True):
                    filled = twin.id in self._filled and not self._redoing
                    self._filled.add(twin.id)
                    views.append(get(twin, None if filled else source))
            else:
                views = [get(c) for c in state.sources(j)]
            if part is None:
                proj_chunk = state.proj[j] if self.galore is not None else None
                proj = get(proj_chunk, dirty=False) if proj_chunk is not None else {}
                self.compute.run(self._adamw, state, grads, views, proj, coef)
                if state.master and not self.config.delay_update:  # (delayed: ``after_gradients``)
                    with store.writing(state.weights[j]) as weights:
                        self.compute.run(_copy, weights, views[0], list(grads))
            else:
                update_part(self.compute, store, self.hparams, state, j, part, grads, views)
        finally:
            for chunk, dirty in reversed(held):
                store.release(chunk, dirty=dirty)
        if isinstance(part, Outside):
            return
        # no redo needs them (and a split update's pieces are done): free their memory
        if not state.twins or self.redoes_from_twins:
            store.discard(state.grads[j])
        if not self._redoing:
            self._fill_ahead(1)

    def _redo(
        self,
        state: GroupState,
        j: int,
        coef: torch.Tensor,
        get: Callable[..., dict[str, torch.Tensor]],
    ) -> None:
        """Redo unit ``j`` of ``state``'s speculative update with ``coef`` into its twins (``adamw_redo``'s
        parts, a moment's source held only while its twin is redone: four chunks at a time, as the update from
        gradients holds; the weights before the step not read), then the compute-dtype weights from the new
        master weights."""
        hp = self.hparams
        c = float(coef)
        (_, m, v), (tp, tm, tv) = state.sources(j), state.twins[j]
        master, first, second = get(tp), get(tm), get(tv)
        names = list(first)
        moved = ([master[n] for n in names], [first[n] for n in names], [second[n] for n in names])
        self.compute.run(adam_move, *moved, hp, back=True)
        for twin, source, weight, beta in ((first, m, c, hp.beta1), (second, v, c * c, hp.beta2)):
            src = self.store.acquire(source, cpu_tier(source, self.device), traced=False)
            try:
                self.compute.run(redo_moment, [twin[n] for n in names], [src[n] for n in names], weight, beta)
            finally:
                self.store.release(source, dirty=False)
        self.compute.run(adam_move, *moved, hp)
        if state.master:
            with self.store.writing(state.weights[j]) as weights:
                self.compute.run(_copy, weights, master, list(weights))

    def _adamw(
        self,
        state: GroupState,
        grads: dict[str, torch.Tensor],
        views: list[dict[str, torch.Tensor]],
        proj: dict[str, torch.Tensor],
        coef: torch.Tensor | None,
    ) -> None:
        """The update of one unit into ``views`` (master weights, moments: in place or the twins), from its
        ``grads`` times ``coef`` (GaLore's: mapped back through ``proj``)."""
        cfg = self.config
        master, m, v = views[:3]
        names = list(grads)  # none: a rank's shard with no element of the chunk's tensors (ZeRO-3)
        g = [grads[n] for n in names]
        if coef is not None and g:
            g = torch._foreach_mul(g, coef)  # out of place: a redo needs the gradients as they were
        by_name = dict(zip(names, g, strict=True))
        hp = self.hparams
        eight_bit = cfg.optim == "adamw_bnb_8bit"
        if self.galore is not None:
            self.galore.update(names, master, by_name, m, v, proj, hp, eight_bit)
        elif eight_bit:
            adamw_8bit(names, master, by_name, m, v, hp, state.decayed)
        elif cfg.master_weights == "bfloat16":
            adamw_stochastic(names, master, by_name, m, v, hp, state.decayed)
        else:
            adamw(names, master, by_name, m, v, hp, state.decayed)

    def close(self) -> None:
        self.worker.close()


FILL_AHEAD = 2
"""How many units ahead of the worker a speculative step's twins are filled (``Updater.start``)."""


class Fill:
    """A unit's twins filled from their sources before its update (``Updater.start``: in the background)."""


FILL = Fill()
WEIGHTS = object()
"""A delayed update's part that writes a group's weights from its master weights (``after_gradients``)."""


def _copy(into: dict[str, torch.Tensor], source: dict[str, torch.Tensor], names: list[str]) -> None:
    """Tensors ``names`` of ``source`` copied into ``into`` (the weights from the new master weights)."""
    for name in names:
        into[name].copy_(source[name])
