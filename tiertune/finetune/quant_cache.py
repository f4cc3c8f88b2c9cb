"""Quantized chunks saved once, so the next run of the same model and settings skips quantization.

Quantizing on the CPU runs at ~70 M parameters/s here (a 70B base: ~17 minutes); reading the result back
runs at disk speed. The cache lives in ``<root>/<key>/``, where the key digests everything the result
depends on: each checkpoint file's name, size and modification time, every tensor's name, dtype, shape and
place in its file, the quantization settings, the compute dtype and the bitsandbytes version. A changed
checkpoint or setting therefore gets a new key and never reads an old entry.

Each chunk's tensors are one safetensors file (``<chunk>/model.safetensors``, read back with the streaming
reader, no mmap) and a manifest (``<chunk>.json``) with an xxh3-64 digest per tensor. The manifest is written
last (temporary name, fsync, rename), so a chunk without one is incomplete and is quantized again; a digest
that does not match what is read raises ``IntegrityError``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
import xxhash

from tiertune.errors import IntegrityError
from tiertune.finetune.files import fsync_file, write_text_atomically
from tiertune.finetune.weights import Checkpoint
from tiertune.offload.aio import buffer_of

log = logging.getLogger("tiertune.quant")

FORMAT = 1


class QuantCache:
    """The cache entry of one checkpoint under one set of quantization settings."""

    def __init__(
        self, root: str | os.PathLike[str], checkpoint: Checkpoint, settings: dict[str, object]
    ) -> None:
        import bitsandbytes

        h = xxhash.xxh3_128()
        h.update(json.dumps({"format": FORMAT, "bitsandbytes": bitsandbytes.__version__, **settings},
                            sort_keys=True, default=str).encode())  # fmt: skip
        files = sorted({e.file for e in checkpoint.entries.values()})
        for path in files:
            st = path.stat()
            h.update(f"{path.name}:{st.st_size}:{st.st_mtime_ns}".encode())
        for e in sorted(checkpoint.entries.values(), key=lambda e: e.name):
            h.update(f"{e.name}:{e.file.name}:{e.dtype}:{e.shape}:{e.start}:{e.nbytes}".encode())
        self.key = h.hexdigest()
        self.directory = Path(root) / self.key
        self.hits = self.misses = 0

    def load(self, name: str, views: dict[str, torch.Tensor]) -> bool:
        """Fill ``views`` (a chunk's tensors) from the cache; False if this chunk is not cached (yet)."""
        manifest = self.directory / f"{name}.json"
        if not manifest.is_file():
            self.misses += 1
            return False
        digests = json.loads(manifest.read_text())["tensors"]
        if set(digests) != set(views):
            self.misses += 1
            return False
        reader = Checkpoint(self.directory / name)
        for key, view in views.items():
            reader.read_into(key, view)
            if _digest(view) != digests[key]:
                raise IntegrityError(
                    f"quantized cache {self.directory / name}: tensor {key!r} does not match its digest; "
                    f"delete {self.directory} to quantize again"
                )
        self.hits += 1
        return True

    def save(self, name: str, views: dict[str, torch.Tensor]) -> None:
        """Write a chunk's quantized tensors; the manifest last, so a partial entry is never used."""
        from safetensors.torch import save_file

        self.directory.mkdir(parents=True, exist_ok=True)
        target = self.directory / name
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=self.directory))
        try:
            save_file({k: v.contiguous() for k, v in views.items()}, str(tmp / "model.safetensors"))
            fsync_file(tmp / "model.safetensors")
            if target.exists():
                shutil.rmtree(target)
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        manifest = {"tensors": {k: _digest(v) for k, v in views.items()}}
        write_text_atomically(self.directory / f"{name}.json", json.dumps(manifest))


def _digest(tensor: torch.Tensor) -> str:
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return xxhash.xxh3_64_hexdigest(buffer_of(flat) if flat.numel() else b"")
