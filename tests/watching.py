"""Watching a run of ``finetune.train.train`` from inside its process: whether it loaded the model (built its
trainer), and each chunk store's in-use peaks and plan reserve when it closed; and the check that no store had
more chunks of a size class in use on a tier than its plan reserved slots for. Used in-process by
``tests/finetune/test_plan.py`` and in each rank by ``tests/distributed/plan_worker.py``."""

from collections.abc import Callable

from tiertune.finetune import train as train_module
from tiertune.offload import store as store_module


def watch(patch: Callable[[object, str, object], None]) -> dict:
    """Install the watch with ``patch(owner, name, value)`` (``monkeypatch.setattr``, or ``setattr`` in a
    process of its own); returns what it sees: ``loaded`` and ``stores`` (``{"peaks", "reserve"}`` each)."""
    seen: dict = {"loaded": False, "stores": []}
    built = train_module.StreamedTrainer

    def trainer(*args, **kwargs):
        seen["loaded"] = True
        return built(*args, **kwargs)

    close = store_module.ChunkStore.close

    def closing(self):
        if not self._closed and not self.ledger:  # a run's store (not the admission's build on a ledger)
            seen["stores"].append({"peaks": self.in_use_peaks(), "reserve": self.config.reserve})
        close(self)

    patch(train_module, "StreamedTrainer", trainer)
    patch(store_module.ChunkStore, "close", closing)
    return seen


def check_in_use(seen: dict) -> None:
    """Every store kept, per tier and size class, no more chunks in use at once than its plan reserved."""
    assert seen["stores"]
    for store in seen["stores"]:
        for tier, by_class in store["peaks"].items():
            slots = (store["reserve"] or {}).get(tier, {})
            for size, n in by_class.items():
                assert n <= slots.get(size, 0), (tier, size, n, slots)
