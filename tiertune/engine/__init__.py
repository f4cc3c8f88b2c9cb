"""The streamed training engine, in parts (ARCHITECTURE.md has the picture):

- ``trainer``: ``StreamedTrainer`` wires the parts and runs a step (``EngineConfig`` says how);
- ``streaming``: the streamed decoder layer, its autograd function and the input stash;
- ``update``: the optimizer worker thread and the learning-rate schedule;
- ``router_aux``: an MoE router's auxiliary loss across streamed layers.
"""

from tiertune.engine.trainer import (
    FUSED_LOSS_ARCHITECTURES,
    EngineConfig,
    StreamedTrainer,
    gradient_entries,
    state_entries,
)

__all__ = ["FUSED_LOSS_ARCHITECTURES", "EngineConfig", "StreamedTrainer", "gradient_entries", "state_entries"]
