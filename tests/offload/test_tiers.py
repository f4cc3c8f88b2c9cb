import random

import pytest
import torch

from tiertune.errors import ConfigError
from tiertune.offload.chunk import ALIGN
from tiertune.offload.tiers import Arena, MemoryTier, Tier, aligned_empty


def test_arena_best_fit_coalesce_and_capacity():
    arena = Arena(10 * ALIGN)
    a = arena.alloc(3 * ALIGN)
    b = arena.alloc(1)  # rounds up to one page
    c = arena.alloc(6 * ALIGN)
    assert (a, b, c) == (0, 3 * ALIGN, 4 * ALIGN)
    assert arena.alloc(1) is None  # full: never exceeds capacity
    arena.free(a)
    arena.free(c)
    assert arena.largest_free() == 6 * ALIGN  # not merged across b
    arena.free(b)
    assert arena.largest_free() == 10 * ALIGN  # all merged
    arena.check()
    assert arena.peak == 10 * ALIGN and arena.used == 0


def test_arena_random_never_overlaps_or_exceeds():
    rng = random.Random(0)
    arena = Arena(256 * ALIGN)
    live = []
    for _ in range(2000):
        if live and rng.random() < 0.45:
            arena.free(live.pop(rng.randrange(len(live))))
        else:
            off = arena.alloc(rng.randint(1, 40 * ALIGN))
            if off is not None:
                live.append(off)
        arena.check()
        assert arena.used <= arena.capacity and arena.peak <= arena.capacity


def test_memory_tier_buffers_are_aligned_and_reused():
    tier = MemoryTier(Tier.HOST, 8 * ALIGN, torch.device("cpu"))
    a = tier.alloc(3 * ALIGN)
    assert a.tensor.data_ptr() % ALIGN == 0 and a.tensor.numel() == 3 * ALIGN
    base = a.tensor.data_ptr()
    tier.free(a)
    b = tier.alloc(3 * ALIGN)
    assert b.tensor.data_ptr() == base  # the same memory again: no allocation per transfer
    assert tier.alloc(6 * ALIGN) is None


def test_aligned_empty():
    for n in (1, 4095, 4096, 123457):
        t = aligned_empty(n, torch.device("cpu"))
        assert t.numel() == n and t.data_ptr() % ALIGN == 0


def test_auto_budgets_follow_what_the_machine_has(monkeypatch):
    import psutil

    from tiertune.offload.store import StoreConfig
    from tiertune.offload.tiers import AUTO_DEVICE_FRACTION_CPU, AUTO_HOST_FRACTION

    # what RAM is available changes with every other program: a fixed reading (the real one, taken once)
    reading = psutil.virtual_memory()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: reading)
    available = reading.available
    cfg = StoreConfig.resolve(device_budget="auto", host_budget="auto", disk_budget="auto")
    assert cfg.device_budget == int(available * AUTO_DEVICE_FRACTION_CPU)
    assert cfg.host_budget == int(available * AUTO_HOST_FRACTION)
    assert cfg.device_budget + cfg.host_budget < available  # room left for the process and the OS
    assert cfg.disk_budget is None  # resolved to the free space when the disk tier opens


def test_budget_typos_are_config_errors():
    import pytest

    from tiertune.errors import ConfigError
    from tiertune.offload.store import StoreConfig

    with pytest.raises(ConfigError, match="offload.host_budget"):
        StoreConfig.resolve(host_budget="automatic")
    with pytest.raises(ConfigError, match="offload.prefetch_depth"):
        StoreConfig.resolve(prefetch_depth=-1)


def test_allocations_have_their_own_autograd_version_counter():
    # a copy into one chunk must not look like an in-place change of another chunk's saved tensors
    tier = MemoryTier(Tier.DEVICE, 4 * ALIGN, torch.device("cpu"))
    a, b = tier.alloc(ALIGN), tier.alloc(ALIGN)
    w = a.tensor.view(torch.float32).requires_grad_(False)
    x = torch.ones(ALIGN // 4, requires_grad=True)
    y = (x * w).sum()  # autograd saves w
    b.tensor.fill_(3)  # e.g. a prefetch landing in the neighbouring chunk
    y.backward()  # would raise "modified by an inplace operation" if a and b shared a version counter
    assert abs(a.tensor.data_ptr() - b.tensor.data_ptr()) == ALIGN  # still one contiguous arena


def test_budgets_beyond_the_machines_memory_fail_up_front(monkeypatch):
    import psutil
    import pytest

    from tiertune.errors import ConfigError
    from tiertune.offload.store import ChunkStore, StoreConfig

    total = psutil.virtual_memory().total
    with pytest.raises(
        ConfigError,
        match=r"offload.host_budget is 100.00 TiB but this machine has .* of memory in "
        r"all; lower offload.host_budget .* or set it to auto",
    ):
        ChunkStore(StoreConfig.resolve(host_budget="100TiB", device_budget="1MiB"))
    with pytest.raises(ConfigError, match="offload.device_budget is .* but this machine has"):
        ChunkStore(StoreConfig.resolve(device="cpu", device_budget=total + (1 << 30), host_budget="1MiB"))
    real = psutil.virtual_memory
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real()._replace(total=48 << 20))
    with pytest.raises(ConfigError, match="together exceed this machine's 48.00 MiB"):
        ChunkStore(StoreConfig.resolve(device="cpu", device_budget="32MiB", host_budget="32MiB"))
    # plain byte counts from code are still read as bytes
    ChunkStore(StoreConfig.resolve(device_budget=16 << 20, host_budget=16 << 20)).close()


