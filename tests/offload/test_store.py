import pytest
import torch

from tiertune.errors import BudgetError, ConfigError, StateError
from tiertune.offload.chunk import ChunkState
from tiertune.offload.store import ChunkStore, StoreConfig
from tiertune.offload.tiers import Tier

MIXED = {
    "f32": ((7, 13), torch.float32),
    "bf16": ((1,), torch.bfloat16),
    "f16": ((33, 3), torch.float16),
    "i8": ((4097,), torch.int8),
    "f64": ((3, 3, 3), torch.float64),
    "i64": ((5,), torch.int64),
    "flag": ((9,), torch.bool),
    "empty": ((0, 4), torch.float32),
    "big": ((70_001,), torch.float32),
}


def _random(shape, dtype, gen):
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if not dtype.is_floating_point:
        return torch.randint(-100, 100, shape, generator=gen, dtype=dtype)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def _tensors(seed):
    gen = torch.Generator().manual_seed(seed)
    return {k: _random(shape, dtype, gen) for k, (shape, dtype) in MIXED.items()}


def _assert_same(views, expected):
    assert set(views) == set(expected)
    for k, v in expected.items():
        assert views[k].dtype == v.dtype and views[k].shape == v.shape, k
        assert torch.equal(views[k].cpu(), v), k


@pytest.mark.parametrize("home", ["device", "host", "disk"])
def test_round_trip_of_mixed_dtypes_through_every_path(home, disk_dir):
    cfg = StoreConfig.resolve(
        device_budget="1MiB",
        host_budget="1MiB",
        disk_path=str(disk_dir),
        chunk_size="96KiB",
        block_size="16KiB",
    )
    with ChunkStore(cfg) as store:
        data = _tensors(0)
        chunks = store.add(data, home=home, name="mixed")
        assert len(chunks) == 2 and [s.name for s in chunks[1].tensors] == [
            "big"
        ]  # "big" (280 KB) gets its own
        for chunk in chunks:
            part = {s.name: data[s.name] for s in chunk.tensors}
            _assert_same(store.acquire(chunk, "device"), part)  # -> device
            store.release(chunk)
            _assert_same(store.acquire(chunk, "host"), part)  # -> host
            store.release(chunk)
            store.evict(chunk)  # back to home only
            assert chunk.valid == {Tier(home)}
            views = store.acquire(chunk, "device")
            _assert_same(views, part)
            for k, v in views.items():  # modify on the device
                if v.numel():
                    v.copy_(_random(v.shape, v.dtype, torch.Generator().manual_seed(hash(k) % 1000)))
                part[k] = v.cpu().clone()
            store.release(chunk, dirty=True)
            assert chunk.valid == {Tier.DEVICE}  # other copies are stale now
            _assert_same(store.acquire(chunk, "host"), part)  # device -> host
            store.release(chunk)
            store.evict(chunk)  # written to home (disk: with checksums)
            assert chunk.valid == {Tier(home)}
            _assert_same(store.read(chunk), part)
            _assert_same(store.acquire(chunk, "device"), part)  # home -> device
            store.release(chunk)


def test_empty_chunks_read_as_zeros_and_add_with_specs(disk_dir):
    with ChunkStore(
        StoreConfig.resolve(device_budget="64KiB", host_budget="64KiB", disk_path=str(disk_dir))
    ) as store:
        (chunk,) = store.add([("w", (10, 10), torch.float32)], home="disk")
        assert chunk.state is ChunkState.EMPTY
        assert torch.all(store.acquire(chunk)["w"] == 0)
        store.release(chunk)


def test_evictions_keep_data_when_budgets_are_tight(disk_dir):
    # 12 chunks homed on disk; device and host can each hold only two at a time
    cfg = StoreConfig.resolve(
        device_budget=2 * 8192,
        host_budget=2 * 8192,
        disk_path=str(disk_dir),
        chunk_size=8192,
        prefetch_depth=1,
    )
    with ChunkStore(cfg) as store:
        chunks = [store.add({"w": torch.full((2048,), float(i))}, home="disk")[0] for i in range(12)]
        for step in range(4):
            for i, chunk in enumerate(chunks):
                w = store.acquire(chunk)["w"]
                assert torch.all(w == i + step), (step, i)
                w.add_(1)
                store.release(chunk, dirty=True)
            store.mark_step()
        stats = store.stats()
        assert stats.tiers["device"].peak <= 2 * 8192 and stats.tiers["host"].peak <= 2 * 8192
        assert stats.bytes_moved["host->disk"] > 0 and stats.bytes_moved["disk->host"] > 0


