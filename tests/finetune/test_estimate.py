"""``estimate`` against what runs measure: the store's peak bytes per tier, to the byte where the tier holds
what passes through it, and a full tier where the budget binds."""

import dataclasses
import io
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from tests.conftest import CAT_PAIRS
from tiertune.cli.app import app
from tiertune.config.recipe import load_recipe
from tiertune.engine import replay as replaying
from tiertune.engine.memory import IN_PLACE
from tiertune.engine.schedule import LayerMajor
from tiertune.errors import ModelError
from tiertune.estimates.report import QUANT_CACHE, estimate
from tiertune.finetune.train import train
from tiertune.loading.hub import SHIPPED
from tiertune.offload.tiers import Tier


@pytest.fixture(scope="module")
def model_dir(cat_model):
    return cat_model(4, hidden=128)


@pytest.fixture
def make_recipe(tmp_path, model_dir, write_recipe):
    path = write_recipe(
        tmp_path,
        model_dir,
        training={"gradient_accumulation_steps": 2},
        offload={"device_budget": "64MiB", "host_budget": "64MiB"},
    )
    return lambda overrides: load_recipe(path, overrides)


CASES = {
    "full, states on disk, host budget short": (
        "offload.params=disk",
        "offload.optimizer_states=disk",
        "offload.host_budget=3MiB",
    ),
    "full, states on disk, everything cached": ("offload.params=disk", "offload.optimizer_states=disk"),
    "full, on the host, no disk": (
        "offload.disk_path=null",
        "offload.params=host",
        "offload.optimizer_states=host",
    ),
    # a step's update during the next step: its gradients held until then (the next step's hand-off waits)
    "full, delayed update, states on disk": (
        "offload.params=disk",
        "offload.optimizer_states=disk",
        "offload.delay_update=true",
    ),
    "full, overlap off, 8-bit": (
        "offload.params=disk",
        "offload.optimizer_states=disk",
        "offload.overlap_optimizer=false",
        "training.optim=adamw_bnb_8bit",
    ),
    "full, layerwise (no clipping, one micro-batch)": (
        "offload.params=disk",
        "offload.optimizer_states=disk",
        "training.max_grad_norm=0",
        "training.gradient_accumulation_steps=1",
    ),
    "galore, activations on the host": (
        "method.type=galore",
        "method.galore.rank=8",
        "offload.params=disk",
        "offload.optimizer_states=disk",
        "offload.activations=host",
    ),
    "qlora, base on disk": (
        "model.quantize=nf4",
        "method.type=lora",
        "offload.params=disk",
        "offload.host_budget=1MiB",
    ),
    "lora on an fp32 base, base on disk": ("method.type=lora", "offload.params=disk"),
    "lora on an fp32 base, on the host": (
        "method.type=lora",
        "offload.params=host",
        "offload.disk_path=null",
    ),
    "full, 8-bit, overlapped, activations on the host": (
        "offload.params=disk",
        "offload.optimizer_states=disk",
        "training.optim=adamw_bnb_8bit",
        "offload.activations=host",
    ),
    "galore, 8-bit, one micro-batch": (
        "method.type=galore",
        "method.galore.rank=8",
        "offload.params=disk",
        "offload.optimizer_states=host",
        "training.optim=adamw_bnb_8bit",
        "training.gradient_accumulation_steps=1",
    ),
    "int8 base, lora": ("model.quantize=int8", "method.type=lora", "offload.params=disk"),
    "full, sequence tiled (8 tokens)": (
        "offload.sequence_tile=8",
        "offload.params=disk",
        "offload.optimizer_states=disk",
    ),
    "full, 8-bit, waves of 1": (
        "offload.params=disk",
        "offload.optimizer_states=disk",
        "training.optim=adamw_bnb_8bit",
        "offload.activations=host",
        "offload.host_budget=2600KiB",
    ),
    "full, 8-bit, waves of 3": (
        "offload.params=disk",
        "offload.optimizer_states=disk",
        "training.optim=adamw_bnb_8bit",
        "offload.activations=host",
        "offload.host_budget=3MiB",
    ),
    "dpo, lora, base on disk": (
        "objective.type=dpo",
        "data.format=preference",
        "method.type=lora",
        "offload.params=disk",
    ),
    "dpo, full, states on disk": (
        "objective.type=dpo",
        "data.format=preference",
        "offload.params=disk",
        "offload.optimizer_states=disk",
    ),
    "kto, qlora, 1 MiB host budget": (
        "objective.type=kto",
        "data.format=unpaired_preference",
        "model.quantize=nf4",
        "method.type=lora",
        "offload.params=disk",
        "offload.host_budget=1MiB",
    ),
    "simpo, full, on the host, no disk": (
        "objective.type=simpo",
        "data.format=preference",
        "offload.params=host",
        "offload.optimizer_states=host",
        "offload.disk_path=null",
    ),
}
PAIRS = CAT_PAIRS
# KTO's unpaired rows: each pair's chosen or rejected completion, labelled
UNPAIRED = [
    {"prompt": p["prompt"], "completion": p["chosen" if i % 2 else "rejected"], "label": bool(i % 2)}
    for i, p in enumerate(PAIRS)
]
# the wave a case must run: the layer boundaries of 8 micro-batches do not fit a host budget of 2600 KiB but
# one micro-batch's, nor of 3 MiB but three's (waves of 3, 3 and 2)
WAVES = {"full, 8-bit, waves of 1": "8 waves of 1", "full, 8-bit, waves of 3": "3 waves of 3"}


