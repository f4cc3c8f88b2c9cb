"""tiertune: fine-tune language models far larger than GPU memory on one workstation.

    import tiertune
    result = tiertune.train("recipes/demo.yaml", ["training.max_steps=20"])

Importing tiertune does no CUDA work and loads neither torch nor transformers until they are used. The
memory manager lives in ``tiertune.offload``, the training engine in ``tiertune.engine``, the run around it in
``tiertune.finetune``.
"""

import logging
import warnings
from typing import Any

from tiertune.errors import (
    BudgetError,
    ConfigError,
    DataError,
    DiskFullError,
    IntegrityError,
    Interrupted,
    ModelError,
    NonFiniteError,
    StateError,
    StorageError,
    TiertuneError,
)

__version__ = "0.1.0"


class _NotTheUsersProblem(logging.Filter):
    """Drops what a dependency logs that a tiertune user can do nothing about: bitsandbytes' CPU backend, on CPUs
    with AVX-512 BF16, warns at import that it could not fetch an optional hub kernel (``kernels-community``),
    for every command, quantized model or not, and falls back to its own kernels."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "kernels-community" not in str(record.msg)


logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_NotTheUsersProblem())
# in a notebook without ipywidgets, the first import of tqdm.auto (by transformers, datasets or the hub client)
# warns "IProgress not found"; tiertune's own progress is plain lines there, and the user asked for no widget
warnings.filterwarnings("ignore", message="IProgress not found")

_LAZY = {
    "train": "tiertune.finetune.train",
    "TrainResult": "tiertune.finetune.train",
    "train_several": "tiertune.finetune.several",
    "AdapterResult": "tiertune.finetune.several",
    "load_recipe": "tiertune.config.recipe",
    "load_recipes": "tiertune.config.sweep",
    "estimate_adapters": "tiertune.estimates.adapters",
    "format_adapters": "tiertune.estimates.adapters",
    "Recipe": "tiertune.config.recipe",
    "estimate": "tiertune.estimates.report",
    "format_estimate": "tiertune.estimates.report",
    "ChunkStore": "tiertune.offload.store",
    "StoreConfig": "tiertune.offload.store",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tiertune' has no attribute {name!r}")


__all__ = [
    "BudgetError",
    "ConfigError",
    "DataError",
    "DiskFullError",
    "IntegrityError",
    "Interrupted",
    "ModelError",
    "NonFiniteError",
    "StateError",
    "StorageError",
    "TiertuneError",
    "__version__",
    "train",
    "TrainResult",
    "train_several",
    "AdapterResult",
    "load_recipe",
    "load_recipes",
    "estimate_adapters",
    "format_adapters",
    "Recipe",
    "estimate",
    "format_estimate",
    "ChunkStore",
    "StoreConfig",
]
