"""The streamed training engine, in parts (ARCHITECTURE.md has the picture):

- ``trainer``: ``StreamedTrainer`` wires the parts and runs a step;
- ``config``: ``EngineConfig``, what a run asks of the engine, validated;
- ``loss``: the causal-LM loss, fused with the head where the architecture allows;
- ``layout``: the training state each trained group registers (gradients, master weights, moments, twins);
- ``binding``: chunk tensors bound as the model instance's parameters;
- ``streaming``: the streamed decoder layer, its autograd function and the input stash;
- ``gradients``: backward's gradient hand-off (accumulation, norms, GaLore's projection);
- ``update``: the CPU optimizer with exact clipping, its worker thread, the step context, the LR schedule;
- ``router_aux``: an MoE router's auxiliary loss across streamed layers.
"""

from tiertune.engine.config import EngineConfig
from tiertune.engine.layout import gradient_entries, state_entries
from tiertune.engine.trainer import StreamedTrainer

__all__ = ["EngineConfig", "StreamedTrainer", "gradient_entries", "state_entries"]
