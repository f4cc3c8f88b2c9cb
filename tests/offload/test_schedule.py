import logging
import math

import torch

from tiertune.offload.chunk import ALIGN, ChunkState
from tiertune.offload.schedule import Scheduler
from tiertune.offload.store import ChunkStore, StoreConfig
from tiertune.offload.tiers import Tier

D = Tier.DEVICE


def _store(device_chunks, prefetch_depth=0, home="host", n=3, disk_dir=None, host_chunks=16):
    cfg = StoreConfig.resolve(
        device_budget=device_chunks * ALIGN,
        host_budget=(n * ALIGN if home == "host" else 0) + host_chunks * ALIGN,
        disk_path=str(disk_dir) if disk_dir else None,
        chunk_size=ALIGN,
        prefetch_depth=prefetch_depth,
    )
    store = ChunkStore(cfg)
    chunks = [
        store.add({f"w{i}": torch.full((ALIGN // 4,), float(i))}, home=home, name=f"c{i}")[0]
        for i in range(n)
    ]
    return store, chunks


def _on_device(chunks):
    return {c.name for c in chunks if Tier.DEVICE in c.valid}


def test_belady_eviction_matches_hand_computed_trace():
    # Device holds 2 chunks; every step uses A B C A B.
    # Step 1 (recording, LRU): C evicts A, A evicts B, B evicts C -> ends with {A, B}.
    # Step 2 (replaying, Belady): A hit, B hit; C must evict A (next use: 0 accesses away) or B (1 away):
    # the furthest is B -> {A, C}; A hit; B must evict A (next use 0 away, in the next step) or C (2 away):
    # C -> {A, B}. Two misses a step, where LRU keeps missing three times.
    store, (a, b, c) = _store(device_chunks=2)
    names = {a.id: "c0", b.id: "c1", c.id: "c2"}
    order = [a, b, c, a, b]
    with store:
        lru = []
        for chunk in order:
            store.acquire(chunk)
            store.release(chunk)
            lru.append(_on_device(order))
        assert lru == [{"c0"}, {"c0", "c1"}, {"c1", "c2"}, {"c2", "c0"}, {"c0", "c1"}]
        store.mark_step()
        for _step in range(3):
            seen = []
            before = store.stats().bytes_moved.get("host->device", 0)
            for chunk in order:
                store.acquire(chunk)
                store.release(chunk)
                seen.append(_on_device(order))
            store.mark_step()
            assert seen == [{"c0", "c1"}, {"c0", "c1"}, {"c0", "c2"}, {"c0", "c2"}, {"c0", "c1"}]
            assert store.stats().bytes_moved["host->device"] - before == 2 * ALIGN  # two misses
        assert names  # ids mapped as expected
        assert store.stats().divergences == 0


def test_scheduler_next_use_wraps_into_the_next_step():
    s = Scheduler()
    for cid in (0, 1, 2, 0):
        s.on_access(cid, D)
    s.mark_step()
    assert s.next_use(0) == 0 and s.next_use(1) == 1 and s.next_use(2) == 2 and s.next_use(9) == math.inf
    s.on_access(0, D)
    s.on_access(1, D)
    # cursor 2: next uses are 2 -> 0 away, 0 -> 1 away, 1 -> wraps: position 1 of the next step, 3 away
    assert (s.next_use(2), s.next_use(0), s.next_use(1)) == (0, 1, 3)
    assert s.upcoming(3) == [2, 0, 1]
    assert sorted((0, 1, 2), key=lambda c: s.victim_key(c, 5 + c, D)) == [1, 0, 2]
    # the key is the next use's position from the first replayed step's head: unchanged while others are used
    before = {c: s.victim_key(c, 0, D) for c in (0, 1)}
    s.on_access(2, D)
    s.on_access(0, D)
    assert s.victim_key(1, 0, D) == before[1] and s.victim_key(0, 0, D) != before[0]
    s.mark_step()  # a step replayed whole: positions go on counting, no epoch change
    epoch = s.epoch
    s.on_access(0, D)
    assert s.epoch == epoch and s.next_use(1) == 0 and s.victim_key(1, 0, D) == before[1]


def test_divergence_logs_once_and_rerecords(caplog):
    store, (a, b, c) = _store(device_chunks=2)
    with store:
        for chunk in (a, b, c):
            store.acquire(chunk)
            store.release(chunk)
        store.mark_step()
        assert store.scheduler.replaying
        for chunk in (a, c, b):  # a different order
            store.acquire(chunk)
            store.release(chunk)
        assert not store.scheduler.replaying  # fell back to LRU while re-recording
        store.mark_step()
        assert store.scheduler.trace is not None
        assert [x.chunk for x in store.scheduler.trace] == [a.id, c.id, b.id]  # the new order was recorded
        for chunk in (a, c, b):
            store.acquire(chunk)
            store.release(chunk)
        store.mark_step()
        assert store.stats().divergences == 1
        for chunk in (b, a):  # diverge again: counted, but not logged as a warning again
            store.acquire(chunk)
            store.release(chunk)
        store.mark_step()
        assert store.stats().divergences == 2
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "diverged" in r.message]
    assert len(warnings) == 1
    assert any(r.levelno == logging.DEBUG and "diverged" in r.message for r in caplog.records)


def test_prefetch_loads_the_next_chunks_before_they_are_acquired(disk_dir):
    store, chunks = _store(
        device_chunks=3, prefetch_depth=1, home="disk", n=6, disk_dir=disk_dir, host_chunks=4
    )
    with store:
        for chunk in chunks:
            store.evict(chunk)
        for chunk in chunks:  # warm-up: records the trace, nothing is prefetched
            store.acquire(chunk)
            store.release(chunk)
            assert chunks[(chunk.id + 2) % 6].valid == {Tier.DISK}
        store.mark_step()
        for chunk in chunks:
            store.evict(chunk)
        for i, chunk in enumerate(chunks):
            views = store.acquire(chunk)
            assert torch.all(views[f"w{i}"] == float(i))
            store.wait()
            nxt = chunks[(i + 1) % 6]
            assert Tier.DEVICE in nxt.valid, f"chunk {nxt.name} was not prefetched to the device"
            ahead = chunks[(i + 2) % 6]
            assert ahead.valid & {Tier.HOST, Tier.DEVICE}, "disk->host prefetch runs further ahead"
            store.release(chunk)
        store.mark_step()
        for chunk in chunks:
            assert chunk.state is not ChunkState.IN_USE


def test_upcoming_skips_chunks_whose_next_access_overwrites_them():
    s = Scheduler()
    H = Tier.HOST
    for chunk, tier, overwrite in [(0, D, True), (1, D, False), (0, D, False), (2, H, True), (3, D, False)]:
        s.on_access(chunk, tier, overwrite)
    s.mark_step()
    assert s.upcoming(3, D) == [1, 3]  # 0 is next written whole; its later read does not count
    assert s.upcoming(4) == [1, 3]  # nor does 2 (host, written whole)
    s.on_access(0, D, True)
    assert s.upcoming(2, D) == [1, 0]  # past the overwrite, 0's next access reads it


def test_overwriting_accesses_are_not_prefetched(disk_dir):
    store, chunks = _store(device_chunks=3, prefetch_depth=2, home="disk", disk_dir=disk_dir)
    with store:
        for _ in range(2):  # per step: read 1, write 0 whole, read 0, read 2
            store.acquire(chunks[1], D)
            store.release(chunks[1])
            store.acquire(chunks[0], D, overwrite=True)
            store.release(chunks[0], dirty=True)
            for chunk in (chunks[0], chunks[2]):
                store.acquire(chunk, D)
                store.release(chunk)
            store.mark_step()
        store.wait()
        for chunk in chunks:
            store.evict(chunk)
        # the evictions' write-backs complete on I/O threads, and each completion may already prefetch what
        # the trace says comes next (1, then 2): count each chunk's reads, not a window of the total
        read = {c.name: store.moved(c).get("disk->host", 0) for c in chunks}
        store.acquire(chunks[1], D)  # replaying: prefetches 2 but not 0, whose next access overwrites it
        store.wait()
        again = {c.name: store.moved(c).get("disk->host", 0) - read[c.name] for c in chunks}
        assert again["c0"] == 0 and store.moved(chunks[0]).get("disk->host", 0) == 0
        assert Tier.HOST in chunks[1].valid and Tier.HOST in chunks[2].valid
        assert not chunks[0].valid & {Tier.HOST, Tier.DEVICE}
        assert store.moved(chunks[2]).get("disk->host", 0) == chunks[2].capacity  # read back once, ahead
        store.release(chunks[1])


def test_a_repeating_pass_keeps_what_the_next_pass_needs_and_gives_the_steps_trace_back():
    """A loop over 4 chunks through a device tier of 3 (a decoding's passes over the layers). With no trace to go
    by (least recently used) every access misses: 4 copies a pass. As a repeating pass (``ChunkStore.repeating``,
    each pass ended by ``mark_step``: the first recorded, the next replayed), Belady keeps what the next pass
    needs soonest: at most 2 copies a pass (1 at best). The steps' scheduler, its trace and where the step is
    in it, is back after the block."""

    def loop(store, chunks) -> int:
        before = store.stats().bytes_moved.get("host->device", 0)
        for chunk in chunks:
            store.acquire(chunk)
            store.release(chunk)
        return (store.stats().bytes_moved.get("host->device", 0) - before) // ALIGN

    store, chunks = _store(device_chunks=3, n=4)
    with store:
        assert [loop(store, chunks) for _ in range(5)] == [4] * 5  # no trace: least recently used
    store, chunks = _store(device_chunks=3, n=4)
    with store:
        loop(store, chunks)  # a training step's trace first: every chunk once
        store.mark_step()
        steps, cursor = store.scheduler, store.scheduler.cursor
        with store.repeating():
            assert store.scheduler is not steps and not store.scheduler.replaying
            copied = []
            for _ in range(6):
                copied.append(loop(store, chunks))
                store.mark_step()
        assert store.scheduler is steps and steps.cursor == cursor and steps.replaying
    assert all(1 <= n <= 2 for n in copied[1:]) and sum(copied[1:]) <= 8, copied


def test_a_pass_that_is_no_step_keeps_the_steps_trace_and_replays_its_own(disk_dir, caplog):
    """An evaluation's passes between steps (``ChunkStore.begin_pass`` ... ``forget_pass``) access the chunks in
    an order of their own (here the step's in reverse). Before, such a pass diverged from the steps' trace, which
    was dropped with a warning: the step after it ran without prefetching, and so did every pass. Now the steps'
    trace is the same object after the pass, the step after it replays it with no divergence, and the second pass
    replays the first pass's trace: its next chunk is prefetched from the disk while it runs."""
    store, chunks = _store(
        device_chunks=2, prefetch_depth=1, home="disk", n=4, disk_dir=disk_dir, host_chunks=2
    )

    def visit(order):  # ``seen``: whether the next chunk in the order was off the disk when each was acquired
        for i, chunk in enumerate(order):
            store.acquire(chunk)
            store.wait()
            seen.append(bool(order[(i + 1) % len(order)].valid & {Tier.HOST, Tier.DEVICE}))
            store.release(chunk)

    with caplog.at_level(logging.DEBUG, logger="tiertune.offload"), store:
        seen: list = []
        visit(chunks)
        store.mark_step()
        steps, trace = store.scheduler, store.scheduler.trace
        for chunk in chunks:  # at home only, as each pass leaves them
            store.evict(chunk)
        for k in range(2):
            store.begin_pass()
            assert store.scheduler is not steps and store.scheduler.replaying == (k > 0)
            seen.clear()
            visit(chunks[::-1])
            # the first pass records (nothing fetched ahead); the second replays it: the chunk after each is on
            # its way from the disk
            assert seen[:-1] == [k > 0] * (len(chunks) - 1), seen
            store.forget_pass()
            assert store.scheduler is steps and steps.trace is trace and steps.cursor == 0
        visit(chunks)
        store.mark_step()
        assert steps.trace is trace and steps.divergences == 0
    assert not [r for r in caplog.records if "diverged" in r.getMessage() and r.levelno >= logging.WARNING]
