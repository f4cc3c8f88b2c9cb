"""Bases read as they ship (``tiertune.quant.shipped``): checkpoints written here in the layout of the hub's FP8
releases (e4m3 codes, an fp32 ``weight_scale_inv`` per block, each expert a module of its own), trained with
``model.quantize: none`` and compared with peft over transformers' model of the file's dequantized values."""

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from parity import ACCUM, LORA, _batches, assert_adam_trained_close, lora_config, peft_lora, plain_training
from releases import rewrite, write_rowwise_fp8

from tiertune.engine import StreamedTrainer
from tiertune.errors import ConfigError, ModelError
from tiertune.offload.store import StoreConfig
from tiertune.quant.shipped import FP8, MXFP4, Compressed
from tiertune.settings import LoraSettings

STEPS = 4
BLOCK = (
    32,
    48,
)  # against 64- and 96-wide matrices: whole blocks, and edge blocks on both axes (and 24-row ones)
LAYER_WEIGHT = re.compile(r"^model\.layers\.\d+\..+\.weight$")


def _quantized(key: str, tensor: torch.Tensor) -> bool:
    """What an FP8 release stores in FP8: the decoder layers' matrices but the router (DeepSeek-V3's
    ``mlp.gate`` is a parameter of the router, shipped in bf16)."""
    return bool(LAYER_WEIGHT.match(key)) and tensor.dim() == 2 and not key.endswith("mlp.gate.weight")


def write_fp8(src, fp8_dir, values_dir, fmt: FP8, skip=()):
    """``src`` written as an FP8 release to ``fp8_dir`` (the codes and scales in place of each layer matrix) and
    as the model of its dequantized values to ``values_dir`` (``rewrite``). Returns the FP8 checkpoint's bytes."""

    def convert(key, tensor):
        if not _quantized(key, tensor) or any(s in key for s in skip):
            return None
        codes, scale = fmt.quantize(tensor)
        return {key: codes, f"{key}_scale_inv": scale}, fmt.dequantize(codes, scale, torch.float32)

    config = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(fmt.block),
        **({"scale_fmt": fmt.scale_fmt} if fmt.scale_fmt != "float" else {}),
        **({"modules_to_not_convert": list(skip)} if skip else {}),
    }
    return rewrite(src, fp8_dir, values_dir, convert, config)


@pytest.fixture(scope="module")
def fp8_release(tiny_model_dir, tmp_path_factory):
    """``fp8_release(family, scale_fmt="float")``: (FP8 dir, dequantized values' dir, its tensor bytes)."""
    made = {}

    def make(family, scale_fmt="float", skip=()):
        key = (family, scale_fmt, skip)
        if key not in made:
            src, _ = tiny_model_dir(family)
            root = tmp_path_factory.mktemp(f"{family}-fp8")
            fmt = FP8(block=BLOCK, scale_fmt=scale_fmt)
            total = write_fp8(src, root / "fp8", root / "values", fmt, skip)
            made[key] = (root / "fp8", root / "values", total)
        return made[key]

    return make


def _config(**kw):
    """parity's LoRA settings, the base read as it ships and homed on disk, this module's steps."""
    return lora_config(**{"quantize": "none", "warmup_steps": 1, "max_steps": STEPS, "params": "disk", **kw})


def _train(path, disk_dir, cfg, host="96KiB", device="256KiB"):
    """STEPS steps of the engine, the frozen base homed on disk (budgets of a layer or two: streamed)."""
    store = StoreConfig.resolve(
        device_budget=device, host_budget=host, disk_path=str(disk_dir), prefetch_depth=1
    )
    trainer = StreamedTrainer(str(path), store, cfg)
    try:
        initial = trainer.adapter_state_dict()
        batches = _batches(trainer.model.config.vocab_size)
        moved, losses = [], []
        for s in range(STEPS):
            before = trainer.store.stats().bytes_moved.get("disk->host", 0)
            losses.append(trainer.step(batches[s * ACCUM : (s + 1) * ACCUM]))
            moved.append(trainer.store.stats().bytes_moved.get("disk->host", 0) - before)
        trained = trainer.adapter_state_dict()
        layers = [c for s in trainer.states if s.group.kind == "layer" for c in s.weights]
        in_place = [trainer.store.in_place(c) is not None for c in layers]
        arena = trainer.store.disk.arena if trainer.store.disk is not None else None
        disk_tier = 0 if arena is None else arena.capacity - arena.free_bytes
    finally:
        trainer.close()
    return initial, trained, batches, losses, moved, in_place, disk_tier


