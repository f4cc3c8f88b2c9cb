"""Frozen weights read in place: chunks homed on disk whose bytes are the tensors of files that already exist.

A pre-quantized checkpoint's safetensors (or tiertune's own quantized cache) already hold a frozen base in
the form it trains in. Copying them into the disk tier's slot file would need the same space again (a 104B
NF4 base is ~55 GB), so such a chunk's disk copy is the files themselves: ``plan_in_place`` lays the chunk out
so each tensor sits at the same offset modulo ``ALIGN`` as in its file; a read of the aligned range of the file
around a run of tensors (a *window*) then lands every tensor of it at its place in the chunk, with O_DIRECT.
The bytes between tensors of a window (at most ``gap``) are read too and never used.

Integrity. Each file's size and modification time are recorded when the chunk is planned, and checked before
every read (a file replaced under a run raises ``IntegrityError``). The first read of a chunk records an xxh3-64
checksum per block; every later read is checked against them, like the slot file's blocks.

These chunks are read-only: the store refuses to write them back (``StateError``).
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import xxhash

from tiertune.errors import IntegrityError, StorageError
from tiertune.offload.aio import AsyncIO, IOHandle, buffer_of
from tiertune.offload.chunk import ALIGN, ChunkLayout, TensorSpec, itemsize
from tiertune.units import round_up

GAP = 64 << 10
"""Bytes between two tensors of one file read rather than split into two windows."""


@dataclass(frozen=True)
class FileTensor:
    """A tensor stored in a file as it is used: ``nbytes`` of ``dtype`` at byte ``start`` of ``file``."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    file: Path
    start: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)


@dataclass(frozen=True)
class Window:
    """An aligned byte range of ``file`` (``nbytes`` from ``file_start``) read to chunk offset ``offset``."""

    file: Path
    file_start: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class InPlace:
    """Where an in-place chunk's bytes are: its windows, and each file's (size, mtime_ns) when planned."""

    windows: tuple[Window, ...]
    stamps: tuple[tuple[Path, int, int], ...]

    @property
    def files(self) -> tuple[Path, ...]:
        return tuple(path for path, _, _ in self.stamps)

    def part(self, start: int, end: int) -> InPlace:
        """Where bytes [start, end) of the chunk are (a rank's shard of it: ``ChunkLayout.shard_range``), as a
        chunk of their own: the windows' parts in that range, at offsets from ``start``."""
        windows = []
        for w in self.windows:
            lo, hi = max(start, w.offset), min(end, w.offset + w.nbytes)
            if lo < hi:
                windows.append(Window(w.file, w.file_start + lo - w.offset, lo - start, hi - lo))
        files = {w.file for w in windows}
        return InPlace(tuple(windows), tuple(s for s in self.stamps if s[0] in files))

    @classmethod
    def image(cls, path: Path, start: int, end: int, stamped: bool = True) -> InPlace:
        """Bytes [start, end) of the file ``path``, an image of a chunk from its byte 0 (the quantized cache's);
        stamped with the file's size and time unless ``stamped`` is false (a ledger's: no file is written)."""
        window = (Window(path, start, 0, end - start),)
        if not stamped:
            return cls(window, ())
        st = path.stat()
        return cls(window, ((path, st.st_size, st.st_mtime_ns),))


def can_map(tensor: FileTensor) -> bool:
    """Whether ``tensor`` can be viewed in place: its start in the file is a multiple of its item size (the
    chunk keeps the file's offset modulo ``ALIGN``, so the view has the alignment the file gives it)."""
    return tensor.start % itemsize(tensor.dtype) == 0


