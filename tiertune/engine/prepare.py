"""A whole model made ready to compute as the engine computes, outside a run: what the speed model measures
(``estimates.speed.measure_compute``) is the run's own preparation, not a copy of it; the skeleton the
estimate counts on."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from tiertune.engine.config import EngineConfig
from tiertune.engine.routing import route_experts
from tiertune.kernels.patch import patch_model, resolve_backend
from tiertune.loading.model import no_cache
from tiertune.methods.lora import Adapters


def prepare_model(model: nn.Module, cfg: EngineConfig, device: torch.device) -> str:
    """``model`` (built on ``device`` with its weights) as a step of ``cfg`` computes: in training mode
    without a KV cache (as the engine loads it); LoRA's adapters wrapped by peft as the engine wraps them, or
    every parameter trained; tiertune's ops patched into its modules where the run patches them. Returns the
    kernel backend its loss is computed with (``kernels.patch.resolve_backend``)."""
    backend = resolve_backend("torch" if cfg.kernels == "none" else cfg.kernels, device)
    route_experts(model)
    no_cache(model)
    model.train()
    if cfg.method == "lora":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            Adapters(model, cfg.lora, device)
    else:
        model.requires_grad_(True)
    if cfg.kernels != "none":
        patch_model(model, backend)
    return backend


def meta_skeleton(model_dir: str, dtype: torch.dtype) -> nn.Module:
    """The model of ``model_dir`` built on the meta device as the engine builds it, before any layer is
    converted: shapes only, nothing allocated, not even for a moment (one fused expert weight of DeepSeek-V3
    is 15 GB in bf16). What the estimate counts a step's FLOPs and traces a layer's activations on."""
    from tiertune.loading.model import build_skeleton

    with torch.device("meta"):
        model = build_skeleton(model_dir, dtype)
    route_experts(model)  # as the engine computes it (Llama 4's experts described as transformers' others)
    return model


__all__ = ["meta_skeleton", "prepare_model"]