def _peft_reference(values_dir, initial, cfg, batches):
    """peft's LoRA (parity's ``peft_lora``: what tiertune's all-linear adapts) over transformers' model of the
    dequantized values, trained by the plain loop from tiertune's initial adapters. Returns the losses and the
    trained adapters."""
    from peft import get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(values_dir, dtype=torch.float32, device_map="cpu")
    model.config.use_cache = False
    model = get_peft_model(model, peft_lora(model))
    model.train()
    set_peft_model_state_dict(model, initial)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay, fused=True)
    losses = plain_training(model, opt, params, cfg, batches, steps=STEPS)
    return losses, get_peft_model_state_dict(model)


def _lora_parity(release_dir, values_dir, total, disk_dir, host="96KiB", device="256KiB"):
    """LoRA on the release in ``release_dir`` (its ``total`` tensor bytes) against peft over the model of its
    dequantized values: step 1's loss rel 1e-5, every step rel 1e-4, the same adapters as Adam trains them, the
    base's home the checkpoint's files (the disk tier empty) and every step after the first streaming it, at most
    two passes of the release (+10%)."""
    cfg = _config()
    initial, trained, batches, losses, moved, in_place, disk_tier = _train(
        release_dir, disk_dir, cfg, host, device
    )
    expected, theirs = _peft_reference(values_dir, initial, cfg, batches)
    assert abs(losses[0] - expected[0]) <= 1e-5 * abs(expected[0])
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-4, atol=0)
    assert set(trained) == set(theirs)
    for name, value in theirs.items():
        assert_adam_trained_close(trained[name], value, name)
    assert all(in_place) and disk_tier == 0  # the base's home is the checkpoint's files
    assert min(moved[1:]) > 0 and max(moved[1:]) <= 2 * total * 1.1  # streamed every step, at most 2 passes


@pytest.mark.parametrize("family", ["qwen3", "deepseek_v3"])
def test_lora_on_an_fp8_release_follows_peft_on_its_dequantized_values(fp8_release, disk_dir, family):
    """A dense model (Qwen3) and DeepSeek-V3 (latent attention, a dense first layer, shared and routed experts,
    each expert's projections FP8 modules of their own): the base read in place from the FP8 files, step 1's loss
    that of the dequantized model (rel 1e-5), every step as peft's over it (rel 1e-4), the disk tier empty and
    each step reading at most twice the checkpoint's bytes."""
    _lora_parity(*fp8_release(family), disk_dir)


