"""The heterogeneous memory manager: chunks, tiers (device, host, disk), async I/O, scheduling, budgets."""

from tiertune.offload.aio import AsyncIO, IOHandle
from tiertune.offload.chunk import ALIGN, Chunk, ChunkLayout, ChunkState, TensorSpec, pack_tensors
from tiertune.offload.disk import DiskTier, clean_stale, supports_o_direct
from tiertune.offload.schedule import Scheduler
from tiertune.offload.store import ChunkStore, StoreConfig, StoreStats, TierStats
from tiertune.offload.tiers import Arena, MemoryTier, Tier

__all__ = [
    "ALIGN",
    "Arena",
    "AsyncIO",
    "Chunk",
    "ChunkLayout",
    "ChunkState",
    "ChunkStore",
    "DiskTier",
    "IOHandle",
    "MemoryTier",
    "Scheduler",
    "StoreConfig",
    "StoreStats",
    "TensorSpec",
    "Tier",
    "TierStats",
    "clean_stale",
    "pack_tensors",
    "supports_o_direct",
]
