import json

import pytest
import torch
from torch import nn

from tiertune.errors import ModelError
from tiertune.loading.model import (
    build_skeleton,
    find_decoder_layers,
    load_buffers,
    load_config,
    load_into_store,
    split_model,
)
from tiertune.loading.weights import Checkpoint
from tiertune.offload.store import ChunkStore, StoreConfig
from tiertune.offload.tiers import Tier


@pytest.mark.parametrize(
    ("family", "tied", "layers_name"),
    [
        ("llama", True, "model.layers"),
        ("qwen2", False, "model.layers"),
        ("gpt_neox", False, "gpt_neox.layers"),
    ],
)
def test_split_finds_layers_embeddings_head_and_groups_every_parameter_once(
    tiny_model_dir, family, tied, layers_name
):
    path, _ = tiny_model_dir(family)
    skeleton = build_skeleton(path)
    assert all(p.is_meta for p in skeleton.parameters())
    assert all(not b.is_meta for b in skeleton.buffers())  # rotary caches are real
    parts = split_model(skeleton)
    assert parts.layers_name == layers_name and len(parts.layers) == 4
    assert parts.tied is tied
    names = [n for g in parts.groups for n in g.params]
    assert len(names) == len(set(names)) == len(dict(skeleton.named_parameters()))
    kinds = [g.kind for g in parts.groups]
    assert kinds == ["embed"] + ["layer"] * 4 + ["rest"] + ([] if tied else ["head"])


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt_neox"])
@pytest.mark.parametrize("home", ["device", "host", "disk"])
def test_streamed_load_puts_every_weight_in_its_chunk(tiny_model_dir, disk_dir, family, home):
    path, model = tiny_model_dir(family)
    parts = split_model(build_skeleton(path))
    cfg = StoreConfig.resolve(
        device_budget="4MiB", host_budget="1MiB", disk_path=str(disk_dir), chunk_size="64KiB"
    )
    with ChunkStore(cfg) as store:
        load_into_store(parts, Checkpoint(path), store, home, torch.float32)
        expected = model.state_dict()
        for group in parts.groups:
            assert group.chunks and all(c.home is Tier(home) for c in group.chunks)
            for chunk in group.chunks:
                for name, value in store.read(chunk).items():
                    assert torch.equal(value, expected[name]), name
        assert store.stats().tiers["host"].peak <= 1 << 20


def test_load_converts_dtype(tiny_model_dir, disk_dir):
    path, model = tiny_model_dir("qwen2")
    parts = split_model(build_skeleton(path))
    with ChunkStore(
        StoreConfig.resolve(device_budget="4MiB", host_budget="4MiB", disk_path=str(disk_dir))
    ) as store:
        load_into_store(
            parts,
            Checkpoint(path),
            store,
            {"embed": "host", "layer": "disk", "rest": "host", "head": "disk"},
            torch.bfloat16,
        )
        chunk = parts.groups[2].chunks[0]
        for name, value in store.read(chunk).items():
            assert value.dtype == torch.bfloat16 and torch.equal(value, model.state_dict()[name].bfloat16())


def test_a_model_without_a_layer_stack_is_named():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)
            self.norm = nn.LayerNorm(4)

    with pytest.raises(ModelError, match=r"Odd has no recognizable stack.*proj: Linear, norm: LayerNorm"):
        find_decoder_layers(Odd())


def test_generic_discovery_prefers_the_largest_homogeneous_list():
    class Block(nn.Module):
        def __init__(self, n):
            super().__init__()
            self.experts = nn.ModuleList(nn.Linear(n, n) for _ in range(3))  # a nested list inside each block

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.heads = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
            self.blocks = nn.ModuleList(Block(8) for _ in range(5))

    name, layers = find_decoder_layers(Net())
    assert name == "blocks" and len(layers) == 5


def test_missing_model_dir_and_missing_tensor(tiny_model_dir, tmp_path, disk_dir):
    with pytest.raises(ModelError, match="no config.json"):
        build_skeleton(tmp_path)
    path, _ = tiny_model_dir("llama")
    parts = split_model(build_skeleton(path))
    parts.groups[1].params["model.layers.0.extra.weight"] = nn.Parameter(torch.empty(2, device="meta"))
    with (
        ChunkStore(
            StoreConfig.resolve(device_budget="1MiB", host_budget="1MiB", disk_path=str(disk_dir))
        ) as store,
        pytest.raises(ModelError, match="no tensor 'model.layers.0.extra.weight'"),
    ):
        load_into_store(parts, Checkpoint(path), store, "disk", torch.float32)


