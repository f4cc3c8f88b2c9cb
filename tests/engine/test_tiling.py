"""Sequence tiling (``engine.tiling``) and segment attention at 2K tokens: a layer's MLP computed 256 tokens at
a time gives the untiled run's and a plain PyTorch loop's losses, gradient norms and weights, on two
architectures; the tiled block's own gradients equal the untiled block's (fp32, 1e-6 relative)."""

import copy

import pytest
import torch
from parity import _config, plain_training

from tiertune.engine import StreamedTrainer, tiling
from tiertune.offload.store import StoreConfig

STEPS = 2
SEQ = 1024  # 2 rows: 2048 tokens a micro-batch


def _batches(vocab: int, count: int) -> list[dict]:
    """Micro-batches of 2 x 1024 tokens, the second row padded by a different amount each time."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(count):
        ids = torch.randint(0, vocab, (2, SEQ), generator=g)
        mask = torch.ones_like(ids)
        mask[1, SEQ - 37 * (i + 1) :] = 0
        out.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return out


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def test_a_tiled_mlp_has_the_untiled_gradients():
    """A Llama MLP on 1000 tokens in tiles of 96 (the last one short): output, input gradient and weight
    gradients equal the untiled block's to 1e-6 relative; forward keeps no intermediate activation."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    torch.manual_seed(0)
    layer = LlamaDecoderLayer(LlamaConfig(hidden_size=64, intermediate_size=176, num_attention_heads=4), 0)
    tiled = copy.deepcopy(layer)
    assert tiling.tile_mlp(tiled, 96)
    x = torch.randn(2, 500, 64)
    g = torch.randn(2, 500, 64)
    results = []
    for block in (layer.mlp, tiled.mlp):
        xi = x.clone().requires_grad_(True)
        out = block(xi)
        out.backward(g)
        results.append((out.detach(), xi.grad, {n: p.grad for n, p in block.named_parameters()}))
    (o1, gx1, gp1), (o2, gx2, gp2) = results
    assert _relative(o2, o1) <= 1e-6 and _relative(gx2, gx1) <= 1e-6
    for name in gp1:
        assert _relative(gp2[name], gp1[name]) <= 1e-6, name


def test_a_tiled_block_with_dropout_recomputes_what_forward_drew():
    """Dropout inside the block: backward's recomputation draws each tile's forward masks again, so the
    gradients are those of the function forward computed (the same tiles, the same seed, by hand)."""
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.Dropout(0.3), torch.nn.Linear(48, 16))
    holder = torch.nn.Module()
    holder.mlp = block
    x = torch.randn(1, 300, 16)
    g = torch.randn(1, 300, 16)
    torch.manual_seed(7)
    xs = x.clone().requires_grad_(True)
    expected = torch.cat([block(part) for part in xs.split(64, dim=1)], dim=1)
    expected.backward(g)
    want = (xs.grad.clone(), [p.grad.clone() for p in block.parameters()])
    block.zero_grad()
    assert tiling.tile_mlp(holder, 64)
    torch.manual_seed(7)
    xt = x.clone().requires_grad_(True)
    out = block(xt)
    out.backward(g)
    torch.testing.assert_close(out.detach(), expected.detach(), rtol=0, atol=0)
    assert _relative(xt.grad, want[0]) <= 1e-6
    for p, w in zip(block.parameters(), want[1], strict=True):  # the same sum over tiles, in another order
        assert _relative(p.grad, w) <= 1e-6


