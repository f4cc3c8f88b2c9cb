"""The host arena's memory (``HostMemory``): exactly its budget, aligned, pinned through ``cudaHostRegister``
(faked here: this runs without CUDA; ``test_gpu.py`` checks the real thing), and released on close; and the
CUDA budget and device choices that need no GPU to check (``auto`` under a memory fraction cap)."""

import gc
import types

import pytest
import torch

from tiertune.errors import ConfigError
from tiertune.offload import tiers
from tiertune.offload.chunk import ALIGN
from tiertune.offload.store import ChunkStore, StoreConfig, _resolve_device
from tiertune.offload.tiers import HostMemory, MemoryTier, Tier, auto_budget, host_pinned_bytes

GiB = 1 << 30


def test_pinned_bytes_are_the_budget_not_the_next_power_of_two():
    # torch's caching host allocator (the old torch.empty(capacity + ALIGN, pin_memory=True)) rounds up
    assert host_pinned_bytes(3 * GiB, caching_allocator=True) == 4 * GiB
    assert host_pinned_bytes(24 * GiB, caching_allocator=True) == 32 * GiB
    assert host_pinned_bytes(40 * GiB, caching_allocator=True) == 64 * GiB
    assert host_pinned_bytes(32 * GiB, caching_allocator=True) == 64 * GiB  # the alignment slack tips it over
    for budget in (3 * GiB, 24 * GiB, 40 * GiB, 32 * GiB):
        assert host_pinned_bytes(budget) == budget
    assert host_pinned_bytes(3 * GiB + 5 * ALIGN + 123) == 3 * GiB + 5 * ALIGN  # the arena's capacity


def _mapped(host: HostMemory) -> bool:
    return host._mapping() is not None


def test_host_arena_is_exactly_its_budget_aligned_and_usable_end_to_end():
    budget = (8 << 20) + 3 * ALIGN + 100  # not a power of two, not a multiple of the alignment
    tier = MemoryTier(Tier.HOST, budget, torch.device("cpu"))
    capacity = budget - budget % ALIGN
    assert tier.budget == capacity
    base = tier._buffer()
    assert base.numel() == capacity and base.dtype == torch.uint8
    assert base.data_ptr() % ALIGN == 0
    assert len(tier._host._mapping()) == capacity  # the mapping itself: nothing rounded up
    assert tier.pinned_bytes == 0  # no CUDA, nothing pinned
    pattern = torch.arange(capacity, dtype=torch.int64).remainder_(251).to(torch.uint8)
    base.copy_(pattern)  # every page, first to last, is writable...
    assert torch.equal(base, pattern)  # ...and reads back
    a = tier.alloc(capacity)  # one allocation may take the whole budget
    assert a is not None and a.tensor.data_ptr() == base.data_ptr() and a.tensor[-1] == pattern[-1]
    assert tier.alloc(1) is None
    tier.free(a)
    host = tier._host
    del a, base
    tier.close()
    gc.collect()
    assert not _mapped(host)  # closing gave the memory back
    assert tier.pinned_bytes == 0


def test_views_that_outlive_close_keep_their_memory():
    tier = MemoryTier(Tier.HOST, 4 * ALIGN, torch.device("cpu"))
    a = tier.alloc(ALIGN)
    a.tensor.fill_(7)
    host = tier._host
    tier.close()
    gc.collect()
    assert _mapped(host)  # a live view holds the mapping: reading it cannot crash
    assert int(a.tensor.sum()) == 7 * ALIGN
    a.tensor.fill_(1)
    del a
    gc.collect()
    assert not _mapped(host)


class _FakeCudart:
    """``torch.cuda.cudart()``'s cudaHostRegister/cudaHostUnregister, recording their calls."""

    def __init__(self, register_error: int = 0) -> None:
        self.calls: list[tuple] = []
        self.register_error = register_error

    def cudaHostRegister(self, ptr, size, flags):
        self.calls.append(("register", ptr, size, flags))
        return self.register_error

    def cudaHostUnregister(self, ptr):
        self.calls.append(("unregister", ptr))
        return 0


@pytest.fixture
def fake_cuda(monkeypatch):
    fake = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    return fake


def test_the_arena_is_registered_with_cuda_exactly_and_unregistered_on_close(fake_cuda):
    budget = (3 << 20) + 7 * ALIGN
    tier = MemoryTier(Tier.HOST, budget, torch.device("cpu"), pin=torch.device("cuda", 0))
    tier.allocate()
    ptr = tier._buffer().data_ptr()
    assert fake_cuda.calls == [("register", ptr, budget, tiers.HOST_REGISTER_PORTABLE)]
    assert tier.pinned_bytes == budget
    a = tier.alloc(ALIGN)
    host = tier._host
    tier.close()
    assert fake_cuda.calls[1:] == [("unregister", ptr)]  # at close, though a view is still alive
    assert tier.pinned_bytes == 0 and _mapped(host)
    tier.close()
    assert len(fake_cuda.calls) == 2  # once
    del a


