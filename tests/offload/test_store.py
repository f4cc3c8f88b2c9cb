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
    cfg = StoreConfig(
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
        StoreConfig(device_budget="64KiB", host_budget="64KiB", disk_path=str(disk_dir))
    ) as store:
        (chunk,) = store.add([("w", (10, 10), torch.float32)], home="disk")
        assert chunk.state is ChunkState.EMPTY
        assert torch.all(store.acquire(chunk)["w"] == 0)
        store.release(chunk)


def test_evictions_keep_data_when_budgets_are_tight(disk_dir):
    # 12 chunks homed on disk; device and host can each hold only two at a time
    cfg = StoreConfig(
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
        StoreConfig(device_budget="16KiB", host_budget="16KiB", disk_path=str(disk_dir), chunk_size="1MiB")
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
    with ChunkStore(StoreConfig(device_budget="8KiB", host_budget="64KiB", chunk_size="4KiB")) as store:
        a, b, c = (store.add([(n, (1024,), torch.float32)], home="host")[0] for n in "abc")
        store.acquire(a)
        store.acquire(b)
        with pytest.raises(BudgetError, match="device tier.*in use.*offload.device_budget"):
            store.acquire(c)
        store.release(a)
        store.release(b)


def test_misuse_raises_state_errors(disk_dir):
    store = ChunkStore(StoreConfig(device_budget="64KiB", host_budget="64KiB", disk_path=str(disk_dir)))
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
        ChunkStore(StoreConfig(device_budget="64KiB", host_budget="64KiB")) as store,
        pytest.raises(ConfigError, match="offload.disk_path"),
    ):
        store.add([("w", (3,), torch.float32)], home="disk")


def test_pins_nest_and_dirty_from_any_holder_counts():
    with ChunkStore(StoreConfig(device_budget="64KiB", host_budget="64KiB")) as store:
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