def _with_config(tiny_model_dir, tmp_path, text):
    import shutil

    path, _ = tiny_model_dir("llama")
    copy = tmp_path / "model"
    shutil.copytree(path, copy)
    (copy / "config.json").write_text(text)
    return copy


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda cfg: "{oops",
            r"config.json is not valid JSON \(Expecting property name .* at line 1, column 2\); "
            r"restore the config.json saved with the model",
        ),
        (lambda cfg: "[1, 2]", r"config.json holds a JSON list, expected an object of model settings"),
        (
            lambda cfg: json.dumps({k: v for k, v in cfg.items() if k != "model_type"}),
            r"config.json has no \"model_type\" key",
        ),
        (
            lambda cfg: json.dumps({**cfg, "model_type": "no_such_model"}),
            r"config.json: transformers .* cannot build a config of model_type 'no_such_model'",
        ),
    ],
    ids=["not json", "not an object", "no model_type", "unknown model_type"],
)
def test_an_invalid_config_json_is_a_model_error_naming_the_file(tiny_model_dir, tmp_path, edit, message):
    path, _ = tiny_model_dir("llama")
    cfg = json.loads((path / "config.json").read_text())
    copy = _with_config(tiny_model_dir, tmp_path, edit(cfg))
    with pytest.raises(ModelError, match=f"^{copy}/{message}"):
        build_skeleton(copy)
    with pytest.raises(ModelError, match=f"^{copy}/{message}"):
        load_config(copy)


def test_an_encoder_decoder_model_is_named_as_not_a_causal_lm(tiny_model_dir, tmp_path):
    from transformers import T5Config

    t5 = T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2, vocab_size=100)
    t5.architectures = ["T5ForConditionalGeneration"]
    copy = _with_config(tiny_model_dir, tmp_path, t5.to_json_string())
    with pytest.raises(
        ModelError,
        match=rf"^tiertune fine-tunes decoder-only causal LMs \(AutoModelForCausalLM\); "
        rf"{copy} is a t5 \(T5ForConditionalGeneration\), an encoder-decoder "
        r"model; set model.path to a decoder-only model",
    ):
        build_skeleton(copy)


def test_what_tiertune_cannot_train_is_refused_in_one_line_saying_what_to_do(tiny_model_dir, tmp_path):
    """An encoder-only model (BERT: transformers gives it a causal-LM head, bidirectional unless is_decoder) and
    a config transformers' model code fails on are each a ModelError in one line, never a traceback nor an
    estimate of something else; a multimodal class whose language model is a decoder (Gemma 3) and a multimodal
    config whose causal LM is the text decoder alone (Llama 4) are not refused, and their dimensions are the
    decoder's."""
    from transformers import BertConfig, Gemma3Config, Llama4Config

    from tiertune.loading.model import decoder_config

    bert = BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    copy = _with_config(tiny_model_dir, tmp_path / "bert", bert.to_json_string())
    with pytest.raises(
        ModelError,
        match=r"is a bert \(no architectures listed\), an encoder-only model \(pretrained "
        r"with bidirectional attention.*set model.path to a decoder-only model",
    ):
        build_skeleton(copy)
    gemma3 = (
        Gemma3Config()
    )  # a multimodal class whose language model is a decoder: trained on text, not refused
    gemma3.architectures = ["Gemma3ForConditionalGeneration"]
    copy = _with_config(tiny_model_dir, tmp_path / "gemma3", gemma3.to_json_string())
    assert load_config(copy).model_type == "gemma3"
    llama4 = Llama4Config(text_config={"hidden_size": 64, "num_hidden_layers": 1, "vocab_size": 100})
    copy = _with_config(tiny_model_dir, tmp_path / "llama4", llama4.to_json_string())
    decoder = decoder_config(copy)
    assert (decoder.hidden_size, decoder.num_hidden_layers, decoder.vocab_size) == (64, 1, 100)
    cfg = json.loads((tiny_model_dir("llama")[0] / "config.json").read_text())
    copy = _with_config(
        tiny_model_dir, tmp_path / "odd", json.dumps({**cfg, "hidden_act": "no_such_activation"})
    )
    with pytest.raises(
        ModelError, match=r"transformers .* cannot build LlamaForCausalLM from .*config.json \("
    ):
        build_skeleton(copy)


