"""Randomized workloads: no tier's accounted bytes ever exceed its budget, and no data is ever lost."""

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiertune.offload.chunk import ALIGN
from tiertune.offload.store import ChunkStore, StoreConfig

PAGE_FLOATS = ALIGN // 4


def _check_accounting(store):
    stats = store.stats()
    for name, tier in stats.tiers.items():
        assert tier.used <= tier.budget and tier.peak <= tier.budget, (name, tier)
    for tier, mem in store._mem.items():
        mem.arena.check()
        held = sum(c.capacity for c in store.chunks if tier in c.copies)
        assert held == mem.arena.used, (tier, held, mem.arena.used)  # accounting == what chunks really hold


op = st.one_of(
    st.tuples(st.just("use"), st.integers(0, 9), st.sampled_from(["device", "host"]), st.booleans()),
    st.tuples(st.just("pair"), st.integers(0, 9), st.integers(0, 9)),
    st.tuples(st.just("evict"), st.integers(0, 9)),
)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    sizes=st.lists(st.integers(1, 4), min_size=1, max_size=10),
    homes=st.lists(st.sampled_from(["device", "host", "disk"]), min_size=10, max_size=10),
    extra=st.tuples(st.integers(0, 6), st.integers(0, 6)),
    prefetch=st.integers(0, 3),
    pattern=st.lists(op, min_size=1, max_size=25),
    perturb=st.lists(op, max_size=5),
)
def test_random_workload_never_exceeds_budgets(
    tmp_path_factory, sizes, homes, extra, prefetch, pattern, perturb
):
    n = len(sizes)
    homes = homes[:n]
    largest = max(sizes) * ALIGN
    reserved = {h: sum(s * ALIGN for s, hh in zip(sizes, homes) if hh == h) for h in ("device", "host")}
    # room for two pinned chunks plus one being staged, whatever the fragmentation; the rest is cache
    cfg = StoreConfig.resolve(
        device_budget=reserved["device"] + 3 * largest + extra[0] * ALIGN,
        host_budget=reserved["host"] + 4 * largest + extra[1] * ALIGN,
        disk_path=str(tmp_path_factory.mktemp("disk")),
        chunk_size=largest,
        prefetch_depth=prefetch,
        block_size=ALIGN,
    )
    with ChunkStore(cfg) as store:
        chunks = [
            store.add([("w", (s * PAGE_FLOATS,), torch.float32)], home=h)[0] for s, h in zip(sizes, homes)
        ]
        values = [float(i) for i in range(n)]
        for chunk, v in zip(chunks, values):
            store.write(chunk, {"w": torch.full((chunk.tensors[0].numel,), v)})
        _check_accounting(store)

        def run(ops):
            for o in ops:
                if o[0] == "use":
                    i, tier, dirty = o[1] % n, o[2], o[3]
                    w = store.acquire(chunks[i], tier)["w"]
                    assert torch.all(w == values[i]), (o, w[0].item(), values[i])
                    if dirty:
                        values[i] += 1
                        w.fill_(values[i])
                    store.release(chunks[i], dirty=dirty)
                elif o[0] == "pair":
                    i, j = o[1] % n, o[2] % n
                    wi = store.acquire(chunks[i])["w"]
                    wj = store.acquire(chunks[j])["w"]
                    assert torch.all(wi == values[i]) and torch.all(wj == values[j])
                    store.release(chunks[j])
                    store.release(chunks[i])
                else:
                    store.evict(chunks[o[1] % n])
                _check_accounting(store)

        for step in range(4):
            run(pattern)
            if step == 2:
                run(perturb)  # the order diverges from the trace
            store.mark_step()
        store.wait()
        _check_accounting(store)
        store.flush()
        for chunk, v in zip(chunks, values):
            store.evict(chunk)
            assert chunk.valid == {chunk.home}
            assert torch.all(store.read(chunk)["w"] == v)
        _check_accounting(store)
        stats = store.stats()
        for name, tier in stats.tiers.items():
            assert tier.peak <= tier.budget, name


@pytest.mark.parametrize("seed", range(3))
def test_tight_budget_streaming_like_training(disk_dir, seed):
    """24 'layers' homed on disk, device budget of two layers: a forward/backward-shaped access order."""
    gen = torch.Generator().manual_seed(seed)
    layer = 16 * ALIGN
    cfg = StoreConfig.resolve(
        device_budget=2 * layer,
        host_budget=6 * layer,
        disk_path=str(disk_dir),
        chunk_size=layer,
        prefetch_depth=1,
    )
    with ChunkStore(cfg) as store:
        chunks = [store.add({"w": torch.randn(layer // 4, generator=gen)}, home="disk")[0] for _ in range(24)]
        expected = [store.read(c)["w"] for c in chunks]
        order = chunks + chunks[::-1]
        for _ in range(3):
            for chunk in order:
                w = store.acquire(chunk)["w"]
                assert torch.equal(w, expected[chunk.id])
                w.mul_(0.5)
                expected[chunk.id] = w.clone()
                store.release(chunk, dirty=True)
                stats = store.stats()
                assert stats.tiers["device"].used <= 2 * layer and stats.tiers["host"].used <= 6 * layer
            store.mark_step()
        assert store.stats().tiers["device"].peak <= 2 * layer
        assert store.stats().divergences == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("block", range(4))
def test_threaded_stress_random_configurations(tmp_path, block):
    """Forward/backward-shaped orders under random budgets, prefetch depths, queue depths and homes, with
    random host acquires and dirty releases: values always right, accounting always exact, never a hang.
    (This found a leaked allocation and two prefetch/acquire livelocks.)"""
    for trial in range(block * 10, block * 10 + 10):
        rng = random.Random(trial)
        layer = rng.choice([1, 4, 16]) * ALIGN
        homes = [rng.choice(["disk", "host", "disk"]) for _ in range(rng.randint(4, 30))]
        cfg = StoreConfig.resolve(
            device_budget=rng.randint(2, 5) * layer,
            host_budget=(homes.count("host") + rng.randint(3, 8)) * layer,
            disk_path=str(tmp_path / f"t{trial}"),
            chunk_size=layer,
            prefetch_depth=rng.randint(0, 4),
            queue_depth=rng.choice([1, 4, 16]),
            block_size=ALIGN * rng.choice([1, 2, 16]),
        )
        with ChunkStore(cfg) as store:
            chunks = [
                store.add({"w": torch.full((layer // 4,), float(i))}, home=h)[0] for i, h in enumerate(homes)
            ]
            values = [float(i) for i in range(len(chunks))]
            for _step in range(5):
                for chunk in chunks + chunks[::-1]:
                    w = store.acquire(chunk, "host" if rng.random() < 0.1 else "device")["w"]
                    assert torch.all(w == values[chunk.id]), (trial, chunk)
                    if rng.random() < 0.5:
                        values[chunk.id] += 1
                        w.fill_(values[chunk.id])
                        store.release(chunk, dirty=True)
                    else:
                        store.release(chunk)
                    _check_accounting(store)
                store.mark_step()