GEMMA_CASES = {
    "gemma, lora on an fp32 base, 2 MiB host budget, base on disk": (
        "method.type=lora",
        "offload.params=disk",
        "offload.host_budget=2MiB",
    ),
    "gemma, lora on an fp32 base, 2 MiB host and device budgets": (
        "method.type=lora",
        "offload.params=disk",
        "offload.host_budget=2MiB",
        "offload.device_budget=2MiB",
    ),
    "gemma, qlora, 1 MiB host and device budgets": (
        "model.quantize=nf4",
        "method.type=lora",
        "offload.params=disk",
        "offload.host_budget=1MiB",
        "offload.device_budget=1MiB",
    ),
    "gemma, full, 8-bit, activations on the host, 4 MiB host budget": (
        "offload.params=disk",
        "offload.optimizer_states=disk",
        "training.optim=adamw_bnb_8bit",
        "offload.activations=host",
        "offload.host_budget=4MiB",
    ),
}
# the host budget binds while the CPU optimizer's thread and the I/O threads work: which copies the host keeps
# depends on when each transfer lands, and a run's own bytes per step vary from run to run (at 8 micro-batches,
# five runs each: the first case read 20.8 to 23.2 MB from disk and wrote 19.6 to 21.4 MB; the Gemma case
# read 21.7 to 22.3 MB, and one more run of it read 12.0 MB). The replay lands each transfer by the store's
# next call: the peaks are still exact, the bytes moved are checked within the runs' spread
TIMED = {
    "full, states on disk, host budget short",
    "full, 8-bit, waves of 1",
    "full, 8-bit, waves of 3",
    "gemma, full, 8-bit, activations on the host, 4 MiB host budget",
}
# the optimizer updates in place during backward and may still run a layer's update while the next layer's
# gradients are copied: the replay holds that unit back (two layers' gradients on the host, the worst case); a run
# whose worker keeps up holds one less. Seen 2026-11-29 in the whole suite beside a fresh install: one layer's
# gradient chunk above the replay of then, which held none back
PACED = {"full, layerwise (no clipping, one micro-batch)"}
# micro-batches per step: 1 and 8, but for the cases that are about one micro-batch; 4 and 16 for a few (under
# a 4 MiB host budget the layer boundaries of 8 and 16 micro-batches do not fit: the step runs in waves)
RUNS = [
    (case, n)
    for case in [*CASES, *GEMMA_CASES]
    for n in (1, 8)
    if (n == 1 or "one micro-batch" not in case) and (n == 8 or case not in WAVES)
]
RUNS += [
    (case, n)
    for case in (
        "full, states on disk, everything cached",
        "qlora, base on disk",
        "full, 8-bit, overlapped, activations on the host",
        "gemma, full, 8-bit, activations on the host, 4 MiB host budget",
    )
    for n in (4, 16)
]


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    """A small random Gemma (tied and scaled embeddings, 1 + w norms) with the cat texts' tokenizer."""
    from transformers import AutoModelForCausalLM, GemmaConfig

    from tests.conftest import CAT_TEXTS
    from tiertune.cli.demo import make_tokenizer

    directory = tmp_path_factory.mktemp("gemma")
    tok = make_tokenizer(CAT_TEXTS, directory)
    config = GemmaConfig(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


@pytest.mark.parametrize(("case", "micro_batches"), RUNS)
def test_the_peaks_and_the_bytes_a_step_moves_are_a_runs(
    tmp_path, model_dir, gemma_dir, write_recipe, monkeypatch, case, micro_batches
):
    """The estimate's peak of every tier is the run's, to the byte (the replay runs each way the update can go:
    a clipped first step, redone, then after backward, then speculated and confirmed); the bytes its last step
    moves on each link, replayed with the steps the run clipped, are the run's last step's within 2%."""
    overrides = [
        o for o in {**CASES, **GEMMA_CASES}[case] if not o.startswith("training.gradient_accumulation")
    ]
    path = write_recipe(
        tmp_path,
        gemma_dir if case in GEMMA_CASES else model_dir,
        training={"gradient_accumulation_steps": micro_batches, "max_steps": 4},
        offload={"device_budget": "64MiB", "host_budget": "64MiB"},
    )
    if "objective.type=kto" in overrides or "data.format=preference" in overrides:
        rows = UNPAIRED if "objective.type=kto" in overrides else PAIRS
        data = tmp_path / "pairs.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        overrides.append(f"data.path={data}")
    recipe = load_recipe(path, overrides)
    predicted = estimate(recipe, measure=False)
    assert predicted.fits
    if case in WAVES:
        assert any(f"runs as {WAVES[case]} micro-batches" in note for note in predicted.notes), (
            predicted.notes
        )
    result = train(recipe, progress=False)
    log = [json.loads(line) for line in result.log_path.read_text().splitlines()]
    # the steps replayed as the run's went: those after a clipped one update in place, without the twins (fewer
    # chunks at once), so the run's peaks are those of its own pattern, never above the estimate's by default
    clipped = tuple(record["grad_norm"] > recipe.training.max_grad_norm for record in log)
    monkeypatch.setattr(replaying, "CLIPPED", clipped)
    default, predicted = predicted, estimate(recipe, measure=False)
    every = all(clipped)
    for tier, peak in log[-1]["peak_bytes"].items():
        slack = predicted.tiers[tier].largest_staged if case in TIMED and tier == "host" else 0
        slack = 2 * predicted.tiers[tier].largest_staged if every and tier == "host" else slack
        assert peak <= default.tiers[tier].peak + slack, (tier, peak, default.tiers)
        if case in TIMED and tier == "host":
            # the budget binds while the optimizer's thread and the I/O threads work: when a transfer lands decides
            # which cached copies are evicted to make room, so how full the host gets varies by up to one staged
            # copy. Measured 2026-11-27 on the Gemma case, 30 runs alone: 29 exact, one 32 KiB below; 37 runs
            # beside two busy processes: 34 exact, three 8 to 36 KiB below; 2026-11-28 in the whole suite under
            # the disk writer and a burned core, 4 KiB above. Never above the budget
            expected = predicted.tiers[tier]
            assert abs(peak - expected.peak) <= expected.largest_staged and peak <= expected.budget, (
                tier,
                peak,
                predicted.tiers,
            )
            continue
        if case in PACED and tier == "host":
            expected = predicted.tiers[tier]
            assert expected.peak - expected.largest_staged <= peak <= expected.peak, (
                tier,
                peak,
                predicted.tiers,
            )
            continue
        if not every or tier != "host":
            assert peak == predicted.tiers[tier].peak, (tier, peak, predicted.tiers)
        else:
            # every step clipped, each after the first in place: the peak is the first step's (speculated, then
            # redone), whose units run as the worker's thread keeps up (seen: 12 KiB above the replay here; in
            # test_preference's DPO 1.14 MB below and 8 KiB above in two runs): within two staged chunks of it
            expected = predicted.tiers[tier]
            assert abs(peak - expected.peak) <= 2 * expected.largest_staged, (tier, peak, predicted.tiers)
    moved = predicted.moved_per_step
    before, after = log[-2]["bytes_moved"], log[-1]["bytes_moved"]
    measured = {k: after[k] - before.get(k, 0) for k in after if after[k] - before.get(k, 0)}
    assert measured.get("host->device", 0) > 0 or case.startswith("gemma, lora") or "lora" in case
    if case in TIMED:  # every link within the spread of the run's own figures
        for link in set(measured) | set(moved):
            assert abs(moved.get(link, 0) - measured.get(link, 0)) <= 0.5 * measured.get(link, 0) + (
                1 << 20
            ), (link, moved, measured)
        return
    for link in set(measured) | set(moved):
        assert abs(moved.get(link, 0) - measured.get(link, 0)) <= 0.02 * measured.get(link, 0), (
            link,
            moved,
            measured,
        )


def test_estimate_command_prints_the_table_and_flags_a_budget_that_cannot_hold(tmp_path, make_recipe):
    recipe = make_recipe(())
    path = tmp_path / "r.yaml"
    path.write_text(recipe.to_yaml())
    ok = CliRunner().invoke(
        app, ["estimate", str(path), "offload.params=disk", "offload.optimizer_states=disk"]
    )
    assert ok.exit_code == 0, ok.output
    assert "how fast:" in ok.output and "  disk         read" in ok.output and "s per step" in ok.output
    assert "micro-batches: 2 per step in 1 wave of 2 (the weights stream once per wave)" in ok.output
    short = CliRunner().invoke(app, ["estimate", str(path), "offload.host_budget=64KiB", "--no-probe"])
    assert short.exit_code == 1 and "NO: needs" in short.output and "DOES NOT FIT" in short.output
    # the budgets train would accept, the same the run's refusal names
    from tiertune.errors import BudgetError

    with pytest.raises(BudgetError) as refused:
        train(load_recipe(path, ("offload.host_budget=64KiB",)), progress=False)
    named = re.search(
        r"The smallest budgets that work: (offload.device_budget: \d+MiB, offload.host_budget: \d+MiB)",
        str(refused.value),
    )
    assert (
        named
        and f"the smallest budgets that work (what train checks before loading): {named.group(1)}"
        in short.output
    )


def test_estimate_creates_nothing_where_disk_path_does_not_exist_yet(tmp_path, make_recipe):
    recipe = make_recipe(())
    path = tmp_path / "r.yaml"
    path.write_text(recipe.to_yaml())
    before = sorted(tmp_path.rglob("*"))
    disk_path = tmp_path / "new" / "nvme"
    result = CliRunner().invoke(
        app,
        ["estimate", str(path), f"offload.disk_path={disk_path}", "offload.params=disk"],
        env={"COLUMNS": "200"},
    )
    assert result.exit_code == 0, result.output
    assert "  disk         read" in result.output  # the disk was probed...
    assert f"{disk_path} does not exist yet" in result.output and f"probed in {tmp_path}," in result.output
    assert sorted(tmp_path.rglob("*")) == before  # ...and nothing was created or left behind


CONFIGS = SHIPPED  # the real models' config.json, by model id, as tiertune ships them (no weights)
PUBLISHED = {
    "mistralai/Mixtral-8x22B-v0.1": 141e9,
    "Qwen/Qwen3-235B-A22B": 235e9,
}  # model cards' totals of the bf16 releases


def _qlora(tmp_path, model_dir, quantize="nf4", **lora):
    path = tmp_path / "qlora.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "model": {"path": str(model_dir), "dtype": "bfloat16", "quantize": quantize},
                "method": {"type": "lora", "lora": {"r": 8, "alpha": 16, "dropout": 0.0, **lora}},
                "data": {"path": str(tmp_path / "train.jsonl"), "max_seq_len": 2048},
                "offload": {
                    "params": "disk",
                    "device_budget": "12GiB",
                    "host_budget": "40GiB",
                    "disk_path": str(tmp_path / "nvme"),
                    "activations": "host",
                },
            }
        )
    )
    return load_recipe(path, ())


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_the_100b_class_moe_configs_are_estimated_with_every_expert_in_nf4(tmp_path, name):
    predicted = estimate(_qlora(tmp_path, CONFIGS / name), measure=False)
    assert abs(predicted.parameters - PUBLISHED[name]) <= 0.01 * PUBLISHED[name]
    # NF4 with double-quantized statistics is 0.516 bytes a parameter; embeddings, head, norms and routers
    # stay bf16. Experts counted at 2 bytes (most of an MoE) would make it more than 1.5
    # the config alone says bf16 and no saved quantization: the base is quantized on load into the quantized
    # cache, whose images are the disk tier's home for it (no copy of them in the slot file)
    weights = sum(nbytes for kind, (_, nbytes) in predicted.kinds.items() if kind.startswith("weights"))
    assert 0.50 < weights / predicted.parameters < 0.56, weights / predicted.parameters
    cached = predicted.kinds[QUANT_CACHE][1]
    assert cached > 0.9 * weights and predicted.disk_needed >= predicted.tiers["disk"].home + cached
    assert predicted.moved_per_step["disk->host"] > 0
    # all-linear on an MoE is attention (these two have no shared expert): the routed experts are left out, and
    # the estimate says what adding them would train: r (in + out) for each expert's gate_up_proj and down_proj
    config = json.loads((CONFIGS / name / "config.json").read_text())
    experts = config.get("num_local_experts") or config.get("num_experts") or config["n_routed_experts"]
    hidden = config["hidden_size"]
    inner = config.get("moe_intermediate_size") or config["intermediate_size"]
    layers = config["num_hidden_layers"]
    kv = config["num_key_value_heads"] * config.get("head_dim", hidden // config["num_attention_heads"])
    q = config["num_attention_heads"] * config.get("head_dim", hidden // config["num_attention_heads"])
    assert predicted.trained_parameters == 8 * layers * ((hidden + q) * 2 + (hidden + kv) * 2)
    added = 8 * experts * ((2 * inner + hidden) + (hidden + inner)) * layers
    (note,) = [n for n in predicted.notes if "routed experts" in n]
    assert f"would train {added:,} more parameters" in note, note


@pytest.mark.parametrize(
    "name, total",
    [
        ("meta-llama/Llama-4-Scout-17B-16E-Instruct", 109e9),
        ("meta-llama/Llama-4-Maverick-17B-128E-Instruct", 400e9),
    ],
)
def test_llama4_is_estimated_as_its_multimodal_class_without_reading_its_tower(tmp_path, name, total):
    """Llama 4 as it ships (Llama4ForConditionalGeneration, bf16), LoRA on text: the model card's total within 1%,
    of which the estimate counts the language model alone; its weights are read in place, 2 bytes a parameter of
    the language model and none of the vision tower's; all-linear trains attention and the shared experts
    (rank r each) and the estimate says what the routed experts would add."""
    from tiertune.engine.prepare import meta_skeleton
    from tiertune.loading.model import tower_parameters

    skeleton = meta_skeleton(str(CONFIGS / name), torch.bfloat16)
    assert type(skeleton).__name__ == "Llama4ForConditionalGeneration"
    tower = sum(p.numel() for n, p in skeleton.named_parameters() if n in set(tower_parameters(skeleton)))
    everything = sum(p.numel() for p in skeleton.parameters())
    assert abs(everything - total) <= 0.01 * total and 0 < tower < 0.01 * everything
    predicted = estimate(_qlora(tmp_path, CONFIGS / name, quantize="none"), measure=False)
    assert predicted.parameters == everything - tower
    read = predicted.kinds[IN_PLACE][1]
    assert 2 * predicted.parameters <= read <= 2 * predicted.parameters * 1.001  # + the files' alignment
    config = json.loads((CONFIGS / name / "config.json").read_text())["text_config"]
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    q, kv = (
        config["num_attention_heads"] * config["head_dim"],
        config["num_key_value_heads"] * config["head_dim"],
    )
    attention = 8 * ((hidden + q) * 2 + (hidden + kv) * 2)
    moe = layers // config["interleave_moe_layer_step"]
    shared = 8 * 3 * (hidden + config["intermediate_size"])  # a shared expert's gate, up and down
    dense = 8 * 3 * (hidden + config["intermediate_size_mlp"])  # the MLP of a layer without experts
    assert predicted.trained_parameters == attention * layers + shared * moe + dense * (layers - moe)
    assert any("would train" in n and "routed experts" in n for n in predicted.notes)


def test_attention_only_lora_counts_the_attention_adapters(tmp_path):
    config = json.loads((CONFIGS / "mistralai/Mixtral-8x22B-v0.1" / "config.json").read_text())
    predicted = estimate(
        _qlora(
            tmp_path,
            CONFIGS / "mistralai/Mixtral-8x22B-v0.1",
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        ),
        measure=False,
    )
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv = config["num_key_value_heads"] * hidden // heads
    per_layer = 8 * (hidden + hidden) * 2 + 8 * (hidden + kv) * 2  # q and o, k and v: r (in + out) each
    assert predicted.trained_parameters == per_layer * config["num_hidden_layers"]


def test_deepseek_v3_builds_as_transformers_own_class_and_its_fp8_weights_are_read_in_place(tmp_path):
    """DeepSeek-V3 ships FP8 (its quantization_config): estimated with its weights read as they ship, in place
    from its files: about a byte a parameter (e4m3 codes, a 4-byte scale per 128 x 128 block, the bf16 embeddings
    and head), no quantized cache, and nothing of the base in the disk tier but the fp32 routers (cast on load).
    NF4 on it is refused in one line: the checkpoint is read as it ships."""
    import torch

    from tiertune.errors import ConfigError
    from tiertune.loading.model import build_skeleton

    with torch.device("meta"):
        model = build_skeleton(CONFIGS / "deepseek-ai/DeepSeek-V3", torch.bfloat16)
    assert type(model).__module__ == "transformers.models.deepseek_v3.modeling_deepseek_v3"  # not auto_map's
    predicted = estimate(
        _qlora(tmp_path, CONFIGS / "deepseek-ai/DeepSeek-V3", quantize="none"), measure=False
    )
    assert abs(predicted.parameters - 671e9) <= 0.01 * 671e9
    in_place = predicted.kinds[IN_PLACE][1]
    assert 1.0 < in_place / predicted.parameters < 1.02, in_place / predicted.parameters
    assert QUANT_CACHE not in predicted.kinds
    routers = (
        58 * 256 * 7168 * 2
    )  # the MoE layers' routers: the checkpoint's fp32 copies, cast to bf16 on load
    assert predicted.tiers["disk"].home <= 2 * routers
    assert not any("'fp8'" in note for note in predicted.notes)
    with pytest.raises(ConfigError, match="ships its weights in FP8.*set model.quantize: none"):
        estimate(_qlora(tmp_path, CONFIGS / "deepseek-ai/DeepSeek-V3"), measure=False)


def _deepseek_v3_fp8(vocab):
    """DeepSeek-V3's published config (fp8 weights: its quantization_config), at a tiny size."""
    config = json.loads((CONFIGS / "deepseek-ai/DeepSeek-V3" / "config.json").read_text())
    config.update(
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        n_routed_experts=4,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        vocab_size=vocab,
    )
    return config


def _gpt_oss_mxfp4(vocab):
    """A tiny gpt-oss as published: MXFP4 experts (quant_method mxfp4)."""
    from transformers import GptOssConfig

    config = GptOssConfig(
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        vocab_size=vocab,
    ).to_dict()
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn"],
    }
    return config


@pytest.mark.parametrize(("make", "method"), [(_deepseek_v3_fp8, "FP8"), (_gpt_oss_mxfp4, "MXFP4")])
def test_a_release_that_ships_quantized_is_estimated_as_it_ships_and_nf4_on_it_stops_in_one_line(
    tmp_path, model_dir, write_recipe, make, method
):
    """DeepSeek-V3's config (FP8) and gpt-oss's (MXFP4 experts), tiny: with ``model.quantize: none`` the estimate
    reads the quantized weights in place (no note about an unreadable format); ``nf4`` on them stops estimate and
    train before reading a weight, with one line that says to set ``model.quantize: none``, exit 2."""
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(model_dir) / file, tiny / file)
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    (tiny / "config.json").write_text(json.dumps(make(vocab)))
    method_section = {"type": "lora", "lora": {"dropout": 0.0}}
    recipe = write_recipe(
        tmp_path, tiny, model={"quantize": "none", "dtype": "bfloat16"}, method=method_section, name="none"
    )
    predicted = estimate(load_recipe(recipe, ()), measure=False)
    assert predicted.kinds[IN_PLACE][1] > 0 and not any("saved quantized" in n for n in predicted.notes)
    recipe = write_recipe(
        tmp_path, tiny, model={"quantize": "nf4", "dtype": "bfloat16"}, method=method_section
    )
    for command in ("estimate", "train"):
        result = CliRunner().invoke(app, [command, str(recipe)], env={"COLUMNS": "200"})
        assert result.exit_code == 2, result.output
        assert (
            f"ships its weights in {method}" in result.output and "set model.quantize: none" in result.output
        )
        assert "Traceback" not in result.output


