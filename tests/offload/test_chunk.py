import pytest
import torch

from tiertune.errors import ConfigError, StateError
from tiertune.offload.chunk import ALIGN, TENSOR_ALIGN, TRANSITIONS, Chunk, ChunkState, pack_tensors
from tiertune.offload.tiers import Tier

S = ChunkState


def test_every_state_has_a_row_and_in_use_only_returns_to_rest():
    assert set(TRANSITIONS) == set(ChunkState)
    assert TRANSITIONS[S.IN_USE] == {S.ON_DEVICE, S.ON_HOST}
    assert S.IN_USE not in TRANSITIONS[S.ON_DISK]  # a chunk on disk must be loaded first


@pytest.mark.parametrize(
    ("start", "target"),
    [
        (S.ON_DISK, S.ON_DEVICE),
        (S.EMPTY, S.ON_HOST),  # EMPTY -> ON_DISK is legal: a frozen chunk homed in a file
        (S.LOADING, S.IN_USE),
        (S.WRITING, S.IN_USE),
        (S.IN_USE, S.ON_DISK),
    ],
)
def test_illegal_transition_raises(start, target):
    layout = pack_tensors([("w", (4,), torch.float32)], 1 << 20)[0]
    chunk = Chunk(0, "c", layout, Tier.DISK, state=start)
    with pytest.raises(StateError, match="illegal transition"):
        chunk.transition(target)
    assert chunk.state is start


def test_legal_path_disk_to_device_and_back():
    layout = pack_tensors([("w", (4,), torch.float32)], 1 << 20)[0]
    chunk = Chunk(0, "c", layout, Tier.DISK, state=S.ON_DISK)
    for nxt in (
        S.LOADING,
        S.ON_HOST,
        S.TO_DEVICE,
        S.ON_DEVICE,
        S.IN_USE,
        S.ON_DEVICE,
        S.TO_HOST,
        S.ON_HOST,
        S.WRITING,
        S.ON_HOST,
        S.ON_DISK,
    ):
        chunk.transition(nxt)
    assert chunk.state is S.ON_DISK


def test_packing_never_splits_a_tensor_and_aligns():
    entries = [(f"t{i}", (1000 + i,), torch.float32) for i in range(20)] + [
        ("big", (3_000_000,), torch.float16)
    ]
    layouts = pack_tensors(entries, chunk_size=16 * 4096, num_shards=3)
    names = [t.name for layout in layouts for t in layout.tensors]
    assert names == [e[0] for e in entries]  # order kept, nothing dropped
    for layout in layouts:
        assert layout.capacity % (ALIGN * 3) == 0
        assert layout.used <= layout.capacity
        ends = 0
        for spec in layout.tensors:
            assert spec.offset % TENSOR_ALIGN == 0 and spec.offset >= ends
            ends = spec.offset + spec.nbytes
        if len(layout.tensors) > 1:
            assert layout.used <= 16 * 4096
    big = next(lay for lay in layouts if lay.tensors[0].name == "big")
    assert len(big.tensors) == 1 and big.capacity >= 6_000_000  # oversized tensor gets a chunk of its own


def test_shards_split_evenly_and_aligned():
    (layout,) = pack_tensors([("w", (12345,), torch.bfloat16)], 1 << 20, num_shards=4)
    ranges = [layout.shard_range(r) for r in range(4)]
    assert ranges[0][0] == 0 and ranges[-1][1] == layout.capacity
    assert all(b - a == ranges[0][1] - ranges[0][0] and a % ALIGN == 0 for a, b in ranges)
    assert all(ranges[i][1] == ranges[i + 1][0] for i in range(3))
    with pytest.raises(ConfigError, match="num_shards=3"):
        layout.shard_range(0, 3)


def test_views_are_typed_windows_of_the_flat_buffer():
    (layout,) = pack_tensors(
        [("a", (3, 5), torch.float32), ("b", (7,), torch.int8), ("c", (2, 2), torch.bfloat16)], 1 << 20
    )
    chunk = Chunk(0, "c", layout, Tier.HOST)
    flat = torch.zeros(layout.capacity, dtype=torch.uint8)
    views = chunk.views(flat)
    views["a"].fill_(1.5)
    views["b"].fill_(-3)
    views["c"].fill_(2.0)
    again = chunk.views(flat)
    assert again["a"].dtype == torch.float32 and again["a"].shape == (3, 5) and torch.all(again["a"] == 1.5)
    assert torch.all(again["b"] == -3) and torch.all(again["c"] == 2.0)


def test_duplicate_names_rejected():
    with pytest.raises(ConfigError, match="twice"):
        pack_tensors([("w", (1,), torch.float32), ("w", (1,), torch.float32)], 4096)
