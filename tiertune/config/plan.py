"""A recipe resolved: the store and engine settings it asks for on this machine (``plan``), every ``auto``
made concrete and every rule between settings checked (``tests/test_rules.py``) before anything is loaded;
with the memory plan over the chunks the run registers, the ``RunPlan`` everything below the CLI reads
(``resolve``)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tiertune.config.recipe import Recipe
from tiertune.distributed.world import World
from tiertune.engine.config import SEQUENCE_TILE, EngineConfig
from tiertune.errors import ConfigError
from tiertune.kernels.patch import resolve_backend
from tiertune.offload.chunk import itemsize
from tiertune.offload.store import StoreConfig
from tiertune.offload.tiers import AUTO_DEVICE_FRACTION

if TYPE_CHECKING:
    from tiertune.engine.memory import Plan
    from tiertune.engine.registered import Laid


BESIDE_SHARE = 2
"""Where a frozen model streams beside the trained one (``Recipe.beside``: a distillation's teacher with
``objective.top_k: 0``, ``finetune.teacher``; GRPO's reference of a full fine-tune, ``finetune.reference``), each
is planned within 1 / this of the run's device and host budgets."""


@dataclass(frozen=True)
class RunPlan:
    """A recipe resolved for one process (``resolve``), what the run and the estimate read: the settings with
    every ``auto`` concrete and the memory plan's decisions in (``store``: its reserved slots; ``engine``: the
    twins, the micro-batches a wave runs), that plan over the chunks the run registers and what its step holds
    (``laid``), and this process among the launch's (``world``, read once)."""

    recipe: Recipe
    store: StoreConfig
    engine: EngineConfig
    world: World
    laid: Laid

    @property
    def memory(self) -> Plan:
        """The run's memory plan (``engine.memory``)."""
        return self.laid.plan


def resolve(
    recipe: Recipe,
    world: World,
    device: str | None = None,
    device_memory: int | None = None,
    notes: list[str] | None = None,
    disk_free: int | None = None,
) -> RunPlan:
    """``recipe`` resolved for this process among ``world``'s (``plan``), and its memory plan over the chunks
    the run registers (``engine.registered.lay_out``: nothing is loaded). ``device`` and ``device_memory``
    (``estimate``): plan for ``cuda`` or ``cpu`` rather than for what this machine has, a GPU of that memory
    sizing an ``auto`` device budget; ``disk_free``: the room the disk's slots take (default: at
    ``disk_path``). What a reader should know is appended to ``notes``."""
    from tiertune.engine.registered import lay_out

    store, engine = plan(recipe, device, world)
    if device_memory is not None and store.device.type == "cpu" and recipe.offload.device_budget == "auto":
        store.device_budget = int(device_memory * AUTO_DEVICE_FRACTION)  # as a run on that GPU resolves it
    shape = (recipe.training.per_device_train_batch_size, recipe.data.max_seq_len)
    laid = lay_out(recipe.model.path, store, engine, shape, notes, world, disk_free)
    store, engine = laid.applied(store, engine)
    return RunPlan(recipe, store, engine, world, laid)


def plan(
    recipe: Recipe, device: str | None = None, world: World | None = None
) -> tuple[StoreConfig, EngineConfig]:
    """The store and engine settings a recipe resolves to (``auto`` made concrete for this machine), with every
    rule between settings (``tests/test_rules.py``). ``device`` (``estimate``): plan the engine for ``cuda`` or
    ``cpu`` rather than for what this machine has; the store then computes on the CPU where the machine has
    no GPU (only its layout is used). ``world``: this process among a launch's (default: the environment's);
    ``estimate --processes`` plans a rank of a launch that is not running."""
    if recipe.model.quantize != "none" and recipe.method.type != "lora":
        raise ConfigError(
            f"model.quantize: {recipe.model.quantize} freezes the base; use method.type: lora with it, "
            f"or model.quantize: none for method.type: {recipe.method.type}"
        )
    if not recipe.model.path:
        raise ConfigError("model.path is required: a local Hugging Face model directory")
    if not (Path(recipe.model.path) / "config.json").is_file():
        raise ConfigError(
            f"model.path {recipe.model.path} is not a Hugging Face model directory (no config.json there); "
            "point it at a local directory saved with save_pretrained, or give a Hugging Face model id "
            "(organization/name; for the demo recipe: run `tiertune demo`)"
        )
    out = Path(recipe.training.output_dir).absolute()
    for key, other in (("model.path", recipe.model.path), ("offload.disk_path", recipe.offload.disk_path)):
        if other and Path(other).absolute() == out:
            raise ConfigError(
                f"training.output_dir is {key} ({out}): the run would write over it; choose another directory"
            )
    world = world or World.from_env()
    t = recipe.training
    if world.size > 1 and recipe.method.type == "galore":
        raise ConfigError(
            f"launched as {world.size} processes, but method.type: galore does not run sharded yet (GaLore "
            "projects each weight matrix's whole gradient, a rank holds a part of it); run one process, or "
            "use method.type: full or lora"
        )
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    resolve_backend(recipe.kernels, torch.device(device))  # kernels: triton where it cannot run is an error
    dtype = {"auto": torch.bfloat16 if device == "cuda" else torch.float32}.get(
        recipe.model.dtype
    ) or getattr(torch, recipe.model.dtype)
    off = recipe.offload
    if t.master_weights == "bfloat16" and (
        recipe.method.type != "full" or t.optim != "adamw_torch" or dtype != torch.bfloat16
    ):
        raise ConfigError(
            "training.master_weights: bfloat16 (bf16 weights as their own master, stochastic rounding) is for "
            f"method.type: full with training.optim: adamw_torch and model.dtype: bfloat16; this recipe has "
            f"method.type: {recipe.method.type}, optim: {t.optim}, dtype {str(dtype).removeprefix('torch.')}. "
            "Set training.master_weights: float32, or change those"
        )

    if off.delay_update and (
        recipe.method.type != "full" or t.master_weights != "float32" or off.overlap_optimizer is True
    ):
        raise ConfigError(
            "offload.delay_update (a step's update during the next step, which computes on the weights before "
            "it) is for method.type: full with training.master_weights: float32, its own way of overlapping the "
            f"optimizer; this recipe has method.type: {recipe.method.type}, master_weights: {t.master_weights}, "
            f"offload.overlap_optimizer: {off.overlap_optimizer}. Set offload.delay_update: false, or change those"
        )

    def place(value: str) -> str:
        if value != "auto":
            return value
        return "disk" if off.disk_path else "host"

    params, states = place(off.params), place(off.optimizer_states)
    if "disk" in (params, states) and not off.disk_path:
        raise ConfigError(
            "offload.params or offload.optimizer_states is disk but offload.disk_path is not set"
        )
    lora_seed = recipe.method.lora.seed
    store = StoreConfig.resolve(
        device=device if torch.cuda.is_available() else "cpu",
        device_budget=off.device_budget,
        host_budget=off.host_budget,
        disk_path=str(world.disk_dir(off.disk_path)) if off.disk_path else None,  # rank-r of several
        chunk_size=1 << 40,  # one chunk per parameter group (a decoder layer): its states then mirror it
        prefetch_depth=off.prefetch_depth,
        num_shards=world.size,
    )
    if world.local_size > 1:  # the host budget is the node's, shared by its ranks (the device's too on a CPU)
        store.host_budget //= world.local_size
        if device == "cpu":
            store.device_budget //= world.local_size
    if recipe.beside:  # the frozen model's and the trained one's stores side by side: half the budgets each
        store.host_budget //= BESIDE_SHARE
        store.device_budget //= BESIDE_SHARE
    engine = EngineConfig(
        dtype=dtype,
        learning_rate=t.learning_rate,
        weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2,
        adam_epsilon=t.adam_epsilon,
        max_grad_norm=t.max_grad_norm,
        optim=t.optim,
        master_weights=t.master_weights,
        kernels=recipe.kernels,
        lr_scheduler_type=t.lr_scheduler_type,
        warmup_steps=t.warmup_steps,
        max_steps=1,  # set once the data is read
        params=params,
        optimizer_states=states,
        # homed on disk when there is one: a layer's gradients then take host memory only from backward
        # until its update (all of them only while accumulating micro-batches, or waiting for the clipping
        # norm), and they are dropped once used, so nothing is written there unless the host runs short
        gradients="disk" if off.disk_path else "host",
        overlap_optimizer=off.overlap_optimizer,
        delay_update=off.delay_update,
        activations=activations_place(recipe, device, dtype, store.device_budget),
        # a micro-batch of pairs holds each pair's two sequences
        activation_tokens=t.per_device_train_batch_size
        * recipe.data.max_seq_len
        * (1 + recipe.objective.paired),
        sequence_tile=SEQUENCE_TILE if off.sequence_tile == "auto" else int(off.sequence_tile),
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        method=recipe.method.type,
        quantize=recipe.model.quantize,
        quant_cache=quant_cache_dir(off.disk_path) if recipe.model.quantize != "none" else None,
        # the method's settings as the recipe holds them (one definition: tiertune.settings); the adapters'
        # init seed is training.seed unless method.lora.seed sets its own
        lora=dataclasses.replace(recipe.method.lora, seed=t.seed if lora_seed is None else lora_seed),
        galore=recipe.method.galore,
        objective=recipe.objective,
        seed=t.seed,
    )
    # resolved for the device planned for (the estimate's, on a machine without that GPU, too)
    engine.handoff_lag = engine.lag(torch.device(device))
    return store, engine


def quant_cache_dir(disk_path: str | None) -> str:
    """Where quantized layers are kept for the next run: beside the offload files, else the user's cache."""
    if disk_path:
        return str(Path(disk_path) / "quantized")
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(root) / "tiertune" / "quantized")


def activations_place(recipe: Recipe, device: str, dtype: torch.dtype, device_budget: int) -> str:
    """``offload.activations``; auto keeps the hidden states at the layer boundaries of a step's micro-batches
    (``engine.schedule``: every micro-batch of the step runs through a layer while it is loaded) on the device
    unless, on a GPU, they would take more than an eighth of the device budget."""
    from tiertune.loading.model import decoder_config

    config = decoder_config(recipe.model.path)  # ModelError for a config.json it cannot use, before all else
    choice = recipe.offload.activations
    if choice != "auto":
        return choice
    if device != "cuda":
        return "device"
    t = recipe.training
    per_layer = t.per_device_train_batch_size * recipe.data.max_seq_len * config.hidden_size
    total = per_layer * t.gradient_accumulation_steps * (config.num_hidden_layers + 1) * itemsize(dtype)
    return "host" if total > device_budget // 8 else "device"
