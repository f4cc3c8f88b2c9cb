"""A run's layout, laid out before anything is loaded: every chunk the run registers (weights, read in place
or not, whole or a rank's shard; each trained chunk's state; the saved layer inputs; the speculative step's
twins), as the loader and ``engine.layout`` lay them out, and the bytes the run keeps outside the store.
``train`` plans its memory from it before loading (``memory_plan``); ``estimate`` reports it, plans it and
replays a step over it (``engine.replay``).

The model is built on the meta device (nothing is allocated, not even for a moment): a quantized base is
converted as the run converts it (MoE experts too, one 4-bit matrix per expert), LoRA adapters are counted
from peft's own wrapping of that skeleton, and frozen weights read in place are laid out over the files
as the store lays them (``offload.inplace.plan_in_place``) where the checkpoint is at hand."""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from tiertune.distributed.ownership import shard_layout
from tiertune.engine.memory import IN_PLACE, QUANT_CACHE, Plan, PlannedChunk, make_plan
from tiertune.engine.schedule import waves as schedule_waves
from tiertune.engine.stash import stash_slots
from tiertune.errors import ModelError
from tiertune.files import nearest_existing
from tiertune.offload.chunk import ALIGN, ChunkLayout, itemsize, pack_tensors
from tiertune.offload.disk import slot_bytes
from tiertune.offload.inplace import plan_in_place
from tiertune.offload.store import StoreConfig
from tiertune.offload.tiers import Tier
from tiertune.units import round_up

if TYPE_CHECKING:
    from tiertune.engine.config import EngineConfig

_Chunk = PlannedChunk


def memory_plan(model_path: str, store_cfg: StoreConfig, cfg: EngineConfig) -> tuple[Plan, bool, int]:
    """The run's memory plan (``engine.memory``) for the store and engine settings ``plan`` resolved, from the
    chunks it will register laid out on the meta device (nothing is loaded), whether those include the
    speculative step's twins (they do when the run fits with them), and the micro-batches a wave runs. What
    ``train`` checks before loading the model, and what ``estimate`` reports."""
    on_gpu = store_cfg.device.type == "cuda"
    disk_room = shutil.disk_usage(nearest_existing(store_cfg.disk_path)).free if store_cfg.disk_path else 0
    laid = run_layout(model_path, store_cfg, cfg, [], on_gpu, disk_room, outside=False)
    return make_plan(laid.chunks, on_cpu=not on_gpu), any(c.role == "twin" for c in laid.chunks), laid.wave


class RunLayout(NamedTuple):
    """What ``run_layout`` lays out: the chunks, the parameters (all, trained), the device bytes outside the
    store by what holds them, the micro-batches a wave runs (``engine.schedule``), and what ``measure`` made
    of the model (None without one)."""

    chunks: list[_Chunk]
    parameters: int
    trained: int
    outside: dict[str, int]
    wave: int
    measured: Any = None