def test_the_dequantization_is_deepseeks_for_edge_blocks_too():
    """Element (r, c) is ``codes[r, c] * scale[r // 128, c // 128]`` (DeepSeek's ``weight_dequant``), for a matrix
    of 160 rows over 2 scale rows and DeepSeek's 576-row ``kv_a_proj_with_mqa`` over 5: where transformers' own
    dequantizing loader derives the block from the grid, it gives other values or refuses."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    fmt = FP8()
    g = torch.Generator().manual_seed(0)
    for rows, cols in [(160, 256), (576, 7168 // 8), (256, 384)]:
        weight = torch.randn(rows, cols, generator=g)
        codes, scale = fmt.quantize(weight)
        values = fmt.dequantize(codes, scale, torch.float32)
        by_element = (
            codes.float() * scale[torch.arange(rows)[:, None] // 128, torch.arange(cols)[None, :] // 128]
        )
        assert torch.equal(values, by_element)
        assert (
            float(((values - weight).abs() / weight.abs().clamp(min=1e-3)).median()) < 0.07
        )  # e4m3's precision
        if rows % scale.shape[0] == 0 and cols % scale.shape[1] == 0:
            theirs = Fp8Dequantize(None)._dequantize_one(codes, scale, torch.float32)
            if rows % 128 == 0 and cols % 128 == 0:
                assert torch.equal(values, theirs)  # whole blocks: transformers agrees
            else:
                assert not torch.equal(values, theirs)  # 160 rows over 2 scale rows: its blocks are 80 rows
    ue8m0 = FP8(scale_fmt="ue8m0")
    codes, scale = ue8m0.quantize(torch.randn(160, 256, generator=g))
    assert scale.dtype == torch.float8_e8m0fnu
    exponents = torch.log2(scale.float())
    assert torch.equal(exponents, exponents.round())  # powers of two


def test_an_fp8_release_with_ue8m0_scales_trains_as_its_values(fp8_release, disk_dir):
    """DeepSeek's newer releases store each block's scale as one byte, a power of two (``scale_fmt: ue8m0``)."""
    fp8_dir, values_dir, _ = fp8_release("qwen3", "ue8m0")
    cfg = _config(max_steps=1)
    initial, _, batches, losses, *_ = _train(fp8_dir, disk_dir, cfg)
    expected, _ = _peft_reference(values_dir, initial, cfg, batches)
    assert abs(losses[0] - expected[0]) <= 1e-5 * abs(expected[0])


def test_an_fp8_release_asks_for_quantize_none_and_names_what_it_reads(fp8_release, disk_dir, tmp_path):
    fp8_dir, _, _ = fp8_release("qwen3")
    store = StoreConfig.resolve(device_budget="8MiB", host_budget="8MiB")
    with pytest.raises(ConfigError, match="set model.quantize: none"):
        StreamedTrainer(str(fp8_dir), store, _config(quantize="nf4", params="host"))
    odd = tmp_path / "odd"
    shutil.copytree(fp8_dir, odd)
    config = json.loads((odd / "config.json").read_text())
    config["quantization_config"]["fmt"] = "e5m2"
    (odd / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match="fmt 'e5m2'.*tiertune reads FP8 e4m3"):
        StreamedTrainer(str(odd), store, _config(params="host"))
    dora = _config(params="host", lora=dataclasses.replace(LORA, use_dora=True))
    with pytest.raises(ConfigError, match="use_dora.*read as they ship.*use_dora: false"):
        StreamedTrainer(str(fp8_dir), store, dora)
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (odd / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match="'awq'.*FP8 ones with blockwise scales"):
        StreamedTrainer(str(odd), store, _config(params="host"))


@pytest.mark.parametrize("family", ["qwen3", "deepseek_v3"])
def test_full_fine_tuning_from_an_fp8_release_is_the_plain_loop_on_its_dequantized_values(
    fp8_release, disk_dir, family
):
    """``method: full`` from an FP8 release: every weight is trained, its master copy starting from the file's
    dequantized values (the experts fused from their per-expert FP8 modules), as the plain PyTorch loop does on
    transformers' model of those values: the same losses (rel 1e-5) and weights (rel 1e-5)."""
    fp8_dir, values_dir, _ = fp8_release(family)
    _full_parity(fp8_dir, values_dir, disk_dir)


