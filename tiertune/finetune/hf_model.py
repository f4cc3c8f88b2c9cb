"""A model written in Hugging Face format: safetensors shards streamed one part at a time (a chunk of the
store, say), the config, the tokenizer and the index, under a temporary name and moved into place with the
file that marks it complete last. What a run writes at its end and what ``export`` writes from a checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from tiertune.files import move_files_into

SHARD_BYTES = 5 * 10**9  # like save_pretrained's default max_shard_size


def write_hf(parts: Iterable[dict[str, torch.Tensor]], config: Any, tokenizer: Any, out: Path) -> Path:
    """Write the weights (an iterable of dicts by parameter name, e.g. one chunk at a time), ``config`` and
    ``tokenizer`` as a Hugging Face model directory ``out``."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".export-", dir=out))
    try:
        shard: dict[str, torch.Tensor] = {}
        size = 0
        written: list[tuple[str, list[str]]] = []

        def flush() -> None:
            nonlocal shard, size
            if shard:
                name = f"model-{len(written) + 1:05d}.safetensors"
                save_file(shard, tmp / name, metadata={"format": "pt"})
                written.append((name, list(shard)))
                shard, size = {}, 0

        for tensors in parts:
            nbytes = sum(v.numel() * v.element_size() for v in tensors.values())
            if size and size + nbytes > SHARD_BYTES:
                flush()
            shard.update(tensors)
            size += nbytes
        flush()
        total = len(written)
        weight_map = {}
        for i, (name, keys) in enumerate(written, 1):
            final = "model.safetensors" if total == 1 else f"model-{i:05d}-of-{total:05d}.safetensors"
            (tmp / name).rename(tmp / final)
            weight_map.update(dict.fromkeys(keys, final))
        config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if total > 1:
            index = {
                "metadata": {"total_size": sum(os.path.getsize(tmp / f) for f in set(weight_map.values()))},
                "weight_map": weight_map,
            }
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        move_files_into(tmp, out, last="model.safetensors.index.json" if total > 1 else "config.json")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
