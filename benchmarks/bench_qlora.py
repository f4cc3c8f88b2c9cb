"""QLoRA at scale on the CPU: a >= 7B model quantized to NF4 on load, its base streamed from disk.

Writes a Mistral-7B-shaped checkpoint with random bf16 weights (7.24 B parameters by default), then, each in
a fresh process of the same invocation:

- ``tiertune``: the streamed engine, LoRA (r 16, all linear layers) on the NF4 base homed on disk, through
  ``--host-budget`` (default 8 GiB) and ``--device-budget`` (the CPU device tier);
- ``peft``: the reference, transformers + bitsandbytes (``load_in_4bit``, NF4, double quantization) + peft,
  the whole quantized model in memory, the same adapter, torch AdamW (``--modes tiertune`` skips it).

Prints one JSON object: per mode, the load (quantize) time, seconds per step (mean of the steps after the
first), the losses, bytes moved per step per link (tiertune; steps after the first) and peak RSS.

Run: ``python benchmarks/bench_qlora.py --dir /mnt/nvme/tmp``
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_load import peak_rss, write_checkpoint
from common import add_model_args, machine, run_child

from tiertune.units import parse_size


def _batch(vocab: int, args: argparse.Namespace) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(0, vocab, (args.batch, args.seq), generator=gen)}


def run_tiertune(model_dir: str, disk_dir: str, args: argparse.Namespace) -> dict:
    from tiertune.finetune.engine import EngineConfig, StreamedTrainer
    from tiertune.finetune.lora import LoraSettings
    from tiertune.offload.store import StoreConfig

    store = StoreConfig(device_budget=args.device_budget, host_budget=args.host_budget, disk_path=disk_dir,
                        chunk_size=1 << 40, prefetch_depth=2)  # fmt: skip
    engine = EngineConfig(dtype=torch.float32, method="lora", quantize="nf4", params="disk",
                          lora=LoraSettings(r=16, alpha=32, dropout=0.0), learning_rate=1e-4,
                          max_steps=args.steps)  # fmt: skip
    began = time.perf_counter()
    trainer = StreamedTrainer(model_dir, store, engine)
    load_s = time.perf_counter() - began
    batch = [_batch(trainer.model.config.vocab_size, args)]
    try:
        losses, times = [], []
        before: dict[str, int] = {}
        for _ in range(args.steps):
            began = time.perf_counter()
            losses.append(trainer.step(batch))
            times.append(time.perf_counter() - began)
            print(f"tiertune step {len(times)}: {times[-1]:.1f} s", file=sys.stderr, flush=True)
            if len(times) == 1:  # the load and the first step (which records the trace) are not steady state
                before = trainer.store.stats().bytes_moved
        stats = trainer.store.stats()
        n = max(1, args.steps - 1)
        layer = next(s.weights[0] for s in trainer._states if s.group.kind == "layer")
    finally:
        trainer.close()
    return {
        "load_and_quantize_s": load_s,
        "step_s": sum(times[1:]) / max(1, len(times) - 1),
        "first_step_s": times[0],
        "losses": losses,
        "bytes_moved_per_step": {k: (v - before.get(k, 0)) / n for k, v in stats.bytes_moved.items()},
        "peak_bytes": {k: v.peak for k, v in stats.tiers.items()},
        "layer_chunk_bytes": layer.capacity,
        "peak_rss_bytes": peak_rss(),
    }


def run_peft(model_dir: str, args: argparse.Namespace) -> dict:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    qc = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                            bnb_4bit_compute_dtype=torch.float32)  # fmt: skip
    began = time.perf_counter()
    base = AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=qc, dtype=torch.float32,
                                                device_map="cpu")  # fmt: skip
    model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear",
                                            task_type="CAUSAL_LM"))  # fmt: skip
    model.train()
    base.gradient_checkpointing_enable()  # the memory-saving setting a QLoRA run uses
    base.enable_input_require_grads()
    load_s = time.perf_counter() - began
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
    batch = _batch(base.config.vocab_size, args)
    losses, times = [], []
    for _ in range(args.steps):
        began = time.perf_counter()
        logits = model(input_ids=batch["input_ids"]).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]).float(), batch["input_ids"][:, 1:].reshape(-1)
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
        times.append(time.perf_counter() - began)
        print(f"peft step {len(times)}: {times[-1]:.1f} s", file=sys.stderr, flush=True)
    return {
        "load_and_quantize_s": load_s,
        "step_s": sum(times[1:]) / max(1, len(times) - 1),
        "first_step_s": times[0],
        "losses": losses,
        "peak_rss_bytes": peak_rss(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p, layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=32000)
    p.add_argument("--steps", type=int, default=3, help="including the first, which records the trace")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--host-budget", default="8GiB")
    p.add_argument("--device-budget", default="2GiB")
    p.add_argument("--modes", default="tiertune,peft")
    args = p.parse_args()
    for name in ("device_budget", "host_budget"):
        setattr(args, name, parse_size(getattr(args, name), f"--{name.replace('_', '-')}"))
    if args.child:
        model_dir, disk_dir, mode = args.child
        result = run_tiertune(model_dir, disk_dir, args) if mode == "tiertune" else run_peft(model_dir, args)
        print(json.dumps(result))
        return
    base = Path(args.dir).resolve()
    base.mkdir(parents=True, exist_ok=True)
    result: dict = {"benchmark": "qlora", "machine": machine()}
    with tempfile.TemporaryDirectory(dir=base) as tmp:
        model_dir = Path(tmp) / "model"
        model_dir.mkdir()
        began = time.perf_counter()
        result["parameters"] = write_checkpoint(model_dir, args.layers, args.hidden, args.intermediate, args.heads,
                                                args.kv_heads, args.vocab)  # fmt: skip
        result["checkpoint_write_s"] = time.perf_counter() - began
        result["tokens_per_step"] = args.batch * args.seq
        result["settings"] = {"host_budget": args.host_budget, "device_budget": args.device_budget}
        for mode in args.modes.split(","):
            result[mode] = run_child(__file__, model_dir, Path(tmp) / "disk", mode)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
