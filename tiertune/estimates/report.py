"""``tiertune estimate``: will a recipe fit, where will each kind of state live, and how fast can a step go.

Nothing is loaded: every chunk the run would register is what the engine registers, built on a ledger
(``engine.registered``: the run's own loader, layout, stash and sharding over no bytes), so the byte counts
are the run's, to the alignment. A checkpoint saved in a quantization tiertune does not read (fp8...) is estimated as its
unquantized release, with a note saying that training from it stops with an error. For each tier:

- *home*: bytes of the chunks homed there (reserved for the whole run);
- *passes through*: home plus the chunks homed lower that a step uses there (cached copies);
- *peak*: what the run's store holds there at most, replayed (``engine.replay``): the chunks registered in
  the trainer's order through the store's own placement, eviction and prefetch on a ledger (no bytes), and a
  step's calls in the engine's order, every micro-batch, each way the optimizer's update runs (speculated and
  confirmed, redone after a clipped step, after backward). Equal to a run's measured peak to the byte, and so
  are the bytes a step moves on each link (``moved_per_step``, the replay's last step; ``moved_after_clipped``
  a run's whose steps clip, their update after backward) where one thread's
  order decides them; where the host budget binds while the CPU optimizer works beside backward, its thread's
  timing moves a run's own figures from step to step (see ``tests/finetune/test_estimate.py``);
- *fits*: the run's memory plan (``engine.memory``): the homes and the slots reserved for the chunks in use at
  once fit each memory tier's budget, as ``train`` checks before loading.

How fast a step goes is ``speed``'s model: the step's FLOPs at a GPU's stated peak or measured on this
machine, the replayed step's disk and PCIe traffic at measured rates, and the CPU optimizer at
torch's fused AdamW rate measured here.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from tiertune.distributed.world import World, usable_cores
from tiertune.engine import replay as replaying
from tiertune.engine.activations import outside_bytes
from tiertune.engine.memory import IN_PLACE, QUANT_CACHE, Plan, slot_bytes_of
from tiertune.engine.prepare import meta_skeleton
from tiertune.engine.registered import Laid
from tiertune.engine.replay import Replayed
from tiertune.engine.sharding import GATHERED
from tiertune.errors import BudgetError, ConfigError, StateError, TiertuneError
from tiertune.estimates.evaluation import EvalEstimate, eval_estimate, format_evaluation
from tiertune.estimates.generation import (
    GenerationEstimate,
    format_generation,
    generation_estimate,
    time_generation,
)
from tiertune.estimates.speed import (
    GPU,
    NOISY,
    Engine,
    Probes,
    StepFlops,
    StepTime,
    measure_adamw,
    measure_bandwidth,
    measure_compute,
    measure_copy,
    measure_engine,
    measure_matmul,
    measure_read,
    resolve_gpu,
    step_flops,
    torch_threads,
)
from tiertune.estimates.teacher import (
    TeacherEstimate,
    format_teacher,
    teacher_estimate,
    time_beside_evaluation,
    time_teacher,
)
from tiertune.estimates.timeline import Rates, Timeline, simulate_steps
from tiertune.loading.hub import config_directory
from tiertune.loading.model import split_model
from tiertune.offload.tiers import Tier
from tiertune.units import format_seconds, format_size

T = TypeVar("T")

if TYPE_CHECKING:
    from tiertune.config.plan import RunPlan
    from tiertune.config.recipe import Recipe
    from tiertune.engine.trace import Trace

ORDER = (Tier.DEVICE, Tier.HOST, Tier.DISK)
LINKS = ("disk->host", "host->disk", "host->device", "device->host")  # what a step moves, link by link


@dataclass
class TierEstimate:
    budget: int
    home: int
    passes: int
    peak: int
    largest_staged: int  # the largest chunk homed lower that a step uses here
    in_use: int = 0  # a memory tier: the slots the plan reserves for the chunks in use there at once

    @property
    def needed(self) -> int:
        """What the budget must hold (a memory tier): its homes and the plan's reserved slots."""
        return self.home + self.in_use

    @property
    def fits(self) -> bool:
        return self.needed <= self.budget


@dataclass
class ScaleOut:
    """The run launched as ``processes`` ranks, ``per_node`` of them on each node (ZeRO-3 over chunks): what
    one rank keeps on each tier (its shard of every chunk, 1/N of it padded to whole 4 KiB pages; layer inputs
    whole), the whole chunks it gathers on its device while computing, what a node's ranks keep together,
    and the bytes rank 0 sends in a step, by collective, as the engine's step on a ledger sends them
    (``engine.replay``, its collectives counting what ring algorithms send): ``all_gather`` (the weights
    gathered per wave, a layer's in forward and again in backward), ``reduce_scatter`` (the trained weights'
    fp32 gradients), ``all_reduce`` (the step's loss and token count, the gradient norm, replicated LoRA
    adapters' gradients)."""

    processes: int
    per_node: int
    per_rank: dict[str, int]  # tier -> bytes one rank homes there
    gathered: int  # device bytes of whole chunks gathered at once: a layer's and the embeddings' and head's
    wire: dict[str, int]  # collective -> bytes one rank sends per step
    budgets: dict[str, int] = field(default_factory=dict)  # a rank's device and host budgets
    plan: Plan | None = None  # a rank's memory plan: what train checks on each rank before loading

    @property
    def fits(self) -> bool:
        """Whether a rank's device and host budgets hold its plan (its shards, the whole chunks it gathers on
        its device, the slots for what it uses at once)."""
        if self.plan is None:
            return False
        return not self.plan.short({Tier(t): n for t, n in self.budgets.items()})

    @property
    def per_node_bytes(self) -> dict[str, int]:
        """Host and disk bytes of a node's ranks together (each rank has a device of its own)."""
        return {tier: n * self.per_node for tier, n in self.per_rank.items() if tier != "device"}

    def as_json(self) -> dict:
        return {
            "processes": self.processes,
            "per_node": self.per_node,
            "per_rank_bytes": self.per_rank,
            "per_node_bytes": self.per_node_bytes,
            "gathered_on_device": self.gathered,
            "wire_bytes_per_step_per_rank": self.wire,
            "budgets_per_rank": self.budgets,
            "plan_per_rank": self.plan.as_json() if self.plan else None,
            "fits": self.fits,
        }


def _scale_out(laid: Laid, processes: int, per_node: int) -> ScaleOut:
    """``ScaleOut`` from what one rank registers and holds (``lay_out`` of a store of ``processes`` shards): what
    it homes per tier and the most whole chunks it held gathered on its device at once (its step's moments).
    The bytes on the wire are the replay's (``engine.replay``, counting collectives)."""
    per_rank = {tier.value: sum(c.capacity for c in laid.chunks if c.home is tier) for tier in ORDER}
    held = (m for ms in laid.moments.values() for m in ms)
    gathered = max((sum(n for t, name, n in m if name.endswith(GATHERED)) for m in held), default=0)
    return ScaleOut(processes, per_node, per_rank, gathered, {})


