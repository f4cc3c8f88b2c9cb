"""The ranks of a launch and the collectives of ZeRO-3 over chunks, in 2 and 3 real processes (gloo, a
FileStore rendezvous, timeouts on every wait)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiertune.distributed.world import World, collective_timeout
from tiertune.errors import ConfigError

WORKER = Path(__file__).with_name("rank_worker.py")


def launch(
    tmp_path: Path, size: int, case: str, timeout: float = 90.0, collective_s: str = "60"
) -> list[dict]:
    """Start ``size`` ranks as torchrun would (its variables), wait for all; their JSON results by rank."""
    out = tmp_path / "out"
    out.mkdir()
    procs = []
    for rank in range(size):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(size),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(size),
            TT_STORE=str(tmp_path / "store"),
            TT_CASE=case,
            TT_OUT=str(out),
            TIERTUNE_COLLECTIVE_TIMEOUT=collective_s,
            OMP_NUM_THREADS="1",
        )
        procs.append(
            subprocess.Popen([sys.executable, str(WORKER)], env=env, stderr=subprocess.PIPE, text=True)
        )
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
    errors = [p.stderr.read()[-2000:] for p in procs]
    results = []
    for rank in range(size):
        path = out / f"rank-{rank}.json"
        results.append(
            json.loads(path.read_text()) if path.exists() else {"exit": codes[rank], "stderr": errors[rank]}
        )
    return results


@pytest.mark.parametrize("size", [2, 3])
def test_a_chunk_is_gathered_from_its_shards_and_a_gradient_scattered_into_them(tmp_path, size):
    results = launch(tmp_path, size, "chunks")
    for rank, r in enumerate(results):
        assert r.get("gathered_equal") and r["scattered_equal"], r
        assert r["norm"] == sum(range(1, size + 1))
        shard = r["capacity"] // size
        # ring algorithms: each rank sends (N - 1) shards for a gather and for a scatter
        assert r["wire"]["all_gather"] == (size - 1) * shard
        assert r["wire"]["reduce_scatter"] == (size - 1) * shard
        assert r["capacity"] % (4096 * size) == 0
        assert r["disk_dir"] == f"/nvme/offload/rank-{rank}"
        assert r["threads"] == max(1, (os.cpu_count() or 1) // size)


def test_a_rank_that_dies_stops_the_others_instead_of_hanging(tmp_path):
    results = launch(tmp_path, 2, "dies", timeout=60, collective_s="10")
    assert results[1]["exit"] == 3
    assert results[0]["error"] is not None and results[0]["seconds"] < 30, results[0]


def test_the_world_comes_from_the_launchers_variables():
    assert World.from_env({}) == World(0, 1, 0, 1)
    torchrun = World.from_env({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"})
    assert torchrun == World(5, 8, 1, 4) and not torchrun.is_main
    assert torchrun.threads(cores=16) == 4 and torchrun.threads(cores=2) == 1
    assert World.from_env({"RANK": "0", "WORLD_SIZE": "1"}).disk_dir("/x") == Path("/x")
    with pytest.raises(ConfigError, match="WORLD_SIZE"):
        World.from_env({"RANK": "2", "WORLD_SIZE": "2"})
    with pytest.raises(ConfigError, match="RANK='one'"):
        World.from_env({"RANK": "one", "WORLD_SIZE": "2"})


def test_the_collective_timeout_is_a_positive_number_of_seconds(monkeypatch):
    monkeypatch.setenv("TIERTUNE_COLLECTIVE_TIMEOUT", "12.5")
    assert collective_timeout().total_seconds() == 12.5
    monkeypatch.setenv("TIERTUNE_COLLECTIVE_TIMEOUT", "-1")
    with pytest.raises(ConfigError, match="> 0"):
        collective_timeout()