def test_a_built_in_recipes_model_id_is_estimated_offline_from_its_shipped_config(tmp_path, monkeypatch):
    """``model.path: mistralai/Mixtral-8x22B-v0.1`` with no network and an empty cache: the config.json tiertune
    ships for the built-in recipes' models is used, and the estimate is that of the config in a directory."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))  # empty: nothing fetched before
    monkeypatch.chdir(tmp_path)
    by_id = estimate(_qlora(tmp_path, "mistralai/Mixtral-8x22B-v0.1"), measure=False)
    local = estimate(_qlora(tmp_path, CONFIGS / "mistralai/Mixtral-8x22B-v0.1"), measure=False)
    assert by_id.parameters == local.parameters and by_id.kinds == local.kinds
    assert (
        abs(by_id.parameters - PUBLISHED["mistralai/Mixtral-8x22B-v0.1"])
        <= 0.01 * PUBLISHED["mistralai/Mixtral-8x22B-v0.1"]
    )


def test_another_model_id_is_estimated_from_its_config_alone(tmp_path, monkeypatch):
    """A model id tiertune does not ship: only its config.json is fetched (here from a stand-in for the Hub)."""
    import huggingface_hub

    from tiertune.loading import hub

    fetched = []

    def download(repo_id, allow_patterns=None, local_files_only=False, **kwargs):
        if local_files_only:
            raise huggingface_hub.errors.LocalEntryNotFoundError("not cached")
        fetched.append((repo_id, allow_patterns))
        snapshot = tmp_path / "hub" / repo_id.replace("/", "--")
        snapshot.mkdir(parents=True, exist_ok=True)
        shutil.copy(CONFIGS / "mistralai/Mixtral-8x22B-v0.1" / "config.json", snapshot / "config.json")
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    monkeypatch.setattr(hub.socket, "create_connection", lambda *a, **k: io.BytesIO())  # the Hub answers
    monkeypatch.chdir(tmp_path)
    by_id = estimate(_qlora(tmp_path, "someone/mixtral-copy"), measure=False)
    assert fetched == [("someone/mixtral-copy", ["config.json"])]
    local = estimate(_qlora(tmp_path, CONFIGS / "mistralai/Mixtral-8x22B-v0.1"), measure=False)
    assert by_id.parameters == local.parameters and by_id.kinds == local.kinds


def test_a_model_id_offline_is_a_clear_error_at_once(tmp_path, monkeypatch):
    """Offline (HF_HUB_OFFLINE, or a Hub that cannot be reached): exit 2 at once with one line naming `hf
    download` and HF_HUB_OFFLINE, not a minute of the hub client's retries; no traceback."""
    import time

    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))  # empty: nothing fetched before
    monkeypatch.chdir(tmp_path)
    recipe = _qlora(tmp_path, "someone/not-shipped")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelError, match="HF_HUB_OFFLINE is set.*`hf download someone/not-shipped`"):
        estimate(recipe, measure=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "https://127.0.0.1:9")  # nothing listens there
    began = time.perf_counter()
    result = CliRunner().invoke(
        app, ["estimate", str(tmp_path / "qlora.yaml"), "--no-probe"], env={"COLUMNS": "200"}
    )
    assert time.perf_counter() - began < 30
    assert result.exit_code == 2, result.output
    assert "cannot be reached" in result.output and "`hf download someone/not-shipped`" in result.output
    assert (
        "HF_HUB_OFFLINE=1" in result.output
        and "Retrying" not in result.output
        and "Traceback" not in result.output
    )


