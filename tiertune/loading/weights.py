"""Streaming reads of safetensors checkpoints, one tensor at a time, without mapping whole files.

``safetensors.safe_open`` maps each file into memory; every page it touches then counts towards the
process's resident memory until the mapping goes away, so walking a 100 GB checkpoint that way grows RSS
towards the checkpoint's size. This reader follows the safetensors format (an 8-byte little-endian header
length, a JSON header of dtype/shape/data_offsets per tensor, then the data) and ``preadv``s each tensor's
bytes into a caller's buffer, converting dtype on the way: peak memory is one tensor plus the destination.
Headers are checked (offsets inside the file, sizes matching dtype x shape), so a truncated or corrupt
file raises ``ModelError`` naming the file and tensor.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tiertune.errors import ModelError
from tiertune.offload.chunk import itemsize

SAFETENSORS_DTYPES = {  # a safetensors header's dtype -> torch's
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,  # 1-byte power-of-two scales (DeepSeek's ue8m0)
}
SCRATCH_BYTES = 64 << 20  # the largest slice converted at once
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes are in a checkpoint."""

    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int


class Checkpoint:
    """The tensors of a Hugging Face safetensors checkpoint directory (single file or sharded with an index),
    or of the safetensors ``files`` named in it (e.g. a PEFT adapter's ``adapter_model.safetensors``)."""

    def __init__(self, directory: str | os.PathLike[str], files: list[str] | None = None) -> None:
        self.directory = Path(directory)
        self.entries: dict[str, TensorEntry] = {}
        # a shipped FP8 format (``quant.shipped.FP8``) whose codes ``read_into`` dequantizes into a wider dtype
        # (a full fine-tune from an FP8 release: the master weights start from the dequantized values)
        self.dequantize: Any = None
        self._scratch: torch.Tensor | None = None  # conversion buffer, allocated on the first conversion
        index = self.directory / INDEX
        weight_map: dict[str, str] = {}
        if files is not None:
            pass
        elif index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as exc:
                raise ModelError(f"{index} is not a valid safetensors index (no weight_map): {exc}") from exc
            files = sorted(set(weight_map.values()))
        elif (self.directory / SINGLE).is_file():
            files = [SINGLE]
        else:
            raise ModelError(
                f"no safetensors weights in {self.directory}: expected {SINGLE} or {INDEX} "
                "(save the model with save_pretrained(..., safe_serialization=True))"
            )
        for name in files:
            path = self.directory / name
            if not path.is_file():
                raise ModelError(f"weight file {path} is listed in {INDEX} but does not exist")
            for entry in _read_header(path):
                if weight_map and weight_map.get(entry.name) not in (None, name):
                    continue  # the index says this tensor lives in another file
                self.entries[entry.name] = entry
        missing = [k for k, f in weight_map.items() if k not in self.entries]
        if missing:
            raise ModelError(
                f"{INDEX} lists tensors not found in their files, e.g. {missing[0]!r} in {weight_map[missing[0]]}"
            )

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def read_into(
        self, name: str, out: torch.Tensor, scratch: torch.Tensor | None = None, row: int | None = None
    ) -> None:
        """Read tensor ``name`` into ``out`` (a contiguous CPU tensor of the same shape, any dtype); with
        ``row``, only its rows (along dimension 0) from ``row`` on, as many as ``out`` has.

        Reads straight into ``out`` when the dtypes match; otherwise slice by slice through ``scratch`` (a
        uint8 CPU buffer; by default one of 64 MiB that this checkpoint allocates once and reuses),
        converting each slice: memory stays bounded whatever the tensor's size.
        """
        entry = self._entry(name)
        shape = entry.shape
        if out.dtype != entry.dtype and out.dtype.is_floating_point and scales_of(self, name) is not None:
            _dequantized(self, name, out, row)
            return
        if row is not None:
            if not shape or not 0 <= row <= row + len(out) <= shape[0]:
                raise ModelError(
                    f"tensor {name!r} in {entry.file} of shape {shape} has no rows {row}-{row + len(out)}"
                )
            item = entry.nbytes // max(1, math.prod(shape))
            begin = row * item * math.prod(shape[1:])
            entry = TensorEntry(
                entry.name,
                entry.file,
                entry.dtype,
                (len(out), *shape[1:]),
                entry.start + begin,
                len(out) * item * math.prod(shape[1:]),
            )
        if tuple(out.shape) != entry.shape:
            raise ModelError(
                f"tensor {name!r} in {entry.file} has shape {entry.shape}, the model expects {tuple(out.shape)}"
            )
        if not out.is_contiguous():
            raise ModelError(f"cannot read {name!r} into a non-contiguous tensor")
        if out.dtype.is_floating_point and not entry.dtype.is_floating_point:
            raise ModelError(
                f"tensor {name!r} in {entry.file} is {str(entry.dtype).removeprefix('torch.')}, but it is a "
                "floating-point weight of the model: casting would train on its integers. The file is not this "
                "model's weights (a quantized checkpoint needs its quantization_config in config.json)"
            )
        fd = os.open(entry.file, os.O_RDONLY)
        try:
            if out.dtype == entry.dtype:
                _pread(fd, entry, out.reshape(-1).view(torch.uint8), 0)  # reshape first: 0-d tensors too
                return
            if scratch is None:
                if self._scratch is None:
                    self._scratch = torch.empty(SCRATCH_BYTES, dtype=torch.uint8)
                scratch = self._scratch
            item = entry.nbytes // max(1, math.prod(entry.shape))
            step = (scratch.numel() // item) * item
            flat = out.view(-1)
            for start in range(0, entry.nbytes, step):
                n = min(step, entry.nbytes - start)
                raw = scratch[:n]
                _pread(fd, entry, raw, start)
                flat[start // item : (start + n) // item].copy_(raw.view(entry.dtype))
        finally:
            os.close(fd)

    def _entry(self, name: str) -> TensorEntry:
        try:
            return self.entries[name]
        except KeyError:
            raise ModelError(f"tensor {name!r} is not in the checkpoint at {self.directory}") from None


class AsSaved(Checkpoint):
    """The checkpoint a model directory would hold, laid out from the model alone (a config.json without
    weights: a model estimated before it is downloaded): each tensor's name, dtype and shape as transformers'
    ``save_pretrained`` writes them, one after another in one file that is never read. ``tensors``: ``(name,
    shape, dtype, content)`` each, ``content`` the values of the few small tensors a loader reads to learn how
    the weights are stored (a quantized weight's lookup tables and quant state), None for the rest: those have
    no values, and reading one is a StateError (a ledger reads none)."""

    def __init__(self, directory: str | os.PathLike[str], tensors: list[tuple]) -> None:
        self.directory = Path(directory)
        self.entries = {}
        self._scratch = None
        self.dequantize = None
        self._contents: dict[str, torch.Tensor] = {}
        file = self.directory / "(weights not downloaded)"
        offset = 0
        for name, shape, dtype, content in tensors:
            nbytes = math.prod(shape) * itemsize(dtype)
            self.entries[name] = TensorEntry(name, file, dtype, tuple(shape), offset, nbytes)
            offset += nbytes
            if content is not None:
                self._contents[name] = content

    def content(self, name: str) -> torch.Tensor | None:
        """The values of tensor ``name`` where the layout carries them (a quantized weight's statistics, a
        packed weight's shape), else None."""
        return self._contents.get(name)

    def read_into(
        self, name: str, out: torch.Tensor, scratch: torch.Tensor | None = None, row: int | None = None
    ) -> None:
        from tiertune.errors import StateError

        if name not in self._contents:
            raise StateError(f"{self.directory} holds no weights: tensor {name!r} has no values to read")
        out.copy_(self._contents[name].reshape(out.shape))


def scales_of(checkpoint: Checkpoint, name: str) -> str | None:
    """The scales of quantized weight tensor ``name`` as the releases name them (FP8's ``_scale_inv`` or
    ``_scale``, MXFP4's ``_blocks`` -> ``_scales``, compressed-tensors' ``_packed`` -> ``_scale``); None when
    ``name`` is not a quantized weight's codes."""
    dtype = checkpoint.entries[name].dtype
    if dtype == torch.float8_e4m3fn:
        candidates = [f"{name}_scale_inv", f"{name}_scale"]
    elif dtype == torch.uint8 and name.endswith("_blocks"):
        candidates = [name.removesuffix("_blocks") + "_scales"]
    elif dtype == torch.int32 and name.endswith("_packed"):
        candidates = [name.removesuffix("_packed") + "_scale"]
    else:
        return None
    return next((c for c in candidates if c in checkpoint.entries), None)


def _dequantized(checkpoint: Checkpoint, name: str, out: torch.Tensor, row: int | None) -> None:
    """Fill ``out`` with the values of quantized weight ``name`` (its codes and scales, ``scales_of``; MXFP4
    experts into the (experts, in, out) weight gpt-oss's model holds), rows from ``row`` on."""
    if checkpoint.dequantize is None:
        raise ModelError(
            f"tensor {name!r} in {checkpoint.entries[name].file} holds quantized codes with scales "
            f"({scales_of(checkpoint, name)}): its values need its quantization_config in config.json"
        )
    entry = checkpoint.entries[name]
    codes = torch.empty(entry.shape, dtype=entry.dtype)
    checkpoint.read_into(name, codes)
    scale_entry = checkpoint.entries[scales_of(checkpoint, name)]  # type: ignore[index]
    scale = torch.empty(scale_entry.shape, dtype=scale_entry.dtype)
    checkpoint.read_into(scale_entry.name, scale)
    fmt = checkpoint.dequantize
    if name.endswith("_blocks"):
        values = torch.stack([fmt.dequantize(codes[e], scale[e], torch.float32).T for e in range(len(codes))])
    else:
        values = fmt.dequantize(codes, scale, torch.float32)
    out.copy_(values if row is None else values[row : row + len(out)])


def _pread(fd: int, entry: TensorEntry, dst: torch.Tensor, offset: int) -> None:
    """Read ``dst.numel()`` bytes of ``entry``, starting ``offset`` bytes into it, from ``fd``."""
    from tiertune.offload.aio import buffer_of, pread_full

    if dst.numel() == 0:
        return
    view = buffer_of(dst)
    if pread_full(fd, view, entry.start + offset) < len(view):
        raise ModelError(
            f"weight file {entry.file} is truncated: tensor {entry.name!r} needs bytes "
            f"{entry.start}-{entry.start + entry.nbytes}, the file has {os.fstat(fd).st_size}"
        )


def _read_header(path: Path) -> list[TensorEntry]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelError(f"weight file {path} is not a safetensors file (shorter than its header)")
        (length,) = struct.unpack("<Q", head)
        if length > min(size - 8, 100 << 20):
            raise ModelError(
                f"weight file {path} is corrupt or truncated: header of {length} bytes in a {size}-byte file"
            )
        try:
            header = json.loads(f.read(length))
        except (ValueError, UnicodeDecodeError) as exc:
            raise ModelError(f"weight file {path} is corrupt: its header is not valid JSON ({exc})") from exc
    base = 8 + length
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = SAFETENSORS_DTYPES[info["dtype"]]
            shape = tuple(int(s) for s in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelError(f"weight file {path} is corrupt: bad header entry for {name!r} ({exc})") from exc
        nbytes = math.prod(shape) * itemsize(dtype)
        if end - begin != nbytes or begin < 0:
            raise ModelError(
                f"weight file {path} is corrupt: {name!r} spans {end - begin} bytes, {nbytes} expected"
            )
        if base + end > size:
            raise ModelError(
                f"weight file {path} is truncated: {name!r} ends at byte {base + end}, the file has {size}"
            )
        entries.append(TensorEntry(name, path, dtype, shape, base + begin, nbytes))
    return entries
