"""Backward's gradient hand-off (``GradientSink``): each wave's weight gradients (summed over its micro-batches
on the device, ``engine.schedule``) added into the fp32 gradient chunks on the host, their norms taken on the
step's last wave, GaLore's projected weights
projected on the compute device, and each finished group handed to the optimizer when it runs during
backward."""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Container
from typing import TYPE_CHECKING, Any

import torch

from tiertune.engine.rows import InputRows, Inside, Rows, add_rows, gather_rows, outside_pieces, put_rows
from tiertune.offload.chunk import Chunk
from tiertune.offload.store import ChunkStore
from tiertune.offload.tiers import Tier

if TYPE_CHECKING:
    from tiertune.engine.adapter_update import AdapterUpdate
    from tiertune.engine.compute import Compute
    from tiertune.engine.layout import GroupState
    from tiertune.engine.sharding import Sharding
    from tiertune.engine.step import StepContext
    from tiertune.engine.update import Updater
    from tiertune.methods.optim import GaLore


class GradientSink:
    """Where backward's weight gradients go. ``bytes`` counts what it has handed to the host side (the CPU
    optimizer's gradient chunks and GaLore's accumulators), cumulative: GaLore's projected weights send r/m
    of theirs. ``add_accumulator(state, j)`` gives GaLore's full-gradient accumulator of weight chunk ``j``
    (registered on first use), ``shapes`` each parameter's shape."""

    def __init__(
        self,
        store: ChunkStore,
        ctx: StepContext,
        times: dict[str, float],
        updater: Updater | AdapterUpdate,
        galore: GaLore | None,
        device: torch.device,
        shapes: dict[str, torch.Size],
        add_accumulator: Callable[[GroupState, int], Chunk | None],
        sharding: Sharding,
        compute: Compute,
    ) -> None:
        self.store, self.ctx, self.times, self.updater = store, ctx, times, updater
        self.sharding = sharding  # ZeRO-3: each chunk's gradients reduce-scattered first, this rank's kept
        self.galore, self.device, self.shapes, self.add_accumulator = galore, device, shapes, add_accumulator
        self.compute = compute  # the substrate (``engine.compute``): the sums, norms and projections
        self.bytes = 0
        # the embedding handed on in two parts this step (``add_outside``): its rows, the norm of its gradient
        # outside them, a tied head's gradient of them (None: it has none), and whether its update is split
        self._parts: dict[int, tuple[InputRows, torch.Tensor | None, torch.Tensor | None, bool]] = {}

    def embedding_parts(self, rows: InputRows | None) -> tuple[bool, bool]:
        """Whether this wave hands the gradient of the embedding of ``rows`` on in two parts (``add_outside``:
        the step's only wave, the tensor whole in this process), and whether its update is split then (a
        speculative step, an update that splits: ``Updater.splits``)."""
        ctx = self.ctx
        two = rows is not None and ctx.first_wave and ctx.last_wave and self.sharding.whole
        split = two and ctx.speculating and self.updater.splits(rows.state)  # type: ignore[union-attr]
        return two, split

    def add_outside(self, rows: InputRows, dense: torch.Tensor | None, split: bool) -> None:
        """The first part of the embedding's hand-off (``rows``; a step of one wave): its gradient outside the
        wave's rows is final, a tied head's (``dense``, on the device) or none. That part goes to the host
        accumulator (its rows left zero) and its norm is kept; ``add`` hands on the rows after the embeddings'
        backward. ``split`` (``Updater.splits``, a speculative step): the update of the rows outside starts
        now, as the worker's background pieces. The compute thread's accesses are the same either way (the
        scheduler's trace is one for every step)."""
        state, name, index = rows.state, rows.name, rows.index
        assert index is not None
        self.times["optimizer"] += self.updater.before_gradients(state)
        head_rows = outside = None
        if dense is not None:
            head_rows = dense.new_empty((rows.count, *dense.shape[1:]))
            self.compute.run(gather_rows, head_rows, dense, index)
            self.compute.run(dense.index_fill_, 0, index.to(dense.device), 0.0)
            outside = self.compute.norm(dense, self.ctx.number)
            self._add(state, {name: dense}, (), norms=False)
        self._parts[id(state)] = (rows, outside, head_rows, split)
        if split:
            pieces = outside_pieces(state, name, _on_cpu(index))
            self.updater.worker.submit_background([(state, 0, piece) for piece in pieces])

    def add(self, state: GroupState, grads: dict[str, torch.Tensor | Rows | None], ready: Any = None) -> None:
        """Add a wave's gradients into the group's fp32 accumulators (the first wave of a step overwrites
        them); on the last wave note each accumulator's norm, as clip_grad_norm_
        computes it, and hand the group to the optimizer when it runs during backward. GaLore's projected
        weights go through ``_project`` instead. ``ready`` (``Compute.mark``): the device work the gradients
        need done; the hand-off's own runs after it, not behind what was launched since (``Compute.after``)."""
        projected = self.galore.targets if self.galore is not None else ()
        in_place = self.ctx.first_wave and self.ctx.last_wave and self.ctx.speculating and not state.twins
        # a delayed update: the last step's update of this group has read its gradients first
        self.times["optimizer"] += self.updater.before_gradients(state)
        first = self._parts.pop(id(state), None)
        if first is not None:
            self._add_inside(state, grads, first, in_place)
            self.updater.after_gradients(state)
            return
        if in_place:
            # updated in place, gradients dropped once used: all but the unit running are done before this
            # group's gradients are made, so the host holds at most two groups' (one when the optimizer keeps
            # up; the ledger replays two: ``submit(behind=True)``), and the worker runs the last group's unit
            # while this one's are copied (a drain to none left it idle during every copy: on a GPU, where
            # backward is fast, the optimizer and the copies then took turns)
            self.times["optimizer"] += self.updater.worker.drain(2)
        with self.compute.after(ready):
            self._add(state, grads, projected)
        # waiting for the optimizer here is time it is not hidden
        if self.ctx.last_wave and self.ctx.speculating:
            self.times["optimizer"] += self.updater.worker.submit(state, None, behind=in_place)
        if self.ctx.last_wave:
            self.updater.after_gradients(state)

    def _add_inside(
        self,
        state: GroupState,
        grads: dict[str, torch.Tensor | Rows | None],
        first: tuple[InputRows, torch.Tensor | None, torch.Tensor | None, bool],
        in_place: bool,
    ) -> None:
        """The second part of the embedding's hand-off (``add_outside``): the rows' whole gradient (a tied head's
        rows plus the embeddings') into the host accumulator's rows, the tensor's norm from both parts'; a split
        update's rows handed to the worker, to run after its pieces."""
        rows, outside, head_rows, split = first
        name = rows.name
        assert rows.index is not None
        g = grads.get(name)
        values = g.values if isinstance(g, Rows) else None
        if head_rows is not None:
            if values is not None:
                self.compute.run(head_rows.add_, values)
            values = head_rows
        if values is None:
            values = torch.zeros((rows.count, *state.group.params[name].shape[1:]), device=self.device)
        inside = self.compute.norm(values, self.ctx.number)
        self.updater.norms[name] = inside if outside is None else (outside.square() + inside.square()).sqrt()
        if in_place:
            self.times["optimizer"] += self.updater.worker.drain(2)
        chunk = state.grads[0]
        began = time.perf_counter()
        # (untied, the step's first use of the chunk: zeros outside the rows)
        acc = self.store.acquire(chunk, Tier.HOST)
        self.times["io_wait"] += time.perf_counter() - began
        try:
            self.compute.run(put_rows, acc[name], rows.index, values)
        finally:
            self.store.release(chunk, dirty=True)
        if head_rows is None:  # (a tied head's rows went with its whole gradient, counted then)
            self.bytes += values.numel() * acc[name].element_size()
        if split:
            part = Inside(name, _on_cpu(rows.index), _on_cpu(values.float()))
            self.times["optimizer"] += self.updater.worker.submit(state, None, 0, behind=in_place, part=part)
        elif self.ctx.speculating:  # the update whole, as ``add`` hands it on
            self.times["optimizer"] += self.updater.worker.submit(state, None, behind=in_place)

    def _add(
        self,
        state: GroupState,
        grads: dict[str, torch.Tensor | Rows | None],
        projected: Container[str],
        norms: bool = True,
    ) -> None:
        """``add``'s sums, norms (on the last wave, unless ``norms`` is False) and projections, chunk by
        chunk."""
        for j, chunk in enumerate(state.grads):
            # ZeRO-3: the sum over the ranks of the elements this rank owns (a collective: before any wait here)
            mine = self.sharding.reduce(state.weights[j], grads)
            began = time.perf_counter()
            views = self.store.acquire(chunk, Tier.HOST, overwrite=self.ctx.first_wave)
            self.times["io_wait"] += time.perf_counter() - began
            try:
                for name, acc in views.items():
                    if name in projected:
                        continue
                    self._accumulate(acc, mine.get(name))
                    if self.ctx.last_wave and norms:
                        self.updater.norms[name] = self.compute.norm(acc, self.ctx.number)
                low = {n: v for n, v in views.items() if n in projected}
                if low:
                    self._project(state, j, low, grads)
            finally:
                self.store.release(chunk, dirty=True)

    def _accumulate(self, acc: torch.Tensor, g: torch.Tensor | Rows | None) -> None:
        """Add a wave's gradient ``g`` (None: the tensor had none; ``Rows``: zeros outside some rows) into its
        fp32 host accumulator, which the step's first wave overwrites."""
        if g is None or isinstance(g, Rows):
            if self.ctx.first_wave:
                self.compute.run(acc.zero_)
            if g is not None:
                self.compute.run(add_rows, acc, g.index, g.values)
                self.bytes += g.values.numel() * acc.element_size()
            return
        if self.ctx.first_wave:
            self.compute.run(acc.copy_, g.detach())
        else:
            self.compute.run(lambda: acc.add_(g.detach().to(device="cpu", dtype=torch.float32)))
        self.bytes += acc.numel() * acc.element_size()

    def _project(
        self, state: GroupState, j: int, low: dict[str, torch.Tensor], grads: dict[str, torch.Tensor | None]
    ) -> None:
        """GaLore's projected weights of weight chunk ``j``: until the last wave, sum their full gradients
        in the host accumulator; on the last, on the compute device, take each full gradient's
        norm, refresh the projection when the step calls for it, and write the low-rank gradient into
        ``low`` (the views of the gradient chunk the optimizer reads, on the host)."""
        galore = self.galore
        assert galore is not None
        single = self.ctx.first_wave and self.ctx.last_wave
        accum = None if single else self.add_accumulator(state, j)
        full: dict[str, torch.Tensor] | None = None
        if accum is not None:
            began = time.perf_counter()
            full = self.store.acquire(accum, Tier.HOST, overwrite=self.ctx.first_wave)
            self.times["io_wait"] += time.perf_counter() - began
        try:
            if not self.ctx.last_wave:  # sum on the host, as the other gradients are
                for name, acc in full.items():  # type: ignore[union-attr]
                    self._accumulate(acc, grads.get(name))
                return
            step = self.ctx.number
            refresh = galore.refreshes(step)
            began = time.perf_counter()
            proj_chunk = state.proj[j]
            assert proj_chunk is not None
            guard = self.updater.before_update
            if refresh and guard is not None:  # a checkpoint being written needs the old ones
                guard((proj_chunk,))
            # read even when refreshed: the same access every step keeps it in the trace, so it is prefetched
            views = self.store.acquire(proj_chunk, Tier.DEVICE, traced=self.ctx.traced)
            try:
                for name, dst in low.items():  # one full gradient on the device at a time
                    norm = self.compute.run(
                        self._project_one, name, dst, grads.get(name), full, views, refresh, step
                    )
                    # clip_grad_norm_'s norm of its full gradient (a ledger's: what its steps are given)
                    self.updater.norms[name] = norm if norm is not None else self.compute.norm(dst, step)
                    self.bytes += dst.numel() * dst.element_size()
            finally:
                self.store.release(proj_chunk, dirty=refresh)
            self.times["galore_project"] += time.perf_counter() - began
        finally:
            if full is not None:
                self.store.release(accum, dirty=not self.ctx.last_wave)  # type: ignore[arg-type]
                if self.ctx.last_wave:
                    self.store.discard(accum)  # type: ignore[arg-type]

    def _project_one(
        self,
        name: str,
        dst: torch.Tensor,
        g: torch.Tensor | None,
        full: dict[str, torch.Tensor] | None,
        views: dict[str, torch.Tensor],
        refresh: bool,
        step: int,
    ) -> torch.Tensor:
        """One projected weight's full gradient (``g``, plus the earlier waves' in ``full``) on the compute
        device: its projection refreshed when ``refresh``, the low-rank gradient into ``dst``; returns the
        full gradient's norm."""
        galore = self.galore
        assert galore is not None
        if full is not None:
            g_full = full[name].to(self.device)
            if g is not None:
                g_full.add_(g.detach().float())
        else:
            shape = self.shapes[name]
            g_full = g.detach().float() if g is not None else torch.zeros(shape, device=self.device)
        norm = torch.linalg.vector_norm(g_full)
        # a gradient that is not finite stops the step (NonFiniteError after backward): no SVD of it
        renew = refresh and bool(torch.isfinite(norm))
        seed = zlib.crc32(f"{name}:{step}".encode())
        began_svd = time.perf_counter()
        projected = galore.project(g_full, views[name], renew, seed)
        if renew:
            self.times["galore_svd"] += time.perf_counter() - began_svd
        dst.copy_(projected)
        return norm


def _on_cpu(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU, where the optimizer reads it (a ledger's, on the meta device, stays there)."""
    return t if t.is_meta else t.cpu()
