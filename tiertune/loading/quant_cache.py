"""Quantized chunks saved once, so the next run of the same model and settings skips quantization, and a
frozen base homed on disk is read from the cache itself rather than copied into the disk tier.

Quantizing on the CPU runs at ~70 M parameters/s here (a 70B base: ~17 minutes); reading the result back
runs at disk speed. The cache lives in ``<root>/<key>/``, where the key digests everything the result
depends on: each checkpoint file's name, size and modification time, every tensor's name, dtype, shape and
place in its file, the quantization settings, the compute dtype and the bitsandbytes version. A changed
checkpoint or setting therefore gets a new key and never reads an old entry.

Each chunk is one file, ``<chunk>.chunk``: the chunk's *image*, its bytes in its layout from byte 0, so a
chunk homed on disk can be read in place from it (``ChunkStore.home_in_file``): the cache is then the only
copy of the quantized base on disk. Beside it, a manifest (``<chunk>.json``) records the layout, an xxh3-64
digest per tensor and one per block of the image. The manifest is written last (temporary name, fsync,
rename), so an image without one is incomplete and is quantized again; a digest that does not match what
is read raises ``IntegrityError`` (block digests are checked by the store on every in-place read).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import xxhash

from tiertune.errors import IntegrityError
from tiertune.files import fsync_file, write_text_atomically
from tiertune.loading.weights import Checkpoint
from tiertune.offload.aio import buffer_of, pread_full
from tiertune.offload.chunk import Chunk, ChunkLayout, layout_views
from tiertune.offload.tiers import Tier

log = logging.getLogger("tiertune.quant")

FORMAT = 2  # 1: a safetensors file per chunk (not readable in place)


class QuantCache:
    """The cache entry of one checkpoint under one set of quantization settings."""

    images = True  # each chunk is kept as a file in its exact layout (``image``): a disk home for it

    def __init__(
        self, root: str | os.PathLike[str], checkpoint: Checkpoint, settings: dict[str, object]
    ) -> None:
        import bitsandbytes

        h = xxhash.xxh3_128()
        h.update(
            json.dumps(
                {"format": FORMAT, "bitsandbytes": bitsandbytes.__version__, **settings},
                sort_keys=True,
                default=str,
            ).encode()
        )
        files = sorted({e.file for e in checkpoint.entries.values()})
        for path in files:
            st = path.stat()
            h.update(f"{path.name}:{st.st_size}:{st.st_mtime_ns}".encode())
        for e in sorted(checkpoint.entries.values(), key=lambda e: e.name):
            h.update(f"{e.name}:{e.file.name}:{e.dtype}:{e.shape}:{e.start}:{e.nbytes}".encode())
        self.key = h.hexdigest()
        self.directory = Path(root) / self.key
        self.hits = self.misses = 0

    def _manifest(self, chunk: Chunk) -> dict | None:
        """The manifest of ``chunk``'s image when the cache holds one in the chunk's layout, else None."""
        path = self.directory / f"{chunk.name}.json"
        if not path.is_file():
            return None
        manifest = json.loads(path.read_text())
        if (
            manifest.get("layout") != _layout(chunk.layout)
            or not (self.directory / f"{chunk.name}.chunk").is_file()
        ):
            return None
        return manifest

    def load(self, chunk: Chunk, views: dict[str, torch.Tensor]) -> bool:
        """Fill ``views`` (``chunk``'s tensors) from the cache, each checked against its digest; False if the
        cache does not hold this chunk (yet)."""
        manifest = self._manifest(chunk)
        if manifest is None:
            self.misses += 1
            return False
        image = self.directory / f"{chunk.name}.chunk"
        with open(image, "rb") as f:
            for spec in chunk.layout.tensors:
                view = views[spec.name]
                raw = buffer_of(view.reshape(-1).view(torch.uint8)) if view.numel() else None
                if raw is not None and pread_full(f.fileno(), raw, spec.offset) < len(raw):
                    raise IntegrityError(f"quantized cache {image} is shorter than its manifest says")
                if _digest(view) != manifest["tensors"][spec.name]:
                    raise IntegrityError(
                        f"quantized cache {image}: tensor {spec.name!r} does not match its digest; "
                        f"delete {self.directory} to quantize again"
                    )
        self.hits += 1
        return True

    def image(self, chunk: Chunk, block_size: int) -> tuple[Path, tuple[int, ...] | None] | None:
        """``chunk``'s image and the digests of its ``block_size`` blocks (None when the manifest has them
        for another block size), or None when the cache does not hold this chunk."""
        manifest = self._manifest(chunk)
        if manifest is None:
            return None
        sums = tuple(manifest["blocks"]) if manifest.get("block_size") == block_size else None
        return self.directory / f"{chunk.name}.chunk", sums

    def shared(
        self, name: str, layout: ChunkLayout, fill: Callable[[dict[str, torch.Tensor]], None], block_size: int
    ) -> tuple[Path, tuple[int, ...] | None]:
        """The image of chunk ``name`` laid out as ``layout`` (a whole chunk, of which a rank of several keeps a
        shard), made by ``fill(views)`` when the cache holds none: by one process at a time (a lock per chunk),
        so a node's ranks quantize each chunk once and read their shards of the one image in place."""
        standin = Chunk(-1, name, layout, Tier.DISK)
        found = self.image(standin, block_size)
        if found is None:
            self.directory.mkdir(parents=True, exist_ok=True)
            with open(self.directory / f".{name}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
                found = self.image(standin, block_size)
                if found is None:
                    flat = torch.zeros(layout.capacity, dtype=torch.uint8)
                    views = layout_views(layout, flat)
                    fill(views)
                    self.misses += 1
                    return self.save(standin, views, block_size)
        self.hits += 1
        return found

    def save(
        self, chunk: Chunk, views: dict[str, torch.Tensor], block_size: int
    ) -> tuple[Path, tuple[int, ...]]:
        """Write ``chunk``'s image from its tensors (``views``), then its manifest (layout, a digest per
        tensor and per ``block_size`` block of the image), so that a partial entry is never used. Returns
        the image and its block digests, as ``image`` gives them."""
        self.directory.mkdir(parents=True, exist_ok=True)
        target = self.directory / f"{chunk.name}.chunk"
        tmp = target.with_name(f".{target.name}.tmp")
        sums = []
        try:
            with open(tmp, "wb") as f:
                for block in _image_blocks(chunk.layout, views, block_size):
                    f.write(block)
                    sums.append(xxhash.xxh3_64_intdigest(block))
            fsync_file(tmp)
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        manifest = {
            "format": FORMAT,
            "layout": _layout(chunk.layout),
            "tensors": {k: _digest(v) for k, v in views.items()},
            "block_size": block_size,
            "blocks": sums,
        }
        write_text_atomically(self.directory / f"{chunk.name}.json", json.dumps(manifest))
        return target, tuple(sums)


def _layout(layout: ChunkLayout) -> dict:
    """A chunk layout as JSON (what an image must match to be read as the chunk)."""
    return {
        "capacity": layout.capacity,
        "tensors": [
            [t.name, list(t.shape), str(t.dtype).removeprefix("torch."), t.offset] for t in layout.tensors
        ],
    }


def _image_blocks(
    layout: ChunkLayout, views: dict[str, torch.Tensor], block_size: int
) -> Iterator[bytearray]:
    """The chunk's image in blocks of ``block_size`` bytes: each tensor's bytes at its offset, zeros between."""
    tensors = sorted((t for t in layout.tensors if t.nbytes), key=lambda t: t.offset)
    raw = {t.name: buffer_of(views[t.name].reshape(-1).view(torch.uint8)) for t in tensors}
    first = 0  # tensors before it end before the current block
    for start in range(0, layout.capacity, block_size):
        end = min(start + block_size, layout.capacity)
        block = bytearray(end - start)
        while first < len(tensors) and tensors[first].offset + tensors[first].nbytes <= start:
            first += 1
        for t in tensors[first:]:
            if t.offset >= end:
                break
            lo, hi = max(start, t.offset), min(end, t.offset + t.nbytes)
            block[lo - start : hi - start] = raw[t.name][lo - t.offset : hi - t.offset]
        yield block


def _digest(tensor: torch.Tensor) -> str:
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return xxhash.xxh3_64_hexdigest(buffer_of(flat) if flat.numel() else b"")


class LedgerCache:
    """The quantized cache as a first run meets it, over a ledger store (``StoreConfig.ledger``): empty, each
    chunk quantized on load into it and read in place from its image from then on; nothing is read or
    written (the estimate creates nothing)."""

    images = True
    directory = Path("quantized cache")

    def __init__(self) -> None:
        self.hits = self.misses = 0
        self.homed: set[str] = set()  # the chunks read in place from an image of the cache, by name

    def load(self, chunk: Chunk, views: dict[str, torch.Tensor]) -> bool:
        self.misses += 1
        return False

    def image(self, chunk: Chunk, block_size: int) -> tuple[Path, tuple[int, ...] | None] | None:
        return None

    def shared(
        self, name: str, layout: ChunkLayout, fill: Callable[[dict[str, torch.Tensor]], None], block_size: int
    ) -> tuple[Path, tuple[int, ...] | None]:
        self.misses += 1
        self.homed.add(name)
        return self.directory / f"{name}.chunk", None

    def save(
        self, chunk: Chunk, views: dict[str, torch.Tensor], block_size: int
    ) -> tuple[Path, tuple[int, ...] | None]:
        self.homed.add(chunk.name)
        return self.directory / f"{chunk.name}.chunk", None
