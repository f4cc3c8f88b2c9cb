"""Tiny random models of each family tiertune knows, built from configs (no hub): ``tiny_config``."""

from __future__ import annotations


def tiny_config(family: str, layers: int = 4):
    from transformers import GPTNeoXConfig, LlamaConfig, Qwen2Config

    common = dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4, vocab_size=211
    )
    if family == "llama":
        return LlamaConfig(**common, num_key_value_heads=2, tie_word_embeddings=True)
    if family == "qwen2":
        return Qwen2Config(**common, num_key_value_heads=2, tie_word_embeddings=False)
    if family == "gpt_neox":
        return GPTNeoXConfig(**common, tie_word_embeddings=False)
    import transformers

    more = {  # other decoder-only families people fine-tune: found generically, no per-family code
        "mistral": ("MistralConfig", dict(num_key_value_heads=2)),
        "qwen3": ("Qwen3Config", dict(num_key_value_heads=2, head_dim=16)),
        # tied and scaled embeddings, 1+w norms
        "gemma": ("GemmaConfig", dict(num_key_value_heads=2, head_dim=16)),
        # soft-capping and a sliding window, both small enough to act on these logits and sequences
        "gemma2": (
            "Gemma2Config",
            dict(num_key_value_heads=2, head_dim=16, final_logit_softcapping=1.0, sliding_window=4),
        ),
        # q/k norms too, sliding and full attention layers in turn
        "gemma3_text": (
            "Gemma3TextConfig",
            dict(
                num_key_value_heads=2,
                head_dim=16,
                final_logit_softcapping=1.0,
                sliding_window=4,
                layer_types=[("sliding_attention", "full_attention")[i % 2] for i in range(layers)],
            ),
        ),
        "phi3": ("Phi3Config", dict(num_key_value_heads=2, pad_token_id=0)),  # fused qkv and gate_up
        "olmo2": ("Olmo2Config", dict(num_key_value_heads=2)),
        "stablelm": ("StableLmConfig", dict(num_key_value_heads=2)),  # partial rotary, biases
        # logits scaled by logit_scale (Command R+), parallel attention and MLP, tied embeddings
        "cohere": ("CohereConfig", dict(num_key_value_heads=2, logit_scale=0.5)),
        # mixtures of experts: checkpoints keep a tensor per expert, transformers 5 fuses them on load
        "mixtral": ("MixtralConfig", dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)),
        "qwen3_moe": (
            "Qwen3MoeConfig",
            dict(
                num_key_value_heads=2,
                head_dim=16,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
            ),
        ),
        # shared experts, multi-head latent attention, a dense first layer
        "deepseek_v3": (
            "DeepseekV3Config",
            dict(
                num_key_value_heads=4,
                n_routed_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                n_shared_experts=1,
                first_k_dense_replace=1,
                n_group=1,
                topk_group=1,
                q_lora_rank=32,
                kv_lora_rank=16,
                qk_rope_head_dim=8,
                qk_nope_head_dim=8,
                v_head_dim=16,
            ),
        ),
    }
    name, extra = more[family]
    return getattr(transformers, name)(**common, **extra)


def save_llama4(path):
    """A tiny Llama 4 (its vision encoder and adapter, a projector, a language model with chunked attention and
    a NoPE layer, dense and MoE layers: a routed expert's fused weights, a shared expert, a router) saved in
    ``path`` as ``save_pretrained`` writes its ``ForConditionalGeneration`` (the class its releases name), in
    shards; returns ``path``."""
    import torch
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    torch.manual_seed(0)
    config = Llama4Config(
        text_config=dict(
            hidden_size=64,
            intermediate_size=48,
            intermediate_size_mlp=96,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=211,
            num_local_experts=4,
            num_experts_per_tok=1,
            interleave_moe_layer_step=2,
            attention_chunk_size=8,
            no_rope_layers=[1, 1, 1, 0],
        ),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
            vision_output_dim=32,
            projector_input_dim=32,
            projector_output_dim=32,
        ),
    )
    Llama4ForConditionalGeneration(config).save_pretrained(path, max_shard_size="60KB")
    return path
