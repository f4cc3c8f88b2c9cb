"""``train()``: a recipe in, a fine-tuned model out. The loop is here, in one place.

The run directory gets ``trainer_log.jsonl`` (one JSON object per logged step: step, loss, learning_rate,
grad_norm, tokens_per_second, peak bytes per tier) and, at the end, the model in Hugging Face safetensors
format (config, shards, index, tokenizer), written shard by shard from the chunk store and moved into
place only once complete; for LoRA, the adapter in PEFT format (``adapter_config.json``,
``adapter_model.safetensors``) and the tokenizer.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tiertune.errors import ConfigError
from tiertune.finetune.checkpoint import (
    RECIPE_FILE,
    STATE_FILE,
    CheckpointWriter,
    checkpoints,
    latest_checkpoint,
    load_checkpoint,
    remove_partial,
)
from tiertune.finetune.data import batches, load_data
from tiertune.finetune.engine import EngineConfig, StreamedTrainer
from tiertune.finetune.export import write_hf
from tiertune.finetune.files import write_text_atomically
from tiertune.finetune.lora import LoraSettings
from tiertune.finetune.optim import GaloreSettings
from tiertune.finetune.recipe import Recipe, load_recipe
from tiertune.finetune.reporting import Reporters
from tiertune.kernels.patch import describe, resolve_backend
from tiertune.offload.store import StoreConfig
from tiertune.units import format_size

log = logging.getLogger("tiertune.train")

LOG_NAME = "trainer_log.jsonl"


@dataclass
class TrainResult:
    """What a run did: the losses of the steps it ran (from ``first_step``: a resumed run starts after its
    checkpoint), where its log and model are, how long it took."""

    output_dir: Path
    losses: list[float] = field(default_factory=list)
    steps: int = 0
    seconds: float = 0.0
    first_step: int = 1

    @property
    def log_path(self) -> Path:
        return self.output_dir / LOG_NAME


def plan(recipe: Recipe) -> tuple[StoreConfig, EngineConfig]:
    """The store and engine settings a recipe resolves to (``auto`` made concrete for this machine)."""
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
            "point it at a local directory saved with save_pretrained (for the demo recipe: run `tiertune demo`)"
        )
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        raise ConfigError(
            f"launched as {world} processes, but multi-GPU training (ZeRO sharding) is not available yet; "
            "run a single process"
        )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    resolve_backend(recipe.kernels, torch.device(device))  # kernels: triton where it cannot run is an error
    dtype = {"auto": torch.bfloat16 if device == "cuda" else torch.float32}.get(
        recipe.model.dtype
    ) or getattr(torch, recipe.model.dtype)
    off = recipe.offload

    def place(value: str) -> str:
        if value != "auto":
            return value
        return "disk" if off.disk_path else "host"

    params, states = place(off.params), place(off.optimizer_states)
    if "disk" in (params, states) and not off.disk_path:
        raise ConfigError(
            "offload.params or offload.optimizer_states is disk but offload.disk_path is not set"
        )
    t = recipe.training
    store = StoreConfig(
        device=device,
        device_budget=off.device_budget,
        host_budget=off.host_budget,
        disk_path=off.disk_path,
        chunk_size=1 << 40,  # one chunk per parameter group (a decoder layer): its states then mirror it
        prefetch_depth=off.prefetch_depth,
    )
    engine = EngineConfig(
        dtype=dtype,
        learning_rate=t.learning_rate,
        weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2,
        adam_epsilon=t.adam_epsilon,
        max_grad_norm=t.max_grad_norm,
        optim=t.optim,
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
        activations=_activations(recipe, device, dtype, store.device_budget),  # type: ignore[arg-type]
        activation_tokens=t.per_device_train_batch_size * recipe.data.max_seq_len,
        method=recipe.method.type,
        quantize=recipe.model.quantize,
        quant_cache=_quant_cache(off.disk_path) if recipe.model.quantize != "none" else None,
        lora=LoraSettings(
            r=recipe.method.lora.r,
            alpha=recipe.method.lora.alpha,
            dropout=recipe.method.lora.dropout,
            target_modules=recipe.method.lora.target_modules,
            seed=t.seed,
            use_dora=recipe.method.lora.use_dora,
        ),
        galore=GaloreSettings(
            rank=recipe.method.galore.rank,
            update_proj_gap=recipe.method.galore.update_proj_gap,
            scale=recipe.method.galore.scale,
            target_modules=recipe.method.galore.target_modules,
        ),
    )
    return store, engine


def _quant_cache(disk_path: str | None) -> str:
    """Where quantized layers are kept for the next run: beside the offload files, else the user's cache."""
    if disk_path:
        return str(Path(disk_path) / "quantized")
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(root) / "tiertune" / "quantized")


