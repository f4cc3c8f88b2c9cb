"""One rank of a data-parallel ZeRO-3 training run of the streamed engine, or the one process it is compared
with (``WORLD_SIZE`` unset or 1: the whole global batch in one process). Started by
``tests/distributed/test_zero.py`` with the variables torchrun sets and:

- ``TT_MODEL``: the model directory; ``TT_CASE``: full (params and states on disk), adam8 (8-bit AdamW,
  states on disk) or qlora (an NF4 base on disk, read in place from the node's quantized cache; LoRA adapters);
- ``TT_STORE``: a FileStore path for the rendezvous; ``TT_DISK``: the offload directory (``rank-r`` below it);
- ``TT_OUT``: where it writes ``rank-<r>.json`` (losses, peaks, disk bytes) and, from rank 0, ``weights.pt``.
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tiertune.distributed.world import World, init_process_group
from tiertune.engine import EngineConfig, StreamedTrainer
from tiertune.offload.store import StoreConfig
from tiertune.settings import LoraSettings

STEPS = 3
ACCUM = 2
GLOBAL_ROWS = 6  # rows of each global micro-batch: 2 or 3 ranks take 3 or 2 rows each


def global_batches(vocab: int) -> list[dict[str, torch.Tensor]]:
    """STEPS x ACCUM global micro-batches, with padding (label -100) of varying length in every row."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(STEPS * ACCUM):
        ids = torch.randint(0, vocab, (GLOBAL_ROWS, 10), generator=g)
        mask = torch.ones_like(ids)
        for row in range(GLOBAL_ROWS):
            pad = int(torch.randint(0, 5, (1,), generator=g))
            if pad:
                mask[row, -pad:] = 0
        out.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return out


def engine_config(case: str) -> EngineConfig:
    common = dict(
        dtype=torch.float32,
        learning_rate=3e-3,
        weight_decay=0.1,
        max_grad_norm=0.5,
        warmup_steps=1,
        max_steps=STEPS,
        kernels="none",
        gradient_accumulation_steps=ACCUM,
    )
    if case == "full":
        return EngineConfig(**common, params="disk", optimizer_states="disk", gradients="disk")
    if case == "adam8":
        return EngineConfig(**common, optimizer_states="disk", optim="adamw_bnb_8bit")
    if case == "qlora":  # no dropout: its masks come from each process's own random stream
        common["learning_rate"] = 2e-2
        lora = LoraSettings(r=4, alpha=8, dropout=0.0, seed=0)
        # the node's quantized cache, as a run keeps it: beside the ranks' offload directories
        cache = str(Path(os.environ["TT_DISK"]) / "quantized")
        return EngineConfig(
            **common, params="disk", method="lora", quantize="nf4", lora=lora, quant_cache=cache
        )
    raise ValueError(case)


def main() -> None:
    world = World.from_env()
    if world.size > 1:
        init_process_group(world, dist.FileStore(os.environ["TT_STORE"], world.size))
    torch.manual_seed(0)
    case = os.environ["TT_CASE"]
    disk = world.disk_dir(os.environ["TT_DISK"])
    store_cfg = StoreConfig.resolve(
        device="cpu",
        device_budget="64MiB",
        host_budget="64MiB",
        disk_path=str(disk),
        chunk_size=1 << 40,
        num_shards=world.size,
    )
    trainer = StreamedTrainer(os.environ["TT_MODEL"], store_cfg, engine_config(case), world=world)
    rows = GLOBAL_ROWS // world.size
    losses, norms = [], []
    batches = global_batches(trainer.model.config.vocab_size)
    for step in range(STEPS):
        micro = [
            {k: v[world.rank * rows : (world.rank + 1) * rows] for k, v in mb.items()}
            for mb in batches[step * ACCUM : (step + 1) * ACCUM]
        ]
        losses.append(trainer.step(micro))
        norms.append(trainer.last_grad_norm)
    weights = trainer.adapter_state_dict() if case == "qlora" else trainer.state_dict()
    stats = trainer.store.stats()
    disk_bytes = sum(f.stat().st_size for f in disk.rglob("*") if f.is_file())
    result = {
        "losses": losses,
        "norms": norms,
        "host_peak": stats.tiers["host"].peak,
        "disk_used": stats.tiers["disk"].used if "disk" in stats.tiers else 0,
        "disk_bytes": disk_bytes,
        "state_bytes": trainer.state_bytes(),
        "wire": trainer.wire_sent(),
    }
    out = Path(os.environ["TT_OUT"])
    if world.is_main:
        torch.save(weights, out / "weights.pt")
    trainer.close()
    (out / f"rank-{world.rank}.json").write_text(json.dumps(result))
    if world.size > 1:
        dist.destroy_process_group()
    sys.exit(0)


if __name__ == "__main__":
    main()
