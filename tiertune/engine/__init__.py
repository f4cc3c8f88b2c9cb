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

How a step runs (all on the caller's thread unless said otherwise):

- Forward: the model's own ``forward`` runs unchanged. Each decoder layer of the *instance* is replaced
  by a ``StreamedLayer`` that, through ``LayerFunction``, acquires the layer's chunk (prefetched from
  the second step on), binds its tensors as the layer's parameters, computes without keeping activations,
  releases the chunk and saves only the layer's input. Embeddings, final norm and a separate head are
  bound for the whole micro-batch.
- Loss: summed cross-entropy over the micro-batch's target tokens, divided by the number of target tokens
  in the whole step (all micro-batches), so the accumulated gradient is the token-weighted mean. An MoE
  whose config asks for it (``output_router_logits``) adds the router's auxiliary loss as transformers
  defines it (``RouterAux``; ``router_aux`` says whether the loss has it, ``last_router_aux_loss`` its part).
- Backward: layer by layer in reverse, each acquires its chunk again, recomputes its forward with the
  saved input (RNG state restored, so dropout matches), back-propagates, and adds its parameter
  gradients into fp32 gradient chunks on the host.
- Optimizer: a worker thread runs AdamW (torch's fused CPU kernel) one weight chunk at a time, while the
  compute thread goes on. During the last micro-batch's backward, each layer is handed to the worker as
  soon as its gradients are final, so the optimizer runs behind backward; the worker prefetches the next
  layers' master weights and moments from disk meanwhile and writes the new compute-dtype weights home.
- Clipping stays exact. The global norm is known only after the last gradient, so the overlapped step is
  *speculative*: it uses coefficient 1 and writes into twin chunks of the master weights and moments,
  leaving the originals intact. After backward the exact coefficient ``clamp(max_norm / (norm + 1e-6),
  max=1)`` is computed as ``clip_grad_norm_`` does. If it is 1 (no clipping) the speculative result is
  bit-for-bit the real one and the twins are exchanged in (``ChunkStore.exchange``: no bytes copied);
  otherwise the step is redone from the originals with the real coefficient. After a clipped step the
  next one is likely clipped too, so it waits for the norm instead of speculating. Without clipping the
  update is always exact and runs in place, with no twins. ``overlap_optimizer`` (auto/on/off) chooses;
  auto overlaps when the twins (12 bytes per parameter) fit the budgets. A layer's gradients are dropped
  once its update has used them; the compute thread waits when the worker falls two units behind, and
  without clipping and gradient accumulation (updates in place) it waits for the worker to finish before
  it makes the next layer's gradients on the host, which then holds one layer's gradients at a time.
- GaLore (``method: galore``) is the same machinery with another update (``methods.optim``): the
  moments of the decoder layers' linear weights are low-rank. Their gradients are projected where backward
  makes them, on the compute device: on the last micro-batch each one's full gradient (summed with the
  earlier micro-batches' in a host accumulator) has its norm taken, at a refreshing step its SVD computed
  and written into the projection chunk (acquired on the device, along the trace), and only the low-rank
  gradient (m/r times smaller) goes to the host for the CPU optimizer, which reads the projection to map
  its update back (the projection is read there, not rewritten: it is not twinned).

Numerics match a plain PyTorch loop: ``torch.optim.AdamW`` (or bitsandbytes' AdamW8bit, or galore-torch's
GaLoreAdamW) with weight decay on tensors of two or more dimensions, ``clip_grad_norm_`` and the same
transformers LR scheduler.
"""

from tiertune.engine.config import EngineConfig
from tiertune.engine.layout import gradient_entries, state_entries
from tiertune.engine.trainer import StreamedTrainer

__all__ = ["EngineConfig", "StreamedTrainer", "gradient_entries", "state_entries"]
