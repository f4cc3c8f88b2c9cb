"""What callers outside the engine read of a run's trainer (``TrainerViews``, a base of ``StreamedTrainer``):
the bytes it sent, totals over the ranks, its memory and traffic, its parameters and chunks, the chunks of its
state to checkpoint and fill back, its weights. They ask these, never its store, sharding or states
(``tests/test_architecture.py`` checks it)."""

from __future__ import annotations

import os
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tiertune.engine.layout import ROLES, STATE_ROLES, state_bytes
from tiertune.errors import ConfigError
from tiertune.offload.chunk import Chunk
from tiertune.offload.store import StoreStats

if TYPE_CHECKING:
    from tiertune.engine.adapter_update import AdapterUpdate
    from tiertune.engine.layout import GroupState
    from tiertune.engine.router_aux import RouterAux
    from tiertune.engine.sharding import Sharding
    from tiertune.engine.update import Updater
    from tiertune.loading.model import ModelParts
    from tiertune.methods.lora import Adapters
    from tiertune.offload.store import ChunkStore


@dataclass(frozen=True)
class StepReport:
    """One optimizer step as the trainer ran it (``StreamedTrainer.last_report``): what the run's loop logs,
    its progress line shows and the benchmarks read, none of them computing its own deltas."""

    loss: float
    learning_rate: float
    grad_norm: float
    seconds: float  # the step's wall-clock time
    peak_bytes: dict[str, int]  # per tier, the most the store has held there since it started
    bytes_moved: dict[str, int]  # per link (``disk->host``...), since the store started
    moved: dict[str, int]  # per link, in this step
    wire: dict[str, int]  # per collective, the bytes this rank sent in this step (of several ranks)
    optimizer_steps: dict[str, int]  # how the updates ran since the run began (``optimizer_counts``)
    metrics: dict[str, float]  # a preference objective's (TRL's names) and an MoE's ``router_aux_loss``
    # seconds of this step by part (``step_parts``), as ``estimate``'s timeline names them
    parts: dict[str, float] = field(default_factory=dict)

    def record(self, step: int, epoch: float, tokens_per_second: float) -> dict:
        """The trainer log's line for this step, the ``step``-th of the run."""
        out = {
            "step": step,
            "loss": self.loss,
            "learning_rate": self.learning_rate,
            "grad_norm": self.grad_norm,
            "tokens_per_second": tokens_per_second,
            "step_seconds": self.seconds,
            "epoch": epoch,
            "peak_bytes": self.peak_bytes,
            "bytes_moved": self.bytes_moved,
            "optimizer_steps": self.optimizer_steps,
            **self.metrics,
        }
        if self.wire:
            out["wire_bytes"] = self.wire
        if self.parts:
            out["parts_s"] = self.parts
        return out