def test_moe_experts_stream_into_the_fused_tensors_and_a_missing_one_is_named(
    tiny_model_dir, tmp_path, disk_dir
):
    """A Mixtral checkpoint as transformers 5 saves it (w1, w2, w3 per expert) fills the model's fused
    ``gate_up_proj`` (w1 rows, then w3 rows, per expert) and ``down_proj`` exactly as ``from_pretrained``
    does; a checkpoint without one expert's tensor is a ModelError that names it."""
    import json as _json
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    path, _ = tiny_model_dir("mixtral", layers=2, shard="10MB")
    expected = dict(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).named_parameters())
    parts = split_model(build_skeleton(path))
    with ChunkStore(
        StoreConfig.resolve(device_budget="4MiB", host_budget="4MiB", disk_path=str(disk_dir))
    ) as store:
        load_into_store(parts, Checkpoint(path), store, "host", torch.float32)
        for group in parts.groups:
            for chunk in group.chunks:
                for name, value in store.read(chunk).items():
                    assert torch.equal(value, expected[name].detach()), name
    copy = tmp_path / "model"
    shutil.copytree(path, copy)
    (shard,) = copy.glob("*.safetensors")
    tensors = load_file(shard)
    del tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(tensors, shard, metadata={"format": "pt"})
    index = copy / "model.safetensors.index.json"
    if index.exists():
        data = _json.loads(index.read_text())
        data["weight_map"].pop("model.layers.1.block_sparse_moe.experts.2.w3.weight", None)
        index.write_text(_json.dumps(data))
    parts = split_model(build_skeleton(copy))
    with (
        ChunkStore(
            StoreConfig.resolve(device_budget="4MiB", host_budget="4MiB", disk_path=str(disk_dir / "b"))
        ) as store,
        pytest.raises(
            ModelError,
            match=r"lacks expert 2's '\.experts\.\*\.w3\.weight' for .*layers\.1\.mlp\.experts\.gate_up_proj",
        ),
    ):
        load_into_store(parts, Checkpoint(copy), store, "host", torch.float32)


def test_a_routers_trained_bias_is_read_from_the_checkpoint_and_routes_as_transformers_does(
    tiny_model_dir, tmp_path, disk_dir
):
    """DeepSeek-V3's routers keep a trained ``e_score_correction_bias`` buffer that picks each token's experts:
    tiertune reads it from the checkpoint (it is built as zeros), so step 1's loss is transformers' own on the
    model it loads from the same files (rel 1e-5)."""
    from parity import ACCUM, _batches, lora_config
    from transformers import AutoModelForCausalLM

    from tiertune.engine import StreamedTrainer
    from tiertune.offload.store import StoreConfig

    src, _ = tiny_model_dir("deepseek_v3")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    biases = {}
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.copy_(torch.randn(buf.shape, generator=g) * 4)  # large enough to change the chosen experts
            biases[name] = buf.clone()
    assert biases
    model.save_pretrained(tmp_path / "biased")
    read = load_buffers(build_skeleton(tmp_path / "biased"), Checkpoint(tmp_path / "biased"), {})
    assert read == []  # nothing named: nothing read
    batches = _batches(model.config.vocab_size)[:ACCUM]
    n = sum(int((mb["labels"][:, 1:] != -100).sum()) for mb in batches)
    with torch.no_grad():
        expected = 0.0
        for mb in batches:
            logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits
            expected += float(
                torch.nn.functional.cross_entropy(
                    logits[:, :-1].reshape(-1, logits.shape[-1]),
                    mb["labels"][:, 1:].reshape(-1),
                    ignore_index=-100,
                    reduction="sum",
                )
            )
    store = StoreConfig.resolve(device_budget="8MiB", host_budget="8MiB", disk_path=str(disk_dir))
    trainer = StreamedTrainer(str(tmp_path / "biased"), store, lora_config(quantize="none", max_steps=1))
    try:
        loss = trainer.step(batches)
    finally:
        trainer.close()
    assert abs(loss - expected / n) <= 1e-5 * abs(expected / n)