def _full_parity(shipped_dir, values_dir, disk_dir):
    """Full fine-tuning of ``shipped_dir`` against the plain loop on ``values_dir``: losses and weights rel 1e-5."""
    from parity import _config as full_config
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(values_dir, dtype=torch.float32, device_map="cpu")
    reference.config.use_cache = False
    reference.train()
    cfg = full_config(
        params="disk",
        optimizer_states="disk",
        gradients="disk",
        max_steps=STEPS,
        warmup_steps=1,
        redo="gradients",
    )
    params = dict(reference.named_parameters())
    groups = [
        {"params": [p for p in params.values() if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params.values() if p.dim() < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(
        groups, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon, fused=True
    )
    batches = _batches(reference.config.vocab_size)
    expected = plain_training(reference, opt, list(params.values()), cfg, batches, steps=STEPS)
    store = StoreConfig.resolve(
        device_budget="8MiB", host_budget="2MiB", disk_path=str(disk_dir), chunk_size="1MiB", prefetch_depth=1
    )
    trainer = StreamedTrainer(str(shipped_dir), store, cfg)
    try:
        assert trainer.quant is None  # nothing frozen: the weights are the trained master copies
        losses = [trainer.step(batches[s * ACCUM : (s + 1) * ACCUM]) for s in range(STEPS)]
        weights = trainer.state_dict()
    finally:
        trainer.close()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0)
    assert set(weights) == set(params)
    for name, p in params.items():
        scale = float(p.detach().abs().max().clamp_min(1e-12))
        assert float((weights[name] - p.detach()).abs().max()) <= 1e-5 * scale, name


def test_fp8_codes_are_never_read_as_values_without_their_scales(fp8_release):
    """Reading an FP8 weight into a wider dtype without its format would train on the bare codes: refused, naming
    the tensor; with the format, the values are the codes times their blocks' scales."""
    from tiertune.loading.weights import Checkpoint

    fp8_dir, values_dir, _ = fp8_release("qwen3")
    checkpoint, values = Checkpoint(fp8_dir), Checkpoint(values_dir)
    key = "model.layers.0.mlp.up_proj.weight"
    out = torch.empty(checkpoint.entries[key].shape)
    with pytest.raises(ModelError, match="quantized codes with scales"):
        checkpoint.read_into(key, out)
    checkpoint.dequantize = FP8(block=BLOCK)
    checkpoint.read_into(key, out)
    expected = torch.empty_like(out)
    values.read_into(key, expected)
    assert torch.equal(out, expected)
    rows = torch.empty(5, out.shape[1])
    checkpoint.read_into(key, rows, row=40)  # rows across a block's edge
    assert torch.equal(rows, expected[40:45])


# ---------------------------------------------------------------------- MXFP4 (gpt-oss)


def write_mxfp4(src, mx_dir, values_dir):
    """``src`` (a saved gpt-oss) written as gpt-oss ships: each layer's fused experts as ``_blocks`` and ``_scales``
    (each expert's (out, in) matrix in groups of 32), the rest as it is; and as the model of the dequantized
    values (``rewrite``). Returns the MXFP4 checkpoint's tensor bytes."""
    fmt = MXFP4()

    def convert(key, tensor):
        if not key.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            return None
        experts = [fmt.quantize(tensor[e].T) for e in range(tensor.shape[0])]  # (out, in) each
        blocks = torch.stack([b for b, _ in experts])
        scales = torch.stack([s for _, s in experts])
        values = torch.stack([fmt.dequantize(b, s, torch.float32).T for b, s in experts])
        return {f"{key}_blocks": blocks, f"{key}_scales": scales}, values

    config = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    return rewrite(src, mx_dir, values_dir, convert, config)


@pytest.fixture(scope="module")
def gpt_oss_release(tmp_path_factory):
    """A tiny gpt-oss (attention sinks, sliding and full attention, biased experts stored (experts, in, out)) as it
    ships with MXFP4 experts: (MXFP4 dir, dequantized values' dir, tensor bytes)."""
    from transformers import AutoModelForCausalLM, GptOssConfig

    torch.manual_seed(0)
    config = GptOssConfig(
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        vocab_size=211,
        sliding_window=4,
    )
    root = tmp_path_factory.mktemp("gpt-oss")
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "src")
    total = write_mxfp4(root / "src", root / "mxfp4", root / "values")
    return root / "mxfp4", root / "values", total


def test_mxfp4_dequantization_is_transformers_gpt_oss_loader(gpt_oss_release):
    """Each expert's codes times 2^(scale - 127), in gpt-oss's (experts, in, out) layout: transformers' own
    dequantizing of the shipped blocks gives the same values, bit for bit."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from tiertune.loading.weights import Checkpoint

    mx_dir, values_dir, _ = gpt_oss_release
    checkpoint, values = Checkpoint(mx_dir), Checkpoint(values_dir)
    key = "model.layers.1.mlp.experts.gate_up_proj"
    blocks = torch.empty(checkpoint.entries[f"{key}_blocks"].shape, dtype=torch.uint8)
    scales = torch.empty(checkpoint.entries[f"{key}_scales"].shape, dtype=torch.uint8)
    checkpoint.read_into(f"{key}_blocks", blocks)
    checkpoint.read_into(f"{key}_scales", scales)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    ours = torch.empty(values.entries[key].shape)
    values.read_into(key, ours)
    assert torch.equal(ours, theirs)
    checkpoint.dequantize = MXFP4()  # the reader of a full fine-tune: the same values
    read = torch.empty_like(ours)
    checkpoint.read_into(f"{key}_blocks", read)
    assert torch.equal(read, theirs)


def test_lora_on_gpt_oss_with_mxfp4_experts_follows_peft_on_its_dequantized_values(gpt_oss_release, disk_dir):
    """gpt-oss as it ships: its MXFP4 experts read in place and computed expert by expert
    from their codes, attention and router 16-bit; LoRA follows peft over the dequantized model (rel 1e-4), the disk
    tier empty and each step reading at most twice the checkpoint's bytes."""
    _lora_parity(*gpt_oss_release, disk_dir)


def test_full_fine_tuning_from_gpt_oss_mxfp4_is_the_plain_loop_on_its_dequantized_values(
    gpt_oss_release, disk_dir
):
    mx_dir, values_dir, _ = gpt_oss_release
    _full_parity(mx_dir, values_dir, disk_dir)


# ---------------------------------------------------------------------- compressed-tensors (INT4, FP8 per channel)

KIMI_IGNORE = (  # Kimi-K2-Thinking's: its INT4 is the routed experts alone
    "lm_head",
    r"re:.*self_attn.*",
    r"re:.*shared_experts.*",
    r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
)


def write_compressed(src, out_dir, values_dir, fmt: Compressed):
    """``src`` written as llm-compressor saves a compressed-tensors model: each quantized layer matrix as its
    packed integers (``weight_packed``, ``weight_scale``, ``weight_shape``) or FP8 values and ``weight_scale``,
    the modules ``fmt.skip`` ignores as they are; and as the model of the dequantized values (``rewrite``).
    Returns the bytes."""

    def convert(key, tensor):
        if not _quantized(key, tensor) or fmt.ignored(key.removesuffix(".weight")):
            return None
        codes, scale = fmt.quantize(tensor)
        stored = (
            {f"{key}_packed": codes, f"{key}_shape": torch.tensor(list(tensor.shape))}
            if fmt.packed
            else {key: codes}
        )
        return {**stored, f"{key}_scale": scale}, fmt.dequantize(codes, scale, torch.float32)

    strategy = "group" if fmt.group > 0 else ("channel" if fmt.group == 0 else "tensor")
    weights = {
        "type": "int" if fmt.packed else "float",
        "num_bits": fmt.bits,
        "strategy": strategy,
        "group_size": fmt.group if fmt.group > 0 else None,
        "symmetric": True,
        "dynamic": False,
    }
    config = {
        "quant_method": "compressed-tensors",
        "format": fmt.format,
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
        "ignore": list(fmt.skip),
        "quantization_status": "compressed",
    }
    return rewrite(src, out_dir, values_dir, convert, config)


COMPRESSED = {  # name: (family, scheme, host and device budgets of a layer or two, not the base)
    "int4-qwen3": ("qwen3", dict(format="pack-quantized", bits=4, group=32), ("64KiB", "160KiB")),
    "int4-kimi": (
        "deepseek_v3",
        dict(format="pack-quantized", bits=4, group=32, skip=KIMI_IGNORE),
        ("160KiB",),
    ),
    "fp8-channel-qwen3": ("qwen3", dict(format="float-quantized", bits=8, group=0), ("96KiB",)),
}


@pytest.fixture(scope="module")
def compressed_release(tiny_model_dir, tmp_path_factory):
    made = {}

    def make(name):
        if name not in made:
            family, scheme, _ = COMPRESSED[name]
            src, _ = tiny_model_dir(family)
            root = tmp_path_factory.mktemp(name)
            fmt = Compressed(scale_dtype=torch.float32, **scheme)
            total = write_compressed(src, root / "q", root / "values", fmt)
            made[name] = (root / "q", root / "values", total)
        return made[name]

    return make


def test_int4_unpacking_is_compressed_tensors_own():
    """The packed INT4 integers, unpacked as compressed-tensors unpacks them (its ``unpack_from_int32``), times
    their group's scale: tiertune's values, bit for bit."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    fmt = Compressed(format="pack-quantized", bits=4, group=32, scale_dtype=torch.float32)
    weight = torch.randn(48, 256, generator=torch.Generator().manual_seed(0))
    packed, scale = fmt.quantize(weight)
    ints = unpack_from_int32(packed, 4, torch.Size(weight.shape))
    theirs = ints.float() * scale.repeat_interleave(32, 1)
    assert torch.equal(fmt.dequantize(packed, scale, torch.float32), theirs)
    assert float((theirs - weight).abs().max()) <= float(scale.max()) / 2 + 1e-6  # half a step at most


@pytest.mark.parametrize("name", list(COMPRESSED))
def test_lora_on_a_compressed_tensors_release_follows_peft_on_its_dequantized_values(
    compressed_release, disk_dir, name
):
    """compressed-tensors' INT4 (packed int32, a scale per group of 32: Kimi-K2-Thinking's experts-only scheme on a
    DeepSeek-V3, and every linear layer of a Qwen3) and FP8 with a scale per channel: read in place, LoRA follows
    peft over the dequantized model (rel 1e-4), the disk tier empty, each step at most twice the bytes."""
    _lora_parity(*compressed_release(name), disk_dir, *COMPRESSED[name][2])


def test_full_fine_tuning_from_int4_is_the_plain_loop_on_its_dequantized_values(compressed_release, disk_dir):
    q_dir, values_dir, _ = compressed_release("int4-kimi")
    _full_parity(q_dir, values_dir, disk_dir)


def _streamed_against_peft(base_dir, values_dir, tmp_path, cat_model):
    """A random LoRA adapter (parity's ``peft_lora`` over transformers' model of ``values_dir``, the release's
    dequantized values) merged by ``tiertune merge`` streamed over the release in ``base_dir``, and by peft's
    merge_and_unload in memory over the values. Asserts the merge streamed, the same tensors (names, dtypes,
    shapes; values to rel 1e-5) and no quantization_config left; returns the plan and the streamed tensors."""
    from peft import get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tiertune.export.commands import _merge_in_memory, merge
    from tiertune.export.merging import plan_merge

    model = AutoModelForCausalLM.from_pretrained(values_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, peft_lora(model, LoraSettings(r=4, alpha=8, dropout=0.0)))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in peft_model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=generator) * 0.05)
    adapter = tmp_path / "adapter"
    peft_model.save_pretrained(adapter)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(cat_model(1)) / f, adapter / f)  # a tokenizer for the merged model
    plan = plan_merge(adapter, base_dir, "none", torch.float32)
    assert not isinstance(plan, str), plan
    out, what = merge(adapter, tmp_path / "merged", base=str(base_dir), dtype="float32")
    assert "in memory" not in what
    _merge_in_memory(adapter, tmp_path / "peft", str(values_dir), torch.float32, "none")

    def tensors(directory):
        return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}

    streamed, reference = tensors(out), tensors(tmp_path / "peft")
    assert streamed.keys() == reference.keys()  # no scales, blocks or packed names left
    for key, tensor in reference.items():
        assert streamed[key].dtype == tensor.dtype and streamed[key].shape == tensor.shape, key
        torch.testing.assert_close(streamed[key], tensor, rtol=1e-5, atol=1e-6)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    return plan, streamed


@pytest.mark.parametrize("family", ["qwen3", "deepseek_v3"])
def test_a_streamed_merge_over_an_fp8_release_is_peft_merge_over_its_dequantized_values(
    fp8_release, tmp_path, cat_model, family
):
    """``tiertune merge`` of a LoRA adapter trained on an FP8 release writes a 16-bit model, streamed: each FP8
    weight dequantized (codes times block scales) plus the adapter, no scales left, no quantization_config; peft's
    merge_and_unload over transformers' model of the dequantized values gives the same tensors. DeepSeek-V3's
    adapter is what all-linear adapts there (attention, the shared experts and the dense MLP, these named as
    parameters: ``methods.lora.as_peft_loads``), and its routed experts, one FP8 matrix each, are written
    dequantized one matrix at a time."""
    fp8_dir, values_dir, _ = fp8_release(family)
    plan, _ = _streamed_against_peft(fp8_dir, values_dir, tmp_path, cat_model)
    assert plan.quantized and set(plan.saved) == set(plan.quantized), plan
    if family == "deepseek_v3":
        assert any(".mlp.experts.3." in k for k in plan.quantized)  # a routed expert's own matrix


def test_an_fp8_linear_layer_patched_with_the_fused_kernel_computes_as_it_did():
    """``kernels.patch`` gives an FP8 ``ShippedLinear`` (bound to its codes and block scales, as the engine binds
    it, and wrapped by peft's LoRA) the fused dequantize-matmul kernel (``TRITON_INTERPRET=1`` on a CPU, fp32):
    the same output and input gradient as its own forward, which dequantizes the weight and calls ``F.linear``."""
    import copy

    from peft import LoraConfig, get_peft_model

    from tiertune.kernels.patch import patch_model
    from tiertune.quant.shipped import ShippedLinear, ShippedWeight

    fmt = FP8(block=BLOCK)
    g = torch.Generator().manual_seed(0)
    codes, scale = fmt.quantize(torch.randn(96, 64, generator=g) * 0.1)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            with torch.device("meta"):
                self.proj = ShippedLinear.of(torch.nn.Linear(64, 96), fmt)
            self.proj._parameters["weight"] = ShippedWeight(codes, fmt, scale)
            self.proj._parameters["bias"] = torch.nn.Parameter(
                torch.randn(96, generator=g), requires_grad=False
            )

        def forward(self, x):
            return self.proj(x)

    model = get_peft_model(Block(), LoraConfig(r=4, lora_alpha=8, target_modules=["proj"]))
    patched = copy.deepcopy(model)
    assert patch_model(patched, "triton")["fp8"] == 1
    x = torch.randn(2, 7, 64, generator=g)
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ours, theirs = patched(x2), model(x1)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    dy = torch.randn(ours.shape, generator=g)
    ours.backward(dy)
    theirs.backward(dy)
    torch.testing.assert_close(x2.grad, x1.grad, rtol=1e-5, atol=1e-5)


def test_a_streamed_merge_over_gpt_oss_mxfp4_is_peft_merge_over_its_dequantized_values(
    gpt_oss_release, tmp_path, cat_model
):
    """``tiertune merge`` of an adapter on gpt-oss's attention (what all-linear adapts there) over its MXFP4
    release: streamed, each layer's experts written 16-bit one expert at a time under transformers' names and
    layout ((experts, in, out), no blocks or scales left), equal to peft's merge_and_unload over transformers'
    model of the dequantized values."""
    mx_dir, values_dir, _ = gpt_oss_release
    plan, streamed = _streamed_against_peft(mx_dir, values_dir, tmp_path, cat_model)
    assert len(plan.mx) == 4, plan  # 2 layers x gate_up_proj, down_proj
    assert not any(k.endswith(("_blocks", "_scales")) for k in streamed)


@pytest.mark.parametrize("name", ["int4-qwen3", "int4-kimi", "fp8-channel-qwen3"])
def test_a_streamed_merge_over_a_compressed_tensors_release_is_peft_merge_over_its_dequantized_values(
    compressed_release, tmp_path, cat_model, name
):
    """``tiertune merge`` over a compressed-tensors release (INT4 packed in int32 words with group scales, Kimi-
    style INT4 routed experts one module each, FP8 with a scale per channel): streamed, each weight written 16-bit
    under its own name (``weight``, not ``weight_packed``; no scales or shapes left), equal to peft's
    merge_and_unload over transformers' model of the dequantized values."""
    q_dir, values_dir, _ = compressed_release(name)
    plan, streamed = _streamed_against_peft(q_dir, values_dir, tmp_path, cat_model)
    assert plan.quantized and set(plan.saved) == set(plan.quantized), plan
    assert not any(k.endswith(("_packed", "_scale", "_shape")) for k in streamed)


def test_qlora_on_gpt_oss_16_bit_stores_its_transposed_biased_experts_4_bit(gpt_oss_release, disk_dir):
    """``model.quantize: nf4`` on gpt-oss's 16-bit release (its fused, biased experts stored (experts, in, out)):
    each expert's (out, in) matrix is NF4 as bitsandbytes quantizes a linear weight, and LoRA (attention, what
    all-linear adapts there) trains as peft over transformers + bitsandbytes' model whose experts are those NF4
    values (rel 1e-4)."""
    import bitsandbytes.functional as bnb_f
    from peft import get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from tiertune.quant import make_quantizer

    _, values_dir, _ = gpt_oss_release
    cfg = _config(quantize="nf4")
    initial, trained, batches, losses, *_ = _train(values_dir, disk_dir, cfg)

    quant = make_quantizer("nf4", torch.float32)
    model = AutoModelForCausalLM.from_pretrained(
        values_dir, dtype=torch.float32, device_map="cpu", quantization_config=quant.config()
    )
    model.config.use_cache = False
    for module in model.modules():
        if type(module).__name__ != "GptOssExperts":
            continue
        assert module.is_transposed
        for attr in ("gate_up_proj", "down_proj"):
            weight = getattr(module, attr)
            with torch.no_grad():
                for e in range(weight.shape[0]):  # (in, out): its (out, in) matrix quantized
                    packed, state = bnb_f.quantize_4bit(
                        weight[e].T.contiguous(), blocksize=64, compress_statistics=True, quant_type="nf4"
                    )
                    weight[e].copy_(bnb_f.dequantize_4bit(packed, state).T)
    reference = get_peft_model(model, peft_lora(model))
    reference.train()
    set_peft_model_state_dict(reference, initial)
    params = [p for p in reference.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay, fused=True)
    expected = plain_training(reference, opt, params, cfg, batches, steps=STEPS)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-4, atol=0)
    assert trained.keys() == {k for k in trained if ".self_attn." in k}  # attention alone


