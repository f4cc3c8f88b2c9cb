"""What a launch of several processes leaves for the next one: the slot files of ranks that are no longer
there are swept (a live run's, locked, never)."""

import fcntl
import os

from tiertune.distributed.world import World
from tiertune.finetune.ranks import sweep_other_ranks
from tiertune.finetune.train import train
from tiertune.offload.disk import PREFIX, SUFFIX


def _slot_file(directory, name="0123456789abcdef"):
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{PREFIX}{name}{SUFFIX}"
    path.write_bytes(b"\0" * 4096)
    return path


def test_a_run_on_fewer_processes_removes_the_slot_files_of_the_ranks_gone(tmp_path, cat_model, write_recipe):
    """A 3-rank run killed left a slot file in each rank's directory (a rank's whole disk-tier share for a real
    model); resumed on one process, rank-1/ and rank-2/ were never cleaned (issue 26). A run now removes the
    unlocked ones, and an emptied rank-r/ directory; a locked one (a live run sharing the disk path) stays."""
    disk = tmp_path / "nvme"
    dead = [_slot_file(disk / f"rank-{r}") for r in range(3)]
    live = _slot_file(disk / "rank-2", "fedcba9876543210")
    fd = os.open(live, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        recipe = write_recipe(
            tmp_path, cat_model(2), training={"max_steps": 1, "save_steps": 0}, offload={"params": "disk"}
        )
        train(recipe, progress=False)
        assert not any(p.exists() for p in dead)
        assert live.exists()
        assert sorted(p.name for p in disk.iterdir() if p.name.startswith("rank-")) == ["rank-2"]
    finally:
        os.close(fd)


def test_the_ranks_of_this_launch_are_never_swept(tmp_path):
    """Of 2 ranks, rank 0 sweeps what one process left in the disk path itself, and rank-2/ and beyond, never
    rank-0/ or rank-1/ (this launch's ranks, whose stores may still be opening)."""
    kept = [_slot_file(tmp_path / "rank-0"), _slot_file(tmp_path / "rank-1")]
    gone = [_slot_file(tmp_path), _slot_file(tmp_path / "rank-2"), _slot_file(tmp_path / "rank-7")]
    (tmp_path / "rank-x").mkdir()  # not a rank's directory
    removed = sweep_other_ranks(tmp_path, World(rank=0, size=2, local_rank=0, local_size=2))
    assert sorted(removed) == sorted(gone)
    assert all(p.exists() for p in kept) and (tmp_path / "rank-x").is_dir()
    assert not (tmp_path / "rank-2").exists() and not (tmp_path / "rank-7").exists()
