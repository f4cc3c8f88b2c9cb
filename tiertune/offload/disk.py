"""The disk tier: one slot file per store in a directory on NVMe, read and written with O_DIRECT.

Layout. A store owns one file, ``tiertune-store-<id>.slots``. Its first ``ALIGN`` bytes say whose file it
is; after that each chunk homed on disk owns a slot for the store's life: an aligned header (magic,
slot owner id, payload length, block size and one xxh3-64 checksum per block, itself checksummed), then the
payload. Slots come from an ``Arena`` whose capacity is the disk budget, and the file grows with
``posix_fallocate`` as slots are handed out, so a full disk is found when a chunk is placed, not halfway
through a write.

Why one file rather than a file per chunk: the two measure the same under O_DIRECT (both are large aligned
requests to preallocated extents), but one file needs one descriptor (a 100B model has thousands of chunks,
past the usual open-file limit), one lock that marks the store alive, and it fails early on ENOSPC.

Integrity. A write hashes each block before writing it and writes the header last. A read checks every
block's length and hash against the checksums the store kept in memory and against the header, so a short,
stale or corrupt read raises ``IntegrityError`` and never returns garbage.

Crashes. A live store holds an exclusive ``flock`` on its file. On start, files of this naming pattern in
the same directory whose lock can be taken belong to dead processes and are removed; nothing else in the
directory is touched. ``close`` removes the store's own file.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import struct
import uuid
import warnings
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import xxhash

from tiertune.errors import BudgetError, DiskFullError, IntegrityError, StorageError
from tiertune.offload.aio import AsyncIO, IOHandle, buffer_of
from tiertune.offload.chunk import ALIGN, Chunk
from tiertune.offload.tiers import Arena, aligned_empty
from tiertune.units import format_size, round_up

log = logging.getLogger("tiertune.offload")

PREFIX = "tiertune-store-"
SUFFIX = ".slots"
TMP_PREFIX = ".tiertune-store-"
TMP_SUFFIX = ".tmp"
FILE_MAGIC = b"TTSTORE1"
CHUNK_MAGIC = b"TTCHUNK1"
_HEADER = struct.Struct(
    "<8sIIQQIIQ"
)  # magic, version, reserved, slot owner id, length, block size, n_blocks, hash
_VERSION = 1
_NO_SPACE = (
    "free space on the filesystem of offload.disk_path, or point offload.disk_path at a directory on a "
    "larger disk"
)
_HINT = "point offload.disk_path at a writable directory on a local disk (an NVMe drive is fastest)"


@dataclass(frozen=True)
class DiskSlot:
    """Where a chunk lives in the slot file: header at ``offset``, payload right after it."""

    offset: int
    header_size: int
    capacity: int
    owner: int = 0  # id written in the header: the chunk the slot was reserved for (moves with the slot)

    @property
    def payload_offset(self) -> int:
        return self.offset + self.header_size


def supports_o_direct(directory: str | os.PathLike[str]) -> bool:
    """Whether files in ``directory`` accept O_DIRECT opens and aligned I/O (tmpfs, for one, does not)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    path = Path(directory) / f"{TMP_PREFIX}probe-{uuid.uuid4().hex}{TMP_SUFFIX}"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
    except OSError as exc:
        # tmpfs and ramfs create the file and then refuse O_DIRECT: the name is ours alone (O_EXCL, a uuid)
        _discard(path)
        if exc.errno == errno.EINVAL:
            return False
        raise StorageError(
            f"disk tier: cannot create a file in {directory} ({exc.strerror}); it is not a writable directory "
            f"of a regular filesystem; {_HINT}"
        ) from exc
    try:
        buf = aligned_empty(ALIGN, _CPU)
        buf.fill_(0)
        os.pwritev(fd, [buffer_of(buf)], 0)
        return os.preadv(fd, [buffer_of(buf)], 0) == ALIGN
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        if is_no_space(exc):
            raise DiskFullError(
                f"disk tier: the filesystem at {directory} is full (no room for a {ALIGN}-byte probe); "
                f"{_NO_SPACE}"
            ) from exc
        raise StorageError(f"disk tier: probing {directory} failed ({exc.strerror}); {_HINT}") from exc
    finally:
        os.close(fd)
        _discard(path)


