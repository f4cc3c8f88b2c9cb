"""What GRPO's sampling costs (``finetune.grpo`` over ``engine.generate``), for ``estimate``.

A generation decodes this process's completions of a step together (``per_device_train_batch_size x
gradient_accumulation_steps`` sequences; times the steps it feeds with ``steps_per_generation``, whose later
steps train on the sampling policy's log-probabilities: a pass of the layers a step's micro-batches, priced as
a decoding's steady pass with its FLOPs), at most ``max_completion_length`` passes over the weights (the first
the prompts' prefill), every ``num_iterations`` steps (times those it feeds). The bytes a pass moves are the
store's own, counted on a ledger (``engine.replay.replay_decoding``: each decoder layer's weights acquired once a pass for every sequence,
the groups outside the layers bound for the whole generation): the first pass's and a steady pass's, the
bytes per decoded token. The GPU is split between the store's device tier, the LoRA adapters, the KV cache
(transformers' ``DynamicCache``: keys and values of every layer, a sliding-window layer's up to its window, at
its longest: the prompt and the whole completion) and a pass's working memory (the prefill's activations, the
last token's logits); the update's activations are not held while it samples. The time, when rates are
measured: each pass the longer of its reads (the disk's rate, PCIe's on a GPU) and its FLOPs at the step's
compute rate (decoding's small products run slower than the step's: a lower bound); dequantizing a quantized
base each pass is not priced. A full fine-tune's KL term adds the reference's pass (``finetune.reference``: the
initial weights beside the policy, within half the budgets) over the generation's completions: its bytes the
ledger's, of a generation's pass after the first on the reference's own store (what its budgets keep stays), its
FLOPs a forward of every token."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tiertune.engine.generate import KV_SHARE, kv_bytes, pass_bytes
from tiertune.estimates.speed import StepFlops
from tiertune.units import format_size

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class GenerationEstimate:
    """A generation's figures (the module docstring); ``seconds`` None unless rates were measured."""

    sequences: int
    prompt_tokens: int
    completion_tokens: int
    num_iterations: int
    num_generations: int
    first_pass: dict[str, int]  # bytes by link: the prefill's pass (binding the groups outside the layers)
    steady_pass: dict[str, int]  # bytes by link: a later pass (one decoded token for every sequence)
    kv_per_sequence: int  # the KV cache of one sequence at its longest
    work_per_sequence: int  # a pass's working memory per sequence at its largest (the prefill's)
    held_beside: (
        int  # bytes held on what computes while sampling, besides those (the store's tiers, adapters)
    )
    has: int | None  # bytes of what computes (the GPU's memory, or this machine's RAM); None: not known
    on: str  # what computes, in words
    prefill_flops: float
    decode_flops: float  # all the passes after the prefill
    seconds: float | None = None
    parts: dict[str, float] = field(default_factory=dict)
    # a full fine-tune's reference beside the policy: the bytes its pass moves by link (empty: no such pass), and
    # its store's peak on what computes
    reference_pass: dict[str, int] = field(default_factory=dict)
    reference_flops: float = 0.0
    reference_peak: int = 0
    layers: int = 1  # the decoder's layers (a KV cache in host memory is on the GPU a layer at a time)
    # a generation that feeds several steps (``steps_per_generation``): how many, and the policy's frozen passes
    # over its completions (the sampling policy's log-probabilities, a pass a step's micro-batches) and their FLOPs
    spans: int = 1
    old_passes: int = 0
    old_flops: float = 0.0

    @property
    def passes(self) -> int:
        return self.completion_tokens

    @property
    def kv_bytes(self) -> int:
        return self.kv_per_sequence * self.sequences

    @property
    def working_bytes(self) -> int:
        return self.work_per_sequence * self.sequences

    @property
    def kv_on_host(self) -> bool:
        """Whether the run holds the KV cache in host memory (``engine.generate.kv_on_host``'s rule, the GPU's
        room being what the store and the adapters leave): on a GPU only."""
        if self.has is None or self.on != "the GPU":
            return False
        return self.kv_bytes + self.working_bytes > KV_SHARE * (self.has - self.held_beside)

    @property
    def kv_held(self) -> int:
        """The KV cache's bytes on what computes: all of it, or held in host memory two layers' (the one in use,
        the next prefetched)."""
        if not self.kv_on_host:
            return self.kv_bytes
        return min(self.kv_bytes, 2 * self.kv_bytes // max(1, self.layers))

    @property
    def kv_pass(self) -> dict[str, int]:
        """Bytes a decoded token's pass moves for a KV cache held in host memory (at a pass's average context):
        each layer's keys and values to the GPU for its visit and back after it (transformers' offloaded cache
        copies the whole layer each way)."""
        if not self.kv_on_host:
            return {}
        context = self.prompt_tokens + self.completion_tokens
        average = self.kv_bytes * (self.prompt_tokens + self.completion_tokens / 2) / context
        return {"host->device": int(average), "device->host": int(average)}

    @property
    def held(self) -> int:
        """Bytes held on what computes while sampling."""
        return self.held_beside + self.kv_held + self.working_bytes

    @property
    def fits(self) -> bool:
        return self.has is None or self.held <= self.has

    @property
    def largest_sequences(self) -> int | None:
        """The most sequences a generation of these lengths holds (a multiple of ``num_generations``)."""
        if self.has is None:
            return None
        each = self.kv_per_sequence + self.work_per_sequence
        room = max(0, self.has - self.held_beside)
        most = room // each if each else self.sequences
        return int(most // self.num_generations * self.num_generations)

    @property
    def bytes_per_token(self) -> int:
        """Bytes a decoded token moves from the disk and the host (a steady pass), for every sequence at once."""
        moved = {**self.steady_pass}
        moved["host->device"] = moved.get("host->device", 0) + self.kv_pass.get("host->device", 0)
        return sum(n for link, n in moved.items() if link in ("disk->host", "host->device"))

    @property
    def read_bytes(self) -> dict[str, int]:
        """Bytes a whole generation moves, by link."""
        links = set(self.first_pass) | set(self.steady_pass) | set(self.reference_pass)
        later = self.passes - 1 + self.old_passes  # (a frozen pass of the layers reads as a decoding's)
        return {
            k: self.first_pass.get(k, 0) + later * self.steady_pass.get(k, 0) + self.reference_pass.get(k, 0)
            for k in sorted(links)
        }

    @property
    def per_step_seconds(self) -> float | None:
        return None if self.seconds is None else self.seconds / (self.num_iterations * self.spans)

    def as_json(self) -> dict[str, Any]:
        return {
            "sequences": self.sequences,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "passes": self.passes,
            "num_iterations": self.num_iterations,
            "steps_a_generation": self.spans,
            "old_policy_passes": self.old_passes,
            "first_pass_bytes": self.first_pass,
            "steady_pass_bytes": self.steady_pass,
            "bytes_per_decoded_token": self.bytes_per_token,
            "generation_bytes": self.read_bytes,
            "kv_cache_bytes": self.kv_bytes,
            "kv_cache_on_host": self.kv_on_host,
            "kv_cache_pass_bytes": self.kv_pass,
            "working_bytes": self.working_bytes,
            "held_beside": self.held_beside,
            "held": self.held,
            "has": self.has,
            "fits": self.fits,
            "largest_sequences": self.largest_sequences,
            "flops": self.prefill_flops + self.decode_flops,
            "seconds": self.seconds,
            "seconds_per_step": self.per_step_seconds,
            "parts_s": self.parts,
            "reference_pass_bytes": self.reference_pass,
            "reference_flops": self.reference_flops,
            "reference_peak_bytes": self.reference_peak,
        }


def generation_estimate(
    recipe: Any,
    config: Any,
    flops: StepFlops,
    moved: list[dict[str, int]],
    held_beside: int,
    has: int | None,
    on: str,
    reference_pass: dict[str, int] | None = None,
    reference_peak: int = 0,
) -> GenerationEstimate:
    """A generation of ``recipe``'s GRPO step: ``config`` the decoder's, ``flops`` the step's (its weights a
    token and attention per token), ``moved`` the ledger's passes (``replay_decoding``), ``held_beside`` what
    computes holds beside the generation's own bytes, ``has`` its size; ``reference_pass``: the bytes a full
    fine-tune's reference moves scoring the generation (None: no reference beside it), ``reference_peak`` its
    store's peak on what computes."""
    from tiertune.finetune.grpo import steps_a_generation

    o, t, d = recipe.objective, recipe.training, recipe.data
    spans = steps_a_generation(recipe, 1)  # (one process's: its completions of a generation)
    sequences = t.per_device_train_batch_size * t.gradient_accumulation_steps * spans
    prompt = d.max_seq_len - o.max_completion_length
    completion = o.max_completion_length
    dtype = DTYPE_BYTES.get(recipe.model.dtype, 2)
    kv = kv_bytes(config, prompt + completion, dtype)
    work = pass_bytes(config, prompt, dtype)
    per_context = flops.attention_per_token / max(1, 2 * d.max_seq_len)  # 4 x context x this: a token's
    weights, head = 2 * flops.layer_weights, 2 * flops.head_weights
    prefill = sequences * (prompt * (weights + 4 * (prompt / 2) * per_context) + head)
    middle = prompt + completion / 2  # a decoded token's context, on average
    decode = (completion - 1) * sequences * (weights + 4 * middle * per_context + head)
    tokens = prompt + completion  # the reference's forward: every token of every completion's row
    scored = sequences * (tokens * (weights + 4 * (tokens / 2) * per_context) + tokens * head)
    est = GenerationEstimate(
        sequences,
        prompt,
        completion,
        o.num_iterations,
        o.num_generations,
        moved[0] if moved else {},
        moved[-1] if moved else {},
        kv,
        work,
        held_beside,
        has,
        on,
        prefill,
        decode,
        layers=config.num_hidden_layers,
        spans=spans,
        old_passes=spans if spans > 1 else 0,
        old_flops=scored if spans > 1 else 0.0,
    )
    if reference_pass is not None:
        est.reference_pass, est.reference_flops, est.reference_peak = (
            dict(reference_pass),
            scored,
            reference_peak,
        )
    return est


def time_generation(
    est: GenerationEstimate, bandwidth: dict[str, float], compute_rate: float | None, gpu: bool
) -> None:
    """Fill in ``est.seconds`` and its parts from the measured (or stated) rates: each pass the longest of its
    disk reads, its PCIe copies (on a GPU) and its compute, the passes one after another."""
    if not compute_rate or "disk_read" not in bandwidth:
        return
    pcie = bandwidth.get("host_to_device") if gpu else None

    def seconds(moved: dict[str, int], flops: float) -> dict[str, float]:
        parts = {"disk": moved.get("disk->host", 0) / bandwidth["disk_read"], "compute": flops / compute_rate}
        if pcie:
            parts["host->device"] = moved.get("host->device", 0) / pcie
        return parts

    first = seconds(est.first_pass, est.prefill_flops)
    steady = {k: n + est.kv_pass.get(k, 0) for k, n in {**est.kv_pass, **est.steady_pass}.items()}
    later = seconds(steady, est.decode_flops / max(1, est.passes - 1))
    reference = seconds(est.reference_pass, est.reference_flops) if est.reference_flops else {}
    old = seconds(est.steady_pass, est.old_flops / est.old_passes) if est.old_passes else {}
    passes = est.passes - 1
    est.parts = {
        k: first[k] + passes * later[k] + reference.get(k, 0.0) + est.old_passes * old.get(k, 0.0)
        for k in first
    }
    est.seconds = (
        max(first.values())
        + passes * max(later.values())
        + max(reference.values(), default=0.0)
        + est.old_passes * max(old.values(), default=0.0)
    )


def format_generation(est: GenerationEstimate) -> list[str]:
    """The generation's lines in ``estimate``'s report."""
    links = ", ".join(f"{k} {format_size(n)}" for k, n in est.steady_pass.items()) or "nothing (all resident)"
    total = ", ".join(f"{k} {format_size(n)}" for k, n in est.read_bytes.items()) or "nothing"
    ok = "yes" if est.fits else "NO"
    lines = [
        f"grpo generation: {est.sequences} completions together, prompts up to {est.prompt_tokens} tokens, up to "
        f"{est.completion_tokens} passes of the weights (one a decoded token, for all of them) every "
        f"{est.num_iterations * est.spans} step(s)",
        f"  a decoded token moves {links} ({format_size(est.bytes_per_token)} from the disk and the host: "
        f"{format_size(est.bytes_per_token / max(1, est.sequences))} a sequence); a generation {total}",
        f"  while sampling, {est.on} holds {format_size(est.held)}"
        + (f" of {format_size(est.has)}" if est.has is not None else "")
        + f": the store's tiers and the adapters {format_size(est.held_beside)}, the KV cache "
        f"{format_size(est.kv_held)} ({format_size(est.kv_per_sequence)} a sequence of "
        f"{est.prompt_tokens + est.completion_tokens} tokens), a pass's working memory "
        f"{format_size(est.working_bytes)} (the update's activations are not held then)  {ok}",
    ]
    if est.kv_on_host:
        lines.append(
            f"  the KV cache ({format_size(est.kv_bytes)}) does not fit beside the store: held in host memory "
            f"(transformers' offloaded cache), a layer's on the GPU for its visit; a decoded token copies "
            f"{format_size(est.kv_pass['host->device'])} of it to the GPU and back"
        )
    if est.old_passes:
        lines.append(
            f"  a generation feeds {est.spans} steps: the sampling policy's log-probabilities of its completions "
            f"in {est.old_passes} more passes of the layers, no autograd ({est.old_flops:.3g} FLOPs)"
        )
    if est.reference_flops:
        moved = ", ".join(f"{k} {format_size(n)}" for k, n in est.reference_pass.items()) or "nothing"
        lines.append(
            f"  the reference (the initial weights beside the policy, each within half the budgets) scores the "
            f"generation's completions in one pass: moves {moved}, {est.reference_flops:.3g} FLOPs; its store "
            f"holds {format_size(est.reference_peak)} on {est.on} at most"
        )
    largest = est.largest_sequences
    if largest is not None and not est.kv_on_host and (not est.fits or largest < 4 * est.sequences):
        lines.append(
            f"  at most {largest} completions a generation fit these lengths (num_generations multiples)"
        )
    if est.seconds is not None:
        parts = ", ".join(f"{k} {v:.3g} s" for k, v in est.parts.items())
        bound = max(est.parts, key=est.parts.__getitem__)
        lines.append(
            f"  a generation takes >= {est.seconds:.3g} s ({parts}; {bound}-bound; dequantization not priced), "
            f"{est.per_step_seconds:.3g} s a step"
        )
    return lines


__all__ = ["GenerationEstimate", "format_generation", "generation_estimate", "time_generation"]
