"""tiertune: fine-tune language models far larger than GPU memory on one workstation.

Importing tiertune does no CUDA work. The memory manager lives in ``tiertune.offload``.
"""

from tiertune.errors import (
    BudgetError,
    ConfigError,
    DataError,
    DiskFullError,
    IntegrityError,
    ModelError,
    StateError,
    StorageError,
    TiertuneError,
)

__version__ = "0.1.0"

__all__ = [
    "BudgetError",
    "ConfigError",
    "DataError",
    "DiskFullError",
    "IntegrityError",
    "ModelError",
    "StateError",
    "StorageError",
    "TiertuneError",
    "__version__",
]