def test_an_moe_block_keeps_its_own_forward():
    holder = torch.nn.Module()
    holder.mlp = torch.nn.Module()
    holder.mlp.experts = torch.nn.ModuleList([torch.nn.Linear(4, 4)])
    assert not tiling.tile_mlp(holder, 64)
    assert not tiling.tile_mlp(torch.nn.Module(), 64)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tiled_equals_untiled_equals_a_plain_loop_at_2k_tokens(tiny_model_dir, disk_dir, family):
    """Full fine-tuning, 2 steps of 2 micro-batches of 2 x 1024 tokens (padded rows: segment attention), the
    MLPs and the attention's input projections tiled by 256 tokens and untiled: losses and gradient norms equal
    the plain loop's to 1e-6, weights to 1e-5; the tiled run tiles every layer's MLP and q/k/v projections in
    each micro-batch's recompute and backward."""
    from transformers import AutoModelForCausalLM

    path, _ = tiny_model_dir(family)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    reference.config.use_cache = False
    reference.train()
    params = dict(reference.named_parameters())
    base = dict(
        params="host",
        optimizer_states="host",
        gradients="host",
        max_steps=STEPS,
        gradient_accumulation_steps=2,
        activation_tokens=2 * SEQ,
        activations="host",
    )
    cfg = _config(**base)
    groups = [
        {"params": [p for p in params.values() if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params.values() if p.dim() < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(
        groups, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon, fused=True
    )
    batches = _batches(reference.config.vocab_size, STEPS * 2)
    norms_expected: list[float] = []
    expected = plain_training(reference, opt, list(params.values()), cfg, batches, STEPS, 2, norms_expected)

    runs = {}
    for tile in (256, 0):
        calls = []
        apply = tiling._Tiled.apply

        def counted(*args, apply=apply, calls=calls):
            calls.append(args[1])
            return apply(*args)

        tiling._Tiled.apply = counted
        store = StoreConfig.resolve(
            device_budget="64MiB", host_budget="256MiB", chunk_size="1MiB", prefetch_depth=1
        )
        trainer = StreamedTrainer(str(path), store, _config(**base, sequence_tile=tile, kernels="torch"))
        try:
            losses, norms = [], []
            for s in range(STEPS):
                losses.append(trainer.step(batches[s * 2 : (s + 1) * 2]))
                norms.append(trainer.last_grad_norm)
            runs[tile] = (losses, norms, trainer.state_dict(), len(calls), trainer.attention_kept)
        finally:
            tiling._Tiled.apply = apply
            trainer.close()
    layers = reference.config.num_hidden_layers
    # the recompute of each micro-batch in backward (forward runs without autograd: tiles, nothing kept): four
    # tiled blocks a layer, the MLP and the q, k and v projections with the attention's input norm
    assert runs[256][3] == 2 * STEPS * layers * 4 and runs[0][3] == 0
    for tile, (losses, norms, weights, _, kept) in runs.items():
        assert kept is None, kept  # segment attention in both
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(expected), rtol=1e-6, atol=0, msg=str(tile)
        )
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(norms_expected), rtol=1e-6, atol=0)
        for name, p in params.items():
            worst = float((weights[name] - p.detach()).abs().max() / p.detach().abs().max().clamp_min(1e-12))
            assert worst <= 1e-5, (tile, name)


@pytest.mark.parametrize("family", ["llama", "gemma", "gemma2"])
def test_the_mlps_norm_and_residual_join_the_tiled_block(family):
    """The norm before the MLP (``kernels.architectures``: Llama's and Gemma 1's post-attention norm, Gemma 2's
    pre-feedforward one) runs inside the tiles, and Llama's and Gemma 1's residual sum goes into the block's
    output in place: the layer's
    output and every gradient equal the untiled layer's (fp32, 1e-6), the norm module passes its input through,
    the output is a plain tensor, and forward and backward hold less at their peak than with the MLP tiled alone
    (no whole-length normed sequence, and with the residual in place no block output beside the layer's: at
    least 3/4 of one, resp. two, hidden states' bytes less)."""
    from tiertune.engine.activations import LiveBytes
    from tiertune.kernels.architectures import mlp_fold

    if family == "llama":
        from transformers import LlamaConfig as Config
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer as Layer
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding as Rotary
    elif family == "gemma":
        from transformers import GemmaConfig as Config
        from transformers.models.gemma.modeling_gemma import GemmaDecoderLayer as Layer
        from transformers.models.gemma.modeling_gemma import GemmaRotaryEmbedding as Rotary
    else:
        from transformers import Gemma2Config as Config
        from transformers.models.gemma2.modeling_gemma2 import Gemma2DecoderLayer as Layer
        from transformers.models.gemma2.modeling_gemma2 import Gemma2RotaryEmbedding as Rotary
    config = Config(
        hidden_size=64,
        intermediate_size=176,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        attn_implementation="sdpa",
        sliding_window=None,
        attn_logit_softcapping=None,
    )
    norm, residual = mlp_fold(config.model_type)
    assert (norm, residual) == (
        ("pre_feedforward_layernorm", False) if family == "gemma2" else ("post_attention_layernorm", True)
    )
    torch.manual_seed(0)
    layer = Layer(config, 0).train()
    for p in layer.parameters():  # norms with weights away from their initial ones
        p.data.add_(torch.randn_like(p) * 0.1)
    tokens = 1000
    x = torch.randn(1, tokens, 64)
    g = torch.randn(1, tokens, 64)
    embeddings = Rotary(config)(x, torch.arange(tokens)[None])
    results, peaks = [], []
    for model_type in (None, "", config.model_type):  # untiled, the MLP alone, with what the table says
        block = copy.deepcopy(layer)
        if model_type is not None:
            assert tiling.tile_mlp(block, 96, model_type)
        xi = x.clone().requires_grad_(True)
        with LiveBytes() as live:
            out = block(xi, attention_mask=None, position_embeddings=embeddings)
            out = out[0] if isinstance(out, tuple) else out
            assert type(out) is torch.Tensor
            out.backward(g)
        peaks.append(live.peak)
        results.append((out.detach(), xi.grad, {n: p.grad for n, p in block.named_parameters()}))
    probe = torch.randn(3, 64)
    assert getattr(block, norm)(probe) is probe
    (o1, gx1, gp1) = results[0]
    for o2, gx2, gp2 in results[1:]:
        assert _relative(o2, o1) <= 1e-6 and _relative(gx2, gx1) <= 1e-6
        for name in gp1:
            assert _relative(gp2[name], gp1[name]) <= 1e-6, name
    saved = 0.75 * (2 if residual else 1) * tokens * 64 * 4
    assert peaks[2] <= peaks[1] - saved, [p / (tokens * 64 * 4) for p in peaks]


def _layer(family: str):
    """A small decoder layer of ``family`` (its config, the layer, its rotary embedding) with weights away from
    their initial values."""
    if family == "llama":
        from transformers import LlamaConfig as Config
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer as Layer
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding as Rotary
    elif family == "qwen3":
        from transformers import Qwen3Config as Config
        from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer as Layer
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding as Rotary
    elif family == "gemma2":
        from transformers import Gemma2Config as Config
        from transformers.models.gemma2.modeling_gemma2 import Gemma2DecoderLayer as Layer
        from transformers.models.gemma2.modeling_gemma2 import Gemma2RotaryEmbedding as Rotary
    else:
        from transformers import Phi3Config as Config
        from transformers.models.phi3.modeling_phi3 import Phi3DecoderLayer as Layer
        from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding as Rotary
    config = Config(
        hidden_size=64,
        intermediate_size=176,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        attn_implementation="sdpa",
        sliding_window=None,
        attn_logit_softcapping=None,
    )
    torch.manual_seed(0)
    layer = Layer(config, 0).train()
    for p in layer.parameters():
        p.data.add_(torch.randn_like(p) * 0.1)
    return config, layer, Rotary(config)


@pytest.mark.parametrize("method", ["full", "lora"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "phi3"])
def test_the_attentions_input_norm_joins_its_projections_tiled(family, method):
    """The attention's input norm folded into its q/k/v projections (Phi-3: the one qkv projection), each a
    tiled block over the layer's input: the layer's output and every gradient (the input's, the weights' or the
    adapters') equal the untiled layer's (fp32, 1e-6); backward holds at least 3/4 of a hidden state's bytes
    less at its peak than with the MLP tiled alone (no whole-length normed sequence); a pass without autograd,
    and a sequence of at most one tile, norm once, as without the fold."""
    from peft import LoraConfig, inject_adapter_in_model

    from tiertune.engine.activations import LiveBytes

    config, layer, rotary = _layer(family)
    if method == "lora":
        targets = ["qkv_proj", "o_proj"] if family == "phi3" else ["q_proj", "k_proj", "v_proj", "o_proj"]
        inject_adapter_in_model(
            LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False), layer
        )
    tokens = 1000
    x = torch.randn(1, tokens, 64)
    g = torch.randn(1, tokens, 64)
    embeddings = rotary(x, torch.arange(tokens)[None])
    results, peaks = [], []
    for fold in (None, tiling.tile_mlp, tiling.tile_layer):
        block = copy.deepcopy(layer)
        if fold is not None:
            fold(block, 96, config.model_type)
        xi = x.clone().requires_grad_(True)
        with LiveBytes() as live:
            out = block(xi, attention_mask=None, position_embeddings=embeddings)
            out = out[0] if isinstance(out, tuple) else out
            out.backward(g)
        peaks.append(live.peak)
        trained = {n: p.grad for n, p in block.named_parameters() if p.requires_grad}
        assert all(grad is not None for grad in trained.values()), family
        results.append((out.detach(), xi.grad, trained))
    (o1, gx1, gp1) = results[0]
    for o2, gx2, gp2 in results[1:]:
        assert _relative(o2, o1) <= 1e-6 and _relative(gx2, gx1) <= 1e-6
        assert gp2.keys() == gp1.keys()
        for name in gp1:
            assert _relative(gp2[name], gp1[name]) <= 1e-6, name
    assert peaks[2] <= peaks[1] - 0.75 * tokens * 64 * 4, [p / (tokens * 64 * 4) for p in peaks]
    # the folded layer's norm, without autograd and on a short sequence: the normed input
    norm = block.input_layernorm
    probe = torch.randn(1, tokens, 64)
    with torch.no_grad():
        assert not torch.equal(norm(probe), probe)
    assert not torch.equal(norm(probe[:, :96]), probe[:, :96]) and norm(probe) is probe


def test_no_fold_where_the_table_names_no_attention_norm():
    """An architecture the table does not list (a parallel block's shared norm, say): its attention keeps its
    input norm."""
    _, layer, _ = _layer("llama")
    assert not tiling.tile_projections(layer, 96, "cohere") and not tiling.tile_projections(layer, 96, None)
    assert tiling.tile_projections(layer, 96, "llama") and not tiling.tile_projections(layer, 0, "llama")


def test_a_projection_given_another_input_than_the_norm_passed_through_is_an_error():
    """A layer that does not feed its attention the norm's output unchanged (not what the table says of it) is
    stopped with a message, never computed on the un-normed input."""
    _, layer, _ = _layer("llama")
    assert tiling.tile_projections(layer, 96, "llama")
    x = torch.randn(1, 200, 64, requires_grad=True)
    assert layer.input_layernorm(x) is x
    with pytest.raises(RuntimeError, match="sequence_tile: 0"):
        layer.self_attn.q_proj(x * 1.0)