def plan_in_place(
    tensors: Sequence[FileTensor], chunk_size: int, gap: int = GAP, stamped: bool = True
) -> list[tuple[ChunkLayout, InPlace]]:
    """Lay ``tensors`` out in chunks of about ``chunk_size`` bytes read in place: tensors in file order, runs
    of them less than ``gap`` apart (and an eighth of the run) in one window. A chunk holds whole windows (one larger than
    ``chunk_size`` gets a chunk of its own). ``stamped``: each chunk records its files' size and modification
    time, checked when it is read (a ledger's files, never read, may not exist)."""
    ordered = sorted(tensors, key=lambda t: (str(t.file), t.start))
    plans: list[tuple[ChunkLayout, InPlace]] = []
    specs: list[TensorSpec] = []
    windows: list[Window] = []
    run: list[FileTensor] = []
    run_end = 0  # the end of the run's last byte in its file (kept as tensors join: one look at each)

    def close_run() -> None:
        nonlocal run
        if not run:
            return
        start = run[0].start - run[0].start % ALIGN
        end = round_up(run_end, ALIGN)
        offset = windows[-1].offset + windows[-1].nbytes if windows else 0
        windows.append(Window(run[0].file, start, offset, end - start))
        specs.extend(TensorSpec(t.name, t.shape, t.dtype, offset + t.start - start) for t in run)
        run = []

    def close_chunk() -> None:
        nonlocal specs, windows
        close_run()
        if windows:
            used = windows[-1].offset + windows[-1].nbytes
            stamps = []
            for path in dict.fromkeys(w.file for w in windows) if stamped else ():
                st = path.stat()
                stamps.append((path, st.st_size, st.st_mtime_ns))
            plans.append(
                (ChunkLayout(tuple(specs), max(used, ALIGN)), InPlace(tuple(windows), tuple(stamps)))
            )
        specs, windows = [], []

    for t in ordered:
        if not can_map(t):
            raise ValueError(f"{t.name}: byte {t.start} of {t.file} is not aligned for {t.dtype}")
        nbytes = t.nbytes
        # a gap is read only when small next to what the run reads (at most an eighth of it)
        reach = min(gap, max(ALIGN, (run_end - run[0].start) // 8)) if run else 0
        if run and (t.file != run[0].file or t.start - run_end > reach):
            close_run()
        base = windows[-1].offset + windows[-1].nbytes if windows else 0
        first = run[0].start if run else t.start
        size = base + round_up(t.start + nbytes, ALIGN) - (first - first % ALIGN)
        if (windows or run) and size > chunk_size:
            close_chunk()
        run_end = max(run_end, t.start + nbytes) if run else t.start + nbytes
        run.append(t)
    close_chunk()
    return plans


class FileReader:
    """Reads in-place chunks from their files through ``AsyncIO``: O_DIRECT where the filesystem allows it,
    one descriptor per file, opened on first use and kept until ``close``."""

    def __init__(self, aio: AsyncIO) -> None:
        self.aio = aio
        self._fds: dict[Path, tuple[int, bool]] = {}
        self._lock = threading.Lock()

    def _fd(self, path: Path) -> tuple[int, bool]:
        with self._lock:
            if path not in self._fds:
                try:
                    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
                    direct = hasattr(os, "O_DIRECT")
                except OSError as exc:
                    if exc.errno != errno.EINVAL:  # EINVAL: this filesystem refuses O_DIRECT (tmpfs)
                        raise StorageError(
                            f"cannot open {path} to read weights in place: {exc.strerror}"
                        ) from exc
                    fd, direct = os.open(path, os.O_RDONLY), False
                self._fds[path] = (fd, direct)
            return self._fds[path]

    def read(
        self, name: str, place: InPlace, dst: torch.Tensor, expected: tuple[int, ...] | None, sums: list[int]
    ) -> IOHandle:
        """Read chunk ``name``'s windows into ``dst`` (a uint8 host buffer of its capacity). With ``expected``
        (the checksums of its first read) every block is checked; without, ``sums`` receives them."""
        for path, size, mtime in place.stamps:
            st = path.stat()
            if (st.st_size, st.st_mtime_ns) != (size, mtime):
                raise IntegrityError(
                    f"{path} changed while a run reads weights from it in place (size or modification time); "
                    "restart the run, and do not modify a model's files while it trains"
                )
        view = buffer_of(dst)
        blocks = [
            (w, a, min(a + self.aio.block_size, w.nbytes))
            for w in place.windows
            for a in range(0, w.nbytes, self.aio.block_size)
        ]
        if expected is not None and len(expected) != len(blocks):
            raise IntegrityError(f"chunk {name!r}: {len(expected)} checksums for {len(blocks)} blocks")
        sums[:] = [0] * len(blocks)

        def read_block(k: int, w: Window, a: int, b: int) -> None:
            fd, direct = self._fd(w.file)
            part = view[w.offset + a : w.offset + b]
            done = 0
            while done < len(part):
                try:
                    n = os.preadv(fd, [part[done:]], w.file_start + a + done)
                except OSError as exc:
                    raise StorageError(
                        f"read of {w.file} at byte {w.file_start + a + done} failed: {exc.strerror}"
                    ) from exc
                if n <= 0:  # the file's end: the window's tail past it is padding
                    if w.file_start + a + done < os.fstat(fd).st_size:
                        raise IntegrityError(
                            f"chunk {name!r}: short read from {w.file} at byte {w.file_start + a + done}"
                        )
                    part[done:] = bytes(len(part) - done)
                    break
                done += n
                if direct and n % ALIGN:  # O_DIRECT returns whole pages except at the end of the file
                    part[done:] = bytes(len(part) - done)
                    break
            digest = xxhash.xxh3_64_intdigest(part)
            if expected is None:
                sums[k] = digest
            elif digest != expected[k]:
                raise IntegrityError(
                    f"chunk {name!r}: checksum mismatch in bytes {w.file_start + a}-{w.file_start + b} of "
                    f"{w.file} since the run first read them; the file was modified or the drive returned bad data"
                )

        tasks = [partial(read_block, k, w, a, b) for k, (w, a, b) in enumerate(blocks)]
        return self.aio.run(f"read {name} in place", tasks)

    def close(self) -> None:
        with self._lock:
            for fd, _ in self._fds.values():
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._fds.clear()