def test_a_prequantized_moe_is_estimated_with_its_experts_in_the_quantized_cache(tmp_path):
    """A bitsandbytes 4-bit MoE as transformers saves it has unquantized experts: the run quantizes them on
    load and homes those layers in the quantized cache (test_prequantized), so the estimate counts them
    there, not in the disk tier's slots."""
    model = tmp_path / "mixtral-bnb-4bit"
    model.mkdir()
    config = json.loads((CONFIGS / "mistralai/Mixtral-8x22B-v0.1" / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "bitsandbytes",
        "load_in_4bit": True,
        "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": True,
    }
    (model / "config.json").write_text(json.dumps(config))
    predicted = estimate(_qlora(tmp_path, model), measure=False)
    cached = predicted.kinds[QUANT_CACHE][1]
    layers = sum(nbytes for kind, (_, nbytes) in predicted.kinds.items() if kind.startswith("weights"))
    assert cached > 0.9 * layers, predicted.kinds
    assert predicted.tiers["disk"].home < 0.01 * cached


def test_estimate_for_several_processes_says_what_each_rank_and_node_holds_and_sends(
    make_recipe, tmp_path, model_dir, write_recipe, monkeypatch
):
    import shutil

    from tiertune.errors import ConfigError

    # the disk tier's budget is the disk's free space, which every other program writing to it changes between
    # two estimates: a fixed reading, so that the two tables compare whole
    free = 500 << 30
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(2 * free, free, free))
    recipe = make_recipe(("offload.params=disk", "offload.optimizer_states=disk"))
    one = estimate(recipe, measure=False)
    four = estimate(recipe, measure=False, processes=4, per_node=2)
    assert one.scale_out is None and four.tiers == one.tiers  # the table stays one process's
    so = four.scale_out
    # each rank homes a quarter of the disk tier's chunks (each padded to whole 4 KiB pages per shard)
    chunks = sum(n for tier, n in one.kinds.values() if tier == "disk")
    assert chunks / 4 <= so.per_rank["disk"] <= chunks / 4 + 4096 * 4 * 64
    assert so.per_node_bytes["disk"] == 2 * so.per_rank["disk"]
    assert so.budgets["host"] == one.tiers["host"].budget // 2  # the node's budget, split between its 2 ranks
    # once a step whatever its micro-batches (2, one wave: ``engine.schedule``), forward gathers every weight
    # once, backward each layer's again, and the gradients are reduce-scattered in fp32; (N - 1)/N of each
    # leaves each rank
    weights = one.kinds["weights"][1]
    assert one.waves.count == 1
    assert 3 / 4 * weights < so.wire["all_gather"] < 2 * 3 / 4 * weights + 4096 * 64
    assert (
        3 / 4 * one.trained_parameters * 4
        <= so.wire["reduce_scatter"]
        < 3 / 4 * one.trained_parameters * 4 + 4096 * 64
    )
    path = write_recipe(tmp_path, model_dir, name="cli")
    data = json.loads(
        CliRunner().invoke(app, ["estimate", str(path), "--no-probe", "--json", "--processes", "2"]).output
    )
    assert (
        data["scale_out"]["processes"] == 2
        and data["scale_out"]["wire_bytes_per_step_per_rank"]["all_gather"] > 0
    )
    # a rank's memory plan: the whole chunks it gathers take device slots, and it is what fits is decided by
    plan = data["scale_out"]["plan_per_rank"]
    assert plan["device"]["needed"] >= data["scale_out"]["gathered_on_device"], plan
    exact = {t: so.plan.needed(Tier(t)) for t in ("device", "host")}
    assert dataclasses.replace(so, budgets=exact).fits
    assert not dataclasses.replace(so, budgets={**exact, "host": exact["host"] - 1}).fits
    text = CliRunner().invoke(app, ["estimate", str(path), "--no-probe", "--processes", "2"]).output
    assert "a rank's memory plan needs: device" in text, text
    with pytest.raises(ConfigError, match="--per-node"):
        estimate(recipe, measure=False, processes=2, per_node=3)


