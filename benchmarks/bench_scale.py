"""A 100B-class QLoRA on this machine: a pre-quantized NF4 checkpoint read in place from disk.

Writes a bitsandbytes 4-bit (NF4, double-quantized) checkpoint of a real model's shapes with random weights
*directly*, shard by shard (never the bf16 model: ~0.53 bytes per parameter of layers, the embeddings in
bf16 as transformers saves them), exactly as ``save_pretrained`` of a bitsandbytes-quantized transformers
model lays it out (config.json with its ``quantization_config``, sharded safetensors with an index). Then, in
a fresh process, trains LoRA adapters on it for ``--steps`` steps with ``offload.params: disk``: the frozen
weights are read in place from those files every step (no second copy on disk), inside ``--host-budget``
and ``--device-budget`` (on a CPU-only machine the "device" tier is host memory too).

Prints one JSON object: parameters, bytes on disk, peak RSS of the training process, seconds per step, disk
bytes read per step and the disk's own read rate measured in the same run (fio when installed, else an
O_DIRECT probe), hence the I/O lower bound of a step, and the slot-file bytes (what was copied: should be
the statistics only). Everything it wrote is removed at the end unless ``--keep``.

Run: ``python benchmarks/bench_scale.py --dir /mnt/nvme/tmp`` (default model: Command R+ 104B, ~58 GB on
disk; ``--config`` names another config.json, ``--layers`` shrinks it for a quick look).
``--micro-batches 1,8`` trains once per count (each in a fresh process) and prints each run against the first:
the disk bytes and seconds of a step of 8 micro-batches over those of a step of 1.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_load import peak_rss
from common import machine

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = (
    ROOT / "tiertune" / "recipes" / "models" / "CohereForAI" / "c4ai-command-r-plus" / "config.json"
)
SHARD_BYTES = 4 << 30
_ST = {torch.float32: "F32", torch.bfloat16: "BF16", torch.uint8: "U8"}
_POOL_BYTES = 256 << 20


class _Writer:
    """A safetensors file written tensor by tensor: the header first (every shape is known), then each
    tensor's bytes as they are produced, so memory holds one tensor at a time."""

    def __init__(self, path: Path, specs: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> None:
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, dtype, shape in specs:
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            header[name] = {
                "dtype": _ST[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.file = open(path, "wb")  # noqa: SIM115 - closed in close()
        self.file.write(len(raw).to_bytes(8, "little") + raw)
        self.size = 8 + len(raw) + offset

    def write(self, data: torch.Tensor) -> None:
        self.file.write(memoryview(data.contiguous().reshape(-1).view(torch.uint8).numpy()))

    def close(self) -> None:
        self.file.flush()
        import os

        os.fsync(self.file.fileno())
        self.file.close()


def _specs(model_dir: Path) -> tuple[list[tuple[str, str, tuple[int, ...]]], int]:
    """Every tensor of the checkpoint (name, kind, logical shape) and the model's parameter count, from the
    model built on the meta device with transformers' own 4-bit conversion of its decoder layers."""
    from tiertune.loading.model import build_skeleton, split_model
    from tiertune.quant import NF4, is_quantized

    model = build_skeleton(model_dir, torch.bfloat16)
    parts = split_model(model)
    for layer in parts.layers:
        NF4(torch.bfloat16).convert(layer)
    specs = []
    params = 0
    for name, p in model.named_parameters():
        specs.append(
            (name, "nf4" if is_quantized(p) else ("norm" if p.dim() == 1 else "dense"), tuple(p.shape))
        )
        params += math.prod(p.shape)
    return specs, params


def _normal_slices(n: int, gen: torch.Generator, step: int = 32 << 20):
    """``n`` bf16 values ~ N(0, 0.02), produced ``step`` at a time."""
    for start in range(0, n, step):
        yield (torch.randn(min(step, n - start), generator=gen) * 0.02).to(torch.bfloat16)


def write_nf4_checkpoint(
    config: dict, directory: Path, shard_bytes: int = SHARD_BYTES, seed: int = 0
) -> dict:
    """Write a bitsandbytes NF4 (double-quantized, blocksize 64) checkpoint of ``config`` (a config.json's
    contents) with random weights into ``directory``; returns its parameter count, bytes and seconds."""
    from tiertune.quant import NF4

    start = time.perf_counter()
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        **config,
        "dtype": "bfloat16",
        "quantization_config": {
            "quant_method": "bitsandbytes",
            "load_in_4bit": True,
            "load_in_8bit": False,
            "bnb_4bit_quant_type": "nf4",
            "bnb_4bit_use_double_quant": True,
            "bnb_4bit_compute_dtype": "bfloat16",
            "bnb_4bit_quant_storage": "uint8",
            "llm_int8_skip_modules": None,
        },
    }
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    specs, params = _specs(directory)
    code, nested_code = NF4(torch.bfloat16).codes(torch.device("cpu"))
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randint(0, 256, (_POOL_BYTES,), dtype=torch.uint8, generator=gen)
    cursor = [0]

    def random_bytes(n: int) -> torch.Tensor:
        """``n`` random-looking bytes, cut from a fixed pool at a moving offset (generating 50 GB would
        take longer than writing it)."""
        out = torch.empty(n, dtype=torch.uint8)
        done = 0
        while done < n:
            take = min(n - done, _POOL_BYTES - cursor[0])
            out[done : done + take] = pool[cursor[0] : cursor[0] + take]
            done += take
            cursor[0] = (cursor[0] + take + 4099) % (_POOL_BYTES - 4096)
        return out

    def tensors_of(
        name: str, kind: str, shape: tuple[int, ...]
    ) -> list[tuple[str, torch.dtype, tuple, object]]:
        if kind == "norm":
            return [(name, torch.bfloat16, shape, lambda s=shape: torch.ones(s, dtype=torch.bfloat16))]
        if kind == "dense":  # written in slices of ~64 MiB: an embedding of 3 B parameters is 6 GB in bf16
            return [(name, torch.bfloat16, shape, lambda s=shape: _normal_slices(math.prod(s), gen))]
        n = math.prod(shape)
        blocks = n // 64
        state = {
            "quant_type": "nf4",
            "blocksize": 64,
            "dtype": "bfloat16",
            "shape": list(shape),
            "nested_blocksize": 256,
            "nested_dtype": "float32",
            "nested_offset": 0.04,
        }
        js = torch.tensor(list(json.dumps(state).encode()), dtype=torch.uint8)
        nested = -(-blocks // 256)
        return [  # absmax = nested_code[u8] * 0.01 + 0.04: weights of std ~0.02, like an initialized model
            (f"{name}.absmax", torch.uint8, (blocks,), lambda b=blocks: random_bytes(b)),
            (f"{name}.nested_absmax", torch.float32, (nested,), lambda k=nested: torch.full((k,), 0.01)),
            (f"{name}.nested_quant_map", torch.float32, (256,), lambda: nested_code),
            (f"{name}.quant_map", torch.float32, (16,), lambda: code),
            (f"{name}.quant_state.bitsandbytes__nf4", torch.uint8, (js.numel(),), lambda j=js: j),
            (name, torch.uint8, (n // 2, 1), lambda h=n // 2: random_bytes(h)),
        ]

    groups: list[list] = []  # the tensors of each parameter group, in order
    for name, kind, shape in specs:
        layer = ".layers." in name and name.split(".layers.")[1].split(".")[0]
        key = f"layer{layer}" if layer else name
        if not groups or groups[-1][0] != key:
            groups.append([key, []])
        groups[-1][1].extend(tensors_of(name, kind, shape))
    shards: list[list] = [[]]
    size = 0
    for _, tensors in groups:
        nbytes = sum(math.prod(s) * torch.empty((), dtype=d).element_size() for _, d, s, _ in tensors)
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].extend(tensors)
        size += nbytes
    weight_map, total = {}, 0
    for i, tensors in enumerate(shards):
        # fp32, then bf16, then bytes: every tensor starts aligned to its item size, as safetensors orders them
        tensors.sort(key=lambda t: -torch.empty((), dtype=t[1]).element_size())
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        writer = _Writer(directory / file, [(n, d, s) for n, d, s, _ in tensors])
        for name, _, _, make in tensors:
            data = make()
            for piece in data if isinstance(data, list) or not isinstance(data, torch.Tensor) else [data]:
                writer.write(piece)
            weight_map[name] = file
        writer.close()
        total += writer.size
        print(f"wrote {file} ({writer.size / 2**30:.2f} GiB)", file=sys.stderr, flush=True)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return {"parameters": params, "bytes_on_disk": total, "write_s": time.perf_counter() - start}


def disk_read_rate(directory: Path) -> dict:
    """The disk's sequential O_DIRECT read rate in ``directory``: fio (1 MiB blocks, queue depth 16, 2 GiB)
    when installed, else tiertune's own probe."""
    if shutil.which("fio"):
        out = subprocess.run(
            [
                "fio",
                "--name=read",
                f"--directory={directory}",
                "--rw=read",
                "--bs=1M",
                "--size=2G",
                "--direct=1",
                "--ioengine=libaio",
                "--iodepth=16",
                "--output-format=json",
            ],
            capture_output=True,
            text=True,
        )
        for f in directory.glob("read.*"):
            f.unlink()
        if out.returncode == 0:
            job = json.loads(out.stdout)["jobs"][0]["read"]
            return {"tool": "fio", "read_GBps": job["bw_bytes"] / 1e9}
    from tiertune.estimates.speed import probe_disk

    read, _ = probe_disk(directory)
    return {"tool": "tiertune probe_disk", "read_GBps": read / 1e9}


def train(model_dir: Path, disk_dir: Path, args: argparse.Namespace, micro_batches: int) -> dict:
    """The measured part, in a fresh process: QLoRA steps of ``micro_batches`` micro-batches with the base read
    in place from disk."""
    from tiertune.engine import EngineConfig, StreamedTrainer
    from tiertune.methods.lora import LoraSettings
    from tiertune.offload.store import StoreConfig

    torch.set_num_threads(args.threads)
    lora = LoraSettings(r=args.rank, alpha=2 * args.rank, dropout=0.0, seed=0, target_modules="all-linear")
    cfg = EngineConfig(
        dtype=torch.bfloat16,
        method="lora",
        quantize="nf4",
        lora=lora,
        learning_rate=args.lr,
        params="disk",
        max_steps=args.steps,
        warmup_steps=0,
        gradient_accumulation_steps=micro_batches,
    )
    store = StoreConfig.resolve(
        device="cpu",
        device_budget=args.device_budget,
        host_budget=args.host_budget,
        disk_path=str(disk_dir),
        chunk_size="1GiB",
        prefetch_depth=1,
    )
    began = time.perf_counter()
    trainer = StreamedTrainer(str(model_dir), store, cfg)
    load_s = time.perf_counter() - began
    rss_after_load = peak_rss()
    in_place = sum(trainer.chunk_sizes().get("in_place", []))
    vocab = trainer.model.config.vocab_size
    # the same micro-batches, trained on at every step: a loss that falls says the adapters learn
    gen = torch.Generator().manual_seed(0)
    batches = [
        {"input_ids": torch.randint(0, vocab, (1, args.seq_len), generator=gen)} for _ in range(micro_batches)
    ]
    steps = []
    try:
        for step in range(args.steps):
            t = time.perf_counter()
            loss = trainer.step(batches)
            seconds = time.perf_counter() - t
            read = trainer.last_report.moved.get("disk->host", 0)
            steps.append({"loss": loss, "s": seconds, "disk_bytes_read": read})
            print(
                f"{micro_batches} micro-batches, step {step + 1}: loss {loss:.4f}, {seconds:.1f} s, "
                f"read {read / 2**30:.2f} GiB",
                file=sys.stderr,
                flush=True,
            )
        stats = trainer.store_stats()
        trained = trainer.parameter_counts()["trained"]
    finally:
        trainer.close()
    later = steps[1:] or steps
    return {
        "micro_batches": micro_batches,
        "tokens_per_step": micro_batches * args.seq_len,
        "load_s": load_s,
        "peak_rss_after_load_bytes": rss_after_load,
        "peak_rss_bytes": peak_rss(),
        "trained_parameters": trained,
        "in_place_bytes": in_place,
        "slot_file_peak_bytes": stats.tiers["disk"].peak,
        "steps": steps,
        "s_per_step": sum(s["s"] for s in later) / len(later),
        "disk_bytes_read_per_step": sum(s["disk_bytes_read"] for s in later) / len(later),
        "times": {k: round(v, 2) for k, v in trainer.times.items()},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=".tiertune-bench", help="where the checkpoint and the disk tier go")
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="the model's config.json (no weights)")
    p.add_argument("--layers", type=int, default=None, help="keep only this many decoder layers")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument(
        "--micro-batches",
        default="1",
        help="micro-batches per step, comma-separated: one run each (e.g. 1,8: the second is compared)",
    )
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--host-budget", default="3GiB")
    p.add_argument("--device-budget", default="8GiB")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--keep", action="store_true", help="leave the checkpoint on disk")
    p.add_argument("--child", nargs=3, metavar=("MODEL", "DISK", "K"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(train(Path(args.child[0]), Path(args.child[1]), args, int(args.child[2]))))
        return
    config = json.loads(Path(args.config).read_text())
    if args.layers is not None:
        config["num_hidden_layers"] = args.layers
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-scale-", dir=args.dir))
    try:
        free_before = shutil.disk_usage(work).free
        written = write_nf4_checkpoint(config, work / "model")
        (work / "disk").mkdir()
        rate = disk_read_rate(work / "disk")
        runs = []
        for k in [
            int(x) for x in args.micro_batches.split(",")
        ]:  # each in a fresh process, its own disk tier
            disk = work / f"disk-{k}"
            disk.mkdir()
            cmd = [sys.executable, __file__, *sys.argv[1:], "--child", str(work / "model"), str(disk), str(k)]
            out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
            runs.append(
                json.loads(out.stdout.strip().splitlines()[-1])
                if out.returncode == 0
                else {"micro_batches": k, "error": f"exit {out.returncode} (its stderr is above)"}
            )
            shutil.rmtree(disk, ignore_errors=True)
        rate_after = disk_read_rate(work / "disk")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    best = max(rate["read_GBps"], rate_after["read_GBps"]) * 1e9
    for run in runs:
        if "steps" in run:
            read, per_step = run["disk_bytes_read_per_step"], run["s_per_step"]
            run.update(io_lower_bound_s=read / best, io_bound_share=read / best / per_step)
    result = {
        "benchmark": "bench_scale",
        "model": config.get("model_type"),
        "config": args.config,
        "layers": config["num_hidden_layers"],
        **written,
        "free_disk_before_bytes": free_before,
        "disk_read": [rate, rate_after],
        "runs": runs,
        "machine": machine(),
    }
    first, *rest = runs
    if rest and all("steps" in r for r in runs):  # each run against the first (one micro-batch a step)
        result["against_first"] = [
            {
                "micro_batches": r["micro_batches"],
                "disk_bytes_per_step": r["disk_bytes_read_per_step"] / first["disk_bytes_read_per_step"],
                "s_per_step": r["s_per_step"] / first["s_per_step"],
            }
            for r in rest
        ]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
