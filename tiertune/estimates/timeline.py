"""A step's time as a timeline: the engine's own schedule (``engine.trace``, recorded by the ledger replay)
played against a rate per resource.

Three kinds of actor run at once, as in a run:

- the compute thread runs its script in order: each decoder layer's forward and backward and the head (priced
  per token position), the host-side copies it makes itself (the gradients' hand-off), and its waits: for a
  chunk whose transfer is in flight (``use``: time waiting on I/O) and for the optimizer's worker (``submit``
  while ``worker.MAX_PENDING`` units are pending, ``drain``, ``join``: time the optimizer is not hidden);
- the optimizer's worker runs the units in the order submitted (AdamW priced per parameter, its copies per
  byte; a unit that starts after backward is done (``tail``) has the compute thread's cores too) and, when
  none is queued, the background pieces (``submit_background``: the twins' fills, a split update's rows
  outside the embedding's), those before a unit submitted "after" them;
- each link moves its transfers in the order started (the disk one way at a time; host-to-device and
  device-to-host each their own way), a chunk's transfer after its previous one.

On a CPU the compute thread and the worker share the cores: while both compute, each goes at the rate
measured with the other running (``Rates.shared``); on a GPU they do not. The result names each part's
seconds in the last replayed step (the steady state: a speculative step confirmed), the share of the
optimizer's busy time hidden behind the step's other work, and what bounds the step, as the run's own log
names them (``StepReport.parts``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tiertune.engine.trace import Op, Trace
from tiertune.engine.worker import MAX_PENDING
from tiertune.errors import StateError

DISK_LINKS = ("disk->host", "host->disk")
"""The links that share the disk: a read and a write take turns."""


@dataclass(frozen=True)
class Rates:
    """What each resource does a second."""

    layer: float  # seconds a decoder layer takes per token position: forward, recompute and backward
    forward_share: float  # the forward's share of ``layer`` (1/4 for trained weights, 1/3 for frozen)
    head: float  # seconds per token position of the rest: embeddings, head and loss, forward and backward
    # bytes/s written by the compute thread's own copies (on a GPU: device-to-host over PCIe); 0: in ``layer``
    copy: float
    adamw: float  # parameters/s of the worker's AdamW while backward runs
    adamw_tail: float  # ... after backward, with the compute thread's cores too
    worker_copy: float  # bytes/s written by the worker's copies (twins, compute-dtype weights)
    read: float = 0.0  # bytes/s the compute thread reads reducing host memory (a gradient's norm); 0: free
    links: dict[str, float] = field(default_factory=dict)  # bytes/s per link ("disk->host", ...)
    shared: tuple[float, float] = (1.0, 1.0)  # (compute, optimizer) speed while both compute: 1 = unshared


@dataclass
class Timeline:
    """Seconds of a replayed step, by part, as a run logs them (``StepReport.parts``)."""

    step: float
    compute: float  # the compute thread computing (layers, head, its copies)
    io_wait: float  # ... waiting for a transfer
    optimizer_wait: float  # ... waiting for the optimizer's worker: the optimizer not hidden
    optimizer_busy: float  # the worker running units (its own waits for its states included)
    links: dict[str, float]  # seconds each link was busy
    work: dict[str, float] = field(default_factory=dict)  # seconds of each kind of work, each at full speed

    @property
    def hidden_share(self) -> float:
        """The share of the optimizer's busy time the compute thread did not wait for."""
        if not self.optimizer_busy:
            return 0.0
        return max(0.0, 1.0 - self.optimizer_wait / self.optimizer_busy)

    @property
    def busy(self) -> dict[str, float]:
        """Seconds each resource worked in the step: the compute thread, the optimizer's worker, the disk (its
        reads and writes take turns) and each other link."""
        out = {"compute": self.compute, "the CPU optimizer": self.optimizer_busy}
        for link, seconds in self.links.items():
            name = "the disk" if link in DISK_LINKS else link
            out[name] = out.get(name, 0.0) + seconds
        return out

    @property
    def bound(self) -> str:
        """The resource busiest in the step (the one the step would shorten with if it were faster)."""
        busy = self.busy
        return max(busy, key=busy.__getitem__)

    def as_json(self) -> dict:
        return {
            "step_s": self.step,
            "compute_s": self.compute,
            "io_wait_s": self.io_wait,
            "optimizer_wait_s": self.optimizer_wait,
            "optimizer_busy_s": self.optimizer_busy,
            "optimizer_hidden_share": self.hidden_share,
            "links_busy_s": self.links,
            "busy_s": self.busy,
            "work_s": self.work,
            "bound": self.bound,
        }