def test_what_computes_must_hold_the_tiers_and_what_is_outside_the_store(tmp_path, make_recipe):
    """Budgets that hold are not enough: on a GPU its memory must hold the device tier's needs plus a layer's
    activations, the boundary gradients and the loss chunk (outside the store). A GPU of just that size fits;
    one byte less, and the estimate says NO on that line and does not fit."""
    from tiertune.estimates.report import format_estimate
    from tiertune.units import format_size

    est = estimate(make_recipe(()), measure=False, gpu="rtx4090")
    what, has, held = est.computes_on()
    assert has == 24 * 10**9 or has > held
    assert what == "the GPU" and held == est.needed("device") + sum(est.outside_store.values())
    assert est.outside_store and est.fits, format_estimate(est, "t")
    est.tiers["device"].budget = est.needed("device")  # the device budget no larger than the GPU
    est.machine["gpu_memory"] = held
    assert est.fits and f"the GPU ({format_size(held)}) holds {format_size(held)}" in format_estimate(
        est, "t"
    )
    est.machine["gpu_memory"] = held - 1
    assert not est.fits and not est.short_of_machine() and est.needed("device") <= est.tiers["device"].budget
    assert (
        "outside the store  NO" in format_estimate(est, "t") and est.as_json()["computes_on"]["held"] == held
    )


