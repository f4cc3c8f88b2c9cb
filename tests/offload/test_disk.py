import errno
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import tiertune.offload.disk as disk_mod
from tiertune.errors import BudgetError, DiskFullError, IntegrityError, StorageError
from tiertune.offload.aio import AsyncIO
from tiertune.offload.chunk import Chunk, pack_tensors
from tiertune.offload.disk import PREFIX, SUFFIX, DiskTier, clean_stale, supports_o_direct
from tiertune.offload.store import ChunkStore, StoreConfig
from tiertune.offload.tiers import MemoryTier, Tier


def _chunks(n, nbytes):
    layout = pack_tensors([("x", (nbytes,), torch.uint8)], nbytes)[0]
    return [Chunk(i, f"c{i}", layout, Tier.DISK) for i in range(n)]


def test_many_writes_and_reads_in_flight_round_trip(disk_dir):
    aio = AsyncIO(queue_depth=8, block_size=64 * 1024)
    disk = DiskTier(disk_dir, 1 << 30, aio)
    chunks = _chunks(32, 300_000)  # odd size: the last block is short
    host = MemoryTier(Tier.HOST, 64 * chunks[0].capacity, torch.device("cpu"))
    src = [host.alloc(c.capacity) for c in chunks]
    dst = [host.alloc(c.capacity) for c in chunks]
    for a in src:
        a.tensor.random_(0, 256)
    slots = [disk.reserve(c, aio.block_size) for c in chunks]
    writes = [disk.write(c, s, a.tensor) for c, s, a in zip(chunks, slots, src)]  # all queued at once
    assert not all(h.done() for h, _ in writes)  # they really are asynchronous
    for c, (h, sums) in zip(chunks, writes):
        h.wait()
        c.disk_checksums = tuple(sums)
    reads = [disk.read(c, s, a.tensor, c.disk_checksums) for c, s, a in zip(chunks, slots, dst)]
    for h in reads:
        h.wait()
    for a, b in zip(src, dst):
        assert torch.equal(a.tensor, b.tensor)
    disk.close()
    aio.close()
    assert not disk.path.exists()


def _disk_store(disk_dir, **kw):
    cfg = dict(
        device_budget=1 << 20,
        host_budget=1 << 20,
        disk_path=str(disk_dir),
        chunk_size=256 << 10,
        block_size=64 << 10,
    )
    cfg.update(kw)
    return ChunkStore(StoreConfig.resolve(**cfg))


def _on_disk(store, value):
    (chunk,) = store.add({"w": torch.full((50_000,), value)}, home="disk")
    store.evict(chunk)
    assert chunk.valid == {Tier.DISK}
    return chunk, store._slots[chunk.id]


def test_corrupt_byte_is_detected(disk_dir):
    with _disk_store(disk_dir) as store:
        chunk, slot = _on_disk(store, 3.0)
        with open(store.disk.path, "r+b") as f:
            f.seek(slot.payload_offset + 70_000)
            byte = f.read(1)
            f.seek(slot.payload_offset + 70_000)
            f.write(bytes([byte[0] ^ 0xFF]))
            f.flush()
            os.fsync(f.fileno())
        with pytest.raises(IntegrityError, match="checksum mismatch in block 1"):
            store.acquire(chunk, "host")


def test_corrupt_header_is_detected(disk_dir):
    with _disk_store(disk_dir) as store:
        chunk, slot = _on_disk(store, 3.0)
        with open(store.disk.path, "r+b") as f:
            f.seek(slot.offset + 20)
            f.write(b"\x00\x01\x02")
            os.fsync(f.fileno())
        with pytest.raises(IntegrityError, match="header"):
            store.acquire(chunk)


def test_truncated_file_is_detected(disk_dir):
    with _disk_store(disk_dir) as store:
        chunk, slot = _on_disk(store, 3.0)
        os.truncate(store.disk.path, slot.payload_offset + 100_000)
        with pytest.raises(IntegrityError, match="short read"):
            store.acquire(chunk)


def test_enospc_on_write_back_is_a_disk_full_error(disk_dir, monkeypatch):
    with _disk_store(disk_dir) as store:
        (chunk,) = store.add({"w": torch.ones(50_000)}, home="disk")

        def full(*args):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(disk_mod.os, "pwritev", full)
        with pytest.raises(DiskFullError, match="full .*ENOSPC"):
            store.flush()
        monkeypatch.undo()
        assert Tier.HOST in chunk.valid  # the data was not dropped