class _Actor:
    """A thread playing a script: ``left`` seconds of work at full speed in the op it runs (None: not
    computing), ``blocked`` what it waits for (None: not waiting)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.script: list[Op] = []
        self.at = 0
        self.left: float | None = None
        self.blocked: tuple | None = None


def simulate(trace: Trace, rates: Rates) -> Timeline:
    """Play ``trace`` against ``rates``; the parts of its last step (see the module docstring)."""
    return simulate_steps(trace, rates)[-1]


def simulate_steps(trace: Trace, rates: Rates) -> list[Timeline]:
    """Play ``trace`` against ``rates``; the parts of each of its steps, in order."""
    return _Play(trace, rates).run()


class _Play:
    """One playing of a trace: the compute thread and the worker advance through their scripts, op by op, until
    each computes or waits; then time moves to the next end of a computation or a transfer, each at its speed
    (``Rates.shared`` while both compute)."""

    def __init__(self, trace: Trace, rates: Rates) -> None:
        self.r = rates
        self.units = trace.units
        self.now = 0.0
        self.compute = _Actor("compute")
        self.compute.script = trace.compute
        self.worker = _Actor("worker")
        self._idle: list[Op] = []  # the worker's script while no unit runs
        self.queue: deque[tuple[int, bool]] = (
            deque()
        )  # units submitted, not started (index, after background)
        self.background: deque[int] = deque()  # background pieces submitted, not started
        self.submitted = 0
        self.pending = 0  # submitted units and background pieces queued or running
        self.pending_background = 0  # ... background pieces among them
        self.unit_background = False  # the worker runs a background piece
        self.tail = False
        self.unit_tail = False  # the unit running started after backward
        # transfers [chunk, seconds left, link]: per lane in the order started, per chunk those not done
        self.lanes: dict[str, deque[list]] = {}
        self.open: dict[int, deque[list]] = {}
        self.link_busy: dict[str, float] = {}
        self.steps: list[float] = []  # when each step began
        self.done: list[Timeline] = []  # the steps before the one running
        self.work: dict[str, float] = {}
        self.work_at_step: dict[str, float] = {}
        self.acc = {"compute": 0.0, "io_wait": 0.0, "optimizer_wait": 0.0, "optimizer_busy": 0.0}
        self.at_step: dict[str, float] = dict(self.acc)
        self.links_at_step: dict[str, float] = {}

    # ---------------------------------------------------------------- the actors' ops

    def _lane(self, link: str) -> str:
        return "disk" if link in DISK_LINKS else link

    def _start(self, cid: int, link: str, nbytes: int) -> None:
        rate = self.r.links.get(link, 0.0)
        seconds = nbytes / rate if rate else 0.0
        transfer = [cid, seconds, link]
        self.lanes.setdefault(self._lane(link), deque()).append(transfer)
        self.open.setdefault(cid, deque()).append(transfer)

    def _priced(self, actor: _Actor, op: Op) -> float:
        seconds, what = self._price(actor, op)
        self.work[what] = self.work.get(what, 0.0) + seconds
        return seconds

    def _price(self, actor: _Actor, op: Op) -> tuple[float, str]:
        """Seconds of ``op`` at full speed, and what kind of work it is."""
        kind = op[0]
        r = self.r
        if kind == "layer":
            share = r.forward_share if op[2] == "forward" else 1.0 - r.forward_share
            return op[1] * r.layer * share, f"layers {op[2]}"
        if kind == "head":
            return op[1] * r.head * (1.0 if op[2] in ("loss", "distill") else 1.0 / 3.0), "head"
        # ("run", "adamw" | "copy" | "read", elements, bytes)
        if op[1] == "read":
            return (op[3] / r.read if r.read else 0.0), f"{actor.name} reads"
        if op[1] == "adamw":
            rate = r.adamw_tail if actor is self.worker and self.unit_tail else r.adamw
            return (op[2] / rate if rate else 0.0), "optimizer"
        rate = r.worker_copy if actor is self.worker else r.copy
        return (op[3] / rate if rate else 0.0), f"{actor.name} copies"

    def _moving(self) -> dict[str, list]:
        """Per lane, the transfer it moves now: the first started whose chunk has no earlier one open."""
        out = {}
        for lane, q in self.lanes.items():
            for transfer in q:
                if self.open[transfer[0]][0] is transfer:
                    out[lane] = transfer
                    break
        return out

    def _advance(self, actor: _Actor) -> bool:
        """Run ``actor``'s instantaneous ops until it computes, waits or has nothing to do; whether it moved."""
        before = (actor.at, actor.left, actor.blocked, id(actor.script))
        self._ops(actor)
        return before != (actor.at, actor.left, actor.blocked, id(actor.script))

    def _ops(self, actor: _Actor) -> None:
        while actor.left is None:
            if actor.blocked is not None:
                if not self._unblocked(actor.blocked):
                    return
                actor.blocked = None
            if actor.at >= len(actor.script):
                if actor is self.worker and self._end_unit():
                    continue
                return
            op = actor.script[actor.at]
            actor.at += 1
            kind = op[0]
            if kind in ("layer", "head", "run"):
                seconds = self._priced(actor, op)
                if seconds > 0:
                    actor.left = seconds
            elif kind == "start":
                self._start(op[1], op[2], op[3])
            elif kind == "use":
                actor.blocked = ("io", op[1])
            elif kind == "submit" and op[1:2] == ("background",):
                self.background.extend(range(self.submitted, self.submitted + op[2]))
                self.submitted += op[2]
                self.pending += op[2]
                self.pending_background += op[2]
                self._ops(self.worker)
            elif kind == "submit":
                if self.pending - self.pending_background < MAX_PENDING:
                    self._submit(after=op[1:2] == ("after",))
                    # the worker takes it up at once (the thread it wakes starts before the caller's next op)
                    self._ops(self.worker)
                else:  # submitted once fewer are pending
                    actor.at -= 1
                    actor.blocked = ("below", MAX_PENDING)
            elif kind == "drain":
                actor.blocked = ("below", op[1])
            elif kind == "join":
                actor.blocked = ("all",)
            elif kind == "tail":
                self.tail = True
            elif kind == "step":
                self._step_began()

    def _unblocked(self, why: tuple) -> bool:
        if why[0] == "io":
            return not self.open.get(why[1])
        if why[0] == "all":
            return not self.pending
        return self.pending - self.pending_background < why[1]

    def _submit(self, after: bool = False) -> None:
        self.queue.append((self.submitted, after))
        self.submitted += 1
        self.pending += 1

    def _end_unit(self) -> bool:
        """The worker's unit is done (if it ran one); the next queued one starts, else a background piece.
        Whether one started."""
        w = self.worker
        if w.script is not self._idle:
            self.pending -= 1
            self.pending_background -= self.unit_background
        if self.queue and not (self.queue[0][1] and self.background):
            index, self.unit_background = self.queue.popleft()[0], False
        elif self.background:
            index, self.unit_background = self.background.popleft(), True
        else:
            w.script, w.at = self._idle, 0
            return False
        if index >= len(self.units):
            raise StateError("the trace submitted more optimizer units than it recorded")
        w.script, w.at = self.units[index], 0
        self.unit_tail = self.tail
        return True

    def _step_began(self) -> None:
        if self.steps:
            self.done.append(self._closed())
        self.tail = False  # backward begins again
        self.steps.append(self.now)
        self.at_step = dict(self.acc)
        self.links_at_step = dict(self.link_busy)
        self.work_at_step = dict(self.work)

    def _closed(self) -> Timeline:
        """The step begun last, from its beginning to now."""
        a, b = self.acc, self.at_step
        began = self.steps[-1] if self.steps else 0.0
        compute = a["compute"] - b["compute"]
        return Timeline(
            # the clock and the compute thread's sum round apart by an ulp or so
            step=max(self.now - began, compute),
            compute=compute,
            io_wait=a["io_wait"] - b["io_wait"],
            optimizer_wait=a["optimizer_wait"] - b["optimizer_wait"],
            optimizer_busy=a["optimizer_busy"] - b["optimizer_busy"],
            links={k: v - self.links_at_step.get(k, 0.0) for k, v in self.link_busy.items()},
            work={k: v - self.work_at_step.get(k, 0.0) for k, v in self.work.items()},
        )

    # ---------------------------------------------------------------- time

    def run(self) -> list[Timeline]:
        c, w = self.compute, self.worker
        w.script = self._idle
        while True:
            while self._advance(c) | self._advance(w):
                pass
            if c.left is None and c.blocked is None and c.at >= len(c.script) and w.script is self._idle:
                break
            heads = self._moving()
            both = c.left is not None and w.left is not None
            speed_c, speed_w = self.r.shared if both else (1.0, 1.0)
            candidates = [t[1] for t in heads.values()]
            if c.left is not None:
                candidates.append(c.left / speed_c)
            if w.left is not None:
                candidates.append(w.left / speed_w)
            if not candidates:
                raise StateError(
                    f"the timeline is stuck: compute waits for {c.blocked}, the worker for {w.blocked}"
                )
            dt = max(0.0, min(candidates))
            self._account(dt, c, w)
            self.now += dt
            if c.left is not None:
                c.left -= dt * speed_c
                if c.left <= 1e-15:
                    c.left = None
            if w.left is not None:
                w.left -= dt * speed_w
                if w.left <= 1e-15:
                    w.left = None
            for lane, head in heads.items():
                head[1] -= dt
                self.link_busy[head[2]] = self.link_busy.get(head[2], 0.0) + dt
                if head[1] <= 1e-15:
                    self.lanes[lane].remove(head)
                    mine = self.open[head[0]]
                    mine.popleft()
                    if not mine:
                        del self.open[head[0]]
        return [*self.done, self._closed()]

    def _account(self, dt: float, c: _Actor, w: _Actor) -> None:
        if c.left is not None:
            self.acc["compute"] += dt
        elif c.blocked is not None:
            self.acc["io_wait" if c.blocked[0] == "io" else "optimizer_wait"] += dt
        if w.script is not self._idle:
            self.acc["optimizer_busy"] += dt


__all__ = ["Rates", "Timeline", "simulate", "simulate_steps"]