def test_budget_errors_name_the_tier_the_bytes_and_the_setting(disk_dir):
    with ChunkStore(
        StoreConfig.resolve(
            device_budget="16KiB", host_budget="16KiB", disk_path=str(disk_dir), chunk_size="1MiB"
        )
    ) as store:
        with pytest.raises(
            BudgetError, match=r"host tier: needs 24.00 KiB but only 16.00 KiB .* `offload.host_budget`"
        ):
            store.add([("w", (6144,), torch.float32)], home="host")
        assert store.stats().tiers["host"].used == 0  # nothing reserved by the failed add
        with pytest.raises(BudgetError, match="host tier.*pass through") as err:
            store.add([("w", (6144,), torch.float32)], home="disk")
        assert (
            err.value.tier == "host"
            and err.value.needed == 24576
            and err.value.setting == "offload.host_budget"
        )
        assert store.stats().tiers["disk"].used == 0


def test_budget_error_when_everything_resident_is_in_use():
    with ChunkStore(
        StoreConfig.resolve(device_budget="8KiB", host_budget="64KiB", chunk_size="4KiB")
    ) as store:
        a, b, c = (store.add([(n, (1024,), torch.float32)], home="host")[0] for n in "abc")
        store.acquire(a)
        store.acquire(b)
        with pytest.raises(BudgetError, match="device tier.*in use.*offload.device_budget"):
            store.acquire(c)
        store.release(a)
        store.release(b)


def test_misuse_raises_state_errors(disk_dir):
    store = ChunkStore(
        StoreConfig.resolve(device_budget="64KiB", host_budget="64KiB", disk_path=str(disk_dir))
    )
    (chunk,) = store.add({"w": torch.ones(3)}, home="disk")
    with pytest.raises(StateError, match="not acquired"):
        store.release(chunk)
    store.acquire(chunk)
    with pytest.raises(StateError, match="release it first"):
        store.flush()
    store.release(chunk)
    with pytest.raises(ConfigError, match="not on disk"):
        store.acquire(chunk, "disk")
    store.close()
    with pytest.raises(StateError, match="closed"):
        store.acquire(chunk)


def test_disk_placement_without_a_disk_tier_is_a_config_error():
    with (
        ChunkStore(StoreConfig.resolve(device_budget="64KiB", host_budget="64KiB")) as store,
        pytest.raises(ConfigError, match="offload.disk_path"),
    ):
        store.add([("w", (3,), torch.float32)], home="disk")


def test_pins_nest_and_dirty_from_any_holder_counts():
    with ChunkStore(StoreConfig.resolve(device_budget="64KiB", host_budget="64KiB")) as store:
        (chunk,) = store.add({"w": torch.zeros(4)}, home="host")
        w1 = store.acquire(chunk)["w"]
        w2 = store.acquire(chunk)["w"]
        assert w1.data_ptr() == w2.data_ptr()
        w1.fill_(7)
        store.release(chunk, dirty=True)
        assert chunk.state is ChunkState.IN_USE
        store.release(chunk)
        assert chunk.state is ChunkState.ON_DEVICE and chunk.valid == {Tier.DEVICE}
        assert torch.all(store.read(chunk)["w"] == 7)


def _cfg(disk_dir, **kw):
    base = dict(
        device_budget="1MiB",
        host_budget="1MiB",
        disk_path=str(disk_dir),
        chunk_size="64KiB",
        block_size="16KiB",
    )
    base.update(kw)
    return StoreConfig.resolve(**base)


@pytest.mark.parametrize("home", ["device", "host", "disk"])
def test_overwrite_acquire_reads_nothing_and_keeps_the_new_bytes(home, disk_dir):
    with ChunkStore(_cfg(disk_dir)) as store:
        (chunk,) = store.add({"x": torch.arange(1000.0)}, home=home, name="c")
        store.evict(chunk)
        before = dict(store.stats().bytes_moved)
        views = store.acquire(chunk, "host", overwrite=True)
        moved = store.stats().bytes_moved
        # nothing fetched for the overwrite (device-homed: no device->host copy either)
        assert moved.get("disk->host", 0) == before.get("disk->host", 0)
        assert moved.get("device->host", 0) == before.get("device->host", 0)
        views["x"].copy_(torch.full((1000,), 7.0))
        store.release(chunk, dirty=True)
        store.evict(chunk)
        assert torch.equal(store.read(chunk)["x"], torch.full((1000,), 7.0))
        # acquiring where a valid copy already is keeps it: overwrite only skips fetching
        store.acquire(chunk, "host")
        store.release(chunk)
        assert torch.equal(store.acquire(chunk, "host", overwrite=True)["x"], torch.full((1000,), 7.0))
        store.release(chunk)