def test_a_schedule_change_is_estimated_by_construction(tmp_path, model_dir, write_recipe, monkeypatch):
    """A change to the step's order made in ``engine/schedule.py`` alone (here ``LayerMajor.waves`` running each
    micro-batch as a wave of its own: the micro-batch-major order that layer-major replaced) is what the estimate
    replays, nothing else changed: the bytes its step moves are the changed run's, and the layers' weights go to
    the device once per micro-batch instead of once per step."""
    path = write_recipe(
        tmp_path,
        model_dir,
        training={"gradient_accumulation_steps": 4, "max_steps": 3},
        offload={"device_budget": "64MiB", "host_budget": "64MiB"},
    )
    overrides = list(CASES["full, states on disk, everything cached"])
    smallest = estimate(load_recipe(path, overrides), measure=False).plan.needed(Tier.DEVICE)
    # the device tier as small as the plan allows: the layers stream through it each wave
    recipe = load_recipe(path, [*overrides, f"offload.device_budget={-(-smallest // (1 << 20))}MiB"])
    layer_major = estimate(recipe, measure=False).moved_per_step
    monkeypatch.setattr(LayerMajor, "waves", lambda self, n: [range(j, j + 1) for j in range(n)])
    result = train(recipe, progress=False)
    log = [json.loads(line) for line in result.log_path.read_text().splitlines()]
    monkeypatch.setattr(
        replaying, "CLIPPED", tuple(r["grad_norm"] > recipe.training.max_grad_norm for r in log)
    )
    moved = estimate(recipe, measure=False).moved_per_step
    before, after = log[-2]["bytes_moved"], log[-1]["bytes_moved"]
    measured = {k: after[k] - before.get(k, 0) for k in after if after[k] - before.get(k, 0)}
    for link in set(measured) | set(moved):
        assert abs(moved.get(link, 0) - measured.get(link, 0)) <= 0.02 * measured.get(link, 0), (
            link,
            moved,
            measured,
        )
    assert moved["host->device"] >= 2 * layer_major["host->device"] > 0, (moved, layer_major)