@pytest.mark.parametrize("release", ["gpt_oss", "deepseek_v3"])
def test_experts_kept_as_shipped_run_the_fused_kernels_as_they_ran_before(
    release, gpt_oss_release, fp8_release, disk_dir, caplog
):
    """With tiertune's Triton kernels (``TRITON_INTERPRET=1`` on a CPU, fp32), the routed experts of gpt-oss's MXFP4
    release and of DeepSeek-V3's FP8 one compute each routed expert with the fused dequantize-matmul kernel
    (``kernels.patch``: the log counts the experts modules), and a step's loss and adapters' gradient norm are
    those of the dequantizing path (``kernels: torch``)."""
    import logging

    path = gpt_oss_release[0] if release == "gpt_oss" else fp8_release("deepseek_v3")[0]
    results = []
    for kernels in ("triton", "torch"):
        store = StoreConfig.resolve(
            device_budget="8MiB", host_budget="8MiB", disk_path=str(disk_dir / kernels)
        )
        with caplog.at_level(logging.DEBUG, logger="tiertune.kernels"):
            trainer = StreamedTrainer(str(path), store, _config(kernels=kernels, max_steps=1))
        try:
            batches = _batches(trainer.model.config.vocab_size)
            results.append((trainer.step(batches[:ACCUM]), trainer.adapter_state_dict()))
        finally:
            trainer.close()
    patched = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kernels (triton)")]
    assert patched and "experts x" in patched[0], patched
    (fused_loss, fused), (loss, eager) = results
    assert fused_loss == pytest.approx(loss, rel=1e-5)
    for name, value in eager.items():
        torch.testing.assert_close(fused[name], value, rtol=1e-4, atol=1e-6, msg=name)