@pytest.mark.parametrize("home", ["device", "host", "disk"])
def test_exchange_swaps_contents_without_copying(home, disk_dir):
    with ChunkStore(_cfg(disk_dir)) as store:
        entries = [("w", (100,), torch.float32), ("b", (3,), torch.float64)]
        (a,) = store.add(entries, home=home, name="a")
        (b,) = store.add(entries, home=home, name="b")
        store.write(a, {"w": torch.ones(100), "b": torch.ones(3, dtype=torch.float64)})
        store.write(b, {"w": torch.full((100,), 2.0), "b": torch.full((3,), 2.0, dtype=torch.float64)})
        store.evict(a)  # a on its home only; b also cached on the host (unless home)
        store.acquire(b, "host")
        store.release(b)
        moved = dict(store.stats().bytes_moved)
        store.exchange(a, b)
        assert store.stats().bytes_moved == moved
        assert torch.equal(store.read(a)["w"], torch.full((100,), 2.0))
        assert torch.equal(store.read(b)["w"], torch.ones(100))
        store.evict(a)
        store.evict(b)
        # disk reads check the header of the slot each chunk now owns
        assert torch.equal(store.acquire(a, "device")["b"], torch.full((3,), 2.0, dtype=torch.float64))
        assert torch.equal(store.acquire(b, "device")["b"], torch.ones(3, dtype=torch.float64))
        with pytest.raises(StateError, match="acquired"):
            store.exchange(a, b)
        store.release(a)
        store.release(b)


def test_exchange_refuses_different_layouts(disk_dir):
    with ChunkStore(_cfg(disk_dir)) as store:
        (a,) = store.add([("w", (100,), torch.float32)], home="host", name="a")
        (b,) = store.add([("w", (101,), torch.float32)], home="host", name="b")
        with pytest.raises(ConfigError, match="cannot exchange"):
            store.exchange(a, b)


@pytest.mark.parametrize("home", ["host", "disk"])
def test_discard_forgets_contents_without_writing_them_back(home, disk_dir):
    with ChunkStore(_cfg(disk_dir)) as store:
        (chunk,) = store.add({"x": torch.arange(1000.0)}, home=home, name="c")
        store.acquire(chunk, "device")
        store.release(chunk, dirty=True)  # newest copy only on the device
        moved = dict(store.stats().bytes_moved)
        used = store.stats().tiers["device"].used
        store.discard(chunk)
        assert chunk.state is ChunkState.EMPTY
        assert store.stats().bytes_moved == moved  # nothing written back
        assert store.stats().tiers["device"].used < used  # the cached copy's space is free again
        assert torch.equal(store.read(chunk)["x"], torch.zeros(1000))


def test_untraced_accesses_leave_the_trace_alone(disk_dir):
    with ChunkStore(_cfg(disk_dir)) as store:
        chunks = [
            store.add({"x": torch.full((1000,), float(i))}, home="disk", name=f"c{i}")[0] for i in range(3)
        ]
        for step in range(3):
            for chunk in chunks:
                store.acquire(chunk, "device")
                store.release(chunk)
            if step == 1:  # extra work outside the trace, e.g. a redone optimizer step
                store.acquire(chunks[2], "host", traced=False)
                store.release(chunks[2])
                store.acquire(chunks[0], "host", traced=False)
                store.release(chunks[0])
            store.mark_step()
        assert store.scheduler.replaying and store.stats().divergences == 0


@pytest.mark.parametrize("home", ["host", "disk"])
def test_copy_from_hands_over_a_cached_copy_or_copies(home, disk_dir):
    with ChunkStore(_cfg(disk_dir)) as store:
        entries = [("w", (1000,), torch.float32)]
        (src,) = store.add({"w": torch.arange(1000.0)}, home=home, name="src")
        (dst,) = store.add(entries, home=home, name="dst")
        store.evict(src)
        used = store.stats().tiers["host"].used
        views = store.acquire(dst, "host", copy_from=src)
        assert torch.equal(views["w"], torch.arange(1000.0))
        if home == "disk":  # src's host copy became dst's: src is back to its disk copy, no new host bytes
            assert src.valid == {Tier.DISK} and store.stats().tiers["host"].used == used + src.capacity
        views["w"].mul_(2)
        store.release(dst, dirty=True)
        assert torch.equal(store.read(src)["w"], torch.arange(1000.0))  # the source is untouched
        assert torch.equal(store.read(dst)["w"], torch.arange(1000.0) * 2)
        with pytest.raises(ConfigError, match="layouts differ"):
            (other,) = store.add([("w", (999,), torch.float32)], home=home, name="other")
            store.acquire(other, "host", copy_from=src)