def clean_stale(directory: str | os.PathLike[str]) -> list[Path]:
    """Remove slot files in ``directory`` left behind by crashed stores; returns what was removed.

    Only files named like a store's (``tiertune-store-*.slots`` and their temporary names) whose lock is
    free are removed: a lock held means a live store owns the file.
    """
    removed = []
    for entry in Path(directory).iterdir():
        name = entry.name
        ours = (name.startswith(PREFIX) and name.endswith(SUFFIX)) or (
            name.startswith(TMP_PREFIX) and name.endswith(TMP_SUFFIX)
        )
        if not ours or not entry.is_file() or entry.is_symlink():
            continue
        try:
            fd = os.open(entry, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # a live store
        else:
            entry.unlink(missing_ok=True)
            removed.append(entry)
        finally:
            os.close(fd)
    if removed:
        log.warning("removed %d stale slot file(s) of crashed runs in %s", len(removed), directory)
    return removed


class DiskTier:
    """A store's slot file: reserves slots within the disk budget and moves chunks through ``AsyncIO``."""

    def __init__(
        self, directory: str | os.PathLike[str], budget: int | None, aio: AsyncIO, direct: bool | None = None
    ) -> None:
        """Open a slot file in ``directory`` (created if missing). ``budget`` None means the free space
        there now; ``direct`` None means O_DIRECT when the filesystem supports it (else one warning)."""
        self.directory = Path(directory).expanduser().resolve()
        self.aio = aio
        _prepare_directory(self.directory)
        clean_stale(self.directory)
        if direct is None:
            direct = supports_o_direct(self.directory)
            if not direct:
                warnings.warn(
                    f"O_DIRECT is not supported in {self.directory} (tmpfs or a network filesystem?); "
                    "falling back to buffered I/O, which goes through the page cache",
                    RuntimeWarning,
                    stacklevel=2,
                )
        self.direct = direct
        self.path = self.directory / f"{PREFIX}{uuid.uuid4().hex[:16]}{SUFFIX}"
        self.budget_is_free_space = budget is None  # no budget: the filesystem's free space is the limit
        self.arena = Arena(_free_bytes(self.directory) if budget is None else budget)
        self.fd = self._create()  # last: nothing after it can fail and leave the file behind
        self._allocated = ALIGN  # bytes of the file backed by fallocate

    @classmethod
    def ledger(cls, budget: int | None, aio: AsyncIO) -> DiskTier:
        """The slots' bookkeeping without a file (``StoreConfig.ledger``): slots within ``budget`` (None: no
        limit); nothing is written or read."""
        tier = cls.__new__(cls)
        tier.directory = tier.path = Path("/nonexistent-ledger")
        tier.aio, tier.direct, tier.budget_is_free_space = aio, False, False
        tier.arena = Arena(budget if budget is not None else 1 << 60)
        tier.fd = -1  # no file: close() has nothing to do
        tier._allocated = 1 << 62  # never grown (reserve's fallocate)
        return tier

    @property
    def budget(self) -> int:
        return self.arena.capacity

    def _create(self) -> int:
        # Create under a name clean_stale ignores until locked, so another store's start-up scan cannot
        # mistake the new file for a stale one.
        tmp = self.directory / f"{TMP_PREFIX}{uuid.uuid4().hex}{TMP_SUFFIX}"
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if self.direct else 0)
        try:
            fd = os.open(tmp, flags, 0o600)
        except OSError as exc:
            _discard(tmp)  # some filesystems create the file before refusing the flags
            raise StorageError(
                f"cannot create a slot file in {self.directory}: {exc.strerror}; {_HINT}"
            ) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(tmp, self.path)
            mark = aligned_empty(ALIGN, _CPU)
            mark.zero_()
            text = FILE_MAGIC + f" pid={os.getpid()}\n".encode()
            buffer_of(mark)[: len(text)] = text
            _pwrite_all(fd, buffer_of(mark), 0, self.path)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            self.path.unlink(missing_ok=True)
            raise
        return fd

    def reserve(self, chunk: Chunk, block_size: int) -> DiskSlot:
        """A slot for ``chunk`` for the store's life; raises BudgetError or DiskFullError if none fits."""
        total = slot_bytes(chunk.capacity, block_size)
        header_size = total - chunk.capacity
        offset = self.arena.alloc(total)
        if offset is None and self.budget_is_free_space:
            if self.arena.capacity == 0:
                raise DiskFullError(
                    f"disk tier: the filesystem at {self.directory} reports 0 bytes free (a ramfs, or a full "
                    f"disk), so chunk {chunk.name!r} ({format_size(total)}) cannot be placed there; point "
                    "offload.disk_path at a directory on a real disk with room"
                )
            raise DiskFullError(
                f"disk tier: chunk {chunk.name!r} needs {format_size(total)} but only "
                f"{format_size(self.arena.largest_free())} is left of the {format_size(self.arena.capacity)} "
                f"that was free on the filesystem at {self.directory} when the store started; {_NO_SPACE}"
            )
        if offset is None:
            raise BudgetError(
                "disk",
                total,
                self.arena.largest_free(),
                "StoreConfig.disk_budget",  # set only from Python: recipes give the disk tier its free space
                f"placing chunk {chunk.name!r}",
            )
        offset += ALIGN  # the file's own header
        end = offset + total
        if end > self._allocated:
            try:
                os.posix_fallocate(self.fd, self._allocated, end - self._allocated)
            except OSError as exc:
                self.arena.free(offset - ALIGN)
                if is_no_space(exc):
                    free = _free_bytes(self.directory)
                    raise DiskFullError(
                        f"disk tier: no space in {self.directory} for chunk {chunk.name!r} "
                        f"({format_size(total)} needed, {format_size(free)} free); {_NO_SPACE}"
                    ) from exc
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise StorageError(f"cannot grow {self.path}: {exc.strerror}") from exc
            self._allocated = max(self._allocated, end)
        return DiskSlot(offset, header_size, chunk.capacity, chunk.id)

    def release(self, slot: DiskSlot) -> None:
        self.arena.free(slot.offset - ALIGN)

    def write(self, chunk: Chunk, slot: DiskSlot, src: torch.Tensor) -> tuple[IOHandle, list[int]]:
        """Write the host buffer ``src`` (uint8, ``capacity`` bytes) to ``slot``: blocks, then the header.

        Returns the handle and the list the per-block checksums land in (complete once the handle is).
        """
        view = buffer_of(src)
        ranges = self.aio.blocks(slot.capacity)
        sums = [0] * len(ranges)
        base = slot.payload_offset

        def write_block(k: int, a: int, b: int) -> None:
            sums[k] = xxhash.xxh3_64_intdigest(view[a:b])
            _pwrite_all(self.fd, view[a:b], base + a, self.path)

        def header_tasks() -> list:
            def write_header() -> None:
                header = aligned_empty(slot.header_size, _CPU)
                header.zero_()
                buffer_of(header)[: _HEADER.size + 8 * len(sums)] = _encode_header(
                    slot.owner, slot, self.aio.block_size, sums
                )
                _pwrite_all(self.fd, buffer_of(header), slot.offset, self.path)

            return [write_header]

        blocks = self.aio.run(
            f"write {chunk.name}", [partial(write_block, k, a, b) for k, (a, b) in enumerate(ranges)]
        )
        return self.aio.then(blocks, f"write header {chunk.name}", header_tasks), sums

    def read(self, chunk: Chunk, slot: DiskSlot, dst: torch.Tensor, expected: tuple[int, ...]) -> IOHandle:
        """Read ``slot`` into the host buffer ``dst``, verifying lengths and checksums block by block."""
        view = buffer_of(dst)
        ranges = self.aio.blocks(slot.capacity)
        if len(expected) != len(ranges):
            raise IntegrityError(f"chunk {chunk.name!r}: {len(expected)} checksums for {len(ranges)} blocks")
        base = slot.payload_offset

        def read_block(k: int, a: int, b: int) -> None:
            _pread_all(self.fd, view[a:b], base + a, self.path, chunk.name)
            if xxhash.xxh3_64_intdigest(view[a:b]) != expected[k]:
                raise IntegrityError(
                    f"chunk {chunk.name!r}: checksum mismatch in block {k} (bytes {a}-{b}) of {self.path}; "
                    "the file was modified or the drive returned bad data"
                )

        def read_header() -> None:
            header = aligned_empty(slot.header_size, _CPU)
            _pread_all(self.fd, buffer_of(header), slot.offset, self.path, chunk.name)
            _check_header(bytes(buffer_of(header)), chunk, slot, expected, self.path)

        tasks = [partial(read_block, k, a, b) for k, (a, b) in enumerate(ranges)]
        return self.aio.run(f"read {chunk.name}", [read_header, *tasks])

    def close(self) -> None:
        """Close and remove the slot file."""
        if self.fd < 0:
            return
        os.close(self.fd)
        self.fd = -1
        self.path.unlink(missing_ok=True)


