"""How fast a step can go: the work of a step (FLOPs, bytes over each link, parameters the CPU optimizer
updates) divided by the rate of the part that does it, and which part bounds the step.

The FLOPs of a step, for ``T`` token positions (batch x accumulation x sequence length: padding computes too):

- decoder layers: ``2 * N * T`` forward, where ``N`` counts the matrix weights a token goes through (an
  MoE's experts scaled by top-k / experts), plus attention's scores and weighted sum, ``4 * T * s/2 * d_attn``
  per layer (causal: a token attends to ``s/2`` positions on average). The engine recomputes each layer's
  forward in backward (only the layer inputs are saved), and backward costs two forwards when the weights
  are trained (input and weight gradients), one when they are frozen (LoRA: input gradients only): so
  ``4x`` the forward for full fine-tuning and GaLore, ``3x`` for LoRA;
- the head: ``2 * V * d * T`` forward, ``3x`` with its gradient when it is trained, ``2x`` when frozen.

Rates: a GPU's stated dense bf16 peak (``GPUS``; no run reaches it, so the compute part is a lower bound)
or a matrix product of the model's own shape measured on the machine (a CPU, or the GPU this runs on);
the disk (``probe_disk``: the disk tier's own I/O path), host-to-device copies and the CPU optimizer
(torch's fused AdamW) measured by ``measure_bandwidth``. On a GPU the parts overlap
(prefetch, the optimizer behind backward) and the step takes at least the longest; on a CPU the compute, the
optimizer and the copies to the device tier share the cores, so their sum competes with the disk.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from tiertune.distributed.world import World, usable_cores
from tiertune.errors import ConfigError
from tiertune.estimates.timeline import Timeline
from tiertune.files import nearest_existing
from tiertune.offload.store import StoreConfig
from tiertune.offload.tiers import Tier


@dataclass(frozen=True)
class GPU:
    """A GPU as its datasheet states it."""

    name: str
    peak_flops: float  # dense bf16 tensor-core FLOP/s with fp32 accumulation (what torch's bf16 matmul uses)
    memory: int  # bytes
    host_to_device: (
        float  # bytes/s of pinned host-to-device copies on its usual PCIe link (typical, not peak)
    )


GPUS: dict[str, GPU] = {
    "rtx3090": GPU("NVIDIA GeForce RTX 3090", 71e12, 24 << 30, 25e9),
    "rtx4090": GPU("NVIDIA GeForce RTX 4090", 165.2e12, 24 << 30, 25e9),
    "a6000": GPU("NVIDIA RTX A6000", 154.8e12, 48 << 30, 25e9),
    "l40s": GPU("NVIDIA L40S", 362e12, 48 << 30, 25e9),
    "a100": GPU("NVIDIA A100 80GB", 312e12, 80 << 30, 25e9),
    "h100": GPU("NVIDIA H100 SXM 80GB", 989e12, 80 << 30, 50e9),
    "h200": GPU("NVIDIA H200 SXM 141GB", 989e12, 141 * 10**9, 50e9),
}
"""``--gpu`` choices: stated peaks (datasheets), memory and typical PCIe rates (PCIe 4.0 x16 ~25 GB/s, 5.0 ~50)."""


@dataclass
class StepFlops:
    """The FLOPs of one optimizer step and what they are made of."""

    tokens: int  # token positions computed per step
    layer_weights: int  # matrix weights a token goes through in the decoder layers (N)
    attention_per_token: float  # forward attention FLOPs per token, all layers
    head_weights: int  # V * d
    layer_factor: int  # 4 (trained) or 3 (frozen): forward + recompute + backward, in forwards
    head_factor: int  # 3 (trained) or 2 (frozen)
    total: float
    shape: tuple[int, int, int]  # (micro-batch tokens, hidden, intermediate): the product measured for a rate

    @property
    def formula(self) -> str:
        return (
            f"{self.layer_factor} x (2 x {self.layer_weights / 1e9:.3g} G weights + "
            f"{self.attention_per_token / 1e9:.3g} G attention) x {self.tokens:,} tokens + "
            f"{self.head_factor} x 2 x {self.head_weights / 1e6:.3g} M head x {self.tokens:,} tokens"
        )


def step_flops(
    model: torch.nn.Module,
    layers: list[torch.nn.Module],
    micro_tokens: int,
    steps_micro: int,
    seq_len: int,
    trained: bool,
    reference: bool = False,
    paired: bool = False,
) -> StepFlops:
    """FLOPs of a step of ``steps_micro`` micro-batches of ``micro_tokens`` positions in rows of ``seq_len``, from the (meta) model's own weights
    before quantization: every matrix in a decoder layer, 3-D fused experts scaled by top-k / experts. A
    preference objective (``paired``) runs the head once more without autograd (the sequences' log-probabilities
    before their weighted gradient); its ``reference`` one more forward of every layer and of the head."""
    config = model.config.get_text_config(decoder=True)  # the decoder's dimensions (``decoder_config``)
    tokens = micro_tokens * steps_micro
    experts = (getattr(config, k, None) for k in ("num_local_experts", "num_experts", "n_routed_experts"))
    n_experts = next((e for e in experts if e), None)
    top_k = getattr(config, "num_experts_per_tok", None) or 1
    weights = 0
    for layer in layers:
        for p in layer.parameters():
            if p.dim() == 3 and n_experts:  # fused experts: a token goes through top_k of them
                weights += p.numel() * top_k // n_experts
            elif p.dim() >= 2:
                weights += p.numel()
    # each layer's attention scores and weighted sum, by its own config where layers differ (a heterogeneous
    # config: heads per layer); none in a layer without attention heads (Mamba's, RWKV's: matrices and scans)
    attention = 0.0
    for each in _layer_configs(config, len(layers)):
        heads = getattr(each, "num_attention_heads", None) or 0
        head_dim = (getattr(each, "head_dim", None) or config.hidden_size // heads) if heads else 0
        attention += 4 * (seq_len / 2) * heads * head_dim
    head = config.vocab_size * config.hidden_size
    layer_factor, head_factor = (4, 3) if trained else (3, 2)
    layer_factor, head_factor = layer_factor + reference, head_factor + reference + paired
    total = layer_factor * (2 * weights + attention) * tokens + head_factor * 2 * head * tokens
    inner = getattr(_layer_configs(config, 1)[0], "intermediate_size", None) or 4 * config.hidden_size
    shape = (micro_tokens, config.hidden_size, inner)
    return StepFlops(tokens, weights, attention, head, layer_factor, head_factor, total, shape)


def _layer_configs(config: Any, layers: int) -> list[Any]:
    """The config of each of the first ``layers`` decoder layers: transformers' per-layer configs where the
    layers differ (``is_heterogeneous``: reading such a setting from the whole config is an error), else the
    config itself for each."""
    if getattr(config, "is_heterogeneous", False):
        return [config.per_layer_config[i] for i in range(layers)]
    return [config] * layers


def measure_matmul(device: torch.device, dtype: torch.dtype, m: int, k: int, n: int) -> float:
    """FLOP/s of ``(m x k) @ (k x n)`` in ``dtype`` on ``device`` (best of a few, after a warm-up): the
    model's own shapes, so a CPU's small-matrix efficiency is in the figure."""
    a = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(k, n, device=device).to(dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    a @ b
    sync()
    reps = max(1, min(20, int(2e10 / max(1, 2 * m * k * n))))  # ~20 GFLOP a try
    best = float("inf")
    for _ in range(3):
        began = time.perf_counter()
        for _ in range(reps):
            a @ b
        sync()
        best = min(best, (time.perf_counter() - began) / reps)
    return 2 * m * k * n / best


MEASURE_LIMIT = 2 << 30
"""The most bytes of weights ``measure_compute`` builds (three decoder layers, embeddings and head)."""


class Compute(NamedTuple):
    """``measure_compute``'s result: seconds of one micro-batch per decoder layer and for the rest, and how
    much the repeats varied (the slowest over the fastest, less one: 0.1 is 10%)."""

    layer: float
    rest: float
    spread: float


NOISY = 0.25
"""A spread of repeats above this says the machine was busy while measuring (``Compute.spread``)."""


def measure_compute(
    model_dir: str,
    cfg,
    micro_batch: int,
    seq_len: int,
    device: torch.device,
    repeats: int = 5,
    budget: float = 30.0,
) -> Compute | None:
    """Seconds of one micro-batch's compute as the engine runs it, measured on ``device``: (per decoder
    layer, the rest: embeddings, head and loss). The model's own forward is run with one and with three
    decoder layers (random weights in the layers' dtype; LoRA adapters as the run wraps them; the loss fused
    with the head and the modules patched with tiertune's ops where the run does so), each as a step runs it:
    a forward without autograd (the streamed forward saves only layer inputs), then a forward with autograd
    and its backward (the recompute and the backward); half the difference is one layer. Each model is run
    ``repeats`` times after a warm-up (fewer once ``budget`` seconds have passed) with the threads this process
    computes with, as the run will, and the fastest repeat counts: another program's load slows a repeat,
    never speeds one up, and a busy CPU oversubscribed by torch's threads can slow one several times over
    (``spread`` says by how much they varied). None when three layers, embeddings and head would take more
    than ``MEASURE_LIMIT`` bytes (the caller falls back to a matrix product's rate). A 4-bit base is measured
    unquantized (its dequantization is not in the figure)."""
    from transformers import AutoModelForCausalLM

    from tiertune.engine.loss import CausalLMLoss
    from tiertune.engine.prepare import prepare_model
    from tiertune.loading.model import decoder_config

    config = decoder_config(model_dir)
    dtype = cfg.layer_dtype(device)
    if _cut_weights(config, 3) * torch.finfo(dtype).bits // 8 > MEASURE_LIMIT:
        return None
    seconds = []
    spread = 0.0
    began = time.perf_counter()
    for n in (1, 3):
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(_cut_config(config, n), dtype=dtype)
        backend = prepare_model(model, cfg, device)  # as the run prepares it
        loss = CausalLMLoss(model, cfg.kernels != "none", backend)
        ids = torch.randint(0, config.vocab_size, (micro_batch, seq_len), device=device)
        _time_step(loss, ids, device)  # warm-up
        times = [_time_step(loss, ids, device)]
        while len(times) < repeats and (len(times) < 2 or time.perf_counter() - began < budget * n / 4):
            times.append(_time_step(loss, ids, device))
        seconds.append(min(times))
        spread = max(spread, max(times) / min(times) - 1)
    layer = max(0.0, seconds[1] - seconds[0]) / 2
    return Compute(layer, max(0.0, seconds[0] - layer), spread)


def _cut_weights(config: Any, layers: int) -> int:
    """Weights, roughly, of ``config``'s model cut to ``layers`` decoder layers (attention and MLP a layer,
    embeddings and head): whether a measurement may build it."""
    per_layer = max(
        12 * config.hidden_size**2, 3 * config.hidden_size * (getattr(config, "intermediate_size", 0) or 0)
    )
    embed = config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2)
    return layers * per_layer + embed


def _cut_config(config: Any, layers: int) -> Any:
    """A copy of ``config`` with its first ``layers`` decoder layers (and their per-layer types) only."""
    import copy

    cut = copy.deepcopy(config)
    cut.num_hidden_layers = layers
    if isinstance(getattr(cut, "layer_types", None), list):
        cut.layer_types = cut.layer_types[:layers]
    return cut


class Engine(NamedTuple):
    """``measure_engine``'s result: the engine's step on this CPU, per micro-batch."""

    layer: float  # seconds of a decoder layer's compute (forward, recompute, backward, its hand-off)
    rest: float  # seconds of the rest (embeddings, head and loss)
    updates: float  # the optimizer's units after backward, parameters a second (0: not measured)
    spread: float  # how much the steps varied (their upper quartile over the lower, less one)
    shared: float = 1.0  # the share of its speed the optimizer keeps beside the compute (at most 1)
    during: float = 0.0  # the units' rate on backward's fewer threads, parameters a second (0: ``updates``'s)


def measure_engine(
    model_dir: str,
    cfg,
    micro_batch: int,
    seq_len: int,
    steps: int = 7,
    overlapped: bool = False,
    budget: float = 10.0,
    packed: bool = False,
    sample: dict[str, torch.Tensor] | None = None,
) -> Engine | None:
    """The engine's step (``StreamedTrainer`` as ``cfg`` configures it, every chunk in memory) on this CPU, on
    random models of the run's shape cut to one decoder layer and to up to five (written to a temporary
    directory): the median step's compute (the step less its waits: layers, head and loss, and the gradients'
    hand-off) per layer and for the rest, with the optimizer after backward; its units' rate (the deeper cut's
    units less the one layer's). The trainers take turns, a step each, for ``steps`` rounds, and more (up to
    three times as many) while ``budget`` seconds have not passed; each figure is the median over the rounds
    (as a run's log is read: on a shared machine most steps are slower than the fastest, by a margin that
    stays) of a difference or ratio within a round. ``overlapped``: the deeper cut again with the optimizer
    during backward (as ``cfg`` says it runs): what share of its speed the optimizer keeps beside the compute
    (``Engine.shared``; at most 1). None when the deeper cut would take more than a quarter of
    ``MEASURE_LIMIT`` bytes or the engine cannot build the cut models (the caller falls back to
    ``measure_compute``). Where backward leaves the optimizer fewer threads than it gets after backward (a
    rank's or ``threads``'s share of the cores), the deeper cut once more with its units at those threads
    (``Engine.during``: the ratio of the two within a round, the engine's own units on each side, since two
    probes of AdamW alone, one thread over two, gave 0.63 to 0.89 from one call to the next, where the
    engine's units ran as fast on one thread as on two). ``sample``: the run's own first micro-batch
    (``finetune.train.first_micro_batch``: a packed row's documents shape the attention's cost), else one
    ``sample_micro_batch`` makes (``packed``: the rows hold several documents each, ``data.packing``)."""
    import dataclasses

    from transformers import AutoModelForCausalLM

    from tiertune.engine.trainer import StreamedTrainer
    from tiertune.loading.model import decoder_config

    config = decoder_config(model_dir)
    dtype = cfg.layer_dtype(torch.device("cpu"))
    deep = max(2, min(5, int(config.num_hidden_layers)))  # the deeper cut: the more layers, the less noise
    weights = _cut_weights(config, deep) * 4
    if weights > MEASURE_LIMIT // 4:  # two or three trainers at once, each ~5 bytes of state a weight byte
        return None
    room = 6 * weights + (256 << 20)  # weights, master, moments, gradients, twins: all resident
    serial = dataclasses.replace(
        cfg,
        overlap_optimizer=False,
        params="device" if cfg.params == "disk" else cfg.params,
        optimizer_states="host",
        gradients="host",
        quant_cache=None,
        max_steps=3 * steps + 3,
    )
    store_cfg = StoreConfig(device_budget=room, host_budget=room)
    batch = [
        sample if sample is not None else sample_micro_batch(micro_batch, seq_len, config.vocab_size, packed)
    ]
    configs = [(1, serial), (deep, serial)]
    if overlapped:
        configs.append((deep, dataclasses.replace(serial, overlap_optimizer=cfg.overlap_optimizer)))
    # the units during backward on the compute thread's threads, fewer than the tail's: measured, not scaled
    fewer = torch.get_num_threads() < World().threads(usable_cores()) and weights <= MEASURE_LIMIT // 5
    if fewer:
        configs.append((deep, serial))
    # per trainer, each round's (compute, optimizer busy): the trainers take turns, a step each, so that the
    # machine's drift from minute to minute (another program's load) falls on all of them alike
    seen: list[list[tuple[float, float]]] = [[] for _ in configs]
    trainers: list = []
    with tempfile.TemporaryDirectory(prefix="tiertune-measure-") as tmp:
        try:
            for n, engine_cfg in configs:
                where = Path(tmp) / str(n)
                if not where.exists():
                    with quiet_saving():
                        model = AutoModelForCausalLM.from_config(_cut_config(config, n), dtype=dtype)
                        model.save_pretrained(where)
                trainers.append(StreamedTrainer(str(where), store_cfg, engine_cfg))
            if fewer:  # its units after backward on the threads of the units during it
                trainers[-1].updater.tail_threads = 0
            for trainer in trainers:
                trainer.step(batch)  # records the trace
            began = time.perf_counter()
            rounds = 0
            while rounds < steps or (rounds < 3 * steps and time.perf_counter() - began < budget):
                rounds += 1
                for k, trainer in enumerate(trainers):
                    trainer.step(batch)
                    parts = trainer.last_report.parts
                    seen[k].append((parts["compute"], parts["optimizer_busy"]))
            counts = [trainer.parameter_counts() for trainer in trainers]
            trained = [c["trained"] for c in counts]
        except Exception:  # a model the cut cannot build or train here: the caller measures the model alone
            return None
        finally:
            for trainer in trainers:
                trainer.close()
    one, many = seen[0], seen[1]
    # the steps' spread: their upper quartile over their lower (a busy machine's steps vary, and all of them
    # slowly: the median is read, and the spread says how far to trust it)
    spread = max(_quartiles(s) for s in seen)
    # deep - 1 layers: the median over the rounds of the deeper cut's step less the one layer's
    layer = max(0.0, statistics.median(b[0] - a[0] for a, b in zip(one, many, strict=True))) / (deep - 1)
    rest = max(0.0, statistics.median(c for c, _ in one) - layer)
    units = statistics.median(b[1] - a[1] for a, b in zip(one, many, strict=True))  # deep - 1 layers' units
    updates = (trained[1] - trained[0]) / units if units > 0 else 0.0
    shared = 1.0
    if overlapped:
        # the units of all layers but the last one backward reaches run beside the compute, the others after
        # it: a share ``f`` of the work. Of the overlapped step's busy time B, the last (1 - f) W ran alone (W:
        # the serial step's busy time), so D = B - (1 - f) W ran beside the compute, doing f W of the
        # optimizer's work: its share kept is f W / D. (What the compute loses meanwhile, D less that share
        # of D, is within the steps' noise wherever the compute is the longer part: not measured here.)
        f = min(1.0, counts[1].get("layer", 0) * (deep - 1) / deep / trained[1]) if trained[1] else 0.0
        busy_s = statistics.median(b for _, b in many)
        beside = statistics.median(b for _, b in seen[2]) - (1.0 - f) * busy_s
        if f > 0 and beside > 0:
            shared = min(1.0, f * busy_s / beside)
    during = 0.0
    if fewer and units > 0:  # the same units on each side, a round's two steps: their busy times' ratio
        during = updates * statistics.median(a[1] / b[1] for a, b in zip(many, seen[-1], strict=True))
    return Engine(layer, rest, updates, spread, shared, during)


def sample_micro_batch(rows: int, seq_len: int, vocab: int, packed: bool) -> dict[str, torch.Tensor]:
    """A micro-batch of ``rows`` x ``seq_len`` random tokens as the data pipeline hands it to the engine: ids
    and labels, and for packed rows (``data.packing``) the position ids of two documents a row (the
    attention's cost grows with the documents a row holds: a 4-layer step of 128-token rows of 10-11 demo
    documents each took 14% longer here than one of two documents or unpacked rows, which took the same)."""
    ids = torch.randint(0, vocab, (rows, seq_len))
    batch = {"input_ids": ids, "labels": ids.clone()}
    if packed and seq_len > 1:
        half = seq_len // 2
        positions = torch.cat([torch.arange(half), torch.arange(seq_len - half)])
        batch["position_ids"] = positions.expand(rows, seq_len).clone()
    return batch


def _quartiles(seen: list[tuple[float, float]]) -> float:
    """The upper quartile of the steps' compute over the lower, less one."""
    q = statistics.quantiles([c for c, _ in seen], n=4)
    return q[2] / q[0] - 1 if q[0] > 0 else 0.0


@contextmanager
def quiet_saving() -> Iterator[None]:
    """transformers' progress bars off for the block (a one-shard "Writing model shards" bar says nothing)."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def measure_read(nbytes: int = 256 << 20) -> float:
    """Bytes per second of an L2 norm over fp32 host memory (what a gradient's norm costs the compute thread
    when it takes it on the host), with the calling thread's torch threads."""
    src = torch.empty(nbytes // 4).normal_()
    torch.linalg.vector_norm(src)
    best = float("inf")
    for _ in range(3):
        began = time.perf_counter()
        torch.linalg.vector_norm(src)
        best = min(best, time.perf_counter() - began)
    return nbytes / best


def measure_copy(nbytes: int = 256 << 20) -> float:
    """Bytes per second of a copy between two buffers in CPU memory (what the host-to-device transfers cost
    when the device is the CPU: its cores do them, between compute)."""
    src = torch.empty(nbytes, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(3):
        began = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - began)
    return nbytes / best


def _time_step(loss, ids: torch.Tensor, device: torch.device) -> float:
    """Seconds of a micro-batch's compute as the engine runs it: a forward without autograd, then a forward
    with autograd and its backward into new gradients (the engine's backward makes each layer's anew: summed
    into the last ones, a gradient's memory would be reused, which a CPU's allocator does not do for large
    tensors between layers)."""
    loss.model.zero_grad(set_to_none=True)
    began = time.perf_counter()
    with torch.no_grad():
        loss(ids, {}, ids[:, 1:])
    loss(ids, {}, ids[:, 1:]).backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - began


def resolve_gpu(choice: str) -> GPU | None:
    """``--gpu``: ``auto`` (the GPU this machine has, its rates measured; None without one), ``cpu`` (None:
    the step computes on this CPU) or a name of ``GPUS`` (its stated figures)."""
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return None
    if choice == "auto":
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return GPU(props.name, 0.0, props.total_memory, 0.0)  # rates measured, not stated
    try:
        return GPUS[choice.lower()]
    except KeyError:
        raise ConfigError(
            f"--gpu {choice!r} is not one estimate knows; choose auto, cpu or one of: {', '.join(GPUS)}"
        ) from None


@dataclass
class StepTime:
    """The step-time estimate: seconds of each part, which bounds the step, and what follows from it."""

    flops: StepFlops
    compute_rate: float  # FLOP/s
    compute_rate_source: str  # "stated peak of ..." or "measured ..."
    parts: dict[str, float]  # seconds: compute, disk, host->device, device->host, optimizer
    overlapped: bool  # GPU: the parts overlap; CPU: compute + optimizer share the cores
    steps: int | None  # the recipe's steps (None: unknown without the data)
    steps_source: str
    timeline: Timeline | None = None  # the step played on the engine's schedule (``estimates.timeline``)
    # ... a step after a clipped one (its optimizer after backward, as every step of a run whose steps clip)
    after_clipped: Timeline | None = None
    # an evaluation's passes after a step and the step after them, played at the same rates (``estimates.evaluation``):
    # one each (several adapters': each evaluating adapter's, in the replay's order)
    evaluation: list[tuple[list[Timeline], Timeline]] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        if self.timeline is not None:
            return self.timeline.step
        p = self.parts
        if self.overlapped:
            return max(p.values(), default=0.0)
        return max(self._cores(), p.get("disk", 0.0))

    def _cores(self) -> float:
        """On a CPU: what its cores do one after another (compute, the optimizer, copies to the device tier)."""
        return sum(v for k, v in self.parts.items() if k != "disk")

    @property
    def bound(self) -> str:
        if self.timeline is not None:
            return self.timeline.bound
        p = self.parts
        if not self.overlapped and self._cores() >= p.get("disk", 0.0):
            return " + ".join(k for k, v in p.items() if k != "disk" and v) + " (the CPU's cores)"
        return max(p, key=p.__getitem__) if p else "nothing"

    @property
    def tokens_per_second(self) -> float:
        return self.flops.tokens / self.seconds if self.seconds else float("inf")

    @property
    def total_seconds(self) -> float | None:
        return None if self.steps is None else self.steps * self.seconds


def measure_bandwidth(
    store_cfg: StoreConfig, probe_bytes: int = 256 << 20, notes: list[str] | None = None
) -> dict[str, float]:
    """Bytes per second of the disk (read, write: ``probe_disk``), host-to-device copies (GPU) and the CPU
    optimizer (parameters per second of torch's fused AdamW). Creates nothing: a ``disk_path`` that does not
    exist yet is probed in its nearest existing parent directory (the filesystem it would be created on); what
    a reader should know about the probe is appended to ``notes``."""
    out: dict[str, float] = {}
    notes = [] if notes is None else notes
    if store_cfg.disk_path:
        where = nearest_existing(store_cfg.disk_path)
        if Path(where) != Path(store_cfg.disk_path):
            notes.append(
                f"offload.disk_path {store_cfg.disk_path} does not exist yet (a run creates it); the disk was "
                f"probed in {where}, the nearest existing directory above it"
            )
        try:
            out["disk_read"], out["disk_write"] = probe_disk(where, probe_bytes)
        except OSError as exc:
            notes.append(f"the disk was not probed ({exc}): no disk term in the lower bound")
    if torch.device(store_cfg.device).type == "cuda":
        from tiertune.offload.tiers import HostMemory

        # the source is pinned as the host tier pins it (exactly, and unpinned when done: ``pin_memory()``
        # would leave the block pinned in torch's caching host allocator for the process's life), and the
        # copies are waited for on the store's own device (``synchronize()`` waits for the current one only)
        device = torch.device(store_cfg.device)
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        src = HostMemory(probe_bytes, device)
        try:
            dst = torch.empty(probe_bytes, dtype=torch.uint8, device=device)
            dst.copy_(src.tensor, non_blocking=True)  # warm-up
            torch.cuda.synchronize(device)
            began = time.perf_counter()
            dst.copy_(src.tensor, non_blocking=True)
            torch.cuda.synchronize(device)
            out["host_to_device"] = probe_bytes / (time.perf_counter() - began)
            del dst
            torch.cuda.empty_cache()  # not reserved by this process for the run's own device budget
        finally:
            torch.cuda.synchronize(device)  # nothing in flight reads it when it is unpinned
            src.close()
    out["optimizer_params"] = _adamw_rate()
    return out


def _adamw_rate(numel: int = 1 << 23) -> float:
    run = _adamw_call(numel)
    run()
    began = time.perf_counter()
    for _ in range(3):
        run()
    return 3 * numel / (time.perf_counter() - began)


def _adamw_call(numel: int) -> Callable[[], None]:
    """One fused AdamW over ``numel`` fp32 parameters (torch's, as the CPU optimizer runs it)."""
    tensors = [torch.zeros(numel) for _ in range(4)]
    step = [torch.tensor(1.0)]

    def run() -> None:
        torch._fused_adamw_(
            [tensors[0]],
            [tensors[1]],
            [tensors[2]],
            [tensors[3]],
            [],
            step,
            lr=1e-3,
            beta1=0.9,
            beta2=0.999,
            weight_decay=0.0,
            eps=1e-8,
            amsgrad=False,
            maximize=False,
        )

    return run


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's threads of the calling thread set to ``n`` for the block."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, n))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def measure_adamw(
    worker: int, tail: int, seconds: float = 0.2, numel: int = 1 << 22, rounds: int = 3
) -> tuple[float, float]:
    """Parameters a second of torch's fused AdamW over ``numel`` fp32 parameters (as the CPU optimizer runs it:
    a unit's size, since a small one runs from the caches) on a thread of its own with ``worker`` threads
    (during backward) and with ``tail`` threads (after it, on every core). The two take turns, ``rounds`` times,
    and each is the median of its rounds (one timing of each differed by 20% and more on a busy 2-core machine,
    which the estimate's ratio of the two carried into the optimizer's time); with as many threads after
    backward as during it, they are one rate."""
    adamw = _adamw_call(numel)
    rates: dict[int, list[float]] = {worker: [], tail: []}

    def optimizer(n: int) -> None:
        with torch_threads(n):
            rates[n].append(numel / _each(adamw, _timed(seconds)))

    for _ in range(rounds):
        for n in dict.fromkeys((worker, tail)):
            side = threading.Thread(target=optimizer, args=(n,))
            side.start()
            side.join()
    return statistics.median(rates[worker]), statistics.median(rates[tail])


def _each(fn: Callable[[], object], stop: Callable[[], bool]) -> float:
    """Seconds per call of ``fn``, called until ``stop()`` (at least three times, after one more)."""
    fn()
    calls, began = 0, time.perf_counter()
    while calls < 3 or not stop():
        fn()
        calls += 1
    return (time.perf_counter() - began) / calls


def _timed(limit: float) -> Callable[[], bool]:
    """A ``stop`` that says when ``limit`` seconds from now have passed."""
    until = time.perf_counter() + limit
    return lambda: time.perf_counter() >= until


def probe_disk(path: str | os.PathLike[str], nbytes: int = 256 << 20) -> tuple[float, float]:
    """(read, write) bytes per second of the disk tier's own I/O path (O_DIRECT where supported, 64 MiB
    chunks, checksums) on ``path``: a quick probe, not a benchmark (``benchmarks/bench_aio.py`` is one). The
    probe writes into a temporary directory in ``path`` (or, if ``path`` does not exist, in its nearest
    existing parent) and removes it; nothing is created or left behind."""
    from tiertune.offload.aio import AsyncIO
    from tiertune.offload.chunk import Chunk, ChunkLayout, TensorSpec
    from tiertune.offload.disk import DiskTier
    from tiertune.offload.tiers import MemoryTier

    path = nearest_existing(path)
    chunk_size = 64 << 20
    n = max(1, nbytes // chunk_size)
    with tempfile.TemporaryDirectory(dir=path, prefix=".probe-") as tmp:
        aio = AsyncIO(16, 1 << 20)
        try:
            disk = DiskTier(Path(tmp), n * (chunk_size + (2 << 20)) + (1 << 20), aio)
        except BaseException:
            aio.close()
            raise
        try:  # the slot file is closed and removed whatever fails below (the directory goes with it)
            host = MemoryTier(Tier.HOST, chunk_size, torch.device("cpu")).alloc(chunk_size)
            host.tensor.view(torch.int32).random_()
            layout = ChunkLayout((TensorSpec("x", (chunk_size,), torch.uint8, 0),), chunk_size)
            chunks = [Chunk(i, f"probe{i}", layout, Tier.DISK) for i in range(n)]
            slots = [disk.reserve(c, 1 << 20) for c in chunks]
            began = time.perf_counter()
            handles = [(c, *disk.write(c, s, host.tensor)) for c, s in zip(chunks, slots, strict=True)]
            for c, handle, sums in handles:
                handle.wait()
                c.disk_checksums = tuple(sums)
            write = n * chunk_size / (time.perf_counter() - began)
            began = time.perf_counter()
            for handle in [
                disk.read(c, s, host.tensor, c.disk_checksums) for c, s in zip(chunks, slots, strict=True)
            ]:
                handle.wait()
            read = n * chunk_size / (time.perf_counter() - began)
        finally:  # the I/O threads finish first: the slot file is not closed under a write in flight
            aio.close()
            disk.close()
    return read, write


class Probes:
    """Measurements taken once and reused: estimates given the same ``Probes`` (the several adapters'
    ``estimates.adapters``: their run's beside the first adapter's alone) price their steps at the same
    rates, so that they differ by their work, not by what else the machine did while each was measured."""

    def __init__(self) -> None:
        self.taken: dict[tuple, Any] = {}

    def take(self, key: tuple, measure: Callable[[], Any]) -> Any:
        """``measure()``'s result the first time ``key`` is asked for, that same result after."""
        if key not in self.taken:
            self.taken[key] = measure()
        return self.taken[key]