def test_a_run_whose_steps_clip_moves_what_the_estimate_says_of_a_step_after_a_clipped_one(
    tmp_path, model_dir, write_recipe
):
    """Every step clipped (``max_grad_norm`` far below the norms), the optimizer overlapped (its twins made): each
    step after the first runs the update after backward, in place, and moves the estimate's
    ``moved_after_clipped`` (the replay's step after clipped ones), not the speculative step's bytes: through the
    twins it read and wrote a second copy of the states (here the states fit the 10 MiB host budget, their twins
    do not: a speculative step reads 1.2 MB and writes 2.4 MB, one in place moves nothing to or from the disk)."""
    path = write_recipe(
        tmp_path,
        model_dir,
        training={"gradient_accumulation_steps": 2, "max_steps": 4, "max_grad_norm": 1e-4},
        offload={"device_budget": "64MiB", "host_budget": "10MiB"},
    )
    recipe = load_recipe(path, ["offload.params=disk", "offload.optimizer_states=disk"])
    predicted = estimate(recipe, measure=False)
    assert predicted.moved_after_clipped and predicted.moved_after_clipped != predicted.moved_per_step
    log = [json.loads(line) for line in train(recipe, progress=False).log_path.read_text().splitlines()]
    steps = [r for r in log if "grad_norm" in r]
    assert steps[-1]["optimizer_steps"] == {"speculative": 0, "redone": 1, "after_backward": 3}
    before, after = steps[-2]["bytes_moved"], steps[-1]["bytes_moved"]
    measured = {k: after[k] - before.get(k, 0) for k in after}
    for link in set(measured) | set(predicted.moved_after_clipped):
        expected = predicted.moved_after_clipped.get(link, 0)
        assert abs(expected - measured.get(link, 0)) <= 0.02 * measured.get(link, 0), (
            link,
            predicted,
            measured,
        )
    assert measured["host->disk"] < predicted.moved_per_step["host->disk"]  # the twins' bytes not moved


