"""CUDA paths: pinned host pool, copies on side streams overlapping compute, stream-ordered eviction."""

import pytest
import torch

from tiertune.offload.aio import AsyncIO
from tiertune.offload.store import ChunkStore, StoreConfig
from tiertune.offload.tiers import Tier

pytestmark = pytest.mark.gpu


def test_host_pool_is_pinned_and_device_tier_is_on_the_gpu(disk_dir):
    cfg = StoreConfig(
        device="cuda", device_budget="64MiB", host_budget="64MiB", disk_path=str(disk_dir), chunk_size="8MiB"
    )
    with ChunkStore(cfg) as store:
        data = {"w": torch.randn(1 << 20)}
        (chunk,) = store.add(data, home="disk")
        store.evict(chunk)
        w = store.acquire(chunk)["w"]
        assert w.is_cuda and torch.equal(w.cpu(), data["w"])
        store.release(chunk)
        assert store._mem[Tier.HOST]._buffer().is_pinned()
        assert store._mem[Tier.DEVICE]._buffer().is_cuda


def test_host_to_device_copy_overlaps_compute():
    aio = AsyncIO()
    src = torch.empty(512 << 20, dtype=torch.uint8).pin_memory()
    dst = torch.empty_like(src, device="cuda")
    a = torch.randn(8192, 8192, device="cuda")

    def compute():
        for _ in range(20):
            a.mul_(1.0001).add_(a @ a * 1e-9)

    def timed(fn):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)

    compute()  # warm-up
    aio.copy(dst, src, "warm-up").wait()
    t_copy = timed(lambda: aio.copy(dst, src, "alone").wait())
    t_compute = timed(compute)

    def both():
        handle = aio.copy(dst, src, "overlapped")
        compute()
        handle.wait()

    t_both = timed(both)
    aio.close()
    assert t_both < 0.85 * (t_copy + t_compute), (t_copy, t_compute, t_both)


def test_eviction_waits_for_kernels_still_using_a_released_chunk(disk_dir):
    n = 4 << 20
    cfg = StoreConfig(
        device="cuda", device_budget=2 * 4 * n, host_budget=8 * 4 * n, chunk_size=4 * n, prefetch_depth=0
    )
    with ChunkStore(cfg) as store:
        chunks = [store.add([("w", (n,), torch.float32)], home="host")[0] for _ in range(4)]
        big = torch.randn(6144, 6144, device="cuda")
        w = store.acquire(chunks[0])["w"]
        for _ in range(10):  # queue a long kernel chain whose result lands in the chunk
            big = big @ big
            big = big / big.norm()
        w.copy_(big.flatten()[:n])
        store.release(chunks[0], dirty=True)  # no synchronize: the kernels may still be running
        for chunk in chunks[1:]:  # force chunk 0 off the device and its memory to be reused
            store.acquire(chunk)["w"].fill_(7.0)
            store.release(chunk, dirty=True)
        expected = big.flatten()[:n].cpu()
        assert torch.equal(store.read(chunks[0])["w"], expected)
