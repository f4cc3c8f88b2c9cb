"""QLoRA at scale: a model quantized to NF4 on load, its base streamed from disk, against peft + bitsandbytes.

Writes a Llama-shaped checkpoint with random bf16 weights (Mistral-7B's shape by default, 7.24 B
parameters), then, each in a fresh process of the same invocation:

- ``tiertune``: the streamed engine, LoRA (r 16, all linear layers) on the NF4 base homed on disk, through
  ``--host-budget`` (default 8 GiB) and ``--device-budget``;
- ``peft``: the reference, transformers + bitsandbytes (``load_in_4bit``, NF4, double quantization) + peft,
  the whole quantized model in memory (on the GPU when there is one), gradient checkpointing, the same
  adapter, torch AdamW (``--modes tiertune`` skips it). Out of memory is reported, not raised.

``--device`` is ``cuda`` when a GPU is present (compute in bf16; ``--gpu-memory-cap`` limits what each
process may allocate there, to emulate a smaller card), else ``cpu`` (fp32, the device tier is host memory).

Prints one JSON object: per mode, the load (quantize) time, seconds per step and tokens/s (mean of the steps
after the first), the losses, bytes moved per step per link (tiertune; steps after the first), peak RSS and
peak GPU memory; and the I/O lower bound of a tiertune step: the bytes it moved from disk and to the device
divided by the disk's read bandwidth (fio on ``--dir``, else tiertune's own disk tier) and the host-to-device
bandwidth measured in the same run.

Run: ``python benchmarks/bench_qlora.py --dir /mnt/nvme/tmp``; a 70B Llama on a 24 GB-capped GPU:
``--layers 80 --hidden 8192 --intermediate 28672 --heads 64 --kv-heads 8 --vocab 128256
--gpu-memory-cap 24GiB --device-budget 20GiB --host-budget 64GiB --seq 2048``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_load import peak_rss, write_checkpoint
from common import add_model_args, machine, moved_per_step, run_child

from tiertune.settings import parse_size


def _batches(vocab: int, args: argparse.Namespace) -> list[dict[str, torch.Tensor]]:
    """A step's ``--micro-batches`` micro-batches of ``--batch`` x ``--seq`` random tokens (the same each step);
    with ``--objective dpo``, ``--batch`` pairs: each a chosen and a rejected row of ``--seq`` tokens, their
    first half the prompt (no targets)."""
    gen = torch.Generator().manual_seed(0)
    if args.objective == "sft":
        return [
            {"input_ids": torch.randint(0, vocab, (args.batch, args.seq), generator=gen)}
            for _ in range(args.micro_batches)
        ]
    out = []
    for _ in range(args.micro_batches):
        ids = torch.randint(0, vocab, (2 * args.batch, args.seq), generator=gen)
        ids[args.batch :, : args.seq // 2] = ids[: args.batch, : args.seq // 2]  # a pair shares its prompt
        labels = ids.clone()
        labels[:, : args.seq // 2] = -100
        out.append({"input_ids": ids, "labels": labels, "pairs": torch.tensor(args.batch)})
    return out


def _grpo_step(trainer: object, args: argparse.Namespace, vocab: int, generation: int) -> tuple[float, dict]:
    """A GRPO step as ``finetune.grpo`` makes it: ``--batch`` x ``--micro-batches`` completions of random prompts
    of ``--seq`` - ``--completion`` tokens, decoded together by the streamed model (no EOS: every one
    ``--completion`` tokens), then trained on with random advantages (the micro-batches of prompt + completion,
    the completion's tokens the targets). Returns the step's loss and the generation's figures: its seconds,
    decoded tokens/s, passes and the bytes it moved by link."""
    gen = torch.Generator().manual_seed(generation)
    rows = args.batch * args.micro_batches
    prompt = args.seq - args.completion
    prompts = torch.randint(0, vocab, (rows, prompt), generator=gen).tolist()
    before = dict(trainer.store_stats().bytes_moved)  # type: ignore[attr-defined]
    began = time.perf_counter()
    completions = trainer.generate(  # type: ignore[attr-defined]
        prompts, args.completion, temperature=1.0, seed=generation, eos_token_id=None
    )
    seconds = time.perf_counter() - began
    after = trainer.store_stats().bytes_moved  # type: ignore[attr-defined]
    moved = {k: n - before.get(k, 0) for k, n in after.items() if n - before.get(k, 0)}
    ids = torch.tensor([p + c for p, c in zip(prompts, completions, strict=True)], dtype=torch.long)
    labels = ids.clone()
    labels[:, :prompt] = -100
    advantages = torch.randn(rows, generator=gen)
    micro = [
        {
            "input_ids": ids[i : i + args.batch],
            "labels": labels[i : i + args.batch],
            "advantages": advantages[i : i + args.batch],
        }
        for i in range(0, rows, args.batch)
    ]
    loss = trainer.step(micro)  # type: ignore[attr-defined]
    passes = max(len(c) for c in completions)
    figures = {
        "generation_s": seconds,
        "decoded_tokens_per_second": rows * passes / seconds,
        "passes": passes,
        "generation_bytes": moved,
    }
    return loss, figures


def _setup_device(args: argparse.Namespace) -> torch.dtype:
    """Cap this process's GPU memory when asked; the compute dtype of the device."""
    if args.device != "cuda":
        return torch.float32
    if args.gpu_memory_cap:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_memory_cap / total))
    return torch.bfloat16