def test_pinned_memory_dropped_without_close_is_unregistered_before_it_is_unmapped(fake_cuda):
    host = HostMemory(2 * ALIGN, torch.device("cuda", 0))
    ref, ptr = host._mapping, host.tensor.data_ptr()
    del host
    gc.collect()
    assert fake_cuda.calls[-1] == ("unregister", ptr) and ref() is None


def test_pinning_refused_is_a_config_error_that_says_what_to_change(fake_cuda, caplog):
    fake_cuda.register_error = 2  # cudaErrorMemoryAllocation
    with pytest.raises(
        ConfigError,
        match=r"offload.host_budget is 12.00 KiB but CUDA could not page-lock that "
        r"much host memory \(.*2.*\); lower offload.host_budget, raise the limit "
        r"on locked memory \(ulimit -l",
    ):
        MemoryTier(Tier.HOST, 3 * ALIGN, torch.device("cpu"), pin=torch.device("cuda", 0)).allocate()
    assert [c[0] for c in fake_cuda.calls] == ["register"]  # nothing to unregister


def test_registration_runs_on_a_thread_of_its_own(monkeypatch):
    # a failed CUDA runtime call leaves its error as the calling thread's last error, which torch's next
    # kernel launch check on that thread would raise: the call must not run on the caller's thread
    import threading

    seen = {}

    class Recording(_FakeCudart):
        def cudaHostRegister(self, ptr, size, flags):
            seen["thread"] = threading.get_ident()
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", Recording)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: seen.setdefault("device", device))
    HostMemory(ALIGN, torch.device("cuda", 1)).close()
    assert seen["thread"] != threading.get_ident() and seen["device"] == torch.device("cuda", 1)


def _fake_gpu(monkeypatch, free: int, total: int, fraction: float, reserved: int, current: int = 0) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: fraction)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda device=None: types.SimpleNamespace(total_memory=total)
    )


def test_auto_device_budget_respects_the_process_memory_fraction(monkeypatch):
    cuda = torch.device("cuda", 0)
    # a 24 GiB card emulated on an 80 GiB one: mem_get_info says 79 GiB free, the allocator stops at 24
    _fake_gpu(monkeypatch, free=79 * GiB, total=80 * GiB, fraction=0.3, reserved=2 * GiB)
    assert auto_budget(Tier.DEVICE, cuda) == int(0.8 * (int(0.3 * 80 * GiB) - 2 * GiB))
    # other processes hold most of the card: what is free binds, not the cap
    _fake_gpu(monkeypatch, free=10 * GiB, total=80 * GiB, fraction=0.3, reserved=2 * GiB)
    assert auto_budget(Tier.DEVICE, cuda) == int(0.8 * 10 * GiB)
    # no cap: 80% of what is free, as before
    _fake_gpu(monkeypatch, free=70 * GiB, total=80 * GiB, fraction=1.0, reserved=2 * GiB)
    assert auto_budget(Tier.DEVICE, cuda) == int(0.8 * 70 * GiB)
    # the cap already used up by this process
    _fake_gpu(monkeypatch, free=70 * GiB, total=80 * GiB, fraction=0.1, reserved=9 * GiB)
    assert auto_budget(Tier.DEVICE, cuda) == 0


def test_a_device_budget_over_the_memory_fraction_cap_fails_up_front(monkeypatch):
    _fake_gpu(monkeypatch, free=79 * GiB, total=80 * GiB, fraction=0.3, reserved=0)
    cfg = StoreConfig.resolve(device="cuda:0", device_budget="30GiB", host_budget="1MiB")
    with pytest.raises(
        ConfigError,
        match=r"offload.device_budget is 30.00 GiB but this process may use at most "
        r"24.00 GiB of cuda:0 \(torch.cuda.set_per_process_memory_fraction\); "
        r"lower offload.device_budget or set it to auto",
    ):
        ChunkStore(cfg)


def test_cuda_without_an_index_is_the_current_device(monkeypatch):
    # the store's buffers, streams and events are also made on I/O threads, whose current device is 0
    _fake_gpu(monkeypatch, free=GiB, total=GiB, fraction=1.0, reserved=0, current=1)
    assert _resolve_device("cuda") == torch.device("cuda", 1)
    assert _resolve_device("auto") == torch.device("cuda", 1)
    assert _resolve_device(torch.device("cuda")) == torch.device("cuda", 1)
    assert _resolve_device("cuda:0") == torch.device("cuda", 0)