def test_a_cuda_device_without_cuda_is_a_config_error():
    import pytest

    from tiertune.errors import ConfigError
    from tiertune.offload.store import StoreConfig

    assert StoreConfig.resolve(device="auto").device == torch.device(
        "cuda" if torch.cuda.is_available() else "cpu"
    )
    with pytest.raises(ConfigError, match="use device='cpu', 'cuda', 'cuda:N' or 'auto'"):
        StoreConfig.resolve(device="gpu")
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    for device in ("cuda", "cuda:0"):  # as in the README's example, on a machine without a GPU
        with pytest.raises(
            ConfigError,
            match=rf"device '{device}' requested but torch.cuda.is_available\(\) is "
            r"False .*; use device='cpu' or device='auto'",
        ):
            StoreConfig.resolve(device=device, device_budget="4GiB", host_budget="16GiB")


def test_homes_go_lowest_and_cached_copies_best_fit_from_the_top():
    arena = Arena(10 * ALIGN, top=True)
    home = arena.alloc(2 * ALIGN, lowest=True)
    cached = arena.alloc(ALIGN)
    assert home == 0 and cached == 9 * ALIGN  # the free space between them stays one piece
    assert arena.largest_free() == 7 * ALIGN
    arena.check()


def test_reserved_slots_serve_only_their_size_class():
    tier = MemoryTier(
        Tier.HOST,
        4 * ALIGN + 3 * ALIGN + 5 * ALIGN,
        torch.device("cpu"),
        reserve={3 * ALIGN: 1, 5 * ALIGN: 1},
    )
    assert (
        tier.arena.capacity == 4 * ALIGN
        and tier.reserved == 8 * ALIGN
        and tier.slot_sizes == [3 * ALIGN, 5 * ALIGN]
    )
    small = tier.alloc_reserved(2 * ALIGN)  # the smallest slot that holds it
    assert small is not None and tier.slot_size(small) == 3 * ALIGN
    assert tier.alloc_reserved(ALIGN) is None  # its class's slot is taken; the larger class's is not its
    big = tier.alloc_reserved(4 * ALIGN)
    assert big is not None and tier.slot_size(big) == 5 * ALIGN and tier.alloc_reserved(6 * ALIGN) is None
    assert tier.used == 6 * ALIGN and tier.peak == 6 * ALIGN
    tier.free(small)
    assert tier.used == 4 * ALIGN and tier.largest_free() == 4 * ALIGN
    with pytest.raises(ConfigError, match="reserves 32.00 KiB"):
        MemoryTier(Tier.HOST, ALIGN, torch.device("cpu"), reserve={2 * ALIGN: 4})


def test_an_arena_says_whether_freeing_some_ranges_makes_room():
    """A prefetch may evict copies only if that makes room (``ChunkStore._room_can_be_made``): a freed range joins
    the free ranges next to it, and two holes apart never make one. Without this check, a prefetch of a large chunk
    evicted a small copy that sat apart from the largest hole, failed, and the next prefetch brought the small copy
    back: a ledger ran in circles for ever (the estimate of GLM-4.6's 92 layers)."""
    a = Arena(10 * ALIGN)
    first, second, third = (a.alloc(ALIGN * n) for n in (3, 1, 3))  # [0,3) [3,4) [4,7), free [7,10)
    assert a.largest_free() == 3 * ALIGN
    assert a.fits_after(4 * ALIGN, [third]) and a.fits_after(6 * ALIGN, [third])  # [4,10)
    assert not a.fits_after(4 * ALIGN, [first])  # [0,3) and [7,10) are apart
    assert a.fits_after(7 * ALIGN, [second, third]) and not a.fits_after(8 * ALIGN, [second, third])
    assert a.fits_after(10 * ALIGN, [first, second, third]) and not a.fits_after(
        11 * ALIGN, [first, second, third]
    )
    assert a.largest_free() == 3 * ALIGN and a.used == 7 * ALIGN  # nothing was freed
