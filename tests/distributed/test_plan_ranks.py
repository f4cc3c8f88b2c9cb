"""The memory plan of a launched run (``engine.memory`` over a rank's shards, ``finetune.train.admit`` on every
rank): each rank either trains to the end or every rank is refused before the model is loaded, naming the
node's smallest budgets that work; ``estimate --processes`` gives the same plan; no rank's store ever has more
chunks (or gathered whole chunks) of a size class in use on a tier than its plan reserved."""

import json
import re
import subprocess
from pathlib import Path

import pytest
from launching import TIMEOUT, launch_env, torchrun
from watching import check_in_use

from tiertune.config.recipe import load_recipe
from tiertune.estimates.report import estimate
from tiertune.offload.tiers import Tier

WORKER = Path(__file__).with_name("plan_worker.py")
MiB = 1 << 20
RANKS = 2


def _launch(recipe: Path, out: Path) -> list[dict]:
    out.mkdir()
    done = subprocess.run(
        [*torchrun(RANKS), str(WORKER), str(recipe)],
        env=dict(launch_env(), TT_OUT=str(out)),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(RANKS)]


CASES = [
    # full fine-tuning, weights and states on disk, clipping (the speculative step's twins when they fit)
    {
        "method": {"type": "full"},
        "offload": {"params": "disk", "optimizer_states": "disk"},
        "training": {"max_grad_norm": 1.0},
    },
    # LoRA on a bf16 base homed on the host, layer inputs in chunks on the host
    {
        "method": {"type": "lora"},
        "model": {"dtype": "bfloat16"},
        "offload": {"params": "host", "activations": "host"},
    },
    # full fine-tuning of a bf16 model (fp32 master weights), weights on the device, states on the host,
    # two micro-batches, no clipping (the optimizer overlapped with backward, no twins)
    {
        "method": {"type": "full"},
        "model": {"dtype": "bfloat16"},
        "offload": {"params": "device", "optimizer_states": "host"},
        "training": {"gradient_accumulation_steps": 2, "max_grad_norm": 0},
    },
    # QLoRA, the NF4 base homed on disk: each rank reads its shards in place (the node's quantized cache, the
    # checkpoint's files) and gathers whole chunks
    {"method": {"type": "lora"}, "model": {"quantize": "nf4"}, "offload": {"params": "disk"}},
]


@pytest.mark.parametrize("case", CASES, ids=["full-disk", "lora-host", "full-bf16-device", "qlora-disk"])
def test_launched_ranks_train_or_are_all_refused_before_loading(tmp_path, cat_model, write_recipe, case):
    model = cat_model(2, hidden=128)

    def recipe(name: str, device: str, host: str) -> Path:
        sections = {k: dict(v) for k, v in case.items()}
        sections.setdefault("offload", {}).update(device_budget=device, host_budget=host)
        sections.setdefault("training", {}).update(
            output_dir=str(tmp_path / name), max_steps=2, save_steps=0, per_device_train_batch_size=2
        )
        return write_recipe(tmp_path, model, name=name, **sections)

    def scale_out(path: Path):
        return estimate(load_recipe(path), measure=False, processes=RANKS).scale_out

    # budgets a little below what a rank needs, for the node's two ranks (below the plan without the twins
    # too, which a run leaves out when they do not fit): every rank is refused alike
    plan = scale_out(recipe("roomy", "1GiB", "1GiB")).plan
    for _ in range(4):
        short = {t: int(plan.needed(t) * 0.85) * RANKS for t in (Tier.DEVICE, Tier.HOST)}
        small = recipe("short", f"{short[Tier.DEVICE]}B", f"{short[Tier.HOST]}B")
        if not scale_out(small).fits:
            break
        plan = scale_out(small).plan
    assert not scale_out(small).fits
    ranks = _launch(small, tmp_path / "refused")
    messages = {r["refused"] for r in ranks}
    assert len(messages) == 1 and None not in messages, messages
    assert not any(r["loaded"] for r in ranks) and not (tmp_path / "short").exists()
    [message] = messages
    assert f"each of the node's {RANKS} ranks gets offload." in message, message
    named = re.search(r"offload\.device_budget: (\d+)MiB, offload\.host_budget: (\d+)MiB", message)
    assert named, message
    device, host = (int(n) for n in named.groups())
    for tier, n in (
        (Tier.DEVICE, device),
        (Tier.HOST, host),
    ):  # the node's: each rank's need, times its ranks
        assert n == -(-plan.needed(tier) // MiB) * RANKS
    # the smallest budgets the refusal names: every rank trains to the end within its plan's slots
    fits = recipe("fits", f"{device}MiB", f"{host}MiB")
    assert scale_out(fits).fits
    for rank in _launch(fits, tmp_path / "trained"):
        assert rank["refused"] is None and rank["loaded"] and rank["steps"] == 2, rank
        check_in_use(rank)