def run_layout(
    model_path: str,
    store_cfg: StoreConfig,
    cfg: EngineConfig,
    notes: list[str],
    on_gpu: bool,
    disk_free: int,
    measure: Callable[[torch.nn.Module, list[torch.nn.Module]], Any] | None = None,
    outside: bool = True,
) -> RunLayout:
    """Every chunk a run of the model at ``model_path`` would register, laid out as the store lays them out
    (what a reader should know about the model is appended to ``notes``; ``on_gpu``: computed on a GPU;
    ``disk_free``: the free bytes at ``disk_path``, room the overlap decision weighs). ``measure(model,
    layers)``: called on the meta skeleton before it is converted (the estimate counts a step's FLOPs there).
    ``outside``: whether to count the bytes outside the store (a layer's activations are traced for them); a
    LoRA run's adapters are the engine's to count (``engine.replay``), not here. With activations on the
    host and ``cfg.wave_size`` 0, the wave is the most micro-batches of a step whose boundary chunks fit the
    budgets (decided before the twins, which take the room left)."""
    from tiertune.engine.layout import home_tier_used
    from tiertune.loading.model import build_skeleton, quantized_on_load, split_model, weight_entries
    from tiertune.methods.optim import GaLore
    from tiertune.quant import is_quantized, make_quantizer
    from tiertune.quant.experts import convert_experts

    # shapes only, so nothing is ever allocated, not even for a moment: a parameter created before it is
    # moved to meta would be (one fused expert weight of DeepSeek-V3 is 15 GB in bf16)
    with torch.device("meta"):
        model = build_skeleton(model_path, cfg.dtype)
        parts = split_model(model)
        micro = cfg.activation_tokens  # a micro-batch's tokens (of pairs: each pair's two sequences)
        k = cfg.gradient_accumulation_steps
        measured = measure(model, list(parts.layers)) if measure is not None else None
        saved = _saved_quantization(model, model_path, cfg.quantize, notes)
        layer_saved = _layer_saved(model, cfg, micro, k, notes, on_gpu) if outside else 0
        quant = make_quantizer(cfg.quantize, cfg.dtype, saved)
        # converted as the engine converts them: the linear layers, and MoE experts one 4-bit matrix each
        if quant is not None:
            for layer in parts.layers:
                quant.convert(layer)
                convert_experts(layer, quant)
            parts = split_model(model)
    paths = {id(m): n for n, m in model.named_modules()}
    galore = GaLore(cfg.galore, list(parts.layers), paths) if cfg.method == "galore" else None
    device = torch.device("cuda" if on_gpu else "cpu")
    size = store_cfg.chunk_size
    chunks: list[_Chunk] = []

    shards = store_cfg.num_shards

    def add(
        entries: list,
        kind: str,
        home: str | Tier,
        used_on: Tier,
        changed: bool,
        in_place: bool = False,
        layer: bool = False,
        group: int = -1,
        role: str = "weights",
    ) -> None:
        for layout in pack_tensors(entries, max(size, 1), shards):
            chunks.append(
                _Chunk(
                    kind,
                    Tier(home),
                    layout.capacity,
                    used_on,
                    changed,
                    in_place,
                    entries,
                    layer,
                    layout,
                    group,
                    role,
                )
            )

    trained_flag = cfg.method != "lora"
    clipping = cfg.clips
    parameters = trained = 0
    units: list[dict[str, _Chunk]] = []  # per optimizer unit: its weights and state chunks, by role
    # a frozen base on disk: read in place where files hold it (each rank of several its shard of them)
    split = (
        _in_place_split(model_path, model, cfg, quant, saved)
        if not trained_flag and cfg.params == "disk"
        else None
    )

    def weight_chunk(
        kind: str, home: str | Tier, layout: ChunkLayout, in_place: bool, layer: bool, gi: int
    ) -> None:
        """A weight chunk as the loader registers it: whole, or (ZeRO-3, ``load_shards``) a rank's shard of it,
        every rank's the same capacity."""
        mine = shard_layout(layout, 0, shards) if shards > 1 else layout
        chunks.append(
            _Chunk(
                kind,
                Tier(home),
                mine.capacity,
                Tier.DEVICE,
                trained_flag and not in_place,
                in_place,
                [(t.name, t.shape, t.dtype) for t in mine.tensors],
                layer,
                mine,
                gi,
                "weights",
                layout if shards > 1 else None,
            )
        )

    for gi, group in enumerate(parts.groups):
        parameters += group.numel
        layer = group.kind == "layer"
        # weights are used on the device; trained fp32 weights are their own master, changed on the host too
        entries = weight_entries(group, cfg.dtype, quant)
        kind = "weights"
        if split is not None:
            mapped, entries = split(group)
            # laid out over the files as the store lays them (a ledger's files: stamped by no one)
            for layout, _ in plan_in_place(mapped, max(size, 1), stamped=False) if mapped else ():
                if shards > 1:  # padded for the shards (``load_shards``)
                    layout = ChunkLayout(layout.tensors, round_up(layout.capacity, ALIGN * shards), shards)
                weight_chunk(IN_PLACE, Tier.DISK, layout, True, layer, gi)
            # as the loader homes it: a checkpoint saved quantized holds every quantized linear weight
            prequantized = (
                {n for n, p in group.params.items() if is_quantized(p)} if saved is not None else ()
            )
            if quant is not None and quantized_on_load(group, prequantized) and cfg.quant_cache is not None:
                kind = QUANT_CACHE
        before = len(chunks)
        for layout in pack_tensors(entries, max(size, 1), shards) if entries else ():
            weight_chunk(kind, cfg.params, layout, kind == QUANT_CACHE, layer, gi)
        if not trained_flag:
            continue
        trained += group.numel
        weights, chunks[before:] = chunks[before:], []
        for w in weights:  # each weight chunk followed by its states (``layout.add_states``)
            chunks.append(w)
            units.append(_states(chunks, cfg, galore, device, gi))
    hidden = model.config.get_text_config(decoder=True).hidden_size
    act = cfg.activation_tokens * hidden * itemsize(cfg.dtype)
    beside: dict[str, int] = {}
    m = len(schedule_waves(cfg, k)[0])  # micro-batches per wave
    if cfg.activations == "host":  # ``stash.ChunkStash``: a chunk per layer boundary, a slot per micro-batch

        def boundaries(slots: int) -> list[_Chunk]:
            before = len(chunks)
            for _ in range(len(parts.layers) + 1):
                add(
                    [("x", (slots * cfg.activation_tokens * hidden,), cfg.dtype)],
                    "activations",
                    Tier.HOST,
                    Tier.DEVICE,
                    True,
                    role="act",
                )
            laid, chunks[before:] = chunks[before:], []
            return laid

        if not cfg.wave_size:  # the most micro-batches at a time whose boundaries fit the budgets
            budgets = {Tier.DEVICE: store_cfg.device_budget, Tier.HOST: store_cfg.host_budget}
            while m > 1 and make_plan(chunks + boundaries(m), on_cpu=not on_gpu).short(budgets):
                m -= 1
            m = -(
                -k // -(-k // m)
            )  # as many waves, of even sizes: the boundaries take no more than they need
            if m < k:
                notes.append(
                    f"the hidden states at the layer boundaries of {k} micro-batches do not fit the budgets: a step "
                    f"runs as {-(-k // m)} waves of {m} micro-batches, each wave streaming the weights once"
                )
        chunks.extend(boundaries(stash_slots(cfg) if cfg.wave_size else m))
    else:  # ``stash.DeviceStash``
        beside["hidden states at the layer boundaries"] = act * m * (len(parts.layers) + 1)
    if layer_saved:
        beside["a layer's activations and temporaries (recompute and backward)"] = layer_saved
    # ``schedule._reference_layer``: the reference's boundary per micro-batch of the
    if cfg.objective.reference:
        # wave, and the one a layer's visit makes from it
        beside["the reference's hidden states (DPO)"] = act * (m + 1)
    # backward carries each micro-batch's gradient at a layer boundary; a trained layer's gradient is summed
    # over the wave in fp32
    beside["boundary gradients of a wave"] = act * m
    if trained_flag:
        beside["a layer's gradient, summed over a wave (fp32)"] = (
            max((sum(p.numel() for p in layer.parameters()) for layer in parts.layers), default=0) * 4
        )
    if trained_flag and cfg.overlap_optimizer != "off" and clipping:
        # the speculative step's twins: when the run fits with them (the plan, and the disk's room), or asked for
        before = len(chunks)
        for u in units:  # each a chunk laid out as its source is (``layout.add_twins``)
            for source in _sources(u):
                chunks.append(
                    dataclasses.replace(
                        source,
                        kind="twins",
                        used_on=home_tier_used(source.home, device),
                        changed=True,
                        layer=False,
                        role="twin",
                        whole=None,
                    )
                )
        budgets = {Tier.DEVICE: store_cfg.device_budget, Tier.HOST: store_cfg.host_budget}
        fits = (
            not make_plan(chunks, on_cpu=not on_gpu).short(budgets)
            and slot_bytes_of(chunks, store_cfg) <= disk_free
        )
        if cfg.overlap_optimizer != "on" and not fits:
            del chunks[before:]
    vocab = model.config.get_text_config(decoder=True).vocab_size
    from tiertune.kernels.architectures import FUSED_LOSS
    from tiertune.kernels.ops.linear_ce import working_bytes

    if cfg.kernels != "none" and model.config.model_type in FUSED_LOSS:
        # the loss fused with the head: its chunk of fp32 logits and what goes with it (the op's own figure),
        # and the head's fp32 gradient when the head is trained. On a GPU in bf16/fp16 the op's products run on
        # the tensor cores (larger chunks); a torch without them takes less, so the figure is an upper bound.
        head = vocab * hidden * 4 if trained_flag else 0
        mixed = on_gpu and cfg.dtype in (torch.bfloat16, torch.float16)
        capped = bool(getattr(model.config, "final_logit_softcapping", None))
        loss = working_bytes(cfg.activation_tokens, vocab, hidden, cfg.dtype, mixed, capped)
        beside["loss chunk (fused with the head)"] = loss + head
    else:  # the logits of a micro-batch, their fp32 copy for the loss and its gradient
        beside["logits and their gradient"] = cfg.activation_tokens * vocab * (itemsize(cfg.dtype) + 8)
    return RunLayout(chunks, parameters, trained, beside if outside else {}, m, measured)


