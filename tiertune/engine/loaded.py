"""The model a run trains, made ready for the engine (``load_model``): the skeleton on the meta device, its
quantized layers converted as a quantized load converts them, and its weights streamed into the store: whole
chunks for one process, this rank's shard of each for one of several (ZeRO-3, ``engine.sharding``)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from tiertune.distributed.collectives import GROUP, Counting
from tiertune.distributed.world import World
from tiertune.engine.config import EngineConfig
from tiertune.engine.routing import route_experts
from tiertune.engine.sharding import Local, Sharding, Zero
from tiertune.errors import ConfigError, ModelError
from tiertune.loading.model import (
    ModelParts,
    TensorSource,
    build_skeleton,
    load_into_store,
    load_shards,
    no_cache,
    saved_checkpoint,
    split_model,
)
from tiertune.loading.weights import Checkpoint
from tiertune.offload.store import ChunkStore
from tiertune.quant import Quantizer, make_quantizer, saved_quantization, store_experts
from tiertune.quant import experts as quant_experts
from tiertune.quant.shipped import is_shipped_format

if TYPE_CHECKING:
    from tiertune.loading.quant_cache import LedgerCache, QuantCache

log = logging.getLogger("tiertune.engine")


@dataclass
class LoadedModel:
    """What ``load_model`` made: the model instance and its parts (their groups' chunks in the store), the
    quantizer of its layers (None: not quantized), the checkpoint and where each parameter is in it, and how
    the chunks are held among the ranks (``Local`` for one process, ``Zero`` for one rank of several)."""

    model: nn.Module
    parts: ModelParts
    quant: Quantizer | None
    checkpoint: Checkpoint  # on a ledger over a config.json alone: ``weights.AsSaved``
    source: dict[str, TensorSource]
    sharding: Sharding
    # where quantized layers were read from or kept (one process; a ledger's stands in for a first run's)
    quant_cache: QuantCache | LedgerCache | None = None


def load_model(
    model_dir: str,
    store: ChunkStore,
    config: EngineConfig,
    world: World,
    times: dict[str, float],
    safe_point: Callable[[], None] | None = None,
) -> LoadedModel:
    """Build the model of ``model_dir`` for training and stream its weights into ``store`` (homed on
    ``config.params``); ``safe_point`` is called after each group (see ``loading.model.load_into_store``)."""
    model = build_skeleton(model_dir, config.dtype)
    route_experts(model)  # Llama 4's experts: each on its routed tokens (transformers runs all on all)
    no_cache(model)
    model.train()  # dropout as configured, and no inference-only kernels (as the HF Trainer does)
    parts = split_model(model)
    try:
        saved = saved_quantization(model.config, model_dir)
    except ModelError:
        if not store.ledger:
            raise
        saved = None  # estimated as its unquantized release would load (the estimate says so)
    # 4-bit weights dequantize to the dtype products run fast in here (fp32 on a CPU without native bf16)
    compute = config.layer_dtype(store.device)
    if compute != config.dtype:
        log.info(
            "this CPU has no native %s matrix products: quantized layers compute in %s",
            str(config.dtype).removeprefix("torch."),
            str(compute).removeprefix("torch."),
        )
    quant = make_quantizer(config.quantize, compute, saved, model_dir)
    shipped = (
        None  # a full fine-tune of a base that ships FP8: every weight trained from its dequantized values
    )
    if is_shipped_format(quant) and config.trains_base:
        shipped, quant = quant, None
    if is_shipped_format(quant) and config.lora.use_dora:
        raise ConfigError(
            f"method.lora.use_dora on {model_dir}, whose weights are read as they ship "
            f"({quant.kind}): peft's DoRA reads a base weight's values itself and cannot read these yet; set "  # type: ignore[union-attr]
            "method.lora.use_dora: false (LoRA), or train DoRA on the model's 16-bit release"
        )
    if quant is not None:  # Linear4bit/8bitLt in every decoder layer, as a plain quantized load has
        # and, beyond it, MoE layers' fused expert weights 4-bit too (one matrix per expert)
        marked = []
        for i, layer in enumerate(parts.layers):
            if is_shipped_format(quant):  # its skip list names modules by their full names
                quant.convert(layer, f"{parts.layers_name}.{i}")
            else:
                quant.convert(layer)
            marked += store_experts(layer, quant)
        if marked:
            quant_experts.use_4bit_experts(model)
            how = "as shipped" if is_shipped_format(quant) else "4-bit"
            log.info("experts: %s stored %s, one matrix per expert", ", ".join(sorted(set(marked))), how)
        parts = split_model(model)
    homes = dict.fromkeys(("embed", "layer", "rest", "head"), config.params)
    # a ledger reads no weight: a config.json alone will do (the checkpoint transformers would save)
    checkpoint = saved_checkpoint(model_dir, model, quant, saved) if store.ledger else Checkpoint(model_dir)
    checkpoint.dequantize = shipped
    if (
        hasattr(quant or shipped, "adopt") and not store.ledger
    ):  # what the config does not say (scales' dtype)
        (quant or shipped).adopt(checkpoint)  # type: ignore[union-attr]
    cache = None
    # a pre-quantized checkpoint too: an MoE's experts are saved unquantized (transformers leaves them so)
    if quant is not None and config.quant_cache is not None:
        from tiertune.loading.quant_cache import LedgerCache, QuantCache

        cache = (
            LedgerCache() if store.ledger else QuantCache(config.quant_cache, checkpoint, quant.settings())
        )
    if world.size > 1:  # this rank's shard of every chunk; a frozen base's read in place, as one process's
        source, full = load_shards(
            parts,
            checkpoint,
            store,
            homes,
            config.dtype,
            world.rank,
            world.size,
            quant,
            safe_point=safe_point,
            in_place=not config.trains_base,
            cache=cache,
        )
        # a ledger's collectives count the bytes each would send among world.size ranks, and join no group
        collectives = Counting(world.size) if store.ledger else GROUP
        zero = Zero(store, world, full, times, collectives)
        return LoadedModel(model, parts, quant, checkpoint, source, zero, cache)
    source = load_into_store(
        parts,
        checkpoint,
        store,
        homes,
        config.dtype,
        quant,
        cache=cache,
        safe_point=safe_point,
        in_place=not config.trains_base,
    )
    if cache is not None:
        log.info("quantized layers: %d read from %s, %d quantized", cache.hits, cache.directory, cache.misses)
    return LoadedModel(model, parts, quant, checkpoint, source, Local(store, times), cache)
