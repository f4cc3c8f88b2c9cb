"""The streamed training engine, in parts (ARCHITECTURE.md has the picture):

- ``trainer``: ``StreamedTrainer`` wires the parts and runs a step;
- ``config``: ``EngineConfig``, what a run asks of the engine, validated;
- ``loss``: the causal-LM loss, fused with the head where the architecture allows;
- ``layout``: the training state each trained group registers (gradients, master weights, moments, twins);
- ``binding``: chunk tensors bound as the model instance's parameters;
- ``streaming``: the streamed decoder layer and the visits that tell it what to do inside a step;
- ``schedule``: the layer-major step (waves of micro-batches, each layer visited once per wave) and its stash;
- ``gradients``: backward's gradient hand-off (accumulation, norms, GaLore's projection);
- ``update``: the CPU optimizer with exact clipping, its worker thread, the step context, the LR schedule;
- ``router_aux``: an MoE router's auxiliary loss across streamed layers;
- ``compute``: the one seam between what a step holds and what it computes: real, or a ledger (no
  arithmetic) over which ``replay`` runs the same step for ``tiertune estimate``.

How a step runs (all on the caller's thread unless said otherwise; ``schedule`` has the details):

- Waves: the step's k micro-batches run as waves of m (all k when the hidden states at the layer boundaries
  of k fit the budgets, ``offload.activations``; the plan chooses m). Within a wave every decoder layer is
  visited once in forward and once in backward for all m micro-batches, so the weights cross disk and PCIe
  k/m times a step, not k times. The model's own ``forward`` still computes everything around the layers:
  each decoder layer of the *instance* is replaced by a ``StreamedLayer``, and the decoder is called in a
  *visit* that records each layer's call (the masks and rotary tables the model computed) and the embeddings'
  output, without running the layers.
- Forward: layer i's chunk is acquired (prefetched from the second step on) and bound as the layer's
  parameters; each micro-batch's hidden states at boundary i run through it without keeping activations into
  boundary i + 1; the boundaries are the stash (device tensors, or host chunks with a slot per micro-batch,
  sent down while the next layer computes). Embeddings, final norm and a separate head are bound for the
  whole wave.
- Loss: per micro-batch the decoder is called again, the last layer handing back its output from the stash:
  summed cross-entropy over the micro-batch's target tokens (fused with the head), divided by the number of
  target tokens in the whole step, so the accumulated gradient is the token-weighted mean. An MoE whose config
  asks for it (``output_router_logits``) adds the router's auxiliary loss as transformers defines it
  (``RouterAux``, per micro-batch).
- Backward: layer by layer in reverse, each acquires its chunk again and, for every micro-batch, recomputes its
  forward from the stashed input (that micro-batch's random stream restored, so dropout matches) and
  back-propagates; the weight gradients are summed over the wave on the device in fp32 and added into fp32
  gradient chunks on the host once per wave. The embeddings are recomputed and back-propagated last.
- Optimizer: a worker thread runs AdamW (torch's fused CPU kernel) one weight chunk at a time, while the
  compute thread goes on. During the last wave's backward, each layer is handed to the worker as
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
  without clipping and with one wave a step (updates in place) it waits for the worker to finish before
  it makes the next layer's gradients on the host, which then holds one layer's gradients at a time.
- GaLore (``method: galore``) is the same machinery with another update (``methods.optim``): the
  moments of the decoder layers' linear weights are low-rank. Their gradients are projected where backward
  makes them, on the compute device: on the last wave each one's full gradient (summed with the earlier
  waves' in a host accumulator) has its norm taken, at a refreshing step its SVD computed
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
