"""Full fine-tuning throughput of the streamed engine: states on disk next to the same model in memory.

Writes a Llama-shaped checkpoint with random weights (default ~1.04 B parameters), then trains it for a few
steps in two fresh processes, in the same invocation:

- ``disk``: weights and AdamW states homed on disk, fp32 gradients on the host, budgets ``--device-budget``
  and ``--host-budget``;
- ``disk-serial``: the same with the optimizer after backward (``overlap_optimizer: false``): the
  reference the overlap is measured against;
- ``memory``: weights on the device tier and everything else on the host, budgets large enough for all;
- ``host`` (when asked for): weights, optimizer states and gradients homed on the host, streamed to the
  device through ``--device-budget`` (a model whose states fit in memory but not on the GPU);
- ``host-serial`` (when asked for): ``host`` with the optimizer after backward;
- ``host-delayed`` (when asked for): ``host`` with ZeRO-Offload's one-step-delayed update (``delay_update``: a
  step's update during the next step, which computes on the weights before it; fp32 master weights kept);
- ``disk-galore`` (when asked for): ``disk`` with GaLore (rank ``--galore-rank``, SVD ``--galore-svd``:
  exact or randomized) instead of AdamW, whose optimizer-state bytes are compared with ``disk``'s
  (``galore_state_ratio``); ``first_step_svd_s`` is the first step's refresh of every projection (on the
  compute device, during backward) and ``first_step_gradient_bytes`` what backward handed to the host.

Prints one JSON object: per mode, tokens/s and the split of step time into compute (the rest), waiting on
I/O (blocked in acquire) and optimizer time not hidden (the compute thread waiting for the optimizer
worker after backward), averaged over the steps after the first (which records the trace).
``optimizer_hidden_share`` is 1 - not hidden / the worker's busy time; ``hidden_by_step_time`` is the same
share measured from step times alone: (serial step - overlapped step) / serial optimizer time.

A GPU computes while the CPU runs the optimizer. On a CPU-only machine both compete for the same cores,
so ``--threads 1`` (the default) gives each thread one core (torch's intra-op pool is one thread), which
emulates that split on a 2-core machine; every mode runs under the same setting.

``--fast-compute F,B`` stands in for a GPU on a CPU machine (``FakeDevice``): each decoder layer's forward
launches F ms and its recompute and backward B ms of sleep on a thread of its own and returns at once, as
kernels on a CUDA stream (no core held meanwhile), its gradients zeros of the weights' shapes; handing a
layer's gradients to the host and the loss wait for the device first, as a GPU's blocking copy and the loss's
read do. The embeddings, head, loss, hand-off and optimizer run as they do. ``compute_s`` includes those waits;
``device_busy_s`` is what the stand-in ran. This is the regime of a fast backward.

``--device cuda`` computes on the GPU (``--dtype bfloat16`` there; ``--gpu-memory-cap`` limits what each
process may allocate, to emulate a smaller card; ``peak_gpu_bytes`` is what it allocated at most).

Run: ``python benchmarks/bench_train.py --dir /mnt/nvme/tmp``
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_load import peak_rss, write_checkpoint
from common import add_model_args, machine, moved_per_step, run_child

from tiertune.settings import parse_size


def run_mode(model_dir: str, disk_dir: str, mode: str, args: argparse.Namespace) -> dict:
    """The measured part, in a fresh process."""
    from tiertune.engine import EngineConfig, StreamedTrainer
    from tiertune.engine.views import step_parts
    from tiertune.methods.optim import GaloreSettings
    from tiertune.offload.store import StoreConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    fake = fast_compute(*args.fast_compute) if args.fast_compute else None
    cuda = args.device == "cuda"
    if cuda and args.gpu_memory_cap:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_memory_cap / total))
    if mode.startswith("disk"):
        store = StoreConfig.resolve(
            device=args.device,
            device_budget=args.device_budget,
            host_budget=args.host_budget,
            disk_path=disk_dir,
            chunk_size=1 << 40,
            prefetch_depth=2,
        )
        engine = EngineConfig(
            params="disk",
            optimizer_states="disk",
            gradients="host",
            max_steps=args.steps,
            overlap_optimizer=mode != "disk-serial",
        )
        if mode == "disk-galore":
            engine.method = "galore"
            engine.galore = GaloreSettings(rank=args.galore_rank, svd=args.galore_svd)
    elif mode in ("host", "host-serial", "host-delayed"):
        # the gradients homed on disk, as a recipe homes them when it has a disk_path: each takes host memory
        # from backward until its update has read it, and is never written to disk unless the host runs short
        store = StoreConfig.resolve(
            device=args.device,
            device_budget=args.device_budget,
            host_budget=args.host_budget,
            disk_path=disk_dir,
            chunk_size=1 << 40,
            prefetch_depth=2,
        )
        engine = EngineConfig(
            params="host",
            optimizer_states="host",
            gradients="disk",
            max_steps=args.steps,
            overlap_optimizer="auto" if mode == "host-delayed" else mode == "host",
            delay_update=mode == "host-delayed",
        )
    else:
        store = StoreConfig.resolve(
            device=args.device,
            device_budget=args.memory_device_budget,
            host_budget=args.memory_host_budget,
            chunk_size=1 << 40,
            prefetch_depth=2,
        )
        engine = EngineConfig(
            params="device", optimizer_states="host", gradients="host", max_steps=args.steps
        )
    engine.dtype = getattr(torch, args.dtype)
    engine.redo = args.redo
    engine.handoff_lag = args.handoff_lag
    engine.learning_rate = 1e-5
    engine.max_grad_norm = args.max_grad_norm
    # the runtime before any model state exists: interpreter, torch, transformers, and what they load on first
    # use (torch._dynamo, imported while the model is built, loads Triton's library when it is installed)
    importlib.import_module("torch._dynamo")
    runtime_rss = current_rss()
    began = time.perf_counter()
    trainer = StreamedTrainer(model_dir, store, engine)
    load_s = time.perf_counter() - began
    gen = torch.Generator().manual_seed(0)
    vocab = trainer.model.config.vocab_size
    batch = [
        {"input_ids": torch.randint(0, vocab, (args.batch, args.seq), generator=gen)}
        for _ in range(args.accum)
    ]
    tokens = args.batch * args.seq * args.accum
    try:
        first = time.perf_counter()
        trainer.step(batch)  # records the trace (and computes GaLore's first projections)
        first_s = time.perf_counter() - first
        first_svd_s = trainer.times.get("galore_svd", 0.0)
        first_gradient_bytes = trainer.gradient_bytes
        trainer.times.clear()
        losses, reports = [], []  # the load and the first step are not steady state
        for _ in range(args.steps - 1):
            losses.append(trainer.step(batch))
            reports.append(trainer.last_report)
        n = args.steps - 1
        times = {k: v / n for k, v in trainer.times.items()}
        stats = trainer.store_stats()
        parameters = sum(p.numel() for g in trainer.parts.groups for p in g.params.values())
        state_bytes = trainer.state_bytes()
    finally:
        trainer.close()
    step = times["step"]
    parts = step_parts(step, times, {})  # a step's parts, averaged, as the run logs them
    return {
        "overlap": trainer.overlap,
        "optimizer_steps": dict(trainer.optimizer_counts),
        "grad_norm": trainer.last_grad_norm,
        "load_s": load_s,
        "first_step_s": first_s,
        # GaLore: the first step's SVD refreshes (every projection), and the gradient bytes backward handed
        # to the host in that step (low-rank for the projected weights)
        "first_step_svd_s": first_svd_s,
        "first_step_gradient_bytes": first_gradient_bytes,
        "step_s": step,
        "tokens_per_second": tokens / step,
        "compute_s": parts["compute"],
        "io_wait_s": parts["io_wait"],
        "optimizer_not_hidden_s": parts["optimizer_wait"],
        "optimizer_busy_s": parts["optimizer_busy"],
        "optimizer_hidden_share": parts["optimizer_hidden_share"],
        "losses": losses,
        # --fast-compute: the stand-in GPU's busy seconds a step (its launches since the first step)
        "device_busy_s": fake.busy / (args.steps - 1) if fake is not None else None,
        "peak_bytes": {k: v.peak for k, v in stats.tiers.items()},
        "bytes_moved_per_step": moved_per_step(reports),
        "peak_rss_bytes": peak_rss(),
        "peak_gpu_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        # what the process holds beyond its budgets (the device tier is host memory on a CPU machine):
        # the runtime, then transient buffers of the size of a parameter group (autograd's gradients of
        # the layer in backward, the embedding's gradient, a clipped gradient copy), logits, activations
        "runtime_rss_bytes": runtime_rss,
        "rss_over_budgets_bytes": peak_rss()
        - store.host_budget
        - (store.device_budget if store.device.type == "cpu" else 0),
        "state_bytes": state_bytes,
        "parameters": parameters,
        # the host tier's peak a parameter, the speculative step's twin states aside (12 B a parameter where
        # the budgets make them): weights, master weights, moments and the gradients in flight
        "host_bytes_per_parameter": (stats.tiers["host"].peak - state_bytes["twins"]) / parameters,
        "largest_group_fp32_bytes": max(trainer.chunk_sizes()["grads"]),
    }


class FakeDevice:
    """A GPU stand-in on the CPU: work "launched" on it (``launch(seconds)``) runs in order on a thread of its
    own, as kernels on a CUDA stream, while the thread that launched it goes on; ``wait(mark)`` waits for
    what was launched before ``mark`` (as a copy on a stream that waits for an event does), ``wait()`` for
    all of it (as ``.item()`` does). ``busy`` sums the seconds it ran."""

    def __init__(self) -> None:
        import threading

        self._cond = threading.Condition()
        self._queue: list[float] = []
        self._launched = self._done = 0
        self.busy = 0.0
        threading.Thread(target=self._run, name="fake-device", daemon=True).start()

    def launch(self, seconds: float) -> None:
        with self._cond:
            self._queue.append(seconds)
            self._launched += 1
            self._cond.notify_all()

    def mark(self) -> int:
        """The point the launched work has reached (``Compute.mark``'s stand-in for a CUDA event)."""
        return self._launched

    def wait(self, mark: int | None = None) -> None:
        """Until the work launched before ``mark`` (None: all of it) is done."""
        with self._cond:
            target = self._launched if mark is None else mark
            while self._done < target:
                self._cond.wait()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                seconds = self._queue[0]
            time.sleep(seconds)  # the "kernels": no core, no lock held
            with self._cond:
                self._queue.pop(0)
                self._done += 1
                self.busy += seconds
                self._cond.notify_all()


def fast_compute(forward_ms: float, backward_ms: float) -> FakeDevice:
    """Each decoder layer's forward launches ``forward_ms`` and its recompute and backward ``backward_ms`` on a
    ``FakeDevice`` and returns at once (the output its input, the gradients zeros made once); a layer's gradient hand-off
    waits for the device's work up to its mark (``Compute.mark``/``after``, as a copy on a stream of its own
    waits for an event), the loss for all of it."""
    from contextlib import contextmanager

    from tiertune.engine.compute import Compute

    device = FakeDevice()

    def layer(self, layer, hidden, call):
        device.launch(forward_ms / 1e3)
        return hidden.clone()

    zeros: dict = {}  # a device makes its gradients itself: the same zeros each time, no CPU time

    def layer_backward(self, layer, hidden, call, holder, inputs, more=None):
        device.launch(backward_ms / 1e3)
        holder.clear()
        out = []
        for t in inputs:
            key = (t.shape, t.dtype)
            if key not in zeros:
                zeros[key] = torch.zeros_like(t)
            out.append(zeros[key])
        return out

    @contextmanager
    def after(self, mark):
        device.wait(mark)
        yield

    loss = Compute.loss

    def waiting_loss(self, *args, **kwargs):
        device.wait()
        return loss(self, *args, **kwargs)

    Compute.layer = layer  # type: ignore[method-assign]
    Compute.layer_backward = layer_backward  # type: ignore[method-assign]
    Compute.mark = lambda self, _device: device.mark()  # type: ignore[method-assign]
    Compute.after = after  # type: ignore[method-assign]
    Compute.loss = waiting_loss  # type: ignore[method-assign]
    return device


def current_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """This script's settings (sizes in bytes); ``argv`` defaults to the command line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p, layers=18, hidden=2048, intermediate=5504, heads=16, kv_heads=16, vocab=32000)
    p.add_argument("--steps", type=int, default=3, help="including the first, which records the trace")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--device-budget", default="2GiB")
    p.add_argument("--host-budget", default="7GiB")
    p.add_argument("--memory-device-budget", default="6GiB")
    p.add_argument("--memory-host-budget", default="14GiB")
    p.add_argument("--modes", default="disk,disk-serial,memory")
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per thread; 0: torch's default")
    p.add_argument("--untied", action="store_true", help="a head of its own (Llama 3's), not the embedding")
    p.add_argument(
        "--redo",
        default="twins",
        choices=("twins", "gradients"),
        help="how a clipped speculative step is redone (EngineConfig.redo): gradients keeps them all a step",
    )
    p.add_argument(
        "--fast-compute",
        default="",
        help="F,B: each layer's forward F ms and backward B ms of sleep, standing in for a GPU (the docstring)",
    )
    p.add_argument(
        "--handoff-lag",
        type=int,
        default=None,
        choices=(0, 1),
        help="EngineConfig.handoff_lag (default: the engine's, 1 on a GPU, else 0)",
    )
    p.add_argument("--galore-rank", type=int, default=128)
    p.add_argument("--galore-svd", default="exact", choices=("exact", "randomized"))
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument(
        "--gpu-memory-cap", default="0", help="e.g. 24GiB: what each process may allocate on the GPU"
    )
    args = p.parse_args(argv)
    args.fast_compute = tuple(float(x) for x in args.fast_compute.split(",")) if args.fast_compute else ()
    if args.fast_compute and len(args.fast_compute) != 2:
        p.error("--fast-compute takes F,B: a layer's forward and backward milliseconds")
    sizes = ("device_budget", "host_budget", "memory_device_budget", "memory_host_budget", "gpu_memory_cap")
    for name in sizes:
        setattr(args, name, parse_size(getattr(args, name), f"--{name.replace('_', '-')}"))
    return args


def main() -> None:
    args = parse_args()
    if args.child:
        print(json.dumps(run_mode(*args.child, args)))
        return
    base = Path(args.dir).resolve()
    base.mkdir(parents=True, exist_ok=True)
    result: dict = {"benchmark": "train", "machine": machine()}
    with tempfile.TemporaryDirectory(dir=base) as tmp:
        model_dir = Path(tmp) / "model"
        model_dir.mkdir()
        result["parameters"] = write_checkpoint(
            model_dir,
            args.layers,
            args.hidden,
            args.intermediate,
            args.heads,
            args.kv_heads,
            args.vocab,
            tied=not args.untied,
        )
        result["tokens_per_step"] = args.batch * args.seq * args.accum
        for mode in args.modes.split(","):
            result[mode] = run_child(__file__, model_dir, Path(tmp) / "disk", mode)
    if "tokens_per_second" in result.get("disk", {}) and "tokens_per_second" in result.get("memory", {}):
        result["disk_over_memory_throughput"] = (
            result["disk"]["tokens_per_second"] / result["memory"]["tokens_per_second"]
        )
    disk, serial = result.get("disk", {}), result.get("disk-serial", {})
    if "step_s" in disk and "step_s" in serial and serial["optimizer_busy_s"]:
        result["hidden_by_step_time"] = (serial["step_s"] - disk["step_s"]) / serial["optimizer_busy_s"]
    galore = result.get("disk-galore", {}).get("state_bytes")
    if galore and "state_bytes" in disk:
        adamw = disk["state_bytes"]
        result["galore_state_ratio"] = (galore["moments"] + galore["projections"]) / adamw["moments"]
    result["settings"] = {
        "threads": args.threads,
        "fast_compute_ms": list(args.fast_compute),
        "handoff_lag": args.handoff_lag,
        "max_grad_norm": args.max_grad_norm,
        "galore_rank": args.galore_rank,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
