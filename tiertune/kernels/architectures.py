"""What tiertune knows of each transformers architecture, by ``model_type``: one table.

- ``fused_loss``: the causal LM's logits are the decoder's output times a linear head, soft-capped by the
  config's ``final_logit_softcapping`` (Gemma 2/3) or scaled by its ``logit_scale`` (Cohere: the hidden
  states are scaled instead, the same product), MoE router losses added apart: the loss can run fused with
  the head (``kernels.ops.linear_ce``, ``engine.loss``).
- ``norm``, ``mlp``, ``attention``: the module classes (by name, in the architecture's modeling module) whose
  forwards ``kernels.patch`` replaces with tiertune's ops (RMSNorm, gated MLP, RoPE in attention); None where
  the architecture keeps transformers' own modules.
- ``mlp_norm``: the decoder layer's norm whose output only its (dense) MLP reads; the MLP's sequence tiling
  takes it into the tiled block (``engine.tiling``). None where no norm feeds the MLP alone, or unchecked.
- ``mlp_residual``: the layer adds the MLP's output to its residual at once (``residual + mlp(...)``) and reads
  it no more: the sum may go into the MLP's output in place.
- ``attention_norm``: the layer's norm whose output only its attention's input projections read (q/k/v, or
  Phi-3's one qkv); the sequence tiling folds it into each of them. None where another module reads it too (a
  parallel block's shared norm) or where it is unchecked.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Architecture:
    """One architecture's entry (see the module docstring)."""

    fused_loss: bool = True
    norm: str | None = None  # RMSNorm class
    mlp: str | None = None  # gated MLP class: gate_proj/up_proj/down_proj, or one gate_up_proj (phi3)
    attention: str | None = None  # attention class whose forward calls the module's apply_rotary_pos_emb
    norm_offset: float = 0.0  # Gemma scales by 1 + weight, in fp32
    mlp_norm: str | None = None  # the layer's norm feeding only its MLP: ``h = mlp(mlp_norm(h))``
    mlp_residual: bool = False  # ``h = residual + mlp(...)``, the MLP's output read by nothing else
    attention_norm: str | None = None  # the layer's norm feeding only the attention's q/k/v projections


def _patched(
    prefix: str, mlp_norm: str = "post_attention_layernorm", mlp_residual: bool = True, **kwargs: float
) -> Architecture:
    return Architecture(
        True,
        f"{prefix}RMSNorm",
        f"{prefix}MLP",
        f"{prefix}Attention",
        mlp_norm=mlp_norm,
        mlp_residual=mlp_residual,
        attention_norm="input_layernorm",
        **kwargs,
    )


ARCHITECTURES: dict[str, Architecture] = {
    "llama": _patched("Llama"),
    "mistral": _patched("Mistral"),
    "qwen2": _patched("Qwen2"),
    "qwen3": _patched("Qwen3"),
    "gemma": _patched("Gemma", norm_offset=1.0),
    # sandwich norms: post_attention_layernorm norms the attention's output before its residual add, and
    # post_feedforward_layernorm the MLP's
    "gemma2": _patched("Gemma2", "pre_feedforward_layernorm", False, norm_offset=1.0),
    "gemma3_text": _patched("Gemma3", "pre_feedforward_layernorm", False, norm_offset=1.0),
    "phi3": _patched("Phi3", mlp_residual=False),  # a dropout between the MLP and the residual
    **{
        name: Architecture()
        for name in (
            "olmo2",
            "stablelm",
            "gpt_neox",
            "cohere",
            "cohere2",
            "mixtral",
            "qwen2_moe",
            "qwen3_moe",
            "deepseek_v3",
            "glm4_moe",
            "gpt_oss",
            "llama4_text",
        )
    },
}

PATCHED = tuple(sorted(name for name, a in ARCHITECTURES.items() if a.norm is not None))
"""The architectures whose modules ``kernels.patch`` gives tiertune's ops."""

FUSED_LOSS = frozenset(name for name, a in ARCHITECTURES.items() if a.fused_loss)
"""The architectures whose loss runs fused with the head."""


def mlp_fold(model_type: str) -> tuple[str | None, bool]:
    """``model_type``'s ``mlp_norm`` and ``mlp_residual`` (None and False where it is not in the table)."""
    arch = ARCHITECTURES.get(model_type, Architecture())
    return arch.mlp_norm, arch.mlp_residual


def attention_fold(model_type: str) -> str | None:
    """``model_type``'s ``attention_norm`` (None where it is not in the table)."""
    return ARCHITECTURES.get(model_type, Architecture()).attention_norm
