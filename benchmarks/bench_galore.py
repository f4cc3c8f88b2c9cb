"""GaLore's projection refresh: the SVDs of one decoder layer's gradients, exact against randomized.

A GaLore step that refreshes the projections computes an SVD of every projected weight's gradient (seven
per Llama decoder layer); the first step of every run refreshes them all. This builds one Llama decoder
layer (transformers' ``LlamaDecoderLayer``, random weights) at the given shapes, back-propagates a random
loss through it over ``--tokens`` tokens to get real gradients (of rank at most the token count, as a
language model's are), and then, on ``--device``, for each projected weight:

- times ``svd: exact`` (``torch.linalg.svd``, galore-torch's) and ``svd: randomized`` (torch's
  ``svd_lowrank``, rank r + 8, two power iterations), median of ``--reps`` after one warm-up, the device
  synchronized;
- measures what the randomized projection keeps: the gradient energy it captures, ``|G Pᵀ|`` (or
  ``|Pᵀ G|``), over what the exact one captures (1 is as good as exact).

Prints one JSON object: per method the seconds per layer, ``first_step_svd_s`` (per layer x ``--layers``:
every layer has the same shapes), the worst energy ratio, and the bytes of the layer's gradients the CPU
optimizer receives with the projection on the device (low-rank) against AdamW's (full).

Run: ``python benchmarks/bench_galore.py`` (the 1B model of ``bench_train.py``: 18 layers, hidden 2048,
MLP 5504, rank 128, 512 tokens, one thread); on a GPU ``--device cuda``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine

from tiertune.methods.optim import SVD_METHODS, orthogonal_basis


def layer_gradients(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """Gradients of the seven linear weights of one random Llama decoder layer, fp32, on ``args.device``."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        num_hidden_layers=1,
    )
    torch.manual_seed(0)
    layer = LlamaDecoderLayer(config, layer_idx=0).to(args.device)
    rotary = LlamaRotaryEmbedding(config).to(args.device)
    hidden = torch.randn(1, args.tokens, args.hidden, device=args.device)
    positions = torch.arange(args.tokens, device=args.device)[None]
    out = layer(hidden, position_embeddings=rotary(hidden, positions), position_ids=positions)
    out = out[0] if isinstance(out, tuple) else out
    (out * torch.randn_like(out)).sum().backward()
    return {
        name: module.weight.grad.detach().float()
        for name, module in layer.named_modules()
        if isinstance(module, torch.nn.Linear)
    }


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_svds(grads: dict[str, torch.Tensor], method: str, args: argparse.Namespace) -> dict:
    """Median seconds of each weight's refresh by ``method``; the projections of the last repetition."""
    seconds, projections = {}, {}
    for name, g in grads.items():
        m, n = g.shape
        right = m >= n
        r = min(args.rank, m, n)
        shape = (r, n) if right else (m, r)
        runs = []
        for rep in range(args.reps + 1):
            _sync(args.device)
            began = time.perf_counter()
            projections[name] = orthogonal_basis(g, torch.Size(shape), right, method, seed=rep)
            _sync(args.device)
            runs.append(time.perf_counter() - began)
        seconds[name] = statistics.median(runs[1:])
    return {"seconds": seconds, "projections": projections}


def captured(g: torch.Tensor, p: torch.Tensor) -> float:
    """The gradient energy a projection keeps: |G Pᵀ| for right singular vectors, |Pᵀ G| for left ones."""
    low = g @ p.t() if g.shape[0] >= g.shape[1] else p.t() @ g
    return float(torch.linalg.matrix_norm(low))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=18)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5504)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=16)
    p.add_argument("--rank", type=int, default=128)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--reps", type=int, default=1, help="timed repetitions per weight, after one warm-up")
    p.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    grads = layer_gradients(args)
    runs = {method: time_svds(grads, method, args) for method in SVD_METHODS}
    exact = runs["exact"]["projections"]
    result: dict = {
        "benchmark": "galore_svd",
        "machine": machine(),
        "device": args.device,
        "threads": torch.get_num_threads(),
        "settings": vars(args),
    }
    for method, run in runs.items():
        per_layer = sum(run["seconds"].values())
        ratios = {n: captured(g, run["projections"][n]) / captured(g, exact[n]) for n, g in grads.items()}
        result[method] = {
            "seconds_per_layer": per_layer,
            "first_step_svd_s": per_layer * args.layers,
            "seconds_by_weight": run["seconds"],
            "worst_energy_ratio": min(ratios.values()),
        }
    result["randomized_speedup"] = (
        result["exact"]["seconds_per_layer"] / result["randomized"]["seconds_per_layer"]
    )
    full = sum(g.numel() * 4 for g in grads.values())
    low = sum(
        (
            g.shape[0] * min(args.rank, *g.shape)
            if g.shape[0] >= g.shape[1]
            else min(args.rank, *g.shape) * g.shape[1]
        )
        * 4
        for g in grads.values()
    )
    result["gradient_bytes_per_layer"] = {"adamw": full, "galore": low, "ratio": full / low}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
