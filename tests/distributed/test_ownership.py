"""Ownership of a sharded chunk's elements, and the gradient buffer packed by owner."""

import itertools

import pytest
import torch

from tiertune.distributed.ownership import owned_slices, pack_by_owner, run_length, views_of_run
from tiertune.offload.chunk import itemsize, pack_tensors

ENTRIES = [
    ("embed", (97, 33), torch.bfloat16),
    ("norm", (33,), torch.bfloat16),
    ("w", (1500, 7), torch.float32),
    ("tiny", (3,), torch.float32),
    ("packed", (5000,), torch.uint8),
]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_element_is_owned_once_and_its_bytes_are_in_its_owners_shard(world):
    [layout] = pack_tensors(ENTRIES, 1 << 24, world)
    owned = owned_slices(layout, world)
    specs = {t.name: t for t in layout.tensors}
    for t in layout.tensors:
        covered = sorted((s.start, s.end) for slices in owned for s in slices if s.name == t.name)
        assert covered[0][0] == 0 and covered[-1][1] == t.numel  # whole tensor
        assert all(a[1] == b[0] for a, b in itertools.pairwise(covered))  # no gap, no overlap
    for rank, slices in enumerate(owned):
        lo, hi = layout.shard_range(rank, world)
        for s in slices:
            t = specs[s.name]
            first, last = t.offset + s.start * itemsize(t.dtype), t.offset + s.end * itemsize(t.dtype)
            assert lo <= first < last <= hi and s.ndim == len(t.shape)


@pytest.mark.parametrize("world", [2, 3])
def test_one_reduce_scatter_of_the_packed_gradients_gives_each_rank_the_sum_of_its_elements(world):
    [layout] = pack_tensors(ENTRIES, 1 << 24, world)
    owned = owned_slices(layout, world)
    run = run_length(owned)
    floats = [t for t in layout.tensors if t.dtype.is_floating_point]
    # every rank's full gradients (integers: the sum is exact in any order)
    grads = [{t.name: torch.randint(-50, 50, t.shape).float() for t in floats} for _ in range(world)]
    packed = [pack_by_owner(g, owned) for g in grads]
    assert all(p.numel() == world * run for p in packed)
    summed = torch.stack(packed).sum(0)  # what reduce-scatter sums; rank r receives run r
    total = {name: sum(g[name] for g in grads) for name in grads[0]}
    for rank in range(world):
        mine = summed[rank * run : (rank + 1) * run]
        for s, view in views_of_run(mine, owned[rank]):
            if s.name in total:
                assert torch.equal(view, total[s.name].reshape(-1)[s.start : s.end])
            else:  # not a gradient (the uint8 payload): zeros
                assert not view.any()
        assert not mine[sum(s.numel for s in owned[rank]) :].any()  # the padding