def test_gpt_oss_120b_as_it_ships_is_read_at_under_0_6_bytes_a_parameter(tmp_path):
    """gpt-oss-120b's published config (MXFP4 experts): its base, read in place from its files, is what the estimate
    counts on disk, at most 0.6 bytes a parameter (attention and embeddings stay bf16; the experts are 17
    bytes per 32 values). Converted to bf16 first, it was 1.97 bytes a parameter."""
    predicted = estimate(_qlora(tmp_path, CONFIGS / "openai/gpt-oss-120b", quantize="none"), measure=False)
    assert abs(predicted.parameters - 116.8e9) <= 0.01 * 116.8e9
    base = predicted.kinds[IN_PLACE][1] + predicted.kinds.get(QUANT_CACHE, ("disk", 0))[1]
    assert base / predicted.parameters <= 0.6, base / predicted.parameters
    assert predicted.tiers["disk"].home == 0  # nothing of the base copied under disk_path


def test_estimate_reads_the_data_once(tmp_path, write_recipe, cat_model, monkeypatch):
    """The steps of an epoch (the time to finish), the first micro-batch (the engine's measured step) and the
    held-out set's passes each need the data as the run tokenizes it: `estimate` reads each file once for all of
    them (three times each before); outside an estimate nothing is kept."""
    from tiertune.estimates.report import estimate
    from tiertune.finetune import train as train_module

    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("".join(json.dumps({"text": f"the cat sat on mat {i}"}) + "\n" for i in range(5)))
    path = write_recipe(
        tmp_path,
        cat_model(2, hidden=64),
        data={"eval_path": str(held_out)},
        training={"max_steps": 0, "num_train_epochs": 2, "eval_strategy": "steps", "eval_steps": 2},
    )
    read = []
    load_data = train_module.load_data

    def counted(path, *args, **kwargs):
        read.append(Path(path).name)
        return load_data(path, *args, **kwargs)

    monkeypatch.setattr(train_module, "load_data", counted)
    recipe = load_recipe(path)
    est = estimate(recipe, gpu="cpu", threads=1)  # measured: its rates from the engine's own step
    assert est.speed is not None and est.speed.steps == 6  # 12 rows by 4, twice
    assert sorted(read) == ["data.jsonl", "held_out.jsonl"]
    assert (
        est.evaluation.rows == 5 and est.evaluation.evaluations == 3
    )  # 6 steps (12 rows by 4, twice): 2, 4, 6
    train_module.load_run(recipe, 1)
    train_module.load_run(recipe, 1)
    assert len(read) == 6  # (outside an estimate: read each time)