def _activations(recipe: Recipe, device: str, dtype: torch.dtype, device_budget: int) -> str:
    """``offload.activations``; auto keeps the layer inputs on the device unless, on a GPU, they would take
    more than an eighth of the device budget."""
    choice = recipe.offload.activations
    if choice != "auto":
        return choice
    if device != "cuda":
        return "device"
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(recipe.model.path)
    per_layer = recipe.training.per_device_train_batch_size * recipe.data.max_seq_len * config.hidden_size
    total = per_layer * config.num_hidden_layers * torch.empty((), dtype=dtype).element_size()
    return "host" if total > device_budget // 8 else "device"


def train(
    recipe: Recipe | str | os.PathLike[str], overrides: tuple[str, ...] = (), progress: bool = True
) -> TrainResult:
    """Run a recipe (a ``Recipe`` or the path of a YAML file) to the end and export the model.

    Raises ConfigError, DataError, ModelError or BudgetError with a message that says what to change.
    """
    from transformers import AutoTokenizer

    if not isinstance(recipe, Recipe):
        recipe = load_recipe(recipe, overrides)
    store_cfg, engine_cfg = plan(recipe)
    t, d = recipe.training, recipe.data
    torch.manual_seed(t.seed)
    tokenizer = AutoTokenizer.from_pretrained(recipe.model.path)
    data = load_data(d.path, tokenizer, d.format, d.max_seq_len, d.add_eos, d.skip_bad_rows)
    log.info(
        "data: %d rows, %d tokens from %s (%d bad rows skipped, %d with nothing to predict dropped)",
        len(data), data.tokens, d.path, data.skipped, data.dropped,
    )  # fmt: skip
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id or 0
    rows = math.ceil(data.tokens / d.max_seq_len) if d.packing else len(data)  # packing: about full rows
    per_epoch = math.ceil(rows / t.per_device_train_batch_size)
    steps = (
        t.max_steps
        if t.max_steps > 0
        else max(1, math.ceil(t.num_train_epochs * per_epoch / t.gradient_accumulation_steps))
    )
    engine_cfg.max_steps = steps
    out = Path(t.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    for path in remove_partial(out):
        log.info("removed %s: an interrupted checkpoint write", path)
    write_text_atomically(out / RECIPE_FILE, recipe.to_yaml())
    resume = _resume_path(t.resume_from_checkpoint, out)
    result = TrainResult(out)
    stream = batches(data, t.per_device_train_batch_size, pad_id, d.shuffle, t.seed, d.packing, d.max_seq_len)
    trainer = StreamedTrainer(recipe.model.path, store_cfg, engine_cfg)
    history: list[dict] = []
    first = 0
    if resume is not None:
        try:
            state = load_checkpoint(trainer, resume)
        except BaseException:
            trainer.close()
            raise
        first, history = int(state["global_step"]), list(state["log_history"])
        for _ in range(state["tiertune"]["micro_batches"]):  # the data position: the same batches follow
            next(stream)
        _rewrite_log(result.log_path, history)  # the steps after the checkpoint are run again
        log.info("resumed from %s at step %d of %d", resume, first, steps)
    result.first_step = first + 1
    banner = _banner(recipe, trainer, store_cfg, steps, first)
    log.info("%s", banner)
    if progress:
        print(banner, flush=True)
    bar = _progress(steps, progress, first)
    writer = CheckpointWriter(trainer, out, t.save_total_limit)
    reporters = None
    start = time.perf_counter()
    try:
        reporters = Reporters(t.report_to, out, recipe.to_dict(), first)
        with open(result.log_path, "a") as log_file:
            for step in range(first, steps):
                micro = [next(stream) for _ in range(t.gradient_accumulation_steps)]
                tokens = sum(int(mb["num_tokens"]) for mb in micro)
                began = time.perf_counter()
                loss = trainer.step(micro)
                seconds = time.perf_counter() - began
                result.losses.append(loss)
                stats = trainer.store.stats()
                peaks = {name: tier.peak for name, tier in stats.tiers.items()}
                record = {
                    "step": step + 1,
                    "loss": loss,
                    "learning_rate": trainer.last_lr,
                    "grad_norm": trainer.last_grad_norm,
                    "tokens_per_second": tokens / seconds,
                    "epoch": (step + 1) * t.gradient_accumulation_steps / per_epoch,
                    "peak_bytes": peaks,
                    "bytes_moved": stats.bytes_moved,
                    "optimizer_steps": dict(trainer.optimizer_counts),
                }
                if (step + 1) % t.logging_steps == 0 or step + 1 == steps:
                    log_file.write(json.dumps(record) + "\n")
                    log_file.flush()
                    history.append(record)
                    reporters.log(record)
                if t.save_steps > 0 and (step + 1) % t.save_steps == 0 and step + 1 < steps:
                    trainer_state = {
                        "global_step": step + 1,
                        "max_steps": steps,
                        "epoch": record["epoch"],
                        "log_history": history,
                        "tiertune": {"micro_batches": (step + 1) * t.gradient_accumulation_steps},
                    }
                    writer.save(trainer_state, recipe.to_yaml())  # written while the next steps run
                if bar is not None:
                    bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens / seconds:.0f}",
                                    **{k: format_size(v) for k, v in peaks.items()})  # fmt: skip
                    bar.update(1)
        writer.wait()
        if trainer.adapters is not None:  # a PEFT adapter directory (the base is the input model)
            trainer.save_adapter(out)
            tokenizer.save_pretrained(str(out))
        else:
            export_hf(trainer, tokenizer, out)
    finally:
        if bar is not None:
            bar.close()
        if reporters is not None:
            reporters.close()
        try:
            writer.wait()  # an interrupted run still completes the checkpoint it was writing
        finally:
            trainer.close()
    result.steps = steps
    result.seconds = time.perf_counter() - start
    return result