def _layer_saved(model: torch.nn.Module, cfg, micro: int, k: int, notes: list[str], on_gpu: bool) -> int:
    """The most one decoder layer's recompute and backward hold at once (``activations``), for the most
    tokens a layer's visit runs at once: a micro-batch, or a stack of them (``stack_limit``); 0 with a note
    when the layer cannot be traced on the meta device."""
    from tiertune.engine.activations import layer_peak_bytes

    stack = min(cfg.stack_limit, k * micro) if cfg.stack_limit > 0 else 0
    try:
        return layer_peak_bytes(model, cfg, max(micro, stack), gpu=on_gpu)
    except Exception as exc:  # an op without a meta kernel: the figure is left out, and said
        notes.append(
            f"a layer's activations and temporaries are not counted (tracing it on the meta device failed: {exc})"
        )
        return 0


def _in_place_split(model_dir: str, model: torch.nn.Module, cfg, quant, saved: dict | None) -> Callable:
    """``split(group)`` -> (entries read in place from the model's files, entries in ordinary chunks), for a
    frozen base homed on disk: the loader's own decision (``read_in_place``) over the model's checkpoint, or,
    for a directory with only config.json, over the one transformers would save (``saved_checkpoint``, as a
    ledger trainer loads it). ``saved``: the checkpoint's own bitsandbytes quantization, None if it has none."""
    from tiertune.loading.model import checkpoint_names, read_in_place, saved_checkpoint

    checkpoint = saved_checkpoint(model_dir, model, quant, saved)
    source = checkpoint_names(model, checkpoint)

    def split(group) -> tuple[list, list]:
        return read_in_place(group, cfg.dtype, quant, checkpoint, source)

    return split