def step_parts(seconds: float, times: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """A step of ``seconds`` by part, from the trainer's cumulative ``times`` now and ``before`` it: the compute
    thread computing (what is left), waiting on I/O, waiting for the CPU optimizer (its time not hidden), and the
    optimizer's worker busy (hidden or not); ``optimizer_hidden_share`` = 1 - waited / busy."""
    delta = {k: times.get(k, 0.0) - before.get(k, 0.0) for k in ("io_wait", "optimizer", "optimizer_busy")}
    busy, waited = delta["optimizer_busy"], delta["optimizer"]
    return {
        "compute": seconds - delta["io_wait"] - waited,
        "io_wait": delta["io_wait"],
        "optimizer_wait": waited,
        "optimizer_busy": busy,
        "optimizer_hidden_share": max(0.0, 1.0 - waited / busy) if busy else 0.0,
    }


class TrainerViews:
    """Read-only views of a trainer's run (and the two ways a checkpoint reads and fills its state)."""

    store: ChunkStore
    sharding: Sharding
    states: list[GroupState]
    adapters: Adapters | None
    parts: ModelParts
    router_aux: RouterAux | None
    last_router_aux_loss: float | None
    last_lr: float
    last_grad_norm: float
    optimizer_counts: dict[str, int]
    last_metrics: dict[str, float]
    updater: Updater | AdapterUpdate
    step_count: int
    loss: Any
    gradients: Any

    @property
    def fused_loss(self) -> bool:
        """Whether the loss runs fused with the head (``CausalLMLoss.fused``)."""
        return self.loss.fused

    @property
    def gradient_bytes(self) -> int:
        """Bytes of gradients backward has handed to the host side, cumulative (``GradientSink.bytes``)."""
        return self.gradients.bytes

    def counters(self) -> dict:
        """The engine's step counters (JSON), for a checkpoint (taken ``settle``d)."""
        return {
            "step_count": self.step_count,
            "last_grad_norm": self.last_grad_norm,
            "optimizer_counts": dict(self.optimizer_counts),
            "weights_behind": self.updater.weights_behind,
        }

    def restore_counters(self, counters: dict) -> None:
        """Continue from a checkpoint's counters: the optimizer's step (bias correction, GaLore's refresh),
        the learning-rate schedule, and whether the next step speculates."""
        self.step_count = int(counters["step_count"])
        self.last_grad_norm = float(counters["last_grad_norm"])
        self.optimizer_counts.update(counters["optimizer_counts"])
        self.updater.weights_behind = bool(counters.get("weights_behind", False))

    def settle(self, weights: bool = False) -> None:
        """A delayed update in flight done (``Updater.settle``: before a checkpoint; ``weights``: the weights
        written from the master weights too, before the model is read)."""
        self.updater.settle(weights)

    def report(
        self,
        loss: float,
        seconds: float,
        moved: dict[str, int],
        sent: dict[str, int],
        parts: dict[str, float] | None = None,
    ) -> StepReport:
        """The step just run, whose loss was ``loss`` in ``seconds``: ``moved`` and ``sent`` are the store's
        bytes moved and this rank's bytes sent before it; ``parts`` its seconds by part (``step_parts``)."""
        stats = self.store.stats()
        aux = {} if self.router_aux is None else {"router_aux_loss": self.last_router_aux_loss}
        return StepReport(
            loss,
            self.last_lr,
            self.last_grad_norm,
            seconds,
            {name: tier.peak for name, tier in stats.tiers.items()},
            stats.bytes_moved,
            {k: n - moved.get(k, 0) for k, n in stats.bytes_moved.items()},
            {k: n - sent.get(k, 0) for k, n in self.wire_sent().items()},
            dict(self.optimizer_counts),
            {**aux, **self.last_metrics},
            parts or {},
        )

    def wire_sent(self) -> dict[str, int]:
        """Bytes this process has sent to the other ranks so far, by collective (none for one process)."""
        return dict(self.sharding.wire.sent)

    def total(self, value: float | int, dtype: torch.dtype = torch.float64) -> float | int:
        """``value`` summed over the ranks (a collective: every rank calls it; one process: ``value``)."""
        return self.sharding.total(value, dtype)

    def state_bytes(self) -> dict[str, int]:
        """Bytes of each kind of training state in the store (``layout.state_bytes``)."""
        return state_bytes(self.states)

    def store_stats(self) -> StoreStats:
        """Per tier its budget, bytes held now and at most; per link the bytes moved so far (``ChunkStore.stats``)."""
        return self.store.stats()

    def parameter_counts(self) -> dict[str, int]:
        """Parameters of the model: ``total``, ``trained`` (the adapters' for LoRA), and per group kind (embed,
        layer, rest, head)."""
        counts: Counter[str] = Counter()
        for state in self.states:
            counts[state.group.kind] += state.group.numel
            counts["total"] += state.group.numel
        counts["trained"] = (
            sum(p.numel() for p in self.adapters.params)
            if self.adapters is not None
            else sum(s.group.numel for s in self.states if s.trainable)
        )
        return dict(counts)

    def chunk_sizes(self) -> dict[str, list[int]]:
        """Capacities of the run's chunks (this rank's shards, of several), by what they hold: ``weights`` (every
        group's, in order), ``layer_weights`` (the decoder layers'), ``in_place`` (frozen weights read from their
        files) and each role of the training state (``grads``, ``master``, ``exp_avg``, ...)."""
        out: defaultdict[str, list[int]] = defaultdict(list)
        for state in self.states:
            for chunk in state.weights:
                out["weights"].append(chunk.capacity)
                if state.group.kind == "layer":
                    out["layer_weights"].append(chunk.capacity)
                if self.store.in_place(chunk) is not None:
                    out["in_place"].append(chunk.capacity)
            for role in ROLES:
                out[role] += [c.capacity for c in getattr(state, role, ()) if c is not None]
        return dict(out)

    def state_parts(self) -> Iterator[tuple[str, Chunk, dict[str, torch.Tensor]]]:
        """Each chunk of the trained groups' state between steps (weights, master weights, moments, GaLore's
        projections) with its role and its group's parameters (on the meta device): what a checkpoint's state
        index lists (``part`` says which elements of each parameter this process holds)."""
        for state in self.states:
            if not state.trainable:
                continue
            for role in STATE_ROLES:
                for chunk in getattr(state, role):
                    if chunk is not None:
                        yield role, chunk, state.group.params

    def part(self, name: str) -> tuple[int, int] | None:
        """The elements [start, end) of parameter ``name`` this rank owns (None: the whole tensor, one process)."""
        return self.sharding.part(name)

    def read_chunk(self, chunk: Chunk) -> dict[str, torch.Tensor]:
        """A CPU copy of one of the run's chunks (a checkpoint writes them one at a time)."""
        return self.store.read(chunk)

    def writing(self, chunk: Chunk) -> AbstractContextManager[dict[str, torch.Tensor]]:
        """One of the run's chunks to fill in place (a checkpoint's state read back into it)."""
        return self.store.writing(chunk)

    # ------------------------------------------------------------------ export

    def weights(self) -> Iterator[dict[str, torch.Tensor]]:
        """The current weights, one chunk at a time (CPU copies by parameter name): for streaming export. A
        rank of several gathers each chunk (every rank must iterate: a collective per chunk). A delayed update
        in flight is finished and its weights written first (``settle``)."""
        self.settle(weights=True)
        for state in self.states:
            for chunk in state.weights:
                yield self.sharding.read_whole(chunk)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """All current weights by parameter name, on the CPU (small models, tests)."""
        out: dict[str, torch.Tensor] = {}
        for part in self.weights():
            out.update(part)
        return out

    @contextmanager
    def _unstreamed(self) -> Iterator[None]:
        """The model's own decoder layers back in place for the block (peft finds its layers by walking
        the module tree, which the streamed stand-ins hide)."""
        streamed = list(self.parts.layers)
        for i, layer in enumerate(streamed):
            self.parts.layers[i] = layer.layer
        try:
            yield
        finally:
            for i, layer in enumerate(streamed):
                self.parts.layers[i] = layer

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | Sequence[int] = 0,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int = 0,
    ) -> list[list[int]]:
        """Each prompt's (token ids) completion by the model as it is now, decoded in batch, the weights read once
        per decoded token for all of them (``engine.generate``: greedy at ``temperature`` 0, else sampled with
        ``top_k`` / ``top_p`` from a generator seeded by ``seed``, or each row from its own with a seed a
        prompt; a row stops at ``eos_token_id``)."""
        from tiertune.engine.generate import generate

        return generate(
            self, prompts, max_new_tokens, temperature, top_p, top_k, seed, eos_token_id, pad_token_id
        )

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        """The LoRA adapter weights as peft saves them (CPU tensors)."""
        if self.adapters is None:
            raise ConfigError("this run trains no adapter (method.type is full)")
        with self._unstreamed():
            return self.adapters.state_dict()

    def save_adapter(self, directory: str | os.PathLike[str]) -> Path:
        """Write the adapter in PEFT format (``PeftModel.from_pretrained(base, directory)`` loads it)."""
        if self.adapters is None:
            raise ConfigError("this run trains no adapter (method.type is full)")
        with self._unstreamed():
            return self.adapters.save(directory)