# ---------------------------------------------------------------------- FP8 per channel (fbgemm_fp8: Meta's)


@pytest.fixture(scope="module")
def rowwise_release(tiny_model_dir, tmp_path_factory):
    """A tiny Llama as Meta's FP8 releases ship (Llama 3.1 405B's layout: a scale per output channel, the
    attention and the last layer's MLP kept 16-bit by name): (release dir, dequantized values' dir, bytes)."""
    src, _ = tiny_model_dir("llama")
    root = tmp_path_factory.mktemp("llama-fbgemm")
    skip = [f"model.layers.{i}.self_attn" for i in range(4)] + ["model.layers.3.mlp"]
    total = write_rowwise_fp8(src, root / "fp8", root / "values", skip)
    return root / "fp8", root / "values", total


def test_lora_on_a_per_channel_fp8_release_follows_peft_on_its_dequantized_values(rowwise_release, disk_dir):
    """quant_method fbgemm_fp8: the MLPs read in place as e4m3 codes with a scale per channel, the modules
    modules_to_not_convert names 16-bit; step 1's loss that of the dequantized model (rel 1e-5), every step as
    peft's over it (rel 1e-4), nothing of the base in the disk tier, a step reading at most twice the release."""
    _lora_parity(*rowwise_release, disk_dir, host="160KiB")