def _saved_quantization(
    model: torch.nn.Module, model_path: str, quantize: str, notes: list[str]
) -> dict | None:
    """The checkpoint's own quantization, as the run reads it (``saved_quantization``). One that tiertune
    cannot read (fp8, GPTQ, AWQ...) makes the run stop with a ModelError before it reads a weight; the
    estimate goes on with the model's shapes, as its unquantized release would be loaded, and says so."""
    from tiertune.quant import saved_quantization

    try:
        return saved_quantization(model.config, model_path)
    except ModelError as exc:
        notes.append(
            f"{exc}. The figures above are for the same model loaded from bf16 weights (model.quantize: "
            f"{quantize}); `tiertune train` on this model.path stops with this error"
        )
        return None


def _states(chunks: list[_Chunk], cfg, galore, device: torch.device, group: int) -> dict[str, _Chunk]:
    """Append the state chunks the engine registers beside the weight chunk last in ``chunks``
    (``layout.laid_states``: a rank's shard of a whole chunk, its states as large as the largest rank's);
    returns the optimizer unit: its chunks by role."""
    from tiertune.engine.layout import laid_states

    weights = chunks[-1]
    unit = {"weights": weights}
    for spec, layout in laid_states(weights.layout, cfg, galore, device, weights.whole):  # type: ignore[arg-type]
        chunks.append(
            _Chunk(
                spec.kind,
                Tier(spec.home),
                layout.capacity,
                spec.used_on,
                True,
                entries=spec.entries,
                layout=layout,
                group=group,
                role=spec.role,
            )
        )
        unit[spec.role] = chunks[-1]
    return unit


def _sources(unit: dict[str, _Chunk]) -> list[_Chunk]:
    """The chunks an optimizer unit rewrites (``GroupState.sources``): master weights (or fp32 weights), moments."""
    return [unit.get("master", unit["weights"]), unit["exp_avg"], unit["exp_avg_sq"]]


def slot_bytes_of(chunks: list[_Chunk], store_cfg: StoreConfig) -> int:
    """Bytes of the disk tier's slots for the disk-homed ``chunks`` (a header with a checksum per block, then
    the chunk); chunks read in place from files take none."""
    block = int(store_cfg.block_size)
    return sum(slot_bytes(c.capacity, block) for c in chunks if c.home is Tier.DISK and not c.in_place)
