"""A wave's micro-batches as the layer-major step (``engine.schedule``) carries them: their random streams, their
inputs and layer calls, and the fp32 sums of the gradients the bound groups receive."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from tiertune.engine.compute import Call


@dataclass
class Rng:
    """A random stream's state: the CPU generator's and, computing on CUDA, the device's."""

    cpu: torch.Tensor
    cuda: torch.Tensor | None

    @classmethod
    def now(cls, device: torch.device) -> Rng:
        return cls(torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None)

    def set(self, device: torch.device) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, device)

    @contextmanager
    def running(self, device: torch.device) -> Iterator[None]:
        """The block draws from this stream; the global generators are put back after it."""
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            self.set(device)
            yield


def streams(count: int, device: torch.device, seeds: list[int] | None = None) -> list[Rng]:
    """``count`` random streams, each seeded by a draw from the global generator (which advances by as many
    draws; its state is what a checkpoint keeps, so a resumed run draws the same streams), or by ``seeds``."""
    if seeds is None:
        seeds = torch.randint(0, 2**62, (count,)).tolist()
    devices = [device] if device.type == "cuda" else []
    out = []
    with torch.random.fork_rng(devices=devices):
        for seed in seeds:
            torch.manual_seed(seed)
            out.append(Rng.now(device))
    return out


@dataclass
class Micro:
    """One micro-batch of a wave: its inputs on the device, the calls of its layers, its random stream (at the
    start of its forward, and before each layer), its hidden states' shape and their gradient being carried."""

    ids: torch.Tensor
    extra: dict[str, torch.Tensor]
    target: torch.Tensor
    start: Rng
    rng: Rng
    calls: list[Call] = field(default_factory=list)
    before: list[Rng] = field(default_factory=list)
    shape: torch.Size = field(default_factory=torch.Size)
    grad: torch.Tensor | None = None
    pairs: int = 0  # a preference objective's pairs: the first ``pairs`` rows chosen, the next rejected
    ref: torch.Tensor | None = None  # the reference's hidden states at the boundary the wave has reached
    ref_logps: torch.Tensor | None = None  # or its sequences' log-probabilities, computed before the step
    desirable: torch.Tensor | None = None  # KTO: whether each row's completion is desirable
    teacher: Any = (
        None  # distillation: the teacher's figures at its scored tokens (``kernels.ops.distill.TopK``)
    )
    # of several adapters over one base (``Adapters``), the one this micro-batch trains, and the target tokens
    # of that adapter's step its loss is divided by (None, 0: the one adapter, the step's)
    adapter: str | None = None
    tokens: int = 0
    objective: Any = None  # and that adapter's ``ObjectiveSettings`` (None: the engine's)
    # GRPO: the micro-batch's dict, with each completion's ``advantages`` and, after the first of its iterations,
    # the ``old_logps`` it was sampled under; the suffix writes the policy's ``logps`` into it
    rollout: dict[str, Any] | None = None

    @classmethod
    def of(cls, batch: dict[str, Any], labels: torch.Tensor, rng: Rng, device: torch.device) -> Micro:
        """A step's micro-batch (its dict, ``StreamedTrainer.step``) on ``device``, its targets ``labels``
        shifted, ``rng`` its stream."""
        from tiertune.engine.teacher import teacher_of

        b = batch
        return cls(
            b["input_ids"].to(device),
            {k: b[k].to(device) for k in ("attention_mask", "position_ids") if k in b},
            labels[:, 1:].to(device),
            rng,
            rng,
            pairs=int(b.get("pairs", 0)),
            ref_logps=b["ref_logps"].to(device) if "ref_logps" in b else None,
            desirable=b["label"].to(device) if "label" in b else None,
            teacher=teacher_of(b, device),
            adapter=b.get("adapter"),
            tokens=int(b.get("adapter_tokens", 0)),
            objective=b.get("adapter_objective"),
            rollout=b if "advantages" in b else None,
        )


def stacked_inputs(parts: list[Micro]) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """The ids, extra inputs and targets of a stack of micro-batches as one batch (one's own as they are)."""
    if len(parts) == 1:
        return parts[0].ids, parts[0].extra, parts[0].target
    ids, target = torch.cat([mb.ids for mb in parts]), torch.cat([mb.target for mb in parts])
    return ids, {k: torch.cat([mb.extra[k] for mb in parts]) for k in parts[0].extra}, target


def add(summed: dict[str, torch.Tensor], name: str, g: torch.Tensor | None) -> None:
    """Add a micro-batch's gradient ``g`` into ``summed[name]`` in fp32 (the first one kept as it is, in fp32)."""
    if g is None:
        return
    if name in summed:
        summed[name].add_(g)
    else:
        summed[name] = g.float()


def harvest(bound: dict[int, dict[str, torch.Tensor]], summed: dict[int, dict[str, torch.Tensor]]) -> None:
    """Move the gradients autograd left on the bound groups' tensors into the wave's fp32 sums."""
    for key, params in bound.items():
        for name, p in params.items():
            if p.grad is not None:
                add(summed[key], name, p.grad)
                p.grad = None


__all__ = ["Micro", "Rng", "add", "harvest", "streams"]