def test_a_per_channel_fp8_release_keeps_what_it_names_16_bit_and_converts_the_rest(rowwise_release):
    """The modules modules_to_not_convert names stay nn.Linear; the other decoder linears are read as shipped."""
    from tiertune.loading.model import build_skeleton
    from tiertune.quant import make_quantizer, saved_quantization
    from tiertune.quant.shipped import RowwiseFP8, ShippedLinear

    fp8_dir, _, _ = rowwise_release
    with torch.device("meta"):
        model = build_skeleton(fp8_dir, torch.float32)
        quant = make_quantizer("none", torch.float32, saved_quantization(model.config))
    assert isinstance(quant, RowwiseFP8)
    for i, layer in enumerate(model.model.layers):
        quant.convert(layer, f"model.layers.{i}")
    kinds = {n: type(m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert kinds["model.layers.0.self_attn.q_proj"] is torch.nn.Linear
    assert kinds["model.layers.3.mlp.up_proj"] is torch.nn.Linear
    assert kinds["model.layers.2.mlp.down_proj"] is ShippedLinear


def test_full_fine_tuning_from_a_per_channel_fp8_release_is_the_plain_loop_on_its_dequantized_values(
    rowwise_release, disk_dir
):
    fp8_dir, values_dir, _ = rowwise_release
    _full_parity(fp8_dir, values_dir, disk_dir)


def test_a_streamed_merge_over_a_per_channel_fp8_release_is_peft_merge_over_its_dequantized_values(
    rowwise_release, tmp_path, cat_model
):
    fp8_dir, values_dir, _ = rowwise_release
    plan, streamed = _streamed_against_peft(fp8_dir, values_dir, tmp_path, cat_model)
    assert plan.quantized and set(plan.saved) == set(plan.quantized), plan
    assert not any(k.endswith("_scale") for k in streamed)