def _banner(recipe: Recipe, trainer: StreamedTrainer, store: StoreConfig, steps: int, first: int) -> str:
    """What the run is about to do: what is trained, the effective batch, where each state lives, budgets."""
    t, cfg = recipe.training, trainer.config
    if trainer.adapters is not None:
        trained = sum(p.numel() for p in trainer.adapters.params)
    else:
        trained = sum(s.group.numel for s in trainer._states if s.trainable)
    total = sum(s.group.numel for s in trainer._states)
    batch = (
        t.per_device_train_batch_size * t.gradient_accumulation_steps * int(os.environ.get("WORLD_SIZE", "1"))
    )
    fused = [describe(trainer.kernel_counts)] if trainer.kernel_counts else []
    if trainer.fused_loss:
        fused.append("fused loss")
    homes = {"weights": cfg.params, "gradients": cfg.gradients, "master": cfg.optimizer_states,
             "moments": cfg.optimizer_states, "projections": cfg.optimizer_states, "twins": cfg.optimizer_states}  # fmt: skip
    where = ", ".join(
        f"{kind} {format_size(n)} on {homes[kind]}" for kind, n in trainer.state_bytes().items() if n
    )
    if trainer.adapters is not None:
        where += f", adapters and their states on {trainer.device.type}"
    method = recipe.method.type + (
        f" on a {recipe.model.quantize} base" if recipe.model.quantize != "none" else ""
    )
    lines = [
        f"tiertune: {method}, {trained:,} of {total:,} parameters trained ({100 * trained / max(total, 1):.2f}%)",
        f"  steps {first + 1}-{steps} of {steps}, effective batch {batch} sequences "
        f"({t.per_device_train_batch_size} x {t.gradient_accumulation_steps} accumulated), "
        f"max_seq_len {recipe.data.max_seq_len}{', packed' if recipe.data.packing else ''}",
        f"  state: {where}",
        f"  budgets: device ({store.device}) {format_size(store.device_budget)}, host {format_size(store.host_budget)}"
        + (f", disk {store.disk_path}" if store.disk_path else ""),
        f"  optimizer: {cfg.optim}, {'overlapped with backward' if trainer.overlap else 'after backward'}; "
        f"activations on {cfg.activations}; output {t.output_dir}",
        f"  kernels: {trainer.kernel_backend} ({', '.join(fused) or 'none fused: the model modules, unfused loss'})",
    ]
    return "\n".join(lines)


def _progress(total: int, enabled: bool, done: int = 0):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=done, desc="tiertune", unit="step")


def _resume_path(setting: str | None, out: Path) -> Path | None:
    """``training.resume_from_checkpoint``: none, ``auto`` (the newest complete checkpoint in the run
    directory, if there is one) or a checkpoint directory."""
    if setting is None or setting is False:
        return None
    if setting == "auto" or setting is True:
        return latest_checkpoint(out)
    path = Path(setting)
    if not (path / STATE_FILE).is_file():
        raise ConfigError(
            f"training.resume_from_checkpoint {setting} is not a complete checkpoint (no {STATE_FILE}); "
            f"use auto, or one of: {', '.join(p.name for p in checkpoints(out)) or 'none in ' + str(out)}"
        )
    return path


def _rewrite_log(path: Path, records: list[dict]) -> None:
    """Replace the JSON-lines log with ``records``."""
    write_text_atomically(path, "".join(json.dumps(r) + "\n" for r in records))


def export_hf(trainer: StreamedTrainer, tokenizer: object, out: Path) -> None:
    """Write the trained model as a Hugging Face directory in ``out``, streaming chunk by chunk."""
    config = trainer.model.config
    config.use_cache = True
    write_hf(trainer.weights(), config, tokenizer, out)
