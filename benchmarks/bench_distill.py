"""A distillation's teacher pass (``finetune.teacher``): bytes read from disk per scored token, and tokens a
second, at several wave sizes (rows a layer visit runs before the next layer's weights are read), in one JSON.

The teacher is a random Llama saved here, streamed with its weights on disk and budgets that keep part of them
(16 MiB of host and 24 MiB of device for a 67 MB model by default); the data is random rows of ``--seq`` tokens, the first quarter of each
a prompt (not scored). The figures' cache is made anew for each wave size. The references in the same run are the
model's size: the first wave reads it, each later one at most once more (less what the budgets kept from the wave
before), so bytes per token are at most (model bytes) / (tokens a wave scores) (``over_read_once_a_wave`` <= 1)
and at least the model read once for all the waves (``over_read_once`` >= 1; 1 where the budgets hold it).

    python benchmarks/bench_distill.py --dir /tmp/bd --waves 1,8,64

``--config CONFIG.json`` makes the teacher a real model's shapes instead (Command R+ 104B's:
``tiertune/recipes/models/CohereForAI/c4ai-command-r-plus/config.json``), written as a pre-quantized NF4 checkpoint
(``bench_scale.write_nf4_checkpoint``, ~58 GB) and read in place as it ships; the disk's own read rate (fio, else
tiertune's probe) is measured in the same run, so each wave's I/O bound (its bytes / that rate) is beside its
time. The checkpoint is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import itertools

from common import add_model_args, machine, proc_status_bytes


def _teacher(directory: Path, a: argparse.Namespace) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    path = directory / "teacher"
    if (path / "config.json").is_file():
        return path
    config = LlamaConfig(
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        intermediate_size=a.intermediate,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        max_position_embeddings=max(512, a.seq),
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(path)
    return path


def _data(rows: int, seq: int, vocab: int):
    from datasets import Dataset

    from tiertune.finetune.data import TokenizedData

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (rows, seq), generator=g)
    labels = ids.clone()
    labels[:, : seq // 4] = -100
    return TokenizedData(
        Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()}), 0, 0, Path("-")
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p, layers=8, hidden=512, intermediate=1376, heads=8, kv_heads=8, vocab=8000)
    p.add_argument("--waves", default="1,8,64", help="rows a wave holds, comma-separated")
    p.add_argument("--rows", type=int, default=64, help="rows of data scored")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--top-k", type=int, default=64)
    p.add_argument("--host-budget", default="16MiB")
    p.add_argument("--device-budget", default="24MiB")
    p.add_argument(
        "--dtype",
        default="bfloat16",
        help="the teacher's compute dtype (objective.teacher.dtype; with --config its unquantized tensors, the embedding and head, are homed in it too)",
    )
    p.add_argument("--config", default=None, help="a real model's config.json: the teacher pre-quantized NF4")
    a = p.parse_args()

    from tiertune.config.recipe import Recipe
    from tiertune.finetune.teacher import teacher_figures

    directory = Path(a.dir)
    directory.mkdir(parents=True, exist_ok=True)
    rate = None
    if a.config:  # a real model's shapes, NF4 as it ships: read in place
        from bench_scale import disk_read_rate, write_nf4_checkpoint

        config = json.loads(Path(a.config).read_text())
        teacher = directory / "teacher-nf4"
        written = write_nf4_checkpoint(config, teacher)
        print(f"checkpoint: {json.dumps(written)}", file=sys.stderr, flush=True)
        a.vocab = int(config["vocab_size"])
        model_bytes = sum(f.stat().st_size for f in teacher.glob("*.safetensors"))
        probe = directory / "probe"
        probe.mkdir(exist_ok=True)
        rate = disk_read_rate(probe)
    else:
        teacher = _teacher(directory, a)
        # the weights as the pass homes them: the checkpoint's (bf16) in the teacher's dtype
        itemsize = 4 if a.dtype == "float32" else 2
        model_bytes = sum(f.stat().st_size for f in teacher.glob("*.safetensors")) * itemsize // 2
    data = _data(a.rows, a.seq, a.vocab)
    out: dict = {
        "benchmark": "distill_teacher_pass",
        "machine": machine(),
        "model_bytes": model_bytes,
        "waves": {},
    }
    if rate is not None:
        out["disk_read"] = rate
    for wave in (int(w) for w in a.waves.split(",")):
        disk = directory / f"disk-{wave}"
        shutil.rmtree(disk, ignore_errors=True)
        recipe = Recipe()
        recipe.model.path = str(teacher)  # the student's; its tokenizer is not read here
        recipe.objective.type = "distill"
        recipe.objective.top_k = a.top_k
        recipe.objective.teacher.path = str(teacher)
        recipe.objective.teacher.wave_size = wave
        recipe.objective.teacher.dtype = a.dtype
        recipe.objective.teacher.quantize = "nf4" if a.config else "none"  # as it ships: read in place
        recipe.data.max_seq_len = a.seq
        recipe.training.per_device_train_batch_size = 1
        recipe.training.output_dir = str(directory / "run")
        recipe.offload.disk_path = str(disk)
        recipe.offload.params = "disk"
        recipe.offload.host_budget = a.host_budget
        recipe.offload.device_budget = a.device_budget
        cache, stats = teacher_figures(recipe, data, 0, a.vocab)
        record = stats.record()
        record["bytes_per_token_if_read_once_a_wave"] = round(model_bytes / (stats.tokens / stats.waves), 1)
        record["over_read_once_a_wave"] = round(
            record["disk_bytes_per_token"] / record["bytes_per_token_if_read_once_a_wave"], 3
        )
        record["over_read_once"] = round(stats.disk_bytes / model_bytes, 3)
        if rate is not None:
            record["io_bound_s"] = round(stats.disk_bytes / (rate["read_GBps"] * 1e9), 1)
            record["io_share_of_the_pass"] = round(record["io_bound_s"] / stats.seconds, 3)
        record["cache_bytes"] = sum(f.stat().st_size for f in cache.directory.glob("*.safetensors"))
        out["waves"][str(wave)] = record
        print(f"wave {wave}: {json.dumps(record)}", file=sys.stderr, flush=True)
        shutil.rmtree(disk, ignore_errors=True)
    if a.config:
        shutil.rmtree(teacher, ignore_errors=True)
        shutil.rmtree(directory / "probe", ignore_errors=True)
    out["peak_rss_bytes"] = proc_status_bytes("VmHWM")
    per = [out["waves"][w]["disk_bytes_per_token"] for w in out["waves"]]
    out["bytes_per_token_falls_with_the_wave"] = all(x > y for x, y in itertools.pairwise(per))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
