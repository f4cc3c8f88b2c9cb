"""Batched decoding over a streamed model (``StreamedTrainer.generate``): every prompt advances one token per pass
over the decoder layers, each layer's weights acquired once a pass for the whole batch (read at most once per
decoded token, however many sequences; the passes are scheduled as a repeating pass, ``decoding_passes``: what the
budgets can keep between passes stays, the layers the next pass needs soonest), its keys and values kept in
transformers' ``DynamicCache`` on the device, or in host memory where the device is short (``kv_on_host``).

Prompts are left-padded, positions counted from each row's first token (as transformers' ``generate`` does), so
greedy decoding (``temperature`` 0) picks the tokens ``generate(do_sample=False)`` picks. Sampling applies the
temperature, then top-k, then top-p (transformers' warpers, in its order) and draws from a generator seeded by
``seed``: the same seed, the same completions; with a seed for each prompt, each row draws from its own generator,
so its completion does not depend on the rows decoded beside it (GRPO's: the same completions whatever the
processes a launch splits a generation over). A row stops at the EOS token (then pads); decoding stops when every
row has, or after ``max_new_tokens``. LoRA adapters are applied as in training (never merged into a quantized
base). The model's attention runs transformers' ``sdpa`` while decoding (tiertune's segment attention is for a
step's whole sequences, not a query against its cache)."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import torch

from tiertune.errors import ConfigError
from tiertune.kernels.ops.attention import NAME as SEGMENTS

log = logging.getLogger("tiertune.engine")


def pick(
    logits: torch.Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    generator: torch.Generator | Sequence[torch.Generator] | None,
) -> torch.Tensor:
    """The next token of each row from its last position's ``logits`` ([rows, vocabulary], fp32): the largest
    at ``temperature`` 0, else a draw from the softmax of the logits over ``temperature`` kept to the ``top_k``
    largest (0: all) and to the smallest set whose probability reaches ``top_p`` (1: all); from ``generator``,
    or a sequence of them, one a row."""
    if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
        raise ConfigError(
            f"temperature must be >= 0, top_p in (0, 1] and top_k >= 0; got {temperature}, {top_p}, {top_k}"
        )
    if temperature == 0:
        return logits.argmax(-1)
    scores = logits / temperature
    if top_k:
        kth = torch.topk(scores, min(top_k, scores.shape[-1])).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1:
        ordered, order = scores.sort(descending=False)
        cumulative = ordered.softmax(-1).cumsum(-1)
        drop = cumulative <= 1 - top_p
        drop[:, -1] = False  # the most likely token always stays
        scores = scores.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    probs = scores.softmax(-1)
    if generator is None or isinstance(generator, torch.Generator):
        return torch.multinomial(probs, 1, generator=generator).squeeze(1)
    return torch.cat([torch.multinomial(p, 1, generator=g) for p, g in zip(probs, generator, strict=True)])


KV_SHARE = 0.9
"""Of the GPU memory free when a decoding starts, the share its KV cache (at its longest) and a pass's working
memory may take there; beyond it the cache is held in host memory (``kv_on_host``)."""


def kv_bytes(config: Any, context: int, dtype_bytes: int) -> int:
    """Bytes of one sequence's keys and values in transformers' ``DynamicCache`` at ``context`` tokens: each
    attention layer's (a sliding-window layer's up to its window; multi-head latent attention's as its
    attention expands them; layers without attention none)."""
    layers = config.num_hidden_layers
    heads = getattr(config, "num_attention_heads", 0) or 0
    if not heads:
        return 0
    if getattr(config, "kv_lora_rank", None):  # DeepSeek's MLA: the expanded keys and values are cached
        nope = getattr(config, "qk_nope_head_dim", 0) or 0
        rope = getattr(config, "qk_rope_head_dim", 0) or 0
        width = heads * (nope + rope) + heads * (getattr(config, "v_head_dim", 0) or 0)
    else:
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        width = 2 * kv_heads * head_dim
    types = list(getattr(config, "layer_types", None) or ["full_attention"] * layers)[:layers]
    window = getattr(config, "sliding_window", None) or context
    tokens = 0
    for kind in types:
        if kind in ("sliding_attention", "chunked_attention"):
            tokens += min(context, window)
        elif "attention" in kind:
            tokens += context
    return tokens * width * dtype_bytes


def pass_bytes(config: Any, prompt: int, dtype_bytes: int) -> int:
    """A decoding pass's working memory for one sequence at its largest, the prefill of ``prompt`` tokens: a
    layer's activations (its inputs, attention and MLP temporaries) and the last token's fp32 logits."""
    hidden = config.hidden_size
    inner = getattr(config, "intermediate_size", None) or 4 * hidden
    return prompt * (4 * hidden + 3 * inner) * dtype_bytes + config.vocab_size * 4


def kv_on_host(
    device: torch.device, config: Any, rows: int, prompt: int, new_tokens: int, dtype_bytes: int
) -> bool:
    """Whether a decoding of ``rows`` sequences holds its KV cache in host memory (transformers' offloaded
    ``DynamicCache``: each layer's keys and values back on the GPU for its visit, prefetched a layer ahead): on a
    CUDA device, where the cache at its longest and a pass's working memory would take more than ``KV_SHARE`` of
    what the device has free now (under a per-process cap too: what the store and the run hold is allocated)."""
    if device.type != "cuda":
        return False
    need = rows * (
        kv_bytes(config, prompt + new_tokens, dtype_bytes) + pass_bytes(config, prompt, dtype_bytes)
    )
    free, total = torch.cuda.mem_get_info(device)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda _: 1.0)(device)
    allocated = torch.cuda.memory_allocated(device)
    unused = torch.cuda.memory_reserved(device) - allocated  # the caching allocator's, free to take
    return need > KV_SHARE * min(free + unused, int(total * fraction) - allocated)


@contextmanager
def decoding(model: torch.nn.Module) -> Iterator[None]:
    """The model's attention as transformers' ``sdpa`` for the block where it runs tiertune's segment
    attention (a query of one token attends to its row's cached keys, with their padding mask)."""
    config = model.config.get_text_config(decoder=True)
    was = getattr(config, "_attn_implementation", None)
    if was == SEGMENTS:
        config._attn_implementation = "sdpa"
    try:
        yield
    finally:
        if was == SEGMENTS:
            config._attn_implementation = was


def generate(
    trainer: Any,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | Sequence[int] = 0,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int = 0,
) -> list[list[int]]:
    """Each prompt's completion (its new tokens, up to and including the EOS token where one was drawn), decoded
    by ``trainer``'s model with its weights as they are (see the module docstring; ``seed``: one for the batch,
    or one a prompt)."""
    from transformers import DynamicCache

    if not prompts or any(len(p) == 0 for p in prompts):
        raise ConfigError("generation needs at least one prompt, each of at least one token")
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if trainer.compute.ledger:
        ledger_decoding(trainer, max_new_tokens)
        return [[0] * max_new_tokens for _ in prompts]
    stops = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
    device, model = trainer.device, trainer.model
    rows, longest = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((rows, longest), pad_token_id, dtype=torch.long)
    mask = torch.zeros((rows, longest), dtype=torch.long)
    for r, prompt in enumerate(prompts):  # left-padded, as generate pads a decoder-only model's batch
        ids[r, longest - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
        mask[r, longest - len(prompt) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    if isinstance(seed, int):
        generator: torch.Generator | list[torch.Generator] | None = torch.Generator().manual_seed(seed)
    else:
        if len(seed) != rows:
            raise ConfigError(f"{len(seed)} seeds for {rows} prompts: give one seed, or one a prompt")
        generator = [torch.Generator().manual_seed(int(s)) for s in seed]
    if temperature == 0:
        generator = None
    out: list[list[int]] = [[] for _ in range(rows)]
    done = torch.zeros(rows, dtype=torch.bool)
    with ExitStack() as stack, torch.no_grad():
        stack.enter_context(decoding(model))
        was_training = model.training
        model.eval()  # no dropout
        stack.callback(model.train, was_training)
        end_pass = stack.enter_context(decoding_passes(trainer))
        text = model.config.get_text_config(decoder=True)
        offload = kv_on_host(device, text, rows, longest, max_new_tokens, trainer.config.dtype.itemsize)
        if offload:
            log.info(
                "generation: the KV cache of %d sequences is held in host memory (the GPU is short)", rows
            )
        cache = DynamicCache(config=model.config, offloading=offload)
        # transformers 5.2x names it ``cache``; earlier releases (and some architectures) ``past_key_values``
        name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        step_ids = ids
        for _ in range(max_new_tokens):
            if trainer.safe_point is not None:
                trainer.safe_point()
            logits = model(
                input_ids=step_ids,
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                **{name: cache},
                logits_to_keep=1,
            ).logits[:, -1]
            chosen = pick(logits.float().cpu(), temperature, top_k, top_p, generator)
            chosen = torch.where(done, torch.full_like(chosen, pad_token_id), chosen)
            for r in range(rows):
                if not done[r]:
                    out[r].append(int(chosen[r]))
            done |= torch.tensor([int(c) in stops for c in chosen.tolist()], dtype=torch.bool)
            end_pass()
            if bool(done.all()):
                break
            step_ids = chosen[:, None].to(device)
            mask = torch.cat([mask, torch.ones((rows, 1), dtype=mask.dtype, device=device)], dim=1)
            positions = positions[:, -1:] + 1
    return out


@contextmanager
def decoding_passes(trainer: Any) -> Iterator[Callable[[], None]]:
    """A decoding's weight accesses (``generate``'s, and the estimate's ``ledger_decoding``): the groups outside
    the decoder layers (embeddings, final norm, head) bound for the whole decoding, out of the scheduler's
    trace; the layers' accesses scheduled as a repeating pass (``ChunkStore.repeating``: the first pass recorded
    and the next ones replayed, so that eviction keeps cached what the next pass needs soonest, a part of the
    layers where the tiers cannot hold them all, and the next layers are prefetched). Yields the call that ends
    a pass; on exit the training steps' trace is back."""
    others = [s for s in trainer.states if s.group.kind != "layer"]
    with ExitStack() as stack:
        trainer.step_ctx.traced = False
        stack.callback(setattr, trainer.step_ctx, "traced", True)
        for state in others:
            stack.enter_context(trainer.bound_group(state, requires_grad=False))
        stack.enter_context(trainer.store.repeating())
        trainer.step_ctx.traced = True
        yield trainer.store.mark_step


def ledger_decoding(trainer: Any, passes: int) -> list[dict[str, int]]:
    """A decoding's weight accesses on a ledger store (``estimate``'s: no arithmetic), as ``generate`` makes
    them (``decoding_passes``): each layer's weights acquired once a pass, ``passes`` passes (no row stops
    early). Returns the bytes each pass moved, by link."""
    layers = sum(1 for s in trainer.states if s.group.kind == "layer")
    start = dict(
        trainer.store_stats().bytes_moved
    )  # the first pass's bytes bind the groups outside the layers
    with decoding_passes(trainer) as end_pass:

        def one_pass() -> None:
            for index in range(layers):
                with trainer.layer_weights(index, requires_grad=False):
                    pass
            end_pass()

        return moved_by_pass(trainer, passes, one_pass, start)


def moved_by_pass(
    trainer: Any, passes: int, one_pass: Callable[[], Any], since: dict[str, int] | None = None
) -> list[dict[str, int]]:
    """Run ``one_pass`` ``passes`` times; the bytes ``trainer``'s store moved in each, by link (the first's
    counted from ``since``, the store's counters taken earlier, where given)."""
    moved: list[dict[str, int]] = []
    before = dict(trainer.store_stats().bytes_moved) if since is None else since
    for _ in range(passes):
        one_pass()
        now = dict(trainer.store_stats().bytes_moved)
        moved.append({k: n - before.get(k, 0) for k, n in now.items() if n - before.get(k, 0)})
        before = now
    return moved


__all__ = [
    "decoding",
    "generate",
    "kv_bytes",
    "kv_on_host",
    "ledger_decoding",
    "moved_by_pass",
    "pass_bytes",
    "pick",
]