_CPU = torch.device("cpu")


def is_no_space(exc: BaseException) -> bool:
    """Whether an error is a filesystem out of room: ENOSPC, or EDQUOT (this user's quota)."""
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def _free_bytes(directory: Path) -> int:
    """Bytes free to this user on the filesystem of ``directory``."""
    return shutil.disk_usage(directory).free


def _discard(path: Path) -> None:
    """Remove ``path`` if it is there; a failure to remove it is no reason to hide the error being raised."""
    with contextlib.suppress(OSError):
        path.unlink(missing_ok=True)


def _prepare_directory(directory: Path) -> None:
    if directory.exists() and not directory.is_dir():
        raise StorageError(f"disk tier: {directory} is not a directory; {_HINT}")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StorageError(f"disk tier: cannot create {directory}: {exc.strerror}; {_HINT}") from exc
    if not directory.is_dir():
        raise StorageError(f"disk tier: {directory} is not a directory; {_HINT}")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise StorageError(f"disk tier: {directory} is not writable by this user; {_HINT}")


def _pwrite_all(fd: int, view: memoryview, offset: int, path: Path) -> None:
    try:
        n = os.pwritev(fd, [view], offset)
    except OSError as exc:
        if is_no_space(exc):
            raise DiskFullError(
                f"disk tier: {path.parent} is full (ENOSPC while writing {len(view)} bytes at offset {offset}); "
                f"{_NO_SPACE}"
            ) from exc
        raise StorageError(f"write to {path} at offset {offset} failed: {exc.strerror}") from exc
    if n != len(view):
        raise StorageError(f"short write to {path}: {n} of {len(view)} bytes at offset {offset}")


