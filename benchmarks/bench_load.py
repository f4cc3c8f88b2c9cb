"""Streaming load of a large checkpoint into the chunk store: peak RSS and throughput.

Writes a Llama-shaped checkpoint with random bf16 weights (default: the shape of Llama-3.2-3B, 3.2 B
parameters, 6.4 GB) as safetensors shards, one tensor at a time so the writer never holds the model, then
loads it in a fresh process: skeleton on the meta device, every group streamed into chunks homed on disk
through a host budget of ``--host-budget``. Prints one JSON object with the loader's peak RSS (from
VmHWM), seconds, GB/s, and, as the reference in the same run, the checkpoint's size: what loading
it the plain way (``from_pretrained``) would need in memory at the least. Peak RSS is the loader process's
``VmHWM``.

Run: ``python benchmarks/bench_load.py --dir /mnt/nvme/tmp``
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import proc_status_bytes

from tiertune.settings import parse_size
from tiertune.units import format_size


def write_checkpoint(
    path: Path,
    layers: int,
    hidden: int,
    intermediate: int,
    heads: int,
    kv_heads: int,
    vocab: int,
    tied: bool = True,
) -> int:
    """Save a random bf16 Llama checkpoint shard by shard (one decoder layer per shard); returns parameters.
    ``tied``: the head is the embedding (else an ``lm_head.weight`` of its own, as Llama 3's)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        tie_word_embeddings=tied,
        dtype="bfloat16",
    )
    config.save_pretrained(path)
    head_dim = hidden // heads
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not tied:
        shapes["lm_head.weight"] = (vocab, hidden)
    per_layer = {
        "self_attn.q_proj.weight": (hidden, hidden),
        "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
        "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
        "self_attn.o_proj.weight": (hidden, hidden),
        "mlp.gate_proj.weight": (intermediate, hidden),
        "mlp.up_proj.weight": (intermediate, hidden),
        "mlp.down_proj.weight": (hidden, intermediate),
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
    }
    shards = [shapes] + [{f"model.layers.{i}.{k}": v for k, v in per_layer.items()} for i in range(layers)]
    weight_map, total, n_params = {}, 0, 0
    gen = torch.Generator().manual_seed(0)
    for s, shard in enumerate(shards):
        name = f"model-{s + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {k: (torch.randn(v, generator=gen) * 0.02).to(torch.bfloat16) for k, v in shard.items()}
        save_file(tensors, path / name, metadata={"format": "pt"})
        for k, t in tensors.items():
            weight_map[k] = name
            total += t.numel() * 2
            n_params += t.numel()
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return n_params


def peak_rss() -> int:
    """This process's peak resident memory in bytes. VmHWM, not getrusage: Linux carries ru_maxrss across
    execve, so a child would report the high-water mark of the parent it was forked from."""
    peak = proc_status_bytes("VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def load(model_dir: str, disk_dir: str, host_budget: int, dtype: str) -> dict:
    """The measured part, run in a fresh process."""
    from tiertune.loading.model import build_skeleton, load_into_store, split_model
    from tiertune.loading.weights import Checkpoint
    from tiertune.offload.store import ChunkStore, StoreConfig

    torch_dtype = getattr(torch, dtype)
    start = time.perf_counter()
    parts = split_model(build_skeleton(model_dir, torch_dtype))
    cfg = StoreConfig.resolve(
        device_budget="1GiB", host_budget=host_budget, disk_path=disk_dir, chunk_size="256MiB"
    )
    with ChunkStore(cfg) as store:
        load_into_store(parts, Checkpoint(model_dir), store, "disk", torch_dtype)
        store.flush()
        seconds = time.perf_counter() - start
        stats = store.stats()
    return {
        "seconds": seconds,
        "peak_rss_bytes": peak_rss(),
        "host_peak_bytes": stats.tiers["host"].peak,
        "disk_bytes": stats.tiers["disk"].used,
        "bytes_written_to_disk": stats.bytes_moved.get("host->disk", 0),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=".tiertune-bench", help="where the checkpoint and the disk tier go")
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--hidden", type=int, default=3072)
    p.add_argument("--intermediate", type=int, default=8192)
    p.add_argument("--heads", type=int, default=24)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--host-budget", default="1GiB")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--child", nargs=2, metavar=("MODEL_DIR", "DISK_DIR"), help=argparse.SUPPRESS)
    args = p.parse_args()
    host_budget = parse_size(args.host_budget, "--host-budget")
    if args.child:
        print(json.dumps(load(args.child[0], args.child[1], host_budget, args.dtype)))
        return
    base = Path(args.dir).resolve()
    base.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=base) as tmp:
        model_dir, disk_dir = Path(tmp) / "model", Path(tmp) / "disk"
        model_dir.mkdir()
        t = time.perf_counter()
        n_params = write_checkpoint(
            model_dir, args.layers, args.hidden, args.intermediate, args.heads, args.kv_heads, args.vocab
        )
        ckpt_bytes = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
        print(
            f"wrote {n_params / 1e9:.2f} B parameters, {format_size(ckpt_bytes)} in {time.perf_counter() - t:.1f}s",
            file=sys.stderr,
        )
        cmd = [
            sys.executable,
            __file__,
            "--child",
            str(model_dir),
            str(disk_dir),
            "--host-budget",
            str(host_budget),
            "--dtype",
            args.dtype,
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        if out.returncode:
            sys.exit(f"the loader failed:\n{out.stderr}")
        result = json.loads(out.stdout.strip().splitlines()[-1])
    result.update(
        benchmark="load",
        parameters=n_params,
        checkpoint_bytes=ckpt_bytes,
        dtype=args.dtype,
        host_budget=host_budget,
        gbps=ckpt_bytes / result["seconds"] / 1e9,
        peak_rss_over_checkpoint=result["peak_rss_bytes"] / ckpt_bytes,
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