def test_a_copy_into_the_device_waits_for_the_compute_streams_last_use_of_it(monkeypatch):
    # a device-homed chunk changed on the host goes back into its home device memory, which kernels queued
    # before its last release may still be reading: the copy stream must wait for that release's event
    import types

    cfg = StoreConfig.resolve(
        device="cpu", device_budget="1MiB", host_budget="1MiB", chunk_size="64KiB", prefetch_depth=0
    )
    with ChunkStore(cfg) as store:
        (chunk,) = store.add({"w": torch.zeros(1024)}, home="device")
        store.read(chunk)  # a host copy as well
        store.acquire(chunk)  # on the device...
        store.release(chunk)
        last_use = types.SimpleNamespace(synchronize=lambda: None)  # ...what a CUDA release records
        chunk.device_event = last_use
        store.acquire(chunk, "host")["w"].fill_(3.0)  # the optimizer's update, on the host
        store.release(chunk, dirty=True)
        afters = []
        copy = store.aio.copy
        monkeypatch.setattr(
            store.aio,
            "copy",
            lambda dst, src, label, after=None: afters.append(after) or copy(dst, src, label, after),
        )
        w = store.acquire(chunk)["w"]  # host -> device, into the home copy
        assert afters == [last_use]
        assert torch.equal(w, torch.full((1024,), 3.0))
        store.release(chunk)


@pytest.mark.parametrize("reserve", [False, True])
def test_chunks_in_use_cannot_fragment_a_planned_tier_into_a_failure(tmp_path, reserve):
    # four 3-page chunks fill a 12-page arena; two stay in use, splitting it into 3-page gaps: a 5-page chunk
    # then fits nowhere though 6 pages are free. A plan reserves a slot of its class, and it goes there
    page = 4096
    slots = {5 * page: 1} if reserve else None
    config = StoreConfig.resolve(
        device="cpu",
        device_budget=8 * page,
        host_budget=12 * page + (5 * page if reserve else 0),
        disk_path=str(tmp_path),
        reserve={"host": slots} if slots else None,
    )
    with ChunkStore(config) as store:
        small = [store.add([("x", (3 * page,), torch.uint8)], home="disk", name=f"s{i}")[0] for i in range(4)]
        [big] = store.add([("x", (5 * page,), torch.uint8)], home="disk", name="big")
        for chunk in small:
            store.acquire(chunk, Tier.HOST)
        store.release(small[0], dirty=True)
        store.release(small[2], dirty=True)
        held = sorted(c.copies[Tier.HOST].offset for c in (small[1], small[3]))
        assert held[1] - held[0] == 6 * page  # in use: every other chunk, the gaps between them 3 pages each
        if not reserve:
            with pytest.raises(BudgetError, match="needs 20.00 KiB but only 12.00 KiB is available"):
                store.acquire(big, Tier.HOST)
            return
        views = store.acquire(big, Tier.HOST)
        assert views["x"].numel() == 5 * page and store._mem[Tier.HOST].in_reserve(big.copies[Tier.HOST])
        # counted by size class: the smallest slot that holds a chunk (the 3-page ones have no class of their own)
        assert store.in_use_peaks()["host"] == {5 * page: 4}
        store.release(big)
        for chunk in (small[1], small[3]):
            store.release(chunk)


def test_a_ledger_places_evicts_and_moves_as_the_store_does_without_a_byte(disk_dir, tmp_path):
    """The same calls on a store and on a ledger (``StoreConfig.ledger``): the same peaks and the same bytes per
    link, with the ledger's tiers on the meta device and no file at its disk_path."""
    entries = [("w", (40_000,), torch.float32)]  # 160 KB chunks: the 512 KiB host holds three of them

    def run(store: ChunkStore) -> tuple[dict, dict, str]:
        chunks = [store.add(entries, home="disk", name=f"c{i}")[0] for i in range(6)]
        chunks += [store.add(entries, home="host", name="h")[0]]
        for step in range(3):
            for chunk in chunks:  # forward: read on the device
                store.acquire(chunk, "device")
                store.release(chunk)
            for chunk in reversed(chunks):  # an update on the host, written back when evicted
                store.acquire(chunk, "host", overwrite=step == 0)
                store.release(chunk, dirty=True)
            store.mark_step()
        store.wait()
        stats = store.stats()
        where = store.acquire(chunks[0], "device")["w"].device.type
        store.release(chunks[0])
        return {t: s.peak for t, s in stats.tiers.items()}, stats.bytes_moved, where

    common = dict(
        device_budget="512KiB", host_budget="512KiB", chunk_size="1MiB", block_size="64KiB", prefetch_depth=0
    )
    with ChunkStore(StoreConfig.resolve(disk_path=str(disk_dir), **common)) as store:
        real = run(store)
    nowhere = tmp_path / "not-created"
    with ChunkStore(StoreConfig.resolve(disk_path=str(nowhere), ledger=True, **common)) as ledger:
        counted = run(ledger)
    assert counted[:2] == real[:2] and real[1]["host->disk"] > 0 and real[1]["disk->host"] > 0
    assert (real[2], counted[2]) == ("cpu", "meta")
    assert not nowhere.exists()