def _step_figures(load_s: float, times: list[float], losses: list[float], args: argparse.Namespace) -> dict:
    """Load time, the mean step time and tokens/s of the steps after the first, the first step, the losses."""
    step_s = sum(times[1:]) / max(1, len(times) - 1)
    return {
        "load_and_quantize_s": load_s,
        "step_s": step_s,
        "tokens_per_second": _rows(args) * args.seq * args.micro_batches * args.adapters / step_s,
        "first_step_s": times[0],
        "losses": losses,
    }


def _rows(args: argparse.Namespace) -> int:
    """Rows of a micro-batch: ``--batch``, or two per pair (``--objective dpo``)."""
    return args.batch * (2 if args.objective == "dpo" else 1)


def _gpu_peak(args: argparse.Namespace) -> int | None:
    return torch.cuda.max_memory_allocated() if args.device == "cuda" else None


def run_tiertune(model_dir: str, disk_dir: str, args: argparse.Namespace) -> dict:
    from tiertune.engine import EngineConfig, StreamedTrainer
    from tiertune.methods.lora import LoraSettings
    from tiertune.offload.store import StoreConfig
    from tiertune.settings import ObjectiveSettings

    dtype = _setup_device(args)
    store = StoreConfig.resolve(
        device=args.device,
        device_budget=args.device_budget,
        host_budget=args.host_budget,
        disk_path=disk_dir,
        chunk_size=1 << 40,
        prefetch_depth=2,
    )
    engine = EngineConfig(
        dtype=dtype,
        method="lora",
        quantize=args.quantize,
        params="disk",
        lora=LoraSettings(r=16, alpha=32, dropout=0.0),
        learning_rate=1e-4,
        max_steps=args.steps,
        quant_cache=args.quant_cache,
        gradient_accumulation_steps=args.micro_batches,
        wave_size=args.wave_size,
        activations=args.activations,
        activation_tokens=_rows(args) * args.seq,
        sequence_tile=args.sequence_tile,
        objective=ObjectiveSettings(type=args.objective),
    )
    if args.adapters > 1:  # several adapters over the base, each its own init (and data: ``_step``)
        others = [dataclasses.replace(engine.lora, seed=i) for i in range(1, args.adapters)]
        engine = dataclasses.replace(
            engine, others=tuple(dataclasses.replace(engine, lora=lora) for lora in others)
        )
    began = time.perf_counter()
    trainer = StreamedTrainer(model_dir, store, engine)
    load_s = time.perf_counter() - began
    vocab = trainer.model.config.vocab_size
    batch = _batches(vocab, args) if args.objective != "grpo" else []
    try:
        losses, times, reports, generations = [], [], [], []
        for step in range(args.steps):
            began = time.perf_counter()
            if args.objective == "grpo":
                loss, generation = _grpo_step(trainer, args, vocab, step)
                generations.append(generation)
            else:
                loss = _step(trainer, batch, args.adapters)
            losses.append(loss)
            times.append(time.perf_counter() - began)
            reports.append(trainer.last_report)
            print(f"tiertune step {len(times)}: {times[-1]:.1f} s", file=sys.stderr, flush=True)
        stats = trainer.store_stats()
        layer_bytes = trainer.chunk_sizes()["layer_weights"][0]
        layers_bytes = sum(trainer.chunk_sizes()["layer_weights"])
    finally:
        trainer.close()
    grpo = {}
    if generations:  # the steady generations (the first records no trace, but binds what stays bound)
        steady = generations[1:] or generations
        last = steady[-1]
        grpo = {
            "generation_s": sum(g["generation_s"] for g in steady) / len(steady),
            "decoded_tokens_per_second": sum(g["decoded_tokens_per_second"] for g in steady) / len(steady),
            "completions": args.batch * args.micro_batches,
            "completion_tokens": args.completion,
            "generation_bytes": last["generation_bytes"],
            # a decoded token's bytes by link over one pass of the decoder layers' weights (to the device: ~1.0,
            # the layers once for every completion; from the disk: what the host tier could not keep)
            "layer_weights_bytes": layers_bytes,
            "layer_passes_per_decoded_token": {
                link: n / max(1, last["passes"]) / max(1, layers_bytes)
                for link, n in last["generation_bytes"].items()
            },
        }
    return {
        **grpo,
        **_step_figures(load_s, times, losses, args),
        # the load and the first step (which records the trace) are not steady state
        "bytes_moved_per_step": moved_per_step(reports[1:] or reports),
        "peak_bytes": {k: v.peak for k, v in stats.tiers.items()},
        "layer_chunk_bytes": layer_bytes,
        "peak_rss_bytes": peak_rss(),
        "peak_gpu_bytes": _gpu_peak(args),
        "host_to_device_gbps": _host_to_device_gbps(args),
    }