def _pread_all(fd: int, view: memoryview, offset: int, path: Path, name: str) -> None:
    try:
        n = os.preadv(fd, [view], offset)
    except OSError as exc:
        raise StorageError(f"read of chunk {name!r} from {path} failed: {exc.strerror}") from exc
    if n != len(view):
        raise IntegrityError(
            f"chunk {name!r}: short read from {path}: {n} of {len(view)} bytes at offset {offset} "
            "(the file was truncated)"
        )


def slot_bytes(capacity: int, block_size: int) -> int:
    """Bytes of the disk tier's slot for a chunk of ``capacity``: its header (with a checksum per block of
    ``block_size``) and its data."""
    return round_up(_HEADER.size + 8 * -(-capacity // block_size), ALIGN) + capacity


def _encode_header(chunk_id: int, slot: DiskSlot, block_size: int, sums: list[int]) -> bytes:
    body = struct.pack(f"<{len(sums)}Q", *sums)
    fields = (CHUNK_MAGIC, _VERSION, 0, chunk_id, slot.capacity, block_size, len(sums))
    digest = xxhash.xxh3_64_intdigest(_HEADER.pack(*fields, 0) + body)
    return _HEADER.pack(*fields, digest) + body


def _check_header(raw: bytes, chunk: Chunk, slot: DiskSlot, expected: tuple[int, ...], path: Path) -> None:
    magic, version, _, chunk_id, length, block_size, n_blocks, digest = _HEADER.unpack_from(raw)
    body = raw[_HEADER.size : _HEADER.size + 8 * n_blocks] if n_blocks <= len(expected) else b""
    fields = (magic, version, 0, chunk_id, length, block_size, n_blocks)
    ok = (
        magic == CHUNK_MAGIC
        and version == _VERSION
        and n_blocks == len(expected)
        and xxhash.xxh3_64_intdigest(_HEADER.pack(*fields, 0) + body) == digest
    )
    if not ok:
        raise IntegrityError(f"chunk {chunk.name!r}: corrupt header in {path} at offset {slot.offset}")
    if chunk_id != slot.owner or length != slot.capacity:
        raise IntegrityError(
            f"chunk {chunk.name!r}: header in {path} names slot {chunk_id} of {length} bytes, "
            f"expected slot {slot.owner} of {slot.capacity} bytes"
        )
    if struct.unpack(f"<{n_blocks}Q", body) != tuple(expected):
        raise IntegrityError(f"chunk {chunk.name!r}: header checksums in {path} do not match the last write")