def test_enospc_when_placing_a_chunk(disk_dir, monkeypatch):
    with _disk_store(disk_dir) as store:

        def full(*args):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(disk_mod.os, "posix_fallocate", full)
        with pytest.raises(DiskFullError, match="no space in .* free"):
            store.add([("w", (50_000,), torch.float32)], home="disk")
        assert store.disk.arena.used == 0  # nothing leaked


def test_disk_budget_is_enforced(disk_dir):
    with _disk_store(disk_dir, disk_budget=300 << 10) as store:
        store.add([("a", (50_000,), torch.float32)], home="disk")
        with pytest.raises(BudgetError, match="disk tier.*StoreConfig.disk_budget"):
            store.add([("b", (50_000,), torch.float32)], home="disk")


def test_path_that_is_not_a_directory(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(StorageError, match="offload.disk_path"):
        _disk_store(afile / "sub")
    with pytest.raises(StorageError, match="not a directory"):
        _disk_store(afile)


def test_missing_directory_is_created(tmp_path):
    with _disk_store(tmp_path / "new" / "dir") as store:
        assert store.disk.path.parent == (tmp_path / "new" / "dir").resolve()


def test_filesystem_without_o_direct_falls_back_to_buffered_io_with_one_warning(disk_dir, monkeypatch):
    # Older tmpfs, some FUSE and network filesystems refuse O_DIRECT with EINVAL at open time.
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(disk_mod.os, "open", no_direct)
    assert supports_o_direct(disk_dir) is False
    with pytest.warns(RuntimeWarning, match="O_DIRECT is not supported") as record:
        store = _disk_store(disk_dir)
    assert len([w for w in record if "O_DIRECT" in str(w.message)]) == 1
    with store:
        assert store.disk.direct is False
        chunk, _ = _on_disk(store, 5.0)
        assert torch.all(store.read(chunk)["w"] == 5.0)


def test_o_direct_on_the_real_disk(disk_dir):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with _disk_store(disk_dir) as store:
            assert store.disk.direct is True


def test_close_removes_the_file_and_stale_files_of_crashed_runs_are_cleaned(disk_dir):
    crash = textwrap.dedent(
        f"""
        import os, torch
        from tiertune.offload.store import ChunkStore, StoreConfig
        s = ChunkStore(StoreConfig.resolve(device_budget=1 << 20, host_budget=1 << 20, disk_path={str(disk_dir)!r}))
        c, = s.add({{"w": torch.ones(1000)}}, home="disk")
        s.flush()
        os._exit(0)  # a crash: no close, no finalizers
        """
    )
    subprocess.run([sys.executable, "-c", crash], check=True)
    stale = list(disk_dir.glob(f"{PREFIX}*{SUFFIX}"))
    assert len(stale) == 1
    (disk_dir / "notes.txt").write_text("not ours")
    (disk_dir / "tiertune-other.slots").write_text("not ours either")
    live = _disk_store(disk_dir)  # start-up cleans the crashed run's file
    assert not stale[0].exists()
    assert (disk_dir / "notes.txt").exists() and (disk_dir / "tiertune-other.slots").exists()
    second = _disk_store(disk_dir)  # a live store's file is never taken for stale
    assert live.disk.path.exists()
    assert clean_stale(disk_dir) == []
    second.close()
    live.close()
    assert not live.disk.path.exists() and not second.disk.path.exists()
    assert sorted(p.name for p in disk_dir.iterdir()) == ["notes.txt", "tiertune-other.slots"]


@pytest.fixture
def tiny_fs(tmp_path):
    """A real 1 MiB filesystem (tmpfs), where the kernel itself answers ENOSPC."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_really_full_filesystem_gives_disk_full_and_keeps_what_was_stored(tiny_fs):
    with _disk_store(tiny_fs, disk_budget="64MiB") as store:
        (first,) = store.add({"w": torch.full((50_000,), 9.0)}, home="disk")
        store.evict(first)
        with pytest.raises(DiskFullError, match=f"no space in {tiny_fs}") as err:
            for i in range(10):  # ~200 KiB each: the 1 MiB filesystem runs out
                store.add([(f"x{i}", (50_000,), torch.float32)], home="disk")
        assert "free" in str(err.value) and "offload.disk_path" in str(err.value)
        assert torch.all(store.read(first)["w"] == 9.0)  # the chunk already there is intact


def _creates_then_refuses_o_direct(monkeypatch):
    """os.open as tmpfs (older kernels) and ramfs answer O_DIRECT: the file is created, then EINVAL."""
    real_open = os.open

    def open_(path, flags, *args, **kw):
        if flags & os.O_DIRECT:
            os.close(real_open(path, flags & ~os.O_DIRECT, *args, **kw))
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr(disk_mod.os, "open", open_)


def test_probes_leave_no_files_behind_even_when_o_direct_is_refused(disk_dir, monkeypatch):
    from tiertune.estimates.speed import probe_disk

    _creates_then_refuses_o_direct(monkeypatch)
    assert supports_o_direct(disk_dir) is False  # what `tiertune env --disk-path` asks
    assert list(disk_dir.iterdir()) == []
    with pytest.warns(RuntimeWarning, match="O_DIRECT is not supported"):
        read, write = probe_disk(disk_dir, 1 << 20)  # `tiertune env --probe`
    assert read > 0 and write > 0
    assert list(disk_dir.iterdir()) == []
    with pytest.raises(StorageError, match="cannot create a slot file"):  # a failed open
        DiskTier(disk_dir, 1 << 20, AsyncIO(1, 1 << 16), direct=True)
    assert list(disk_dir.iterdir()) == []


@pytest.mark.parametrize("path", ["/proc", "/sys"])
def test_a_special_directory_is_a_storage_error(path):
    if not os.path.isdir(path):
        pytest.skip(f"no {path} here")
    with pytest.raises(
        StorageError,
        match=f"cannot create a file in {path} .*point offload.disk_path at a "
        "writable directory on a local disk",
    ):
        _disk_store(path)


def test_out_of_space_says_what_helps_with_the_bytes_needed_and_free(disk_dir, monkeypatch):
    with _disk_store(disk_dir) as store:

        def full(*args):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(disk_mod.os, "posix_fallocate", full)
        with pytest.raises(DiskFullError) as err:
            store.add([("w", (50_000,), torch.float32)], home="disk")
    message = str(err.value)
    assert "disk_budget" not in message  # no such recipe key
    assert "(200.00 KiB needed, " in message and " free)" in message
    assert "free space on the filesystem of offload.disk_path, or point offload.disk_path at a" in message


def test_a_filesystem_with_no_free_bytes_is_named_as_such(disk_dir, monkeypatch):
    import shutil

    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=0))  # what ramfs reports
    with _disk_store(disk_dir) as store, pytest.raises(DiskFullError) as err:
        store.add([("w", (50_000,), torch.float32)], home="disk")
    message = str(err.value)
    assert f"the filesystem at {disk_dir.resolve()} reports 0 bytes free (a ramfs, or a full disk)" in message
    assert "point offload.disk_path at a directory on a real disk with room" in message
    assert "disk_budget" not in message


def test_space_used_up_since_the_store_started_says_what_helps(disk_dir, monkeypatch):
    import shutil

    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=300 << 10))
    with _disk_store(disk_dir) as store:
        store.add([("a", (50_000,), torch.float32)], home="disk")
        with pytest.raises(
            DiskFullError,
            match="needs 200.00 KiB but only 100.00 KiB is left of the 300.00 KiB that was "
            "free on the filesystem at .*; free space on the filesystem of "
            "offload.disk_path",
        ):
            store.add([("b", (50_000,), torch.float32)], home="disk")


@pytest.fixture
def ramfs(tmp_path):
    """A real ramfs: it reports 0 bytes free and refuses O_DIRECT after creating the file."""
    mnt = tmp_path / "ramfs"
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "ramfs", "ramfs", str(mnt)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a ramfs here: {mounted.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_real_ramfs_gives_a_clear_error_and_leaves_nothing(ramfs):
    with pytest.warns(RuntimeWarning, match="O_DIRECT is not supported"):
        store = _disk_store(ramfs)
    with store, pytest.raises(DiskFullError, match="reports 0 bytes free"):
        store.add([("w", (50_000,), torch.float32)], home="disk")
    assert list(ramfs.iterdir()) == []
