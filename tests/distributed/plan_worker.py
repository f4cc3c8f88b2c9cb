"""One rank of ``tiertune train`` launched by torchrun, watched: whether it loaded the model (built its
trainer), what its store had in use at once by size class and what its plan reserved (``engine.memory``), and
the BudgetError it raised, if any. Writes ``rank-<r>.json`` into ``TT_OUT``; the recipe is ``argv[1]``."""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the watch, shared with test_plan.py
import watching

from tiertune.distributed.world import World
from tiertune.errors import BudgetError
from tiertune.finetune import train as train_module


def main() -> None:
    seen = watching.watch(setattr)
    seen["refused"] = None
    world = World.from_env()
    try:
        result = train_module.train(sys.argv[1], progress=False)
        seen["steps"] = len(result.losses)
    except BudgetError as exc:
        seen["refused"] = str(exc)
    Path(os.environ["TT_OUT"], f"rank-{world.rank}.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main()
