"""`tiertune merge` against peft's `merge_and_unload`: peak memory against the model's size, and the outputs.

Writes a Llama-shaped checkpoint with random bf16 weights (default 1.2 GB: 12 layers of hidden 2048, MLP 5632,
a 32000-token vocabulary, tied embeddings), sharded one decoder layer per file, and a random rank-16 LoRA
adapter on all its linear layers. Then, each in a fresh process: `tiertune merge` (streamed, tensor by tensor),
and, as the reference in the same run, what users run today: the base loaded in bf16 with transformers, the
adapter with peft, `merge_and_unload()` and `save_pretrained`. Prints one JSON object: each one's peak RSS
(VmHWM) and seconds, the checkpoint's size, and how the two outputs compare (max abs difference, share of
identical elements, the same tensor names and files).

Run: ``python benchmarks/bench_merge.py --dir /mnt/nvme/tmp``
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_load import peak_rss, write_checkpoint

CHILD = r"""
import sys, time, json
sys.path.insert(0, {here!r})
from bench_load import peak_rss
start = time.perf_counter()
{body}
print(json.dumps({{"seconds": time.perf_counter() - start, "peak_rss_bytes": peak_rss()}}))
"""

STREAMED = """
from tiertune.export.commands import merge
merge({adapter!r}, {out!r})
"""

PEFT = """
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({base!r}, dtype=torch.bfloat16)
merged = PeftModel.from_pretrained(model, {adapter!r}).merge_and_unload()
merged.save_pretrained({out!r})
"""


def write_adapter(
    base: Path, out: Path, rank: int, layers: int, hidden: int, intermediate: int, kv: int
) -> int:
    """A random LoRA adapter (lora_A and lora_B both non-zero) on every linear layer, in peft's format."""
    from safetensors.torch import save_file

    shapes = {
        "self_attn.q_proj": (hidden, hidden),
        "self_attn.k_proj": (kv, hidden),
        "self_attn.v_proj": (kv, hidden),
        "self_attn.o_proj": (hidden, hidden),
        "mlp.gate_proj": (intermediate, hidden),
        "mlp.up_proj": (intermediate, hidden),
        "mlp.down_proj": (hidden, intermediate),
    }
    gen = torch.Generator().manual_seed(1)
    tensors = {}
    for i in range(layers):
        for module, (rows, cols) in shapes.items():
            key = f"base_model.model.model.layers.{i}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn((rank, cols), generator=gen) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn((rows, rank), generator=gen) * 0.02
    out.mkdir(parents=True)
    save_file(tensors, out / "adapter_model.safetensors", metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": sorted({m.split(".")[1] for m in shapes}),
        "base_model_name_or_path": str(base),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
    }
    (out / "adapter_config.json").write_text(json.dumps(config))
    return sum(t.numel() for t in tensors.values())


def run_child(body: str) -> dict:
    here = str(Path(__file__).resolve().parent)
    done = subprocess.run(
        [sys.executable, "-c", CHILD.format(here=here, body=body)], check=True, capture_output=True, text=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare(a: Path, b: Path) -> dict:
    """How two model directories' weights compare, tensor by tensor (one loaded at a time)."""
    from safetensors import safe_open

    def index(d: Path) -> dict[str, Path]:
        found = {}
        for f in sorted(d.glob("*.safetensors")):
            with safe_open(f, "pt") as s:
                found.update(dict.fromkeys(s.keys(), f))
        return found

    ia, ib = index(a), index(b)
    worst, same, total = 0.0, 0, 0
    for name in sorted(set(ia) & set(ib)):
        with safe_open(ia[name], "pt") as fa, safe_open(ib[name], "pt") as fb:
            x, y = fa.get_tensor(name).float(), fb.get_tensor(name).float()
        worst = max(worst, (x - y).abs().max().item())
        same += int((x == y).sum())
        total += x.numel()
    return {
        "same_names": sorted(ia) == sorted(ib),
        "max_abs_difference": worst,
        "identical_share": same / max(total, 1),
        "files": sorted(p.name for p in set(ia.values())),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="Where to write the checkpoint (a fast disk).")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--no-reference", action="store_true", help="Skip peft's merge_and_unload.")
    args = parser.parse_args()
    heads, kv_heads = args.hidden // 64, max(1, args.hidden // 256)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-merge-") as tmp:
        root = Path(tmp)
        base = root / "base"
        base.mkdir()
        params = write_checkpoint(
            base, args.layers, args.hidden, args.intermediate, heads, kv_heads, args.vocab
        )
        from tiertune.cli.demo import make_tokenizer

        make_tokenizer(["the cat sat on the mat ."], base)
        size = sum(f.stat().st_size for f in base.glob("*.safetensors"))
        adapter_params = write_adapter(
            base, root / "adapter", args.rank, args.layers, args.hidden, args.intermediate, kv_heads * 64
        )
        streamed = run_child(STREAMED.format(adapter=str(root / "adapter"), out=str(root / "streamed")))
        result = {
            "parameters": params,
            "checkpoint_bytes": size,
            "adapter_parameters": adapter_params,
            "tiertune_merge": streamed,
            "tiertune_rss_over_model": streamed["peak_rss_bytes"] / size,
            "benchmark_process_rss_bytes": peak_rss(),
        }
        if not args.no_reference:
            reference = run_child(
                PEFT.format(base=str(base), adapter=str(root / "adapter"), out=str(root / "peft"))
            )
            result["peft_merge_and_unload"] = reference
            result["peft_rss_over_model"] = reference["peak_rss_bytes"] / size
            start = time.perf_counter()
            result["outputs"] = compare(root / "streamed", root / "peft")
            result["compare_seconds"] = time.perf_counter() - start
            result["base_files"] = sorted(p.name for p in base.glob("*.safetensors"))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
