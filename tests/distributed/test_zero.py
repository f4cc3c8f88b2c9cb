"""ZeRO-3 over chunks in real processes (gloo, a FileStore rendezvous, timeouts): 2 and 3 ranks, each with its
part of every global batch, train as one process with the whole batch does: full fine-tuning with the weights
and states on disk, 8-bit AdamW, QLoRA with an NF4 base on disk; on Llama (tied embeddings) and Qwen2."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("bitsandbytes")

WORKER = Path(__file__).with_name("engine_worker.py")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(family, case, size)``: the worker's results by rank and rank 0's final weights, run once."""
    from tiny import tiny_config
    from transformers import AutoModelForCausalLM

    done: dict = {}
    models: dict = {}

    def run(family: str, case: str, size: int):
        if family not in models:
            torch.manual_seed(0)
            models[family] = tmp_path_factory.mktemp(family)
            AutoModelForCausalLM.from_config(tiny_config(family, 3)).save_pretrained(models[family])
        key = (family, case, size)
        if key not in done:
            root = tmp_path_factory.mktemp(f"{family}-{case}-{size}")
            procs = []
            for rank in range(size):
                env = dict(
                    os.environ,
                    TT_MODEL=str(models[family]),
                    TT_CASE=case,
                    TT_STORE=str(root / "store"),
                    TT_DISK=str(root / "disk"),
                    TT_OUT=str(root),
                    OMP_NUM_THREADS="1",
                    TIERTUNE_COLLECTIVE_TIMEOUT="60",
                )
                if size > 1:
                    env.update(
                        RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(size)
                    )
                procs.append(
                    subprocess.Popen(
                        [sys.executable, str(WORKER)], env=env, stderr=subprocess.PIPE, text=True
                    )
                )
            try:
                codes = [p.wait(timeout=240) for p in procs]
            finally:
                for p in procs:
                    p.kill()
            assert codes == [0] * size, [p.stderr.read()[-3000:] for p in procs]
            results = [json.loads((root / f"rank-{r}.json").read_text()) for r in range(size)]
            done[key] = results, torch.load(root / "weights.pt"), root
        return done[key]

    return run


def _weight_gap(a: dict, b: dict) -> tuple[float, float, float]:
    """Largest element difference, the difference's norm relative to the weights' norm, and the fraction of
    elements that differ by more than 1e-5."""
    worst, num, den, off, total = 0.0, 0.0, 0.0, 0, 0
    for name, x in a.items():
        d = (x.float() - b[name].float()).abs()
        worst = max(worst, float(d.max()))
        num += float((d**2).sum())
        den += float((x.float() ** 2).sum())
        off += int((d > 1e-5).sum())
        total += d.numel()
    return worst, (num / den) ** 0.5, off / total


CASES = [
    ("llama", "full", 2),
    ("llama", "full", 3),
    ("qwen2", "full", 2),
    ("qwen2", "full", 3),
    ("llama", "adam8", 2),
    ("qwen2", "adam8", 3),
    ("llama", "qlora", 2),
    ("qwen2", "qlora", 3),
]


@pytest.mark.parametrize(("family", "case", "size"), CASES)
def test_ranks_train_as_one_process_with_the_whole_batch(runs, family, case, size):
    one, one_weights, _ = runs(family, case, 1)
    ranks, weights, _ = runs(family, case, size)
    for r in ranks:  # every rank logs the same loss: the global batch's
        assert r["losses"] == ranks[0]["losses"]
    for got, want in zip(ranks[0]["losses"], one[0]["losses"], strict=True):
        assert abs(got - want) <= 1e-5 * abs(want)
    for got, want in zip(ranks[0]["norms"], one[0]["norms"], strict=True):
        assert abs(got - want) <= 1e-5 * abs(want)
    assert weights.keys() == one_weights.keys()
    worst, relative, off = _weight_gap(one_weights, weights)
    assert relative <= 1e-5
    if case == "full":
        assert worst <= 1e-5
    elif case == "qlora":  # near-zero adapter gradients: Adam's first steps amplify their last bits
        assert worst <= 1e-4
    else:  # 8-bit moments: a last-bit difference in a gradient can move a value to the next of 256 levels
        assert off <= 1e-4


@pytest.mark.parametrize(("family", "case"), [("llama", "full"), ("qwen2", "full")])
def test_each_rank_holds_its_share_of_the_state(runs, family, case):
    one, _, _ = runs(family, case, 1)
    ranks, _, root = runs(family, case, 2)
    # the state in each rank's store is its half, padded to whole 4 KiB pages per rank and chunk
    single = one[0]["state_bytes"]
    for kind in ("weights", "master", "moments"):
        per_rank = [r["state_bytes"][kind] for r in ranks]
        assert sum(per_rank) <= single[kind] * 1.25 + 2 * 4096 * 16, (kind, per_rank, single[kind])
        assert max(per_rank) <= single[kind] * 0.65 + 4096 * 16, (kind, per_rank, single[kind])
    # the offload files of each rank are in its own directory, about half of one process's
    dirs = sorted(p.name for p in (root / "disk").iterdir())
    assert dirs == ["rank-0", "rank-1"]
    for r in ranks:
        assert 0 < r["disk_bytes"] <= one[0]["disk_bytes"] * 0.65


@pytest.mark.parametrize("size", [2, 3])
def test_a_sharded_qlora_reads_its_base_in_place_from_one_cache_per_node(runs, size):
    """No rank copies the frozen base into its disk tier: each reads its shard of every chunk from the files,
    the NF4 layers from the node's quantized cache (one image of each whole chunk, quantized once for all
    ranks), the rest from the checkpoint's own files; as one process reads its whole chunks."""
    one, _, _ = runs("llama", "qlora", 1)
    ranks, _, root = runs("llama", "qlora", size)
    assert one[0]["disk_used"] == 0 and [r["disk_used"] for r in ranks] == [0] * size
    images = sorted(p.name for p in (root / "disk" / "quantized").rglob("*.chunk"))
    assert len(images) == 3 and all(name.endswith(f".of{size}.chunk") for name in images), images  # 3 layers
    assert all(r["disk_bytes"] <= 4096 * 4 for r in ranks)  # the ranks' slot files: headers only
