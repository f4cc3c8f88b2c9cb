"""How the distributed tests start processes: the environment (a timeout on every collective, one thread
each) and torchrun's command line (loopback rendezvous)."""

import os
import sys

TIMEOUT = 300


def launch_env() -> dict[str, str]:
    return dict(os.environ, TIERTUNE_COLLECTIVE_TIMEOUT="60", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def torchrun(ranks: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