def _step(trainer: object, batch: list[dict[str, torch.Tensor]], adapters: int) -> float:
    """One step; of several adapters, each one's micro-batches (``batch``'s shapes, its own tokens) in one pass of
    the base (``step_adapters``), the first adapter's loss returned."""
    if adapters == 1:
        return trainer.step(batch)  # type: ignore[attr-defined]
    from tiertune.methods.lora import adapter_name

    groups = {  # each adapter's rows its own: the step's tokens shifted by its index
        adapter_name(i): [
            {k: v.roll(i, 1) if k in ("input_ids", "labels") else v for k, v in mb.items()} for mb in batch
        ]
        for i in range(adapters)
    }
    out = trainer.step_adapters(groups)  # type: ignore[attr-defined]
    return out[adapter_name(0)].loss


def _host_to_device_gbps(args: argparse.Namespace, size: int = 1 << 30) -> float | None:
    """Pinned host to GPU copy bandwidth (the link a streamed base crosses every step)."""
    if args.device != "cuda":
        return None
    src = torch.empty(size, dtype=torch.uint8).pin_memory()
    dst = torch.empty(size, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return 3 * size / (time.perf_counter() - began) / 1e9


def disk_read_gbps(directory: Path, size: int = 2 << 30) -> tuple[float, str]:
    """The disk's sequential read bandwidth in GB/s: fio (O_DIRECT, 1 MiB blocks, queue depth 16) when it
    is installed, else tiertune's own disk tier; and which one measured it."""
    from bench_aio import fio_pass

    from tiertune.offload.disk import supports_o_direct

    fio = fio_pass(directory, "read", size, 1 << 20, 16, supports_o_direct(directory))
    (directory / "fio-bench.tmp").unlink(missing_ok=True)
    if fio is not None:
        return fio, "fio"
    from bench_aio import bench_engine

    settings = argparse.Namespace(
        size=size,
        chunk_size=64 << 20,
        block_size=1 << 20,
        queue_depth=16,
        host_bytes=1 << 30,
        rounds=1,
        no_fio=True,
    )
    return bench_engine(settings, directory)["read_gbps"], "tiertune"


def run_peft(model_dir: str, args: argparse.Namespace) -> dict:
    try:
        return _run_peft(model_dir, args)
    except torch.OutOfMemoryError as exc:
        return {
            "error": "out of memory",
            "detail": str(exc).splitlines()[0],
            "peak_gpu_bytes": _gpu_peak(args),
        }


def _run_peft(model_dir: str, args: argparse.Namespace) -> dict:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    dtype = _setup_device(args)
    qc = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=dtype,
    )
    began = time.perf_counter()
    base = AutoModelForCausalLM.from_pretrained(
        model_dir,
        quantization_config=qc,
        dtype=dtype,
        device_map="cuda:0" if args.device == "cuda" else "cpu",
    )
    model = get_peft_model(
        base,
        LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"),
    )
    model.train()
    base.gradient_checkpointing_enable()  # the memory-saving setting a QLoRA run uses
    base.enable_input_require_grads()
    load_s = time.perf_counter() - began
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
    batches = [{k: v.to(base.device) for k, v in b.items()} for b in _batches(base.config.vocab_size, args)]
    losses, times = [], []
    for _ in range(args.steps):
        began = time.perf_counter()
        total = 0.0
        for batch in batches:  # gradient accumulation, as a Trainer runs it
            logits = model(input_ids=batch["input_ids"]).logits
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]).float(), batch["input_ids"][:, 1:].reshape(-1)
            ) / len(batches)
            loss.backward()
            total += float(loss)
        loss = torch.tensor(total)
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
        times.append(time.perf_counter() - began)
        print(f"peft step {len(times)}: {times[-1]:.1f} s", file=sys.stderr, flush=True)
    return {
        **_step_figures(load_s, times, losses, args),
        "peak_rss_bytes": peak_rss(),
        "peak_gpu_bytes": _gpu_peak(args),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """This script's settings (sizes in bytes); ``argv`` defaults to the command line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p, layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=32000)
    p.add_argument("--steps", type=int, default=3, help="including the first, which records the trace")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--micro-batches", type=int, default=1, help="per step (gradient accumulation)")
    p.add_argument(
        "--wave-size",
        type=int,
        default=0,
        help="micro-batches through a layer while it is loaded (0: the step's; 1: one at a time, the "
        "schedule before the layer-major step)",
    )
    p.add_argument(
        "--activations",
        choices=("device", "host"),
        default="device",
        help="where the hidden states at the layer boundaries wait (offload.activations)",
    )
    p.add_argument("--sequence-tile", type=int, default=2048, help="a layer's MLP this many tokens at a time")
    p.add_argument("--host-budget", default="8GiB")
    p.add_argument("--device-budget", default="2GiB")
    p.add_argument("--modes", default="tiertune,peft")
    p.add_argument(
        "--adapters",
        type=int,
        default=1,
        help="LoRA adapters over the one base (engine.several), each its own micro-batches a step",
    )
    p.add_argument(
        "--objective",
        choices=("sft", "dpo", "grpo"),
        default="sft",
        help="dpo: --batch pairs a micro-batch, the reference (adapters off) in the same layer visits; grpo: "
        "each step first decodes --batch x --micro-batches completions of --completion tokens together",
    )
    p.add_argument("--completion", type=int, default=16, help="grpo: the tokens each completion decodes")
    p.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda")
    )
    p.add_argument(
        "--gpu-memory-cap", default="0", help="e.g. 24GiB: what each process may allocate on the GPU"
    )
    p.add_argument(
        "--quantize",
        choices=("nf4", "none"),
        default="nf4",
        help="none: a base that ships quantized (FP8, MXFP4, INT4), read as it ships",
    )
    p.add_argument(
        "--quant-cache",
        default=None,
        help="directory of quantized layers kept across runs (the recipe's model.quant_cache); none by default",
    )
    args = p.parse_args(argv)
    for name in ("device_budget", "host_budget", "gpu_memory_cap"):
        setattr(args, name, parse_size(getattr(args, name), f"--{name.replace('_', '-')}"))
    return args


def io_lower_bound(ours: dict, disk_gbps: float) -> dict:
    """The fastest a tiertune step could be given what it moved (``ours``: ``run_tiertune``'s result): each
    link's bytes per step over its bandwidth (disk read ``disk_gbps``, host to device as measured), the
    slowest link's time, and the measured step over that bound."""
    moved = ours["bytes_moved_per_step"]
    bounds = {"disk": moved.get("disk->host", 0) / (disk_gbps * 1e9)}
    if ours.get("host_to_device_gbps"):
        bounds["host_to_device"] = moved.get("host->device", 0) / (ours["host_to_device_gbps"] * 1e9)
    # the step cannot be faster than its slowest link moving what the step moved over it
    bound = max(bounds.values())
    return {
        "io_lower_bound_s": bound,
        "io_lower_bound_by_link_s": bounds,
        "step_over_io_lower_bound": ours["step_s"] / bound if bound else None,
    }


def main() -> None:
    args = parse_args()
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
        result["parameters"] = write_checkpoint(
            model_dir, args.layers, args.hidden, args.intermediate, args.heads, args.kv_heads, args.vocab
        )
        result["checkpoint_write_s"] = time.perf_counter() - began
        result["tokens_per_step"] = _rows(args) * args.seq
        result["settings"] = {
            "host_budget": args.host_budget,
            "device_budget": args.device_budget,
            "device": args.device,
            "gpu_memory_cap": args.gpu_memory_cap,
        }
        for mode in args.modes.split(","):
            if mode == "peft" and args.objective != "sft":
                result[mode] = {"skipped": f"the peft reference runs SFT only, not {args.objective}"}
                continue
            result[mode] = run_child(__file__, model_dir, Path(tmp) / "disk", mode)
        gbps, tool = disk_read_gbps(Path(tmp))
    result["disk_read_gbps"], result["disk_read_measured_by"] = gbps, tool
    ours = result.get("tiertune", {})
    if "bytes_moved_per_step" in ours:
        result.update(io_lower_bound(ours, gbps))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