@dataclass
class Waves:
    """How a step runs its micro-batches (``engine.schedule``): ``micro_batches`` in waves of ``wave``, each wave
    streaming the weights once; the hidden states at the layer boundaries of a wave (``stash`` bytes) wait on
    ``stash_tier``."""

    micro_batches: int
    wave: int
    stash: int
    stash_tier: str

    @property
    def count(self) -> int:
        """Waves per step."""
        return -(-self.micro_batches // self.wave)

    def as_json(self) -> dict:
        return {
            "micro_batches": self.micro_batches,
            "wave": self.wave,
            "waves": self.count,
            "stash_bytes": self.stash,
            "stash_tier": self.stash_tier,
        }


@dataclass
class Estimate:
    """What ``estimate`` predicts for a recipe (bytes are integers)."""

    parameters: int
    trained_parameters: int
    kinds: dict[str, tuple[str, int]]  # kind -> (home tier, bytes)
    tiers: dict[str, TierEstimate]
    outside_store: dict[str, int]  # device bytes the store does not manage (adapters, saved activations)
    moved_per_step: dict[str, int] = field(default_factory=dict)
    # ... a step after a clipped one (a run whose steps clip: its update after backward, in place)
    moved_after_clipped: dict[str, int] = field(default_factory=dict)
    bandwidth: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # said under the table (e.g. where the disk was probed)
    machine: dict[str, int] = field(default_factory=dict)  # what it has: ram, gpu_memory (bytes)
    target: str = "cpu"  # what computes: "cpu", or the GPU's name
    speed: StepTime | None = None  # the step-time estimate (None: not measured)
    scale_out: ScaleOut | None = None  # launched as several processes (``estimate(processes=N)``)
    plan: Plan | None = None  # the run's memory plan (``engine.memory``): what train checks before loading
    waves: Waves | None = None  # the micro-batches a wave runs, and where its boundary hidden states wait
    teacher: TeacherEstimate | None = None  # a distillation's teacher pass (``estimates.teacher``)
    generation: GenerationEstimate | None = None  # GRPO's sampling (``estimates.generation``)
    evaluation: EvalEstimate | None = None  # the held-out set's passes (``estimates.evaluation``)
    # several adapters' (``others``): each evaluating one's, alone over the base, by its place among the recipes
    adapter_evaluations: dict[int, EvalEstimate] = field(default_factory=dict)
    beside: int = (
        1  # the stores the budgets are split into (``config.plan.BESIDE_SHARE``: a frozen model beside)
    )

    def short_of_machine(self) -> dict[str, str]:
        """Budgets this machine cannot give, by tier, with why (a budget above its RAM or GPU memory)."""
        out: dict[str, str] = {}
        ram, gpu = self.machine.get("ram"), self.machine.get("gpu_memory")
        device, host = self.tiers["device"].budget, self.tiers["host"].budget
        if gpu is not None and device > gpu:
            out["device"] = f"the GPU has {format_size(gpu)}"
        if ram is not None:
            on_ram = host + (device if gpu is None else 0)  # computing on the CPU: the device tier is RAM too
            if on_ram > ram:
                what = "host" if gpu is not None else "host + device"
                out["host"] = (
                    f"{what} budgets {format_size(on_ram)} > this machine's {format_size(ram)} of RAM"
                )
        return out

    @property
    def disk_needed(self) -> int:
        """Free bytes ``offload.disk_path`` needs: the disk tier's slots and the quantized cache's images (the
        only disk copy of a base quantized on load and homed on disk); weights read in place from the model's
        own files need none."""
        return self.tiers["disk"].home + self.kinds.get(QUANT_CACHE, ("disk", 0))[1]

    def needed(self, tier: str) -> int:
        """What ``tier``'s budget must hold: on a memory tier, its homes and the slots the run's plan reserves
        for the chunks in use there at once (what ``train`` checks before it loads the model); on the disk,
        ``disk_needed``."""
        return self.disk_needed if tier == "disk" else self.tiers[tier].needed

    def computes_on(self) -> tuple[str, int, int] | None:
        """What computes, the bytes it has and the bytes the run holds there: on a GPU, its memory against the
        device tier's needs plus the bytes outside the store; on the CPU, this machine's RAM against the host and
        device tiers' needs plus those bytes. None when the machine's size is not known."""
        outside = sum(self.outside_store.values())
        if "gpu_memory" in self.machine:
            return "the GPU", self.machine["gpu_memory"], self.needed("device") + outside
        if "ram" in self.machine:
            return (
                "this machine's RAM",
                self.machine["ram"],
                self.needed("host") + self.needed("device") + outside,
            )
        return None

    @property
    def fits(self) -> bool:
        """Whether every budget holds (and, launched as several processes, each rank's), and what computes
        holds the run (``computes_on``)."""
        ranks = self.scale_out is None or self.scale_out.fits
        on = self.computes_on()
        room = on is None or on[2] <= on[1]
        return (
            all(self.needed(n) <= t.budget for n, t in self.tiers.items())
            and not self.short_of_machine()
            and ranks
            and room
            and (self.generation is None or self.generation.fits)
        )

    def as_json(self) -> dict:
        """The estimate as JSON: the same figures as ``format_estimate``."""
        out = {
            "parameters": self.parameters,
            "trained_parameters": self.trained_parameters,
            "target": self.target,
            "state": {k: {"tier": t, "bytes": n} for k, (t, n) in self.kinds.items()},
            "outside_store": self.outside_store,
            "tiers": {
                n: {
                    "budget": t.budget,
                    "home": t.home,
                    "passes": t.passes,
                    "peak": t.peak,
                    "fits": self.needed(n) <= t.budget,
                }
                for n, t in self.tiers.items()
            },
            "machine": self.machine,
            "short_of_machine": self.short_of_machine(),
            "computes_on": dict(zip(("what", "bytes", "held"), on, strict=True))
            if (on := self.computes_on())
            else None,
            "disk_needed": self.disk_needed,
            "moved_per_step": self.moved_per_step,
            "moved_after_clipped_step": self.moved_after_clipped,
            "bandwidth": self.bandwidth,
            "fits": self.fits,
            "notes": self.notes,
        }
        if self.plan is not None:
            out["plan"] = self.plan.as_json()
        if self.waves is not None:
            out["waves"] = self.waves.as_json()
        if self.scale_out is not None:
            out["scale_out"] = self.scale_out.as_json()
        if self.teacher is not None:
            out["teacher_pass"] = self.teacher.as_json()
        if self.generation is not None:
            out["generation"] = self.generation.as_json()
        if self.evaluation is not None:
            out["evaluation"] = self.evaluation.as_json()
        if self.adapter_evaluations:
            out["adapter_evaluations"] = {str(i): e.as_json() for i, e in self.adapter_evaluations.items()}
        if self.speed is not None:
            sp = self.speed
            out["step_time"] = {
                "seconds": sp.seconds,
                "bound": sp.bound,
                "parts_s": sp.parts,
                "overlapped": sp.overlapped,
                "flops": sp.flops.total,
                "flops_formula": sp.flops.formula,
                "tokens_per_step": sp.flops.tokens,
                "compute_flops_per_s": sp.compute_rate,
                "compute_rate_source": sp.compute_rate_source,
                "tokens_per_second": sp.tokens_per_second,
                "steps": sp.steps,
                "steps_source": sp.steps_source,
                "total_seconds": sp.total_seconds,
                "timeline": sp.timeline.as_json() if sp.timeline is not None else None,
                "after_clipped": sp.after_clipped.as_json() if sp.after_clipped is not None else None,
            }
        return out


def reads_data_once(function: Callable[..., T]) -> Callable[..., T]:
    """``function`` run within ``finetune.train.data_read_once``: its readers of the data share one read."""

    @functools.wraps(function)
    def wrapped(*args: Any, **kwargs: Any) -> T:
        from tiertune.finetune.train import data_read_once

        with data_read_once():
            return function(*args, **kwargs)

    return wrapped


@reads_data_once
def estimate(
    recipe: Recipe,
    measure: bool = True,
    gpu: str = "auto",
    processes: int = 1,
    per_node: int | None = None,
    threads: int | None = None,
    layer_seconds: tuple[float, float] | None = None,
    others: Sequence[Recipe] = (),
    probes: Probes | None = None,
) -> Estimate:
    """Predict bytes per tier, whether each budget holds (against the budget and against this machine) and
    how long a step takes (``measure``: probe the disk, the CPU optimizer and the compute rate). ``gpu``: what
    computes (``speed.resolve_gpu``: ``auto``, ``cpu`` or a name of ``speed.GPUS``). ``model.path`` may be a
    directory with only the model's config.json, or a Hugging Face model id (its config.json alone is
    fetched): nothing needs to be downloaded first. ``processes``: the run launched as that many ranks,
    ``per_node`` (default: all) on each node: ``Estimate.scale_out`` says what each rank and node holds and
    sends (the tiers' table stays one process's). ``threads``: torch's threads the run computes with (default:
    as ``train`` sets them, the cores shared by the node's processes). ``layer_seconds``: a decoder layer's
    (forward, recompute and backward) seconds a micro-batch as given (a GPU's, measured elsewhere), not
    measured: its work runs beside the CPU's, which the rest of the step is measured on. ``others``: recipes
    whose LoRA adapters train over ``recipe``'s base in the same run (``config.sweep``; they share it): the
    step is all of theirs (``StreamedTrainer.step_adapters`` on the ledger), its FLOPs theirs summed, its compute
    the first recipe's measured rate over all their tokens. ``probes``: measurements shared with other
    estimates (each taken once: ``speed.Probes``)."""
    probes = probes or Probes()
    if layer_seconds is not None and (len(layer_seconds) != 2 or min(layer_seconds) < 0):
        raise ConfigError(f"layer seconds are (forward, backward), each >= 0; got {layer_seconds}")
    if processes < 1 or (per_node is not None and not 1 <= per_node <= processes):
        raise ConfigError(
            f"--processes must be >= 1 and --per-node between 1 and it; got {processes} and {per_node}"
        )
    import psutil

    from tiertune.config.plan import BESIDE_SHARE, resolve

    directory = config_directory(recipe.model.path)
    if directory != recipe.model.path:
        recipe = copy.deepcopy(recipe)
        recipe.model.path = directory
    target = resolve_gpu(gpu)
    device_type, memory_of = ("cuda", target.memory) if target is not None else ("cpu", None)
    notes: list[str] = []
    run = resolve(recipe, World(), device_type, memory_of, notes)
    laid = run.laid
    disk_room = laid.disk_free  # what the plan decided the twins on (read once: it changes as others write)
    chunks, parameters, trained, wave = laid.chunks, laid.parameters, laid.trained, laid.wave
    runs = [run]
    if others:  # several adapters over the base: one engine, every adapter's micro-batches in its step
        from tiertune.config.sweep import shared_engine

        for other in others:
            other = copy.deepcopy(other)
            other.model.path = recipe.model.path
            runs.append(resolve(other, World(), device_type, memory_of, disk_free=disk_room))
        run = dataclasses.replace(run, engine=shared_engine(runs, [2] * len(runs)))
        trained = sum(r.laid.trained for r in runs)
        wave = sum(r.laid.wave for r in runs)
    store_cfg, cfg = run.store, run.engine
    model = meta_skeleton(recipe.model.path, cfg.dtype)
    each = [
        step_flops(
            model,
            list(split_model(model).layers),
            r.engine.activation_tokens,
            r.recipe.training.gradient_accumulation_steps,
            r.recipe.data.max_seq_len,
            trained=cfg.method != "lora",
            reference=r.recipe.objective.reference,
            paired=r.recipe.objective.paired,
        )
        for r in runs
    ]
    flops = each[0]
    if others:
        flops = dataclasses.replace(
            flops, tokens=sum(f.tokens for f in each), total=sum(f.total for f in each)
        )
    acts = sum(c.capacity for c in chunks if c.role == "act")
    outside = outside_bytes(model, cfg, wave, target is not None, notes, stash_chunks=bool(acts))
    memory = laid.plan
    kinds: dict[str, tuple[str, int]] = {}
    for c in chunks:
        tier, total = kinds.get(c.kind, (c.home.value, 0))
        kinds[c.kind] = (tier, total + c.capacity)
    budgets = {Tier.DEVICE: store_cfg.device_budget, Tier.HOST: store_cfg.host_budget, Tier.DISK: disk_room}
    device = torch.device("cuda" if target is not None else "cpu")  # what the run would compute on
    evaluating = [i for i, r in enumerate(runs) if r.recipe.evaluates] if others else []
    passes = EVAL_PASSES if recipe.evaluates or evaluating else 0
    replayed = _replay(run, notes, device, runs[1:], passes, evaluating)
    if cfg.method == "lora":
        outside["LoRA adapters + states"] = trained * 16
    tiers = {}
    for tier in ORDER:
        above = ORDER.index(tier)
        home = sum(c.capacity for c in chunks if c.home is tier)
        staged = [c for c in chunks if ORDER.index(c.home) > above and ORDER.index(c.used_on) <= above]
        passes = home + sum(c.capacity for c in staged)
        if tier is Tier.DISK:  # slots: a header with a checksum per block, then the chunk; nothing above it
            home = passes = slot_bytes_of(chunks, int(store_cfg.block_size))
        if replayed is not None:
            peak = replayed.peaks.get(tier.value, 0)
        else:  # no step to replay: the tier fills up to what passes through it
            peak = min(budgets[tier], passes) if tier is not Tier.DISK else home
        in_use = memory.needed(tier) - home if tier is not Tier.DISK else 0
        largest = max((c.capacity for c in staged), default=0)
        tiers[tier.value] = TierEstimate(budgets[tier], home, passes, peak, largest, in_use)
    if recipe.reference_beside:
        notes.append(
            "grpo's reference is the initial weights: a frozen copy streams beside the policy (model.path as it "
            "ships; offload files under disk_path/reference), each store within half the budgets, and scores "
            "each generation's completions once (priced with the generation)"
        )
    elif recipe.objective.reference and recipe.method.type != "lora":
        notes.append(
            f"{recipe.objective.type}'s reference is the initial weights: before the first step one pass over the data "
            "(no autograd, each layer read once per wave) computes its log-probabilities, cached in "
            "reference-logps/ under disk_path (else the output directory) for later runs of the same model and data"
        )
    if recipe.evaluates:
        t = recipe.training
        when = (
            f"every {recipe.eval_every} steps and after the last"
            if recipe.eval_every
            else "at each epoch's end"
        )
        sampled = (
            f"the held-out prompts (data.eval_path) sampled, {recipe.objective.generations_eval} completions "
            "each, a step's generation at a time, then rewarded and scored"
            if recipe.objective.rollouts
            else "the held-out set (data.eval_path)"
        )
        notes.append(
            f"evaluation {when}: {sampled} in passes of "
            f"{t.gradient_accumulation_steps} x {t.per_device_train_batch_size} rows, each pass reading the "
            "weights once more (less what the budgets keep cached), no autograd"
            + (
                " (each adapter's alone over the base, priced: adapter_evaluations)"
                if others
                else " (priced below: evaluation)"
            )
            + (
                f"; early stopping after {t.early_stopping_patience} evaluations without a better "
                f"{recipe.best_metric[0]}"
                if t.early_stopping_patience
                else ""
            )
        )
    if recipe.objective.rollouts:
        o = recipe.objective
        notes.append(
            f"grpo: the step above is the update on its {recipe.data.max_seq_len}-token rows; its completions' "
            + (
                "sampling is priced below (grpo generation)"
                if o.rollout_engine == "tiertune"
                else "sampling runs in the llama.cpp server the run starts (its base GGUF in "
                f"{o.rollout_gguf_type} under the output directory's served/, loaded there): not priced here"
                if o.rollout_engine == "llama_cpp"
                else f"sampling runs in the {o.rollout_engine} server at {o.rollout_url} (its own GPU and memory; "
                "the adapter pushed to it each generation): not priced here"
            )
        )
        for name in o.reward_funcs or []:
            if ":" not in name:  # a reward model (finetune.grpo.RewardModel)
                notes.append(
                    f"grpo: the reward model {name} is held whole on what computes, outside the budgets "
                    f"({_weights_size(name)} of weights as stored), and scores each generation's completions"
                )
    if IN_PLACE in kinds:
        notes.append(
            f"{format_size(kinds[IN_PLACE][1])} of frozen weights are read in place from the model's own files "
            "(no copy of them at disk_path)"
        )
    if QUANT_CACHE in kinds:
        notes.append(
            f"the base is quantized on load into {format_size(kinds[QUANT_CACHE][1])} of images in the quantized "
            "cache under disk_path, read in place from there (the disk tier holds no second copy; the next run "
            "of the same model and settings reuses them)"
        )
    if recipe.method.type == "lora":
        from tiertune.methods.lora import expert_adapter_note

        said = expert_adapter_note(model, recipe.method.lora, recipe.model.quantize in ("nf4", "fp4"))
        if said:
            notes.append(said)
    est = Estimate(parameters, trained, kinds, tiers, outside, notes=notes, plan=memory)
    est.beside = BESIDE_SHARE if recipe.beside else 1
    est.waves = Waves(
        sum(r.recipe.training.gradient_accumulation_steps for r in runs),
        wave,
        acts or outside.get("hidden states at the layer boundaries", 0),
        "host" if acts else "device",
    )
    est.target = "cpu" if target is None else target.name
    est.machine["ram"] = psutil.virtual_memory().total
    if target is not None:
        est.machine["gpu_memory"] = target.memory
    est.moved_per_step = {link: replayed.moved.get(link, 0) for link in LINKS} if replayed is not None else {}
    if replayed is not None and replayed.after_clipped:
        est.moved_after_clipped = {link: replayed.after_clipped.get(link, 0) for link in LINKS}
    if recipe.objective.rollouts and recipe.objective.rollout_engine == "tiertune":
        est.generation = _generation(est, run, model, flops, device, replayed is not None)
    evaluated: list[replaying.Evaluated] = []  # the replay's, in the order it ran them
    if recipe.evaluates and not others:
        est.evaluation = _evaluation(recipe, replayed.evaluation if replayed is not None else None)
        evaluated = [replayed.evaluation] if replayed is not None and replayed.evaluation is not None else []
    replays = list(replayed.evaluations.values()) if replayed is not None else [None] * len(evaluating)
    for i, of in zip(evaluating, replays, strict=True):
        est.adapter_evaluations[i] = _evaluation(runs[i].recipe, of)
        evaluated += [of] if of is not None else []
    # the chunks each rank registers (its shards), under a rank's budgets, as train plans it
    if processes > 1:
        local = per_node or processes
        rank_world = World(rank=0, size=processes, local_rank=0, local_size=local)
        rank_run = resolve(recipe, rank_world, device_type, memory_of, disk_free=disk_room)
        sharded = rank_run.store
        est.scale_out = _scale_out(rank_run.laid, processes, local)
        est.scale_out.plan = rank_run.memory
        rank = _replay(rank_run, [], device)  # its collectives counting what it sends
        est.scale_out.wire = rank.wire if rank is not None else {}
        est.scale_out.budgets = {"device": sharded.device_budget, "host": sharded.host_budget}
    if recipe.objective.distills:
        est.teacher = _teacher(recipe, store_cfg.device_budget, notes)
        if replayed is not None:  # its passes (a step's, or a wave's) on its own ledger store
            from tiertune.finetune.teacher import teacher_recipe

            frozen = teacher_recipe(recipe)
            frozen.model.path = config_directory(frozen.model.path)
            wave = (
                None
                if recipe.objective.beside
                else -(-est.teacher.wave_rows // recipe.training.per_device_train_batch_size)
            )
            # its store's accesses are the pass's whatever its head makes (the head's copy is priced apart)
            decoded = _frozen_passes(
                est, run, frozen, lambda engine, mb, last: None, device, TEACHER_PASSES, wave
            )
            est.teacher.pass_bytes = tuple(
                sum(n for k, n in m.items() if k.startswith("disk->")) for m in decoded.moved
            )
            est.teacher.pass_copied = tuple(m.get("host->device", 0) for m in decoded.moved)
            if est.evaluation is not None and recipe.objective.beside:
                # each evaluation pass's batches scored by it first
                est.evaluation.teacher_pass_bytes = est.teacher.later_pass
    if measure:

        def probe() -> tuple[dict[str, float], list[str]]:
            said: list[str] = []  # the probe's notes, said by every estimate that shares its figures
            return measure_bandwidth(store_cfg, notes=said), said

        bandwidth, said = probes.take(("bandwidth", str(store_cfg.disk_path)), probe)
        est.bandwidth = dict(bandwidth)
        est.notes.extend(said)
        if target is not None and target.host_to_device and "host_to_device" not in est.bandwidth:
            est.bandwidth["host_to_device"] = target.host_to_device  # stated: not this machine's GPU
        trace = replayed.trace if replayed is not None else None
        scale = flops.tokens / each[0].tokens  # all the adapters' tokens over the first's (1: one adapter)
        est.speed = _step_time(
            est,
            recipe,
            runs[0].engine,
            flops,
            target,
            trace,
            threads,
            layer_seconds,
            scale,
            probes,
            evaluated,
        )
        each = [est.evaluation] if est.evaluation is not None else list(est.adapter_evaluations.values())
        if est.speed.timeline is not None:
            for priced, (passes, after) in zip(each, est.speed.evaluation, strict=False):
                priced.pass_seconds = (passes[0].step, passes[-1].step)
                priced.step_after_extra = max(0.0, after.step - est.speed.timeline.step)
        if est.teacher is not None:
            rate = est.speed.compute_rate if est.speed else None
            time_teacher(
                est.teacher, est.bandwidth.get("disk_read"), rate, est.bandwidth.get("host_to_device")
            )
            ev = est.evaluation
            if ev is not None and ev.teacher_pass_bytes is not None and ev.passes is not None:
                ev.teacher_seconds = time_beside_evaluation(
                    est.teacher, ev.passes, est.bandwidth.get("disk_read"), rate
                )
        if est.generation is not None:
            time_generation(
                est.generation,
                est.bandwidth,
                est.speed.compute_rate if est.speed else None,
                target is not None,
            )
    if est.generation is not None and est.evaluation is not None and est.evaluation.generations:
        est.evaluation.generation_bytes = dict(est.generation.read_bytes)  # GRPO's: each a step's generation
        est.evaluation.generation_seconds = est.generation.seconds
    return est


def _generation(
    est: Estimate, run: RunPlan, model: torch.nn.Module, flops: StepFlops, device: torch.device, replay: bool
) -> GenerationEstimate:
    """GRPO's sampling (``estimates.generation``): its passes replayed on a ledger store of the run's budgets
    (none when the step itself could not be), beside what the run holds while it samples."""
    moved: list[dict[str, int]] = []
    if replay:
        ledger = dataclasses.replace(run.store, disk_budget=None)
        moved = replaying.replay_decoding(
            run.recipe.model.path, ledger, run.engine, 3, device, run.world
        ).moved
    reference, reference_peak = None, 0
    if run.recipe.reference_beside:  # the initial weights beside the policy: a pass of its own store
        from tiertune.engine.grpo import token_logps_head
        from tiertune.finetune.reference import reference_recipe

        reference = {}
        if replay:
            head = token_logps_head(run.recipe.objective.temperature)
            decoded = _frozen_passes(est, run, reference_recipe(run.recipe), head, device)
            # the second pass: a generation's after the first (what the reference's budgets keep stays)
            reference, reference_peak = decoded.moved[-1], decoded.peaks.get("device", 0)
    on = est.computes_on()
    adapters = est.outside_store.get("LoRA adapters + states", 0)
    held = (on[2] - sum(est.outside_store.values()) + adapters) if on is not None else 0
    config = model.config.get_text_config(decoder=True)
    return generation_estimate(
        run.recipe,
        config,
        flops,
        moved,
        held,
        on[1] if on else None,
        on[0] if on else "what computes",
        reference,
        reference_peak,
    )


def _frozen_passes(
    est: Estimate,
    run: RunPlan,
    frozen: Recipe,
    head: Any,
    device: torch.device,
    passes: int = 2,
    micro_batches: int | None = None,
) -> replaying.Decoded:
    """``passes`` passes of a frozen model (``frozen``: its recipe, planned as the run plans it: beside the run's
    model, within its share of the budgets, or, a distillation's teacher pass before the run, within all of
    them) over ``micro_batches`` micro-batches of the run's shape (a step's), replayed on its own ledger store:
    the bytes each moved (the first from cold, the next with what its budgets keep) and its tiers' peaks."""
    from tiertune.config.plan import resolve
    from tiertune.finetune.reference import frozen_engine

    memory = est.machine.get("gpu_memory")
    beside = resolve(frozen, run.world, device.type, memory, disk_free=run.laid.disk_free)
    ledger = dataclasses.replace(beside.store, disk_budget=None)
    t = run.recipe.training
    rows, tokens = t.per_device_train_batch_size, run.recipe.data.max_seq_len
    batches = [
        {"input_ids": torch.zeros(rows, tokens, dtype=torch.long)}
        for _ in range(micro_batches or t.gradient_accumulation_steps)
    ]
    engine = frozen_engine(beside.engine)
    return replaying.replay_frozen_passes(
        frozen.model.path, ledger, engine, batches, passes, head, device, run.world
    )


def _teacher(recipe: Recipe, device_budget: int, notes: list[str]) -> TeacherEstimate:
    """A distillation's teacher pass over the recipe's data and its held-out set (their rows and scored tokens as
    the run tokenizes them), or, where the data or a tokenizer cannot be read here, over ``TEACHER_ROWS`` rows
    of ``data.max_seq_len`` tokens, every one scored, and no held-out set (said in ``notes``)."""
    from tiertune.finetune.train import scored_rows

    recipe = copy.deepcopy(recipe)
    recipe.objective.teacher.path = config_directory(recipe.objective.teacher.path)
    try:
        (rows, scored), held_out = scored_rows(recipe)
    except (TiertuneError, OSError) as exc:
        rows, scored, held_out = TEACHER_ROWS, TEACHER_ROWS * (recipe.data.max_seq_len - 1), (0, 0)
        notes.append(
            f"the teacher pass is priced for {rows:,} rows of data.max_seq_len tokens, every one scored"
            f"{', and no held-out set' if recipe.evaluates else ''}: the data cannot be read here "
            f"({str(exc).splitlines()[0][:120]})"
        )
    return teacher_estimate(recipe, device_budget, rows, scored, held_out)


def _weights_size(name: str) -> str:
    """A local model directory's weight files' size, in words ("unknown size" for a hub id or where none)."""
    from pathlib import Path

    directory = Path(name).expanduser()
    files = [*directory.glob("*.safetensors"), *directory.glob("*.bin")] if directory.is_dir() else []
    return format_size(sum(f.stat().st_size for f in files)) if files else "unknown size"


def _evaluation(recipe: Recipe, evaluated: replaying.Evaluated | None) -> EvalEstimate:
    """The run's evaluations (``estimates.evaluation``): their count and passes from the run's data as it reads
    them (the held-out set's rows, the steps, an epoch's micro-batches), their bytes from the replay."""
    from tiertune.finetune.train import load_run

    t = recipe.training
    try:
        loaded = load_run(recipe, World.from_env().size)
        est = eval_estimate(recipe, loaded.steps, loaded.per_epoch, len(loaded.eval_data))
    except (TiertuneError, OSError) as exc:
        steps = t.max_steps if t.max_steps > 0 else None
        est = eval_estimate(recipe, steps, None, None)
        est.why = f"the data cannot be read here: {str(exc).splitlines()[0][:120]}"
    if evaluated is not None:
        est.first_pass, est.later_pass = evaluated.passes[0], evaluated.passes[-1]
        est.step_after, est.replayed = evaluated.after, True
    return est


EVAL_PASSES = 2
"""The evaluation passes replayed after the steps: the first after a step, and one after another pass."""
TEACHER_PASSES = 3
"""A distillation teacher's passes replayed on its own store: the first (cold, no trace yet), the second (the
first's trace, what the first left cached), the third as each later one."""


def _replay(
    run: RunPlan,
    notes: list[str],
    device: torch.device,
    others: Sequence[RunPlan] = (),
    evaluate: int = 0,
    evaluating: Sequence[int] = (),
) -> Replayed | None:
    """The run's steps replayed on a ledger (``engine.replay``: the engine's own step over the store's own
    placement, eviction and prefetch, every micro-batch) under its budgets and memory plan; its peaks and the
    bytes a step moves. None (with a note) when the budgets cannot hold the plan: there is no step to
    replay."""
    store_cfg, cfg, recipe = run.store, run.engine, run.recipe
    if run.memory.short({Tier.DEVICE: store_cfg.device_budget, Tier.HOST: store_cfg.host_budget}):
        notes.append(
            "no step replayed: the budgets cannot hold the run's memory plan (the peaks shown are what "
            "passes through each tier, up to its budget)"
        )
        return None
    ledger = dataclasses.replace(store_cfg, disk_budget=None)
    t = recipe.training
    shapes = [
        (r.training.per_device_train_batch_size, r.data.max_seq_len, r.training.gradient_accumulation_steps)
        for r in [recipe, *(o.recipe for o in others)]
    ]
    try:
        return replaying.replay(
            recipe.model.path,
            ledger,
            cfg,
            t.per_device_train_batch_size,
            recipe.data.max_seq_len,
            t.gradient_accumulation_steps,
            replaying.CLIPPED[: 2 if cfg.method == "lora" else None],
            device,
            run.world,
            shapes=shapes if others else (),
            evaluate=evaluate,
            evaluating=evaluating,
        )
    except (BudgetError, StateError) as exc:  # the store's own refusal, as a run would meet it
        notes.append(
            f"a step could not be replayed within these budgets ({exc}); the peaks shown are what passes "
            "through each tier, up to its budget"
        )
        return None


def _step_time(
    est: Estimate,
    recipe: Recipe,
    cfg,
    flops: StepFlops,
    target: GPU | None,
    trace: Trace | None = None,
    run_threads: int | None = None,
    layer_seconds: tuple[float, float] | None = None,
    scale: float = 1.0,
    probes: Probes | None = None,
    evaluation: Sequence[replaying.Evaluated] = (),
) -> StepTime:
    """Seconds of each part of a step (see ``speed``), from the bytes moved, the bandwidths measured and the
    compute rate: measured at the model's own product shape on this machine's CPU or GPU, or a named GPU's
    stated peak; and, from the replay's ``trace``, the step as a timeline (``estimates.timeline``) of those
    rates. ``run_threads``: torch's threads the run computes with (default: as ``train`` sets them);
    ``layer_seconds``: a decoder layer's (forward, backward) seconds a micro-batch, given (``estimate``);
    ``scale``: the step's tokens over the recipe's (several adapters' steps: all of theirs); ``cfg``: the
    recipe's own engine, whose step is measured; ``probes``: measurements shared with other estimates;
    ``evaluation``: the replay's evaluations (one, or several adapters' each), their passes and the step after
    them, played at the same rates."""
    probes = probes or Probes()
    from tiertune.finetune.train import steps_of

    t = recipe.training
    bw = est.bandwidth
    micro_batches = t.gradient_accumulation_steps
    micro_tokens = t.per_device_train_batch_size * recipe.data.max_seq_len
    during = run_threads or World().threads()
    tail = max(during, World().threads(usable_cores()))
    layers = recipe_layers(recipe.model.path)
    per_token: tuple[float, float] | None = None  # seconds a token position: one decoder layer, the rest
    measured = engine = None  # ``engine``: the engine's own step measured (its copies in the layers' time)
    if target is not None and target.peak_flops:
        compute = flops.total / target.peak_flops
        source = f"at the {target.name}'s stated dense bf16 peak, which runs do not reach: at least this"
    else:
        device = torch.device("cuda" if target is not None else "cpu")
        where = "this CPU" if target is None else target.name
        rows, seq = t.per_device_train_batch_size, recipe.data.max_seq_len
        with torch_threads(during):
            if target is None and trace is not None:  # the engine's own step, its hand-off included
                overlapped = bool(est.kinds.get("moments")) and cfg.overlap_optimizer != "off"
                engine = probes.take(
                    ("engine", recipe.model.path, rows, seq, during),
                    lambda: measure_engine(
                        recipe.model.path,
                        cfg,
                        rows,
                        seq,
                        overlapped=overlapped,
                        packed=recipe.data.packing,
                        sample=_sample(recipe),
                    ),
                )
            measured = engine or probes.take(
                ("compute", recipe.model.path, rows, seq, during),
                lambda: measure_compute(recipe.model.path, cfg, rows, seq, device),
            )
        if measured is not None:
            layer, rest = measured.layer, measured.rest
            if layer_seconds is not None:
                layer = sum(layer_seconds)
            compute = scale * micro_batches * (layers * layer + rest)
            per_token = (layer / micro_tokens, rest / micro_tokens)
            what = (
                "the engine's step (its gradients' hand-off included)"
                if engine is not None
                else "the model's forward and backward"
            )
            source = (
                f"measured on {where}: {what} with 1 and more layers, "
                f"{format_seconds(layer)} a layer + {format_seconds(rest)} the rest, per micro-batch, "
                + (
                    f"the median of steps taken in turn with {during} threads"
                    if engine is not None
                    else f"the fastest of repeats with {during} threads"
                )
            )
            if layer_seconds is not None:
                source = (
                    f"a decoder layer as given, {format_seconds(layer_seconds[0])} forward and "
                    f"{format_seconds(layer_seconds[1])} backward a micro-batch; the rest {format_seconds(rest)}, "
                    + source
                )
            if engine is not None and measured.spread > NOISY:
                est.notes.append(
                    f"the engine's steps measured varied by {measured.spread:.0%} between their quartiles: the CPU "
                    "was busy with other work while measuring, and so will the run's be if it still is (the "
                    "step time above is their median); estimate again on an idle machine for a steadier figure"
                )
            elif engine is None and measured.spread > NOISY:
                est.notes.append(
                    f"the compute measurement's repeats varied by {measured.spread:.0%}: the CPU was busy with other "
                    "work while measuring, and a run now would be slower than the step time above (it uses the "
                    "fastest repeat); estimate again on an idle machine for a steadier figure"
                )
        else:
            dtype = cfg.layer_dtype(device)
            m, k, n = flops.shape
            with torch_threads(during):
                rate = probes.take(("matmul", m, k, n), lambda: measure_matmul(device, dtype, m, k, n))
                compute = flops.total / rate
            source = (
                f"a ({m} x {k}) @ ({k} x {n}) {str(dtype).removeprefix('torch.')} product measured on {where}"
            )
    parts = {"compute": compute}
    moved = {link: est.moved_per_step.get(link, 0) for link in LINKS}
    if "disk_read" in bw:
        parts["disk"] = moved["disk->host"] / bw["disk_read"] + moved["host->disk"] / bw["disk_write"]
    with torch_threads(during):  # host memory copied by the threads the run copies with
        host_copy = probes.take(("copy", during), measure_copy)
    copy_rate = host_copy if target is None else bw.get("host_to_device", 0.0)
    for link in ("host->device", "device->host"):  # PCIe: each way at the host-to-device rate
        if target is not None and "host_to_device" in bw:
            parts[link] = moved[link] / bw["host_to_device"]
        elif target is None and moved[link]:  # the CPU's own cores copy between the tiers
            parts[link] = moved[link] / copy_rate
    if "optimizer_params" in bw and est.kinds.get("moments"):
        parts["optimizer"] = est.trained_parameters / bw["optimizer_params"]
    try:
        steps: int | None = steps_of(recipe)
        how = "training.max_steps" if recipe.training.max_steps > 0 else "the epochs over the data"
    except (TiertuneError, OSError):
        steps, how = None, "unknown here: counting the epochs' steps needs the data and the model's tokenizer"
    timeline = after_clipped = None
    evaluated: list[tuple[list[Timeline], Timeline]] = []
    if trace is not None and trace.compute:
        if per_token is None:  # from the FLOPs at the rate found: a layer's share and the head's
            rate = flops.total / compute if compute else 0.0
            layer_flops = flops.layer_factor * (2 * flops.layer_weights + flops.attention_per_token) / layers
            head_flops = flops.head_factor * 2 * flops.head_weights
            per_token = (layer_flops / rate, head_flops / rate) if rate else (0.0, 0.0)
        units = sorted(op[2] for unit in trace.units for op in unit if op[:2] == ("run", "adamw"))
        size = units[len(units) // 2] if units else 1 << 22  # the units' AdamW as large as theirs
        numel = min(max(size, 1 << 20), 1 << 24)
        if engine is not None and engine.updates and (engine.during or during >= tail):
            # the engine's units, their own overheads in, on each side of backward's end
            adamw, adamw_tail = engine.during or engine.updates, engine.updates
        else:
            adamw, adamw_tail = probes.take(
                ("adamw", during, tail, numel), lambda: measure_adamw(during, tail, numel=numel)
            )
            if engine is not None and engine.updates:  # the engine's units after backward, scaled
                adamw, adamw_tail = engine.updates * adamw / adamw_tail, engine.updates
        links = {"disk->host": bw.get("disk_read", 0.0), "host->disk": bw.get("disk_write", 0.0)}
        links.update({"host->device": copy_rate, "device->host": copy_rate})
        given = layer_seconds is not None and sum(layer_seconds) > 0
        # the compute thread's hand-off (copies, norms) is in the engine's own layers' time when measured
        in_layers = engine is not None and layer_seconds is None
        read_rate = 0.0
        if not in_layers:
            with torch_threads(during):
                read_rate = probes.take(("read", during), measure_read)
        rates = Rates(
            layer=per_token[0],
            forward_share=layer_seconds[0] / sum(layer_seconds) if given else 1.0 / flops.layer_factor,
            head=per_token[1],
            copy=0.0 if in_layers else copy_rate,
            read=read_rate,
            adamw=adamw,
            adamw_tail=adamw_tail,
            worker_copy=host_copy,
            links=links,
            # a GPU's layers (or layers given as a GPU's) hold no core of the CPU
            shared=_shared(engine, during) if target is None and layer_seconds is None else (1.0, 1.0),
        )
        played = simulate_steps(trace, rates)
        timeline = played[-1]
        if evaluation:  # the steps again, then each pass (adapter by adapter) and the step after them
            every = simulate_steps(evaluation[0].trace, rates)
            for ev in evaluation:
                start = len(played) + ev.first
                evaluated.append((every[start : start + len(ev.passes)], every[-1]))
        # the replay's step after clipped ones (``engine.replay.AFTER_CLIPPED``): its optimizer after backward
        n = replaying.AFTER_CLIPPED
        after_clipped = played[n] if len(played) > n + 1 and cfg.method != "lora" else None
    return StepTime(
        flops,
        flops.total / compute if compute else 0.0,
        source,
        parts,
        target is not None,
        steps,
        how,
        timeline,
        after_clipped,
        evaluated,
    )


def _sample(recipe: Recipe) -> dict[str, torch.Tensor] | None:
    """The run's first micro-batch (``finetune.train.first_micro_batch``), or None without the data, the
    model's tokenizer, or for a preference objective (its rows are pairs) or GRPO (its rows are sampled)."""
    from tiertune.errors import TiertuneError
    from tiertune.finetune.train import first_micro_batch

    if recipe.objective.paired or recipe.objective.rollouts:  # pairs; GRPO's rows are sampled in the run
        return None
    try:
        return first_micro_batch(recipe)
    except (TiertuneError, OSError, StopIteration):
        return None


def _shared(engine: Engine | None, threads: int) -> tuple[float, float]:
    """The (compute, optimizer) share of its speed each keeps while both run on this CPU: the optimizer's as
    measured beside the engine's compute (``measure_engine``), the compute's the cores over both threads'
    counts (the OS shares the cores between the threads that ask for them; none lost while they are
    enough)."""
    cores = usable_cores()
    compute = min(1.0, cores / (2 * threads))
    return compute, engine.shared if engine is not None else compute


def recipe_layers(model_dir: str) -> int:
    """The decoder layers of the model at ``model_dir`` (its config)."""
    from tiertune.loading.model import decoder_config

    return int(decoder_config(model_dir).num_hidden_layers)


TEACHER_ROWS = 10_000
"""Rows a teacher pass is priced for when the recipe's data cannot be read (``_teacher``)."""


IN_FLIGHT = "  (homed on disk, held on the host from backward until the layer's update has read them)"
"""What the state table says of gradients homed on disk: a step writes none there unless the host runs short."""


def format_estimate(est: Estimate, title: str) -> str:
    """The estimate as a person reads it: what lives where, whether each budget holds (on the budget and on
    this machine), the disk it needs, and how fast a step goes, with its parts and formula."""
    width = max([34, *(len(k) + 2 for k in (*est.kinds, *est.outside_store))])
    lines = [
        title,
        f"parameters: {est.parameters:,} ({est.trained_parameters:,} trained); computes on: {est.target}",
        "",
    ]
    lines.append(f"{'state':<{width}}{'lives on':<10}{'bytes':>12}{'a parameter':>13}")
    for kind, (tier, nbytes) in est.kinds.items():
        each = f"{nbytes / est.parameters:>11.2f} B" if est.parameters and kind != "activations" else ""
        why = IN_FLIGHT if kind == "gradients" and tier == "disk" else ""
        lines.append(f"{kind:<{width}}{tier:<10}{format_size(nbytes):>12}{each}{why}")
    for what, nbytes in est.outside_store.items():
        lines.append(f"{what:<{width}}{'device':<10}{format_size(nbytes):>12}  (outside the chunk store)")
    lines += ["", "will it fit:", f"{'tier':<8}{'budget':>12}{'home':>12}{'passes':>12}{'peak':>12}  fits"]
    short = est.short_of_machine()
    for name, t in est.tiers.items():
        budget = format_size(t.budget) + (" free" if name == "disk" else "")
        needed = est.needed(name)
        ok = "yes" if needed <= t.budget else f"NO: needs {format_size(needed)}"
        if name in short:
            ok = f"NO: {short[name]}" if ok == "yes" else f"{ok}; {short[name]}"
        lines.append(
            f"{name:<8}{budget:>12}{format_size(t.home):>12}{format_size(t.passes):>12}"
            f"{format_size(t.peak):>12}  {ok}"
        )
    on = est.computes_on()
    if on is not None:
        what, has, held = on
        ok = "yes" if held <= has else "NO"
        lines.append(
            f"{what} ({format_size(has)}) holds {format_size(held)}: the tiers it homes and what is "
            f"outside the store  {ok}"
        )
    moved = ", ".join(f"{k} {format_size(est.moved_per_step[k])}" for k in LINKS if k in est.moved_per_step)
    lines += ["", f"how much disk: disk_path needs {format_size(est.disk_needed)} free", ""]
    w = est.waves
    if w is not None:
        lines.append(
            f"micro-batches: {w.micro_batches} per step in {w.count} wave{'s' if w.count > 1 else ''} of "
            f"{w.wave} (the weights stream once per wave); the hidden states at the layer boundaries of a "
            f"wave: {format_size(w.stash)} on the {w.stash_tier}"
        )
    lines.append(f"moved per step: {moved}")
    if est.moved_after_clipped and est.moved_after_clipped != est.moved_per_step:
        after = ", ".join(f"{k} {format_size(n)}" for k, n in est.moved_after_clipped.items() if n)
        lines.append(
            f"  a step after a clipped one (its update after backward, in place): {after or 'nothing'}"
        )
    if est.teacher is not None:
        lines += format_teacher(est.teacher)
    if est.generation is not None:
        lines += format_generation(est.generation)
    if est.evaluation is not None:
        lines += format_evaluation(est.evaluation)
    sp = est.speed
    if sp is not None:
        bw = est.bandwidth
        lines.append(f"how fast: FLOPs per step = {sp.flops.formula} = {sp.flops.total:.3g}")
        lines.append(
            f"  compute      {sp.parts['compute']:.3g} s ({sp.compute_rate_source}), "
            f"{sp.compute_rate / 1e12:.3g} TFLOP/s"
        )
        if "disk" in sp.parts:
            moved = est.moved_per_step
            lines.append(
                f"  disk         read {format_size(moved.get('disk->host', 0))} / "
                f"{bw['disk_read'] / 1e9:.2f} GB/s + write {format_size(moved.get('host->disk', 0))} / "
                f"{bw['disk_write'] / 1e9:.2f} GB/s = {sp.parts['disk']:.3g} s"
            )
        for link in ("host->device", "device->host"):
            if sp.parts.get(link):
                rate = est.moved_per_step[link] / sp.parts[link]
                lines.append(
                    f"  {link} {format_size(est.moved_per_step[link])} / "
                    f"{rate / 1e9:.1f} GB/s = {sp.parts[link]:.3g} s"
                )
        if "optimizer" in sp.parts:
            lines.append(
                f"  optimizer    {est.trained_parameters:,} params / {bw['optimizer_params'] / 1e9:.2f} G params/s "
                f"(CPU AdamW) = {sp.parts['optimizer']:.3g} s"
            )
        tl = sp.timeline
        if tl is not None:
            lines.append(
                f"  timeline     the replayed step's schedule at these rates: compute {format_seconds(tl.compute)}, "
                f"waiting on I/O {format_seconds(tl.io_wait)}, waiting for the CPU optimizer "
                f"{format_seconds(tl.optimizer_wait)}; the optimizer busy {format_seconds(tl.optimizer_busy)}, "
                f"{tl.hidden_share:.0%} of it hidden"
            )
            busy = ", ".join(f"{link} {format_seconds(v)}" for link, v in tl.links.items() if v)
            if busy:
                lines.append(f"               links busy: {busy}")
            clipped = sp.after_clipped
            if clipped is not None and clipped.step > 1.05 * tl.step:
                lines.append(
                    f"               a step after a clipped one (the optimizer after backward, as in a run whose "
                    f"steps clip: training.max_grad_norm) takes {format_seconds(clipped.step)}"
                )
        how = (
            "the timeline"
            if tl is not None
            else "the longest part (they overlap)"
            if sp.overlapped
            else "the CPU's parts one after another, or the disk"
        )
        lines.append(
            f"  => {sp.seconds:.3g} s per step ({how}; bound by {sp.bound}), "
            f"{sp.tokens_per_second:,.0f} tokens/s over {sp.flops.tokens:,} tokens per step"
        )
        g = est.generation
        if g is not None and g.per_step_seconds is not None:
            with_generation = sp.seconds + g.per_step_seconds
            lines.append(
                f"  => with its generation: {with_generation:.3g} s per step (the update {sp.seconds:.3g} s + "
                f"sampling {g.per_step_seconds:.3g} s), "
                f"{sp.flops.tokens / with_generation:,.0f} tokens/s"
            )
        sampled = g.per_step_seconds if g is not None and g.per_step_seconds is not None else 0.0
        evaluations = est.evaluation.total_seconds if est.evaluation is not None else None
        if evaluations is not None:
            lines.append(
                f"  => with its evaluations: {est.evaluation.evaluations:,} x {format_seconds(est.evaluation.seconds)} = "
                f"{_duration(evaluations)} more over the run, at most"
            )
        if sp.total_seconds is not None:
            total = sp.total_seconds + (sp.steps or 0) * sampled + (evaluations or 0.0)
            lines.append(f"  => {sp.steps:,} steps ({sp.steps_source}): {_duration(total)}")
        else:
            lines.append(
                f"  => steps {sp.steps_source} (or set training.max_steps); 1,000 steps take "
                f"{_duration(1000 * (sp.seconds + sampled))}"
            )
    if est.scale_out is not None:
        lines += ["", *_format_scale_out(est.scale_out)]
    lines += [f"note: {note}" for note in est.notes]
    if est.plan is not None:
        slots = "; ".join(f"{t.value} {est.plan.describe(t)}" for t in est.plan.home if est.plan.reserve[t])
        lines.append(f"in use at once (slots reserved by size): {slots or 'none'}")
    if not est.fits:
        lower = any(
            tier != "disk"
            for kind, (tier, _) in est.kinds.items()
            if kind in ("weights", "master", "moments")
        )
        lines.append(
            "DOES NOT FIT: raise the budgets marked NO (within what the machine has)"
            + (", or place more state on disk" if lower else "")
        )
        if est.plan is not None:
            lines.append(
                "the smallest budgets that work (what train checks before loading): "
                + est.plan.smallest({t: est.beside for t in (Tier.DEVICE, Tier.HOST)})
            )
    return "\n".join(lines).rstrip()


def _format_scale_out(so: ScaleOut) -> list[str]:
    """``ScaleOut`` as a person reads it: a rank's bytes, plan and budgets, a node's, and the wire per step."""
    rank = ", ".join(f"{tier} {format_size(n)}" for tier, n in so.per_rank.items())
    ok = (
        "yes"
        if so.fits
        else "NO: raise offload.host_budget / device_budget (the node's, split between its ranks)"
    )
    budgets = ", ".join(f"{tier} {format_size(n)}" for tier, n in so.budgets.items())
    node = ", ".join(f"{tier} {format_size(n)}" for tier, n in so.per_node_bytes.items())
    wire = ", ".join(f"{k} {format_size(v)}" for k, v in so.wire.items())
    lines = [
        f"as {so.processes} processes ({so.per_node} per node; ZeRO-3: each rank keeps 1/{so.processes} of every chunk):",
        f"  per rank: {rank}, + {format_size(so.gathered)} of whole chunks gathered on its device while computing",
    ]
    if so.plan is not None:
        needs = "; ".join(
            f"{t.value} {format_size(so.plan.needed(t))} (slots: {so.plan.describe(t)})"
            for t in (Tier.DEVICE, Tier.HOST)
        )
        lines.append(f"  a rank's memory plan needs: {needs}")
    lines += [
        f"  a rank's budgets: {budgets}; fits: {ok}",
        f"  per node: {node}",
        f"  on the wire per step, each rank sends: {wire}",
    ]
    return lines


def _duration(seconds: float) -> str:
    """``seconds`` as a person says it: 42 s, 7.5 min, 3.2 h, 2.1 days."""
    if seconds < 10:
        return format_seconds(seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"
