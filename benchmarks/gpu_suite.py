"""Everything a lent GPU machine is for, in at most three commands: the GPU tests, the fused kernels against
torch eager and Liger-Kernel, QLoRA of a Llama-3-70B-shaped base under a 24 GiB GPU cap against peft +
bitsandbytes, and full fine-tuning of a Llama-2-7B-shaped model under the same cap against PyTorch FSDP2 with
CPU offload. Prints one JSON object per result on stdout (progress goes to stderr); ``KEYS`` lists each
result's keys, which ``--dry-run`` prints too.

On the device machine (no network there; the wheels come from ``bash benchmarks/gpu_wheels.sh`` run here
first), three calls of the device tool, each with ``carry: [".whl"]`` and ``timeout_s: 600``; each command
stays inside its ``--budget-s`` (what does not fit is skipped and says so; the qlora phase cuts its depth to the
time the accumulation phase leaves it) and tees its JSON to $OUT::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:. || exit; PYTHONUNBUFFERED=1 python3 benchmarks/gpu_suite.py --phases tests,kernels --budget-s 530 | tee $OUT/tests-kernels.jsonl

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:. || exit; PYTHONUNBUFFERED=1 python3 benchmarks/gpu_suite.py --phases accumulation,qlora --budget-s 530 | tee $OUT/qlora.jsonl

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:. || exit; PYTHONUNBUFFERED=1 python3 benchmarks/gpu_suite.py --phases full --budget-s 530 | tee $OUT/full.jsonl

Phases and what each result says:

- ``tests``: ``python -m pytest -m gpu -q`` with a JUnit XML report: passed, failed, skipped, errors and the
  ids of the failing tests.
- ``kernels``: ``bench_kernels.py`` (bf16, Llama-3-8B shapes, 8192 tokens; one process per op, peak GPU
  memory reset before each implementation), one result per op: each implementation's figures and its speedup
  over torch eager.
- ``qlora``: ``qlora/tiertune``: a Llama-3-70B-shaped NF4 base homed on disk, streamed through a 12 GiB host
  budget (the base is ~37 GB) and a 10 GiB device budget, under a 24 GiB GPU cap: tokens/s, peak GPU memory
  and the step against its I/O lower bound (disk read and host-to-device bandwidths measured in the same
  run). ``qlora/peft``: transformers + bitsandbytes + peft on the deepest model of the same shape that fits
  the same cap (an estimate of its memory picks the depth, smaller depths are tried after an out-of-memory).
- ``accumulation``: ``accumulation/tiertune``: QLoRA of 16 of the 70B shape's layers, streamed from disk
  through budgets below them, at 1 micro-batch a step, at 8 (the layer-major step: each layer visited once a
  step for all 8) and at 8 one micro-batch at a time (the schedule before it): tokens/s and bytes moved per
  step of each, the layer-major speedup (target >= 2x) and k=8 over k=1.
- ``full``: ``full/tiertune``: full fine-tuning, weights and AdamW states homed in host memory, streamed to
  the GPU under the cap, the optimizer overlapped with backward; ``full/fsdp2``: ``fully_shard`` with
  ``CPUOffloadPolicy`` (one process, world size 1), activation checkpointing and torch AdamW on the same
  model and batch; ``full/tiertune-delayed``: tiertune again with the one-step-delayed update
  (``offload.delay_update``), where the time left holds it; ``full/deepspeed``: skipped (why is in the
  result). TFLOPS, MFU and HFU by the formula each result states, against a bf16 matrix product measured in the
  same run and against the datasheet.
- ``longseq``: ``longseq/tiertune``: QLoRA of 4 layers of the Llama-3-8B shape on one row of 64K, 128K and
  256K tokens a step under the cap: tokens/s and peak GPU memory of each length.
- ``dpo``: ``dpo/tiertune``: QLoRA DPO of 16 of the 70B shape's layers streamed from disk under the cap, 8
  micro-batches of one pair of 2048-token rows a step (the reference, the base with the adapters off, in the
  same layer visits; the boundaries on the device), against SFT of as many rows: bytes moved per step (their
  ratio), tokens/s, peak GPU memory and whether it stayed under the cap.

- ``grpo``: ``grpo/tiertune``: QLoRA GRPO of 16 of the 70B shape's layers streamed from disk under the cap, as
  ``finetune.grpo`` steps: 16 completions of 32 tokens decoded together by the streamed model (a decoded token
  moves the layers' weights to the GPU once for all of them: ``layer_passes_per_decoded_token``), then the update
  on them: the generation's seconds and decoded tokens/s, the step's seconds, peak GPU memory.

- ``shipped``: ``shipped/tiertune``: LoRA of DeepSeek-V3.1 as it ships (FP8 with block scales, each routed expert
  a module of its own), cut to 5 layers (3 dense, 2 MoE: ~28 GB), read in place from its own files and streamed
  through a 14 GiB host and a 16 GiB device budget under the cap, 2 micro-batches of 2048 tokens a step:
  tokens/s, disk passes a step (bytes read over the release's layer bytes), the step over its disk bound, peak
  GPU memory and whether it stayed under the cap.

Random weights throughout, and the base never exists in bf16. The 70B base's checkpoint lists every tensor
but its decoder layers are a hole in a sparse file (header only, no disk blocks: ``ls -l`` ~137 GB, ``du``
~2 GB for the real embedding); its NF4 layers are generated at load time (N(0, 0.02) in the compute dtype,
quantized by tiertune's own NF4 quantizer, on the GPU) and handed to the loader through the interface of
tiertune's quantized cache, so the disk tier holds the one ~37 GB copy every step streams. Writing them into
the cache instead, as a previous run would have, needs a second ~37 GB copy: 74 GB on a 64 GiB disk. Where the
disk still cannot hold the disk tier, fewer layers run and ``tokens_per_second_at_full_depth`` scales the
figure to 80 (streaming time is linear in the depth), and the result says so. The peft reference loads a
pre-quantized checkpoint (bitsandbytes' own serialization of ``Linear4bit``, what ``save_pretrained`` writes
for a ``load_in_4bit`` model), ~0.52 bytes per parameter on disk.

``--dry-run`` runs every phase on the CPU at toy sizes (fp32, gloo for FSDP2, Liger skipped: Triton needs a
GPU) and prints the same keys; values that need a GPU (peak GPU memory, host-to-device bandwidth, the
datasheet peak) are null there.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import math
import os
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine as base_machine

from tiertune.settings import parse_size
from tiertune.units import format_size

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

PHASES = ("tests", "kernels", "qlora", "accumulation", "full", "longseq", "dpo", "several", "grpo", "shipped")


def _side_by_side_keys(ratio: str) -> tuple[str, ...]:
    """The keys of a result of two runs side by side (``_side_by_side``): ``ratio``'s bytes and seconds."""
    return (
        "system",
        "base",
        "seq",
        "micro_batches",
        "host_budget_bytes",
        "device_budget_bytes",
        "runs",
        f"{ratio}_bytes",
        f"{ratio}_seconds",
        "peak_gpu_bytes",
        "under_cap",
    )


COMMON_KEYS = ("phase", "result", "machine", "gpu_memory_cap_bytes", "command", "dry_run")
_TRAINING = (
    "batch",
    "seq",
    "tokens_per_step",
    "steps",
    "load_s",
    "step_s",
    "first_step_s",
    "tokens_per_second",
    "losses",
    "peak_gpu_bytes",
    "peak_rss_bytes",
)
_FLOPS = (
    "flops_formula",
    "tflops",
    "hardware_tflops",
    "peak_tflops_measured",
    "peak_tflops_datasheet",
    "mfu",
    "mfu_datasheet",
    "hfu",
)
# a tiertune run's overlap of the CPU optimizer with the compute (bench_train's, as it logs them)
_OVERLAP = ("optimizer_hidden_share", "optimizer_busy_s", "optimizer_not_hidden_s", "io_wait_s")
# a full fine-tune's result, tiertune's and its delayed update's (theirs: the placement and optimizer they run)
_FULL = ("system", "model", "placement", *_TRAINING, "max_grad_norm", *_FLOPS, "optimizer")
# every key of every result, besides COMMON_KEYS and "wall_s" (a result that failed or was skipped carries
# "error" or "skipped" and nulls for what it could not measure)
KEYS: dict[str, tuple[str, ...]] = {
    "tests": ("pytest_command", "exit_code", "timed_out", "counts", "failing"),
    "kernels": (
        "op",
        "dtype",
        "tokens",
        "shapes",
        "isolation",
        "eager",
        "tiertune",
        "liger",
        "speedup_vs_eager",
        "forward_speedup_vs_eager",
        "peak_vs_eager",
    ),
    "galore": (
        "shapes",
        "rank",
        "tokens",
        "exact_s_per_layer",
        "randomized_s_per_layer",
        "randomized_speedup",
        "worst_energy_ratio",
        "gradient_bytes_per_layer",
    ),
    "qlora/tiertune": (
        "system",
        "base",
        *_TRAINING,
        "host_budget_bytes",
        "device_budget_bytes",
        "tokens_per_second_at_full_depth",
        "peak_tier_bytes",
        "bytes_moved_per_step",
        "disk_read_gbps",
        "disk_read_measured_by",
        "host_to_device_gbps",
        "io_lower_bound_s",
        "io_lower_bound_by_link_s",
        "step_over_io_lower_bound",
        "disk_usage",
    ),
    "qlora/peft": (
        "system",
        "base",
        "layers_chosen_by",
        "attempts",
        *_TRAINING,
        "parameters_vs_tiertune_base",
    ),
    "accumulation/tiertune": (
        "system",
        "base",
        "batch",
        "seq",
        "micro_batches",
        "host_budget_bytes",
        "device_budget_bytes",
        "disk_read_gbps",
        "runs",
        "layer_major_speedup",
        "k8_over_k1_tokens_per_second",
        "k8_over_k1_disk_bytes",
    ),
    "full/tiertune": (*_FULL, *_OVERLAP, "plan", "peak_tier_bytes"),
    "full/fsdp2": (
        *_FULL,
        "optimizer_s",
        "mixed_precision",
        "backend",
        "pinned_memory_rounding",
    ),
    "full/tiertune-delayed": (*_FULL, *_OVERLAP),
    "full/deepspeed": ("reference", "skipped"),
    "longseq/tiertune": (
        "system",
        "base",
        "batch",
        "host_budget_bytes",
        "device_budget_bytes",
        "sequence_tile",
        "runs",
        "longest_trained",
    ),
    "dpo/tiertune": _side_by_side_keys("dpo_over_sft"),
    "several/tiertune": _side_by_side_keys("n4_over_n1"),
    "grpo/tiertune": (
        "system",
        "base",
        "seq",
        "completions",
        "completion_tokens",
        "host_budget_bytes",
        "device_budget_bytes",
        "generation_s",
        "decoded_tokens_per_second",
        "generation_bytes",
        "layer_weights_bytes",
        "layer_passes_per_decoded_token",
        "step_s",
        "losses",
        "bytes_moved_per_step",
        "peak_gpu_bytes",
        "under_cap",
    ),
    "shipped/tiertune": (
        "system",
        "base",
        "micro_batches",
        *_TRAINING,
        "host_budget_bytes",
        "device_budget_bytes",
        "disk_read_gbps",
        "disk_read_measured_by",
        "bytes_moved_per_step",
        "disk_passes_per_step",
        "step_over_disk_bound",
        "under_cap",
    ),
}
# the results each phase prints (kernels: one per op)
PHASE_RESULTS = {
    "tests": ("tests",),
    "kernels": ("kernels", "galore"),
    "qlora": ("qlora/tiertune", "qlora/peft"),
    "accumulation": ("accumulation/tiertune",),
    "full": ("full/tiertune", "full/fsdp2", "full/tiertune-delayed", "full/deepspeed"),
    "longseq": ("longseq/tiertune",),
    "dpo": ("dpo/tiertune",),
    "several": ("several/tiertune",),
    "grpo": ("grpo/tiertune",),
    "shipped": ("shipped/tiertune",),
}
# what only a GPU has or measures: null in a dry run
GPU_ONLY = frozenset(
    {
        "gpu_memory_cap_bytes",
        "peak_gpu_bytes",
        "under_cap",
        "host_to_device_gbps",
        "peak_tflops_datasheet",
        "mfu_datasheet",
    }
)
DATASHEET_BF16_DENSE = {"H100 PCIe": 756e12, "H100": 989.4e12, "H200": 989.4e12}  # NVIDIA datasheets
LORA_RANK = 16  # bench_qlora's adapter: r 16 on every linear layer of the decoder


@dataclass(frozen=True)
class Shape:
    """A Llama model's dimensions (tied embeddings, as ``bench_load.write_checkpoint`` writes them)."""

    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int

    @property
    def kv_width(self) -> int:
        return self.kv_heads * (self.hidden // self.heads)

    def linears(self) -> dict[str, tuple[int, int]]:
        """Each decoder layer's linear weights: (out, in)."""
        h, i, kv = self.hidden, self.intermediate, self.kv_width
        return {
            "q_proj": (h, h),
            "k_proj": (kv, h),
            "v_proj": (kv, h),
            "o_proj": (h, h),
            "gate_proj": (i, h),
            "up_proj": (i, h),
            "down_proj": (h, i),
        }

    def layer_linear_params(self) -> int:
        return sum(o * i for o, i in self.linears().values())

    def layer_params(self) -> int:
        return self.layer_linear_params() + 2 * self.hidden

    def parameters(self) -> int:
        return self.layers * self.layer_params() + self.vocab * self.hidden + self.hidden

    def with_layers(self, layers: int) -> Shape:
        return replace(self, layers=layers)

    def args(self) -> list[str]:
        """The model arguments of the bench_* scripts."""
        return [
            "--layers",
            str(self.layers),
            "--hidden",
            str(self.hidden),
            "--intermediate",
            str(self.intermediate),
            "--heads",
            str(self.heads),
            "--kv-heads",
            str(self.kv_heads),
            "--vocab",
            str(self.vocab),
        ]

    def describe(self) -> dict:
        return {
            "shape": self.name,
            "layers": self.layers,
            "hidden": self.hidden,
            "intermediate": self.intermediate,
            "heads": self.heads,
            "kv_heads": self.kv_heads,
            "vocab": self.vocab,
            "tied_embeddings": True,
            "parameters": self.parameters(),
        }


LLAMA3_70B = Shape("Llama-3-70B", 80, 8192, 28672, 64, 8, 128256)
LLAMA2_7B = Shape("Llama-2-7B", 32, 4096, 11008, 32, 32, 32000)
LLAMA3_8B = Shape("Llama-3-8B", 32, 4096, 14336, 32, 8, 128256)


@dataclass(frozen=True)
class Settings:
    """What each phase runs: the real sizes on a GPU, toy sizes on the CPU (``--dry-run``)."""

    dry_run: bool
    device: str
    dtype: str
    gpu_cap: int
    kernel_args: tuple[str, ...]
    galore_args: tuple[str, ...]  # bench_galore: one decoder layer's SVD refreshes, exact and randomized
    qlora_shape: Shape
    qlora_batch: int
    qlora_seq: int
    qlora_steps: int
    qlora_host_budget: int
    qlora_device_budget: int
    peft_reserve_s: float  # what the peft reference needs of the qlora phase's budget
    # the accumulation phase: the qlora shape cut to this many layers, streamed through budgets below it
    accum_layers: int
    accum_host_budget: int
    accum_device_budget: int
    grpo_completion: int  # the grpo phase: the tokens each completion decodes
    full_shape: Shape
    full_batch: int
    full_seq: int
    full_steps: int
    full_device_budget: int
    # the longseq phase: QLoRA of the 8B shape cut to this many layers, one row of each length a step
    longseq_layers: int
    longseq_seqs: tuple[int, ...]
    longseq_host_budget: int
    longseq_device_budget: int
    # the shipped phase: DeepSeek-V3.1 as it ships (FP8) cut to this many layers, its settings changed by
    # ``shipped_overrides`` (the dry run's toy sizes), streamed from disk through budgets below it
    shipped_layers: int
    shipped_overrides: dict
    shipped_seq: int
    shipped_micro_batches: int
    shipped_host_budget: int
    shipped_device_budget: int
    disk_probe_bytes: int
    ram_reserve: int  # host memory left to the OS, the CUDA runtime, the interpreter and the page cache
    disk_margin: int

    @classmethod
    def for_run(cls, dry_run: bool, gpu_cap: int) -> Settings:
        if not dry_run:
            return cls(
                dry_run=False,
                device="cuda",
                dtype="bfloat16",
                gpu_cap=gpu_cap,
                # bench_kernels at Llama-3-8B's shapes (its defaults, named so that the results say them)
                # one process per op (each implementation in it, peak GPU memory reset before each), which costs a
                # third of a process per op and implementation: the tests share this command's 9 minutes
                kernel_args=(
                    "--tokens",
                    "8192",
                    "--hidden",
                    "4096",
                    "--intermediate",
                    "14336",
                    "--heads",
                    "32",
                    "--kv-heads",
                    "8",
                    "--head-dim",
                    "128",
                    "--vocab",
                    "128256",
                    "--rank",
                    "16",
                    "--in-process",
                ),
                galore_args=(
                    "--hidden",
                    "4096",
                    "--intermediate",
                    "14336",
                    "--heads",
                    "32",
                    "--kv-heads",
                    "8",
                    "--rank",
                    "128",
                    "--tokens",
                    "4096",
                    "--layers",
                    "32",
                    "--reps",
                    "3",
                    "--threads",
                    "0",
                ),
                qlora_shape=LLAMA3_70B,
                qlora_batch=1,
                qlora_seq=2048,
                qlora_steps=3,
                qlora_host_budget=12 << 30,
                qlora_device_budget=10 << 30,
                peft_reserve_s=170.0,
                # 16 of the 70B shape's layers (~7.5 GB of NF4) through 3 GiB of host and 5 GiB of device budget
                # (the 2.1 GB bf16 embedding stays on the device): every wave streams them from disk
                accum_layers=16,
                accum_host_budget=3 << 30,
                accum_device_budget=5 << 30,
                grpo_completion=32,
                full_shape=LLAMA2_7B,
                full_batch=8,
                full_seq=2048,
                full_steps=4,
                full_device_budget=6 << 30,
                # a layer's memory at a length is the same at any depth: 4 layers keep 256K tokens within minutes;
                # the device holds up to three boundaries at once (2 GiB each at 256K: 4 GiB refused it) + weights
                longseq_layers=4,
                longseq_seqs=(65536, 131072, 262144),
                longseq_host_budget=24 << 30,
                longseq_device_budget=8 << 30,
                # 3 dense layers and 2 MoE ones (256 routed experts of FP8 each: 10.7 GiB a layer), ~28 GB with
                # the bf16 embedding and head; the host budget holds one MoE layer, not the base: every pass
                # reads the layers from disk, in place from the release's own files
                shipped_layers=5,
                shipped_overrides={},
                shipped_seq=2048,
                shipped_micro_batches=2,
                shipped_host_budget=14 << 30,
                shipped_device_budget=16 << 30,
                disk_probe_bytes=2 << 30,
                ram_reserve=20 << 30,
                disk_margin=3 << 30,
            )
        return cls(
            dry_run=True,
            device="cpu",
            dtype="float32",
            gpu_cap=gpu_cap,
            kernel_args=(
                "--tokens",
                "64",
                "--hidden",
                "64",
                "--intermediate",
                "96",
                "--heads",
                "4",
                "--kv-heads",
                "2",
                "--head-dim",
                "16",
                "--vocab",
                "300",
                "--rank",
                "4",
                "--reps",
                "1",
                "--warmup",
                "1",
                "--in-process",
            ),
            galore_args=(
                "--hidden",
                "128",
                "--intermediate",
                "256",
                "--heads",
                "4",
                "--kv-heads",
                "2",
                "--rank",
                "8",
                "--tokens",
                "32",
                "--layers",
                "2",
                "--reps",
                "1",
                "--threads",
                "0",
            ),
            # the toy base (8 layers of 80 KiB, a 128 KiB embedding) outgrows its host and device budgets: it
            # streams from the disk tier as the real one does
            qlora_shape=Shape("toy Llama (dry run)", 8, 128, 256, 4, 2, 256),
            qlora_batch=1,
            qlora_seq=32,
            qlora_steps=2,
            qlora_host_budget=256 << 10,
            qlora_device_budget=256 << 10,
            peft_reserve_s=20.0,
            accum_layers=8,
            accum_host_budget=256 << 10,
            accum_device_budget=256 << 10,
            grpo_completion=8,
            full_shape=Shape("toy Llama (dry run)", 2, 128, 256, 4, 4, 512),
            full_batch=2,
            full_seq=32,
            full_steps=3,
            full_device_budget=2 << 20,
            longseq_layers=2,
            longseq_seqs=(256, 512),
            longseq_host_budget=64 << 20,
            longseq_device_budget=16 << 20,
            shipped_layers=3,
            shipped_overrides=dict(
                hidden_size=256,
                intermediate_size=512,
                moe_intermediate_size=128,
                n_routed_experts=8,
                num_experts_per_tok=2,
                num_attention_heads=4,
                num_key_value_heads=4,
                q_lora_rank=128,
                kv_lora_rank=64,
                qk_nope_head_dim=32,
                qk_rope_head_dim=16,
                v_head_dim=32,
                vocab_size=1024,
                n_group=1,
                topk_group=1,
                first_k_dense_replace=1,
            ),
            shipped_seq=32,
            shipped_micro_batches=2,
            shipped_host_budget=1 << 20,
            shipped_device_budget=3 << 20,
            disk_probe_bytes=16 << 20,
            ram_reserve=1 << 30,
            disk_margin=64 << 20,
        )


class Budget:
    """The wall-clock seconds this invocation may still use."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


@dataclass
class Context:
    settings: Settings
    budget: Budget
    phases: tuple[str, ...]
    machine: dict
    command: str
    dir: Path
    printed: list[str] = field(default_factory=list)
    # where the tests phase writes pytest's whole output (stderr gets its tail)
    pytest_log: Path | None = None


def log(message: str) -> None:
    print(f"[gpu_suite {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def emit(ctx: Context, phase: str, result: str, values: dict, began: float) -> dict:
    """Print one result (one JSON line) with the common keys; every key of ``KEYS[result]`` must be there
    unless the result failed or was skipped (then what it lacks is null). ``gpu_memory_cap_bytes`` is null
    where nothing was capped."""
    missing = [k for k in KEYS[result] if k not in values]
    if missing and not ({"error", "skipped"} & set(values)):
        raise KeyError(f"result {result} lacks {missing}: KEYS and the code disagree")
    # every phase's processes but the tests' and the kernels' run under the cap (those have the whole GPU)
    capped = phase not in ("tests", "kernels") and not ctx.settings.dry_run
    cap = ctx.settings.gpu_cap if capped else None
    out = {
        "phase": phase,
        "result": result,
        **dict.fromkeys(missing),
        **values,
        "machine": ctx.machine,
        "gpu_memory_cap_bytes": cap,
        "command": ctx.command,
        "dry_run": ctx.settings.dry_run,
        "wall_s": round(time.perf_counter() - began, 3),
    }
    print(json.dumps(out), flush=True)
    ctx.printed.append(result)
    return out


def describe_machine(directory: Path) -> dict:
    """``common.machine()`` and the GPU, host memory and the disk under ``directory``."""
    import psutil

    info = base_machine() | {
        "ram_bytes": psutil.virtual_memory().total,
        "disk_free_bytes": shutil.disk_usage(directory).free,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info |= {"gpu": props.name, "gpu_memory_bytes": props.total_memory, "cuda": torch.version.cuda}
    else:
        info |= {"gpu": None, "gpu_memory_bytes": None, "cuda": None}
    return info


# ------------------------------------------------------------------ children (fresh processes)


def run_child(name: str, params: dict, timeout: float, env: dict | None = None) -> dict:
    """Run ``CHILDREN[name](params)`` in a fresh process (its own allocator state, GPU cap and peak figures);
    its last stdout line is the JSON result, its stderr passes through. Killed after ``timeout`` seconds."""
    if timeout < 10:
        return {"error": f"not started: {timeout:.0f} s left of the command's time budget"}
    cmd = [sys.executable, __file__, "--child", name, json.dumps(params)]
    try:
        out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=timeout, env=_env(env))
    except subprocess.TimeoutExpired:
        return {"error": f"stopped after {timeout:.0f} s, the time left of the command's budget"}
    lines = out.stdout.strip().splitlines()
    if out.returncode or not lines:
        return {"error": f"{name} exited with status {out.returncode} (its stderr is above)"}
    return json.loads(lines[-1])


def _cap_gpu(cap: int) -> None:
    """Emulate a smaller card: this process's caching allocator may hold at most ``cap`` bytes."""
    if cap and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))


class RandomNF4Cache:
    """Stands in for ``QuantCache`` (same interface): every decoder layer's chunk is *generated* instead of
    read: each linear weight drawn from N(0, 0.02) in the compute dtype on the GPU (the CPU without one) and
    quantized by tiertune's own NF4 quantizer straight into the chunk, norms set to 1. The checkpoint's layer
    tensors are never read (they are a hole in a sparse file)."""

    def __init__(self, root: object, checkpoint: object, settings: dict[str, object]) -> None:
        from tiertune.quant.bnb4 import NF4

        self.directory = "(generated at load: random NF4)"
        self.images = False  # nothing on disk: the disk tier keeps the generated layers
        self.hits = self.misses = 0
        self.quant = NF4(settings["dtype"])  # type: ignore[arg-type]
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.generator = torch.Generator(self.device).manual_seed(0)

    def image(self, chunk: object, block_size: int) -> None:
        return None  # nothing on disk: the disk tier keeps the generated layers

    def load(self, chunk: object, views: dict[str, torch.Tensor]) -> bool:
        for key, view in views.items():
            if f"{key}.absmax" in views:  # a quantized weight: two 4-bit codes per byte
                weight = torch.randn(
                    view.numel() * 2,
                    generator=self.generator,
                    device=self.device,
                    dtype=self.quant.compute_dtype,
                ).mul_(0.02)
                self.quant.quantize_into(key, weight, views)
            elif not key.endswith((".absmax", ".absmax2", ".offset")):  # the layer's norms
                view.fill_(1.0)
        self.hits += 1
        return True

    def save(self, chunk: object, views: dict[str, torch.Tensor], block_size: int) -> None:
        raise RuntimeError("a generated base is never saved")


def child_qlora_tiertune(p: dict) -> dict:
    """bench_qlora's tiertune mode on the sparse checkpoint, its NF4 layers generated (``RandomNF4Cache``)."""
    import bench_qlora

    import tiertune.loading.quant_cache

    tiertune.loading.quant_cache.QuantCache = RandomNF4Cache  # type: ignore[misc]
    args = bench_qlora.parse_args(p["argv"])
    return bench_qlora.run_tiertune(p["model"], p["disk"], args)


def child_peft(p: dict) -> dict:
    """bench_qlora's peft mode (transformers + bitsandbytes + peft) on the pre-quantized checkpoint."""
    import bench_qlora

    warnings.filterwarnings("ignore", message=".*quantization_config.*")  # already in the checkpoint's config
    return bench_qlora.run_peft(p["model"], bench_qlora.parse_args(p["argv"]))


def child_train(p: dict) -> dict:
    """bench_train's ``host`` mode (or ``p["mode"]``: ``host-delayed``): weights and AdamW states homed on the
    host, streamed to the device."""
    import bench_train

    mode = p.get("mode", "host")
    return bench_train.run_mode(p["model"], p["disk"], mode, bench_train.parse_args(p["argv"]))


def child_peak(p: dict) -> dict:
    """The dense matrix-product throughput this process reaches: 8192^3 in bf16 on a GPU, 1024^3 in fp32 on
    a CPU (the dry run), timed over repeated products after a warm-up."""
    cuda = p["device"] == "cuda"
    n, dtype, reps = (8192, torch.bfloat16, 500) if cuda else (1024, torch.float32, 5)
    a = torch.randn(n, n, device=p["device"], dtype=dtype)
    b = torch.randn(n, n, device=p["device"], dtype=dtype)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(3):
        a @ b
    sync()
    began = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync()
    seconds = time.perf_counter() - began
    return {
        "tflops": 2 * n**3 * reps / seconds / 1e12,
        "matmul": f"{n}x{n}x{n} {str(dtype).removeprefix('torch.')}",
        "device": torch.cuda.get_device_name() if cuda else "cpu",
    }


def child_fsdp2(p: dict) -> dict:
    """PyTorch FSDP2 on one process: ``fully_shard`` per decoder layer and at the root with ``CPUOffloadPolicy``
    (fp32 parameters, gradients and AdamW states on the host), bf16 compute on a GPU, transformers' activation
    checkpointing, torch AdamW (fused when it takes DTensors, else foreach) under the linear schedule tiertune's
    engine uses, the same batches as bench_train."""
    import torch.distributed as dist
    from bench_load import peak_rss
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    from transformers import get_scheduler

    from tiertune.loading.model import build_skeleton
    from tiertune.loading.weights import Checkpoint

    cuda = p["device"] == "cuda"
    torch.set_num_threads(p["threads"] or torch.get_num_threads())
    if cuda:
        torch.cuda.set_device(0)
        _cap_gpu(p["gpu_cap"])
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, init_method=f"file://{p['rendezvous']}", rank=0, world_size=1)
    try:
        began = time.perf_counter()
        model = build_skeleton(p["model"], torch.float32)  # parameters on meta, buffers (rotary) real
        model.config.use_cache = False
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # renamed in later transformers; same behaviour
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        mesh = init_device_mesh(p["device"], (1,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cuda else None
        offload = CPUOffloadPolicy(pin_memory=cuda)
        kwargs = {"mesh": mesh, "offload_policy": offload} | ({"mp_policy": mp} if mp else {})
        for layer in model.model.layers:
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)
        modules = dict(model.named_modules())
        buffers = {
            (m, n): b.clone() for m, module in modules.items() for n, b in module.named_buffers(recurse=False)
        }
        model.to_empty(device="cpu")  # the sharded fp32 parameters, on the host
        for (m, n), value in buffers.items():  # buffers are not FSDP's: they live on the compute device
            modules[m]._buffers[n] = value.to(p["device"])
        checkpoint = Checkpoint(p["model"])
        with torch.no_grad():
            for name, param in model.named_parameters():
                checkpoint.read_into(name, param.to_local())
        model.train()
        opt, how = _adamw(model)
        # the learning rate tiertune's engine follows: transformers' linear schedule over the run's steps
        schedule = get_scheduler("linear", opt, num_warmup_steps=0, num_training_steps=p["steps"])
        load_s = time.perf_counter() - began
        gen = torch.Generator().manual_seed(0)  # bench_train's batches
        batch = [torch.randint(0, model.config.vocab_size, (p["batch"], p["seq"]), generator=gen)]
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        times, opt_times, losses = [], [], []
        for step in range(p["steps"]):
            began = time.perf_counter()
            total = 0.0
            for ids in batch:
                ids = ids.to(p["device"])
                loss = model(input_ids=ids, labels=ids).loss / len(batch)
                loss.backward()
                total += float(loss.detach())
            sync()
            opt_began = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            schedule.step()
            sync()
            opt_times.append(time.perf_counter() - opt_began)
            times.append(time.perf_counter() - began)
            losses.append(total)
            log(f"fsdp2 step {step + 1}: {times[-1]:.1f} s (optimizer {opt_times[-1]:.1f} s)")
    finally:
        dist.destroy_process_group()
    n = max(1, len(times) - 1)
    return {
        "load_s": load_s,
        "first_step_s": times[0],
        "step_s": sum(times[1:]) / n,
        "optimizer_s": sum(opt_times[1:]) / n,
        "losses": losses[1:],
        "optimizer": how,
        "peak_gpu_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "peak_rss_bytes": peak_rss(),
        "mixed_precision": "bf16 parameters and compute, fp32 reduce" if cuda else "none (fp32 on the CPU)",
        "backend": backend,
    }


def _adamw(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, str]:
    """torch AdamW over the model's (DTensor) parameters: the fused kernel where this torch has it for CPU
    tensors (tiertune's optimizer runs the same kernel), else foreach; and which one."""
    probe = torch.nn.Parameter(torch.zeros(4))
    probe.grad = torch.zeros(4)
    try:
        torch.optim.AdamW([probe], lr=1e-5, fused=True).step()
        fused = True
    except (RuntimeError, TypeError) as exc:
        log(f"fused AdamW unavailable ({str(exc).splitlines()[0]}); foreach")
        fused = False
    kind = {"fused": True} if fused else {"foreach": True}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0, **kind)
    return opt, f"torch.optim.AdamW({next(iter(kind))}=True)"


CHILDREN: dict[str, Callable[[dict], dict]] = {
    "qlora-tiertune": child_qlora_tiertune,
    "peft": child_peft,
    "train": child_train,
    "peak": child_peak,
    "fsdp2": child_fsdp2,
}


# ------------------------------------------------------------------ checkpoints with random weights


def _model_tensors(shape: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """The checkpoint's tensors, names and shapes as transformers' Llama has them (built on the meta device)."""
    from tiertune.loading.model import build_skeleton

    with tempfile.TemporaryDirectory() as tmp:
        _llama_config(shape).save_pretrained(tmp)
        model = build_skeleton(tmp, torch.bfloat16)
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]


def _llama_config(shape: Shape, quantization: dict | None = None) -> object:
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        vocab_size=shape.vocab,
        tie_word_embeddings=True,
        dtype="bfloat16",
        max_position_embeddings=8192,
    )
    if quantization is not None:
        config.quantization_config = quantization
    return config


def _write_sparse(path: Path, tensors: list[tuple[str, tuple[int, ...]]]) -> None:
    """A safetensors file whose header lists ``tensors`` (bf16) and whose data region is a hole: the file has
    their size but no disk blocks. Written by hand because the library writes the data, which is exactly what
    must not happen here; ``tiertune.loading.weights`` and ``safetensors.safe_open`` read the header."""
    header: dict[str, object] = {}
    offset = 0
    for name, shape in tensors:
        nbytes = math.prod(shape) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as the library writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        f.truncate(8 + len(raw) + offset)


def write_checkpoint(path: Path, shape: Shape, layers_as: str, compute_dtype: torch.dtype) -> dict:
    """A Llama checkpoint of ``shape`` with random weights, one shard per decoder layer, generated on the GPU
    when there is one: the embedding N(0, 0.02) in bf16, norms 1, and the decoder layers' linear weights
    ``layers_as`` ``random`` (bf16 N(0, 0.02)), ``sparse`` (a hole: listed, never written) or ``nf4``
    (N(0, 0.02) in ``compute_dtype`` quantized by bitsandbytes' ``Linear4bit`` and saved in its own
    serialization, with the ``quantization_config`` transformers loads it by). Returns its figures."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator(device).manual_seed(0)
    quantization = None
    if layers_as == "nf4":
        from transformers import BitsAndBytesConfig

        quantization = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=compute_dtype,
        ).to_dict()
    _llama_config(shape, quantization).save_pretrained(path)
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[] for _ in range(shape.layers + 1)]
    for name, tshape in _model_tensors(shape):
        parts = name.split(".")
        shards[int(parts[2]) + 1 if parts[1] == "layers" else 0].append((name, tshape))
    weight_map: dict[str, str] = {}
    total = 0
    for shard, tensors in enumerate(shards):
        file = path / f"model-{shard:05d}-of-{len(shards) - 1:05d}.safetensors"
        if shard and layers_as == "sparse":
            _write_sparse(file, tensors)
            weight_map |= {n: file.name for n, _ in tensors}
            total += sum(math.prod(t) * 2 for _, t in tensors)
            continue
        out: dict[str, torch.Tensor] = {}
        for name, tshape in tensors:
            if name.endswith("norm.weight"):
                out[name] = torch.ones(tshape, dtype=torch.bfloat16)
                continue
            dtype = compute_dtype if shard and layers_as == "nf4" else torch.bfloat16
            value = torch.randn(tshape, generator=gen, device=device, dtype=dtype).mul_(0.02)
            if shard and layers_as == "nf4":
                out |= _nf4_serialized(name.removesuffix("weight"), value, compute_dtype)
            else:
                out[name] = value.cpu()
        save_file(out, file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(out, file.name)
        total += sum(t.numel() * t.element_size() for t in out.values())
        del out
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    files = sorted(path.glob("*.safetensors"))
    with safe_open(str(files[-1]), "pt") as f:  # the library reads what was written (headers of holes too)
        if set(f.keys()) != {k for k, v in weight_map.items() if v == files[-1].name}:
            raise RuntimeError(f"{files[-1]} does not hold the tensors its index names")
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "parameters": shape.parameters(),
        "apparent_bytes": sum(f.stat().st_size for f in files),  # what ls -l shows
        "allocated_bytes": sum(f.stat().st_blocks * 512 for f in files),  # what du shows
        "layers_as": layers_as,
        "generated_on": device.type,
    }


def _nf4_serialized(prefix: str, weight: torch.Tensor, compute_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``weight`` quantized to NF4 (double-quantized scales) by ``bnb.nn.Linear4bit``, as its state dict
    saves it (``<prefix>weight``, ``weight.absmax``, ``weight.quant_map``, ``weight.nested_*``,
    ``weight.quant_state.bitsandbytes__nf4``)."""
    import bitsandbytes as bnb

    out_features, in_features = weight.shape
    linear = bnb.nn.Linear4bit(
        in_features,
        out_features,
        bias=False,
        compute_dtype=compute_dtype,
        quant_type="nf4",
        compress_statistics=True,
        device="meta",
    )
    linear.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4", compress_statistics=True)
    linear = linear.to(weight.device)  # quantizes
    return {k: v.detach().contiguous().cpu() for k, v in linear.state_dict(prefix=prefix).items()}


def subset_checkpoint(source: Path, target: Path, layers: int) -> None:
    """``source``'s first ``layers`` decoder layers as a model of its own (config, index, links to shards)."""
    target.mkdir(parents=True)
    config = json.loads((source / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (target / "config.json").write_text(json.dumps(config))
    index = json.loads((source / "model.safetensors.index.json").read_text())
    keep = {
        k: f
        for k, f in index["weight_map"].items()
        if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers
    }
    (target / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": keep}))
    for file in set(keep.values()):
        (target / file).symlink_to(source / file)


# ------------------------------------------------------------------ memory arithmetic


def nf4_layer_bytes(shape: Shape, compute_dtype: torch.dtype) -> int:
    """Bytes of one decoder layer's chunk with an NF4 base, laid out as tiertune lays it out."""
    from tiertune.offload.chunk import pack_tensors
    from tiertune.quant.bnb4 import NF4

    entries = []
    for name, (o, i) in shape.linears().items():
        entries += NF4(compute_dtype).entries(name, (o, i))
    entries += [
        ("input_layernorm", (shape.hidden,), compute_dtype),
        ("post_norm", (shape.hidden,), compute_dtype),
    ]
    return pack_tensors(entries, 1 << 50)[0].capacity


def peft_layers_that_fit(shape: Shape, tokens: int, cap: int) -> int:
    """An estimate of the deepest model of ``shape`` that peft + bitsandbytes train under ``cap`` bytes (bf16,
    gradient checkpointing, LoRA r 16 on every linear layer, fp32 adapters with AdamW): per layer the NF4
    weights, the adapter's parameters, gradients and moments, and the layer input checkpointing keeps; once,
    the bf16 embedding (tied head), the logits (bf16, their fp32 copy and both gradients), one layer's
    recomputed activations and a dequantized weight, and 1 GiB of workspace and allocator slack."""
    nf4 = shape.layer_linear_params() * (0.5 + 1 / 64 + 4 / (64 * 256)) + 4 * shape.hidden
    lora = LORA_RANK * sum(o + i for o, i in shape.linears().values()) * 16
    per_layer = nf4 + lora + tokens * shape.hidden * 2
    recompute = tokens * (4 * shape.intermediate + 6 * shape.hidden) * 2 * 2
    fixed = (
        shape.vocab * shape.hidden * 2
        + tokens * shape.vocab * 12
        + recompute
        + shape.hidden * shape.intermediate * 2 * 2
        + (1 << 30)
    )
    return max(0, int((cap - fixed) // per_layer))


def _pow2ceil(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def plan_full(s: Settings, ram: int, disk_free: int, pinned_rounds: bool) -> dict:
    """The deepest model of the full phase's shape whose states both systems hold in host memory, and the
    arithmetic: tiertune keeps bf16 weights (2 B/parameter), fp32 master weights and both Adam moments
    (12 B) on the host, and the fp32 gradients of the layers in flight (homed on disk as a recipe homes them,
    each dropped once its update has read it: counted in ``working``; no clipping, so no twin states); FSDP2's CPU offload keeps fp32 parameters and fp32 gradients (each a pinned
    tensor, rounded up to a power of two by torch's pinned allocator unless that is configured off) and the
    Adam moments (8 B). The checkpoint (2 B/parameter) must fit on disk."""
    from tiertune.offload import tiers

    # tiertune's host tier pins exactly its budget (HostMemory), or torch's allocator does not round it up
    exact_pin = hasattr(tiers, "HostMemory") or not pinned_rounds
    usable = ram - s.ram_reserve
    for layers in range(s.full_shape.layers, 0, -1):
        shape = s.full_shape.with_layers(layers)
        n = shape.parameters()
        working = 3 * 4 * shape.layer_params() + 4 * shape.vocab * shape.hidden + (1 << 30)
        tiertune_host = 14 * n + working
        tiertune_pinned = tiertune_host if exact_pin else _pow2ceil(tiertune_host + 4096)
        sizes = [o * i for o, i in shape.linears().values()] + [shape.hidden] * 2
        pin = _pow2ceil if pinned_rounds else (lambda b: b)
        per_layer = sum(pin(4 * x) for x in sizes)
        pinned = layers * per_layer + pin(4 * shape.vocab * shape.hidden) + pin(4 * shape.hidden)
        fsdp2_host = 2 * pinned + 8 * n
        checkpoint = 2 * n
        if max(tiertune_pinned, fsdp2_host) <= usable and checkpoint + s.disk_margin <= disk_free:
            break
    else:
        raise RuntimeError(
            f"not even one layer of {s.full_shape.name} fits {format_size(usable)} of host memory"
        )
    return {
        "layers": layers,
        "layers_in_shape": s.full_shape.layers,
        "why_fewer_layers": None
        if layers == s.full_shape.layers
        else f"{s.full_shape.layers} layers do not fit {format_size(usable)} of host memory in both systems",
        "parameters": n,
        "host_usable_bytes": usable,
        "tiertune_host_bytes": tiertune_host,
        "tiertune_host_budget_bytes": tiertune_host,
        "tiertune_pinned_bytes": tiertune_pinned,
        "tiertune_bytes_per_parameter": {
            "weights_bf16": 2,
            "master_fp32": 4,
            "adam_moments_fp32": 8,
            "gradients_fp32_of_the_layers_in_flight": 0,
        },
        "fsdp2_host_bytes": fsdp2_host,
        "fsdp2_pinned_rounding": pinned_rounds,
        "checkpoint_bytes": checkpoint,
        "disk_free_bytes": disk_free,
        "why_host": f"weights and AdamW states fit the {format_size(usable)} of host memory; homed on disk they "
        f"would take {format_size(14 * n)} next to the {format_size(checkpoint)} checkpoint with "
        f"{format_size(disk_free)} free"
        + ("" if 16 * n + s.disk_margin <= disk_free else ", more than the disk holds"),
    }


def flops(shape: Shape, tokens: int, step_s: float, peak: float | None, datasheet: float | None) -> dict:
    """Throughput by formula: model FLOPs 6·N·tokens per step (N: every matrix-multiplied weight, the decoder
    layers' linears and the tied head), hardware FLOPs (8·N_layers + 6·N_head)·tokens (each decoder layer's
    forward runs again in backward: checkpointing); attention's score and value products are left out."""
    n_layers = shape.layers * shape.layer_linear_params()
    n_head = shape.vocab * shape.hidden
    model = 6 * (n_layers + n_head) * tokens / step_s / 1e12
    hardware = (8 * n_layers + 6 * n_head) * tokens / step_s / 1e12
    return {
        "flops_formula": "model 6*N*tokens, hardware (8*N_layers + 6*N_head)*tokens with recomputed layers; "
        f"N = {n_layers + n_head} matmul weights (layers' linears {n_layers}, tied head {n_head}); attention "
        "score/value products excluded",
        "tflops": model,
        "hardware_tflops": hardware,
        "peak_tflops_measured": peak,
        "peak_tflops_datasheet": datasheet,
        "mfu": model / peak if peak else None,
        "mfu_datasheet": model / datasheet if datasheet else None,
        "hfu": hardware / peak if peak else None,
    }


def datasheet_tflops(gpu: str | None) -> float | None:
    """The bf16 dense peak of NVIDIA's datasheet for ``gpu`` (H100 SXM and H200: 989.4 TFLOPS), if known."""
    if not gpu:
        return None
    for key, value in DATASHEET_BF16_DENSE.items():
        if all(word in gpu for word in key.split()):
            return value / 1e12
    return None


def pinned_rounding_off(s: Settings) -> dict[str, str]:
    """The environment that stops torch's pinned allocator from rounding blocks of 64 MiB and more up to a
    power of two (``pinned_max_round_threshold_mb``), if this torch has that setting: a throwaway process pins
    96 MiB + 1 byte under it and must neither fail nor report 128 MiB pinned. Empty when it has not (or on the
    CPU, where nothing is pinned)."""
    if s.dry_run:
        return {}
    env = {"PYTORCH_ALLOC_CONF": "pinned_max_round_threshold_mb:64"}
    probe = (
        "import torch; torch.zeros(1, device='cuda'); t = torch.empty((96 << 20) + 1).pin_memory(); "
        "print(getattr(torch.cuda, 'host_memory_stats', dict)().get('allocated_bytes.current', -1))"
    )
    out = subprocess.run([sys.executable, "-c", probe], env=_env(env), capture_output=True, text=True)
    lines = out.stdout.split()
    return env if out.returncode == 0 and lines and int(lines[-1]) < (128 << 20) else {}


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of the processes this suite starts: the repository importable, output unbuffered."""
    env = {**os.environ, **(extra or {}), "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


# ------------------------------------------------------------------ phases


def phase_tests(ctx: Context) -> None:
    """``pytest -m gpu``: the counts from its JUnit report and the failing test ids."""
    began = time.perf_counter()
    # the phases after it keep their share (the kernels take about 20 s an op)
    share = 1.0 if ctx.phases[-1] == "tests" else 0.6 if "kernels" in ctx.phases else 0.5
    limit = ctx.budget.left() * share - 10
    with tempfile.TemporaryDirectory(dir=ctx.dir) as tmp:
        report = Path(tmp) / "junit.xml"
        pytest = [
            "-m",
            "pytest",
            "-m",
            "gpu",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={report}",
            "-o",
            "junit_family=xunit1",
        ]
        log(f"tests: python {shlex.join(pytest)} (at most {limit:.0f} s)")
        proc = subprocess.Popen(
            [sys.executable, *pytest],
            cwd=ROOT,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        timed_out = False
        try:
            output, _ = proc.communicate(timeout=max(limit, 1))
        except subprocess.TimeoutExpired:
            # interrupted (as by Ctrl-C), pytest stops and still writes its report of the tests that ran
            timed_out = True
            proc.send_signal(signal.SIGINT)
            try:
                output, _ = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                output, _ = proc.communicate()
        code = proc.returncode
        print(output[-4000:], file=sys.stderr, flush=True)
        if ctx.pytest_log is not None:
            ctx.pytest_log.write_text(output)
        counts = parse_junit(report) if report.is_file() else None
    command = shlex.join(["python", *pytest]).replace(str(report), "REPORT.xml")
    values: dict = {"pytest_command": command, "exit_code": code, "timed_out": timed_out}
    if counts is None:
        values["error"] = (
            "pytest was stopped by the time budget before writing its report"
            if timed_out
            else "pytest wrote no report"
        )
    else:
        values |= counts
    emit(ctx, "tests", "tests", values, began)


def parse_junit(path: Path) -> dict:
    """``counts`` of passed, failed, skipped and errored test cases in a JUnit XML report, and the ids of
    the failed and errored ones (``failing``, as path::name)."""
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    failing = []
    for case in ET.parse(path).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        # xunit1 reports name the file; a test in a class keeps the class in its id
        where, classname = case.get("file", ""), case.get("classname", "")
        cls = classname.rsplit(".", 1)[-1] if classname.rsplit(".", 1)[-1][:1].isupper() else ""
        test_id = "::".join(x for x in (where or classname, cls, case.get("name", "")) if x)
        if "failure" in kinds:
            counts["failed"] += 1
            failing.append(test_id)
        elif "error" in kinds:
            counts["errors"] += 1
            failing.append(test_id)
        elif "skipped" in kinds:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return {"counts": counts, "failing": failing}


def phase_kernels(ctx: Context) -> None:
    """bench_kernels per op (on a GPU one invocation per op, so that the budget can stop between ops)."""
    from bench_kernels import OPS

    s = ctx.settings
    groups = [list(OPS)] if s.dry_run else [[op] for op in OPS]
    per_group = None
    for ops in groups:
        began = time.perf_counter()
        left = ctx.budget.left() - 5
        if per_group is not None and left < 1.3 * per_group:
            for op in ops:
                emit(
                    ctx,
                    "kernels",
                    "kernels",
                    {"op": op, "skipped": f"time budget: {left:.0f} s left, an op took {per_group:.0f} s"},
                    began,
                )
            continue
        cmd = [sys.executable, str(HERE / "bench_kernels.py"), "--ops", ",".join(ops), *s.kernel_args]
        log(f"kernels: {' '.join(ops)}")
        try:
            out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=max(left, 1), env=_env())
            report = json.loads(out.stdout) if out.returncode == 0 else None
        except subprocess.TimeoutExpired:
            report = None
        per_group = time.perf_counter() - began
        for op in ops:
            if report is None:
                emit(
                    ctx,
                    "kernels",
                    "kernels",
                    {"op": op, "error": "bench_kernels failed or ran out of time"},
                    began,
                )
                continue
            emit(ctx, "kernels", "kernels", _kernel_result(op, report, s.kernel_args), began)
    phase_galore(ctx)


def phase_galore(ctx: Context) -> None:
    """GaLore's SVD refresh on the device, exact against randomized (``bench_galore.py``, one Llama-3-8B
    decoder layer's real gradients over 4096 tokens, rank 128)."""
    s = ctx.settings
    began = time.perf_counter()
    left = ctx.budget.left() - 5
    if left < 60:
        emit(ctx, "kernels", "galore", {"skipped": f"time budget: {left:.0f} s left"}, began)
        return
    cmd = [sys.executable, str(HERE / "bench_galore.py"), "--device", s.device, *s.galore_args]
    log("galore: SVD refreshes, exact and randomized")
    try:
        out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=left, env=_env())
        report = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else None
    except subprocess.TimeoutExpired:
        report = None
    if report is None:
        emit(ctx, "kernels", "galore", {"error": "bench_galore failed or ran out of time"}, began)
        return
    settings = report["settings"]
    emit(
        ctx,
        "kernels",
        "galore",
        {
            "shapes": {k: settings[k] for k in ("hidden", "intermediate", "heads", "kv_heads")},
            "rank": settings["rank"],
            "tokens": settings["tokens"],
            "exact_s_per_layer": report["exact"]["seconds_per_layer"],
            "randomized_s_per_layer": report["randomized"]["seconds_per_layer"],
            "randomized_speedup": report["randomized_speedup"],
            "worst_energy_ratio": report["randomized"]["worst_energy_ratio"],
            "gradient_bytes_per_layer": report["gradient_bytes_per_layer"],
        },
        began,
    )


def _kernel_shapes(kernel_args: tuple[str, ...]) -> dict[str, int]:
    """The shapes bench_kernels ran at: the ``--name value`` pairs of its command line."""
    shapes = {}
    for flag, value in itertools.pairwise(kernel_args):
        if flag.startswith("--") and not value.startswith("--") and flag not in ("--reps", "--warmup"):
            shapes[flag[2:].replace("-", "_")] = int(value)
    return shapes


def _kernel_result(op: str, report: dict, kernel_args: tuple[str, ...]) -> dict:
    """One op's implementations and their speed (eager time / theirs) and peak memory (theirs / eager's)."""
    results = report["ops"][op]
    eager = results.get("eager", {})
    impls = ("tiertune", "liger")

    def ratio(key: str, impl: str, theirs_over_eager: bool = False) -> float | None:
        mine = results.get(impl, {})
        if not (mine.get(key) and eager.get(key)):
            return None
        return mine[key] / eager[key] if theirs_over_eager else eager[key] / mine[key]

    return {
        "op": op,
        "dtype": report["dtype"],
        "tokens": report["tokens"],
        "shapes": _kernel_shapes(kernel_args),
        "isolation": report["isolation"],
        **{impl: results.get(impl) for impl in ("eager", *impls)},
        "speedup_vs_eager": {impl: ratio("forward_backward_s", impl) for impl in impls},
        "forward_speedup_vs_eager": {impl: ratio("forward_s", impl) for impl in impls},
        "peak_vs_eager": {impl: ratio("peak_bytes", impl, theirs_over_eager=True) for impl in impls},
    }


QLORA_HOW = (
    "random weights, never materialized in bf16: the checkpoint lists every tensor, its decoder layers a hole in "
    "a sparse file (never read); at load each layer's linear weights are drawn from N(0, 0.02) in the compute "
    "dtype and quantized by tiertune's NF4 quantizer (bitsandbytes, 64-element blocks, double-quantized "
    "scales) into the layer's chunk, through the quantized cache's interface (RandomNF4Cache), so the load "
    "time is generation plus writing the disk tier, not a checkpoint read; every step streams the NF4 layers "
    "from the disk tier (O_DIRECT where the filesystem allows it)"
)


def phase_qlora(ctx: Context) -> None:
    """tiertune on the 70B-shaped NF4 base streamed from disk, then peft + bitsandbytes on the deepest model of
    the same shape that fits the same GPU cap."""
    import bench_qlora

    from tiertune.offload.disk import supports_o_direct

    s = ctx.settings
    dtype = getattr(torch, s.dtype)
    with tempfile.TemporaryDirectory(dir=ctx.dir, prefix="qlora-") as name:
        tmp = Path(name)
        began = time.perf_counter()
        free = shutil.disk_usage(tmp).free
        gbps, measured_by = bench_qlora.disk_read_gbps(tmp, s.disk_probe_bytes)
        log(f"qlora: disk reads {gbps:.2f} GB/s ({measured_by}), {format_size(free)} free at {tmp}")
        shape, why, steps = _qlora_depth(ctx, free, gbps, dtype)
        model = tmp / "base"
        checkpoint = write_checkpoint(model, shape, "sparse", dtype)
        log(
            f"qlora: sparse checkpoint of {shape.layers} layers: {format_size(checkpoint['apparent_bytes'])} "
            f"apparent, {format_size(checkpoint['allocated_bytes'])} on disk"
        )
        argv = [
            *shape.args(),
            "--steps",
            str(steps),
            "--batch",
            str(s.qlora_batch),
            "--seq",
            str(s.qlora_seq),
            "--host-budget",
            f"{s.qlora_host_budget}B",
            "--device-budget",
            f"{s.qlora_device_budget}B",
            "--device",
            s.device,
            "--gpu-memory-cap",
            f"{s.gpu_cap}B",
            "--quant-cache",
            "generated",
        ]
        limit = ctx.budget.left() - s.peft_reserve_s
        ours = run_child(
            "qlora-tiertune", {"argv": argv, "model": str(model), "disk": str(tmp / "disk")}, limit
        )
        full = s.qlora_shape
        base = {
            **full.describe(),
            "layers_run": shape.layers,
            "parameters_run": shape.parameters(),
            "why_fewer_layers": why,
            "nf4_layer_bytes": nf4_layer_bytes(full, dtype),
            "how": QLORA_HOW,
            "generated_on": checkpoint["generated_on"],
        }
        tokens = s.qlora_batch * s.qlora_seq
        values: dict = {
            "system": "tiertune",
            "base": base,
            "batch": s.qlora_batch,
            "seq": s.qlora_seq,
            "tokens_per_step": tokens,
            "steps": steps,
            "host_budget_bytes": s.qlora_host_budget,
            "device_budget_bytes": s.qlora_device_budget,
            "disk_read_gbps": gbps,
            "disk_read_measured_by": measured_by,
            "disk_usage": {
                "free_before_bytes": free,
                "o_direct": supports_o_direct(tmp),
                "checkpoint_apparent_bytes": checkpoint["apparent_bytes"],
                "checkpoint_allocated_bytes": checkpoint["allocated_bytes"],
                "disk_tier_peak_bytes": ours.get("peak_bytes", {}).get("disk"),
            },
        }
        if "error" in ours:
            values["error"] = ours["error"]
        else:
            values |= {
                "load_s": ours["load_and_quantize_s"],
                "step_s": ours["step_s"],
                "first_step_s": ours["first_step_s"],
                "tokens_per_second": ours["tokens_per_second"],
                "tokens_per_second_at_full_depth": ours["tokens_per_second"] * shape.layers / full.layers,
                "losses": ours["losses"],
                "peak_gpu_bytes": ours["peak_gpu_bytes"],
                "peak_rss_bytes": ours["peak_rss_bytes"],
                "peak_tier_bytes": ours["peak_bytes"],
                "bytes_moved_per_step": ours["bytes_moved_per_step"],
                "host_to_device_gbps": ours["host_to_device_gbps"],
                **bench_qlora.io_lower_bound(ours, gbps),
            }
        emit(ctx, "qlora", "qlora/tiertune", values, began)
        shutil.rmtree(model)  # room for the reference's checkpoint
        shutil.rmtree(tmp / "disk", ignore_errors=True)
        _peft_reference(ctx, tmp, dtype)


ACCUMULATION_RUNS = (
    ("1 micro-batch", 1, 0),
    ("8 micro-batches, layer-major", 8, 0),
    ("8 micro-batches, one at a time", 8, 1),
)
"""The accumulation phase's runs: (label, micro-batches per step, wave size: 0 the step's, 1 the schedule
before the layer-major step, each micro-batch's forward and backward streaming every layer)."""


def phase_accumulation(ctx: Context) -> None:
    """QLoRA of the 70B shape (cut to ``accum_layers`` layers, budgets below them) at 1 and at 8 micro-batches
    a step: the layer-major step (each layer visited once a step for all 8) against one micro-batch at a time
    (each visit once per micro-batch). Tokens/s and the bytes moved per step of each."""
    import bench_qlora

    s = ctx.settings
    dtype = getattr(torch, s.dtype)
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=ctx.dir, prefix="accumulation-") as name:
        tmp = Path(name)
        gbps, measured_by = bench_qlora.disk_read_gbps(tmp, s.disk_probe_bytes)
        shape = s.qlora_shape.with_layers(s.accum_layers)
        model = tmp / "base"
        write_checkpoint(model, shape, "sparse", dtype)
        runs: dict[str, dict] = {}
        for label, k, wave in ACCUMULATION_RUNS:
            argv = [
                *shape.args(),
                "--steps",
                "2",
                "--batch",
                str(s.qlora_batch),
                "--seq",
                str(s.qlora_seq),
                "--micro-batches",
                str(k),
                "--wave-size",
                str(wave),
                "--host-budget",
                f"{s.accum_host_budget}B",
                "--device-budget",
                f"{s.accum_device_budget}B",
                "--device",
                s.device,
                "--gpu-memory-cap",
                f"{s.gpu_cap}B",
                "--quant-cache",
                "generated",
            ]
            left = ctx.budget.left() - 10
            if left < 30:
                runs[label] = {"skipped": f"{left:.0f} s of the budget left"}
                continue
            out = run_child(
                "qlora-tiertune",
                {"argv": argv, "model": str(model), "disk": str(tmp / f"disk-{k}-{wave}")},
                left,
            )
            runs[label] = {
                "micro_batches": k,
                "wave_size": wave,
                **{
                    key: out.get(key)
                    for key in (
                        "error",
                        "step_s",
                        "first_step_s",
                        "tokens_per_second",
                        "losses",
                        "peak_gpu_bytes",
                        "bytes_moved_per_step",
                        "peak_bytes",
                    )
                },
            }
            shutil.rmtree(tmp / f"disk-{k}-{wave}", ignore_errors=True)
    one, layer_major, at_a_time = (runs[label] for label, _, _ in ACCUMULATION_RUNS)

    def ratio(a: dict, b: dict, key: str, link: str | None = None) -> float | None:
        x = (a.get(key) or {}).get(link) if link else a.get(key)
        y = (b.get(key) or {}).get(link) if link else b.get(key)
        return x / y if x and y else None

    values = {
        "system": "tiertune",
        "base": {**shape.describe(), "of": s.qlora_shape.name},
        "batch": s.qlora_batch,
        "seq": s.qlora_seq,
        "micro_batches": [k for _, k, _ in ACCUMULATION_RUNS],
        "host_budget_bytes": s.accum_host_budget,
        "device_budget_bytes": s.accum_device_budget,
        "disk_read_gbps": gbps,
        "runs": runs,
        "layer_major_speedup": ratio(layer_major, at_a_time, "tokens_per_second"),
        "k8_over_k1_tokens_per_second": ratio(layer_major, one, "tokens_per_second"),
        "k8_over_k1_disk_bytes": ratio(layer_major, one, "bytes_moved_per_step", "disk->host"),
    }
    log(
        f"accumulation: disk reads {gbps:.2f} GB/s ({measured_by}); layer-major speedup at 8 micro-batches: "
        f"{values['layer_major_speedup']}"
    )
    emit(ctx, "accumulation", "accumulation/tiertune", values, began)


def phase_longseq(ctx: Context) -> None:
    """QLoRA of the Llama-3-8B shape (cut to ``longseq_layers`` layers: a layer's memory at a length is the
    same at any depth) on one row of 64K, 128K and 256K tokens a step under the GPU cap: the layer inputs on
    the host, segment attention, the MLP in sequence tiles, the head fused with the loss. Tokens/s and peak GPU
    memory of each length, up to the first that does not train."""
    s = ctx.settings
    dtype = getattr(torch, s.dtype)
    began = time.perf_counter()
    tile = 256 if s.dry_run else 2048  # the dry run's rows are tiled too
    shape = (LLAMA3_8B if not s.dry_run else s.qlora_shape).with_layers(s.longseq_layers)
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(dir=ctx.dir, prefix="longseq-") as name:
        tmp = Path(name)
        model = tmp / "base"
        write_checkpoint(model, shape, "sparse", dtype)
        for seq in s.longseq_seqs:
            argv = [
                *shape.args(),
                "--steps",
                "2",
                "--batch",
                "1",
                "--seq",
                str(seq),
                "--activations",
                "host",
                "--sequence-tile",
                str(tile),
                "--host-budget",
                f"{s.longseq_host_budget}B",
                "--device-budget",
                f"{s.longseq_device_budget}B",
                "--device",
                s.device,
                "--gpu-memory-cap",
                f"{s.gpu_cap}B",
                "--quant-cache",
                "generated",
            ]
            left = ctx.budget.left() - 10
            if left < 30:
                runs[str(seq)] = {"skipped": f"{left:.0f} s of the budget left"}
                break
            out = run_child(
                "qlora-tiertune", {"argv": argv, "model": str(model), "disk": str(tmp / f"disk-{seq}")}, left
            )
            runs[str(seq)] = {
                key: out.get(key)
                for key in (
                    "error",
                    "step_s",
                    "first_step_s",
                    "tokens_per_second",
                    "losses",
                    "peak_gpu_bytes",
                    "peak_rss_bytes",
                )
            }
            log(f"longseq {seq} tokens: {json.dumps(runs[str(seq)])}")
            shutil.rmtree(tmp / f"disk-{seq}", ignore_errors=True)
            if out.get("error"):
                break
    trained = [int(k) for k, r in runs.items() if r.get("step_s") is not None]
    values = {
        "system": "tiertune",
        "base": {**shape.describe(), "of": LLAMA3_8B.name},
        "batch": 1,
        "host_budget_bytes": s.longseq_host_budget,
        "device_budget_bytes": s.longseq_device_budget,
        "sequence_tile": tile,
        "runs": runs,
        "longest_trained": max(trained, default=None),
    }
    emit(ctx, "longseq", "longseq/tiertune", values, began)


def _streamed_qlora_runs(
    ctx: Context, phase: str, shape: Shape, runs: dict[str, list[str]], more: tuple[str, ...] = ()
) -> dict[str, dict]:
    """bench_qlora's tiertune mode once per entry of ``runs`` (label -> its own arguments) on one sparse checkpoint
    of ``shape`` (its NF4 layers generated), streamed from disk through the accumulation phase's budgets under
    the GPU cap, 2 steps of 8 micro-batches, their boundaries on the device; each run's figures by label (and
    ``more`` of bench_qlora's keys)."""
    s = ctx.settings
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(dir=ctx.dir, prefix=f"{phase}-") as name:
        tmp = Path(name)
        model = tmp / "base"
        write_checkpoint(model, shape, "sparse", getattr(torch, s.dtype))
        for label, own in runs.items():
            argv = [
                *shape.args(),
                "--steps",
                "2",
                "--seq",
                str(s.qlora_seq),
                "--micro-batches",
                "8",
                *own,
                "--activations",
                "device",
                "--host-budget",
                f"{s.accum_host_budget}B",
                "--device-budget",
                f"{s.accum_device_budget}B",
                "--device",
                s.device,
                "--gpu-memory-cap",
                f"{s.gpu_cap}B",
                "--quant-cache",
                "generated",
            ]
            left = ctx.budget.left() - 10
            if left < 30:
                out[label] = {"skipped": f"{left:.0f} s of the budget left"}
                continue
            got = run_child(
                "qlora-tiertune", {"argv": argv, "model": str(model), "disk": str(tmp / "disk")}, left
            )
            keys = (
                "error",
                "step_s",
                "tokens_per_second",
                "losses",
                "peak_gpu_bytes",
                "bytes_moved_per_step",
                *more,
            )
            out[label] = {key: got.get(key) for key in keys}
            log(f"{phase}, {label}: {json.dumps(out[label])}")
            shutil.rmtree(tmp / "disk", ignore_errors=True)
    return out


def _side_by_side(
    s: Settings, shape: Shape, runs: dict[str, dict], base: str, other: str, ratio: str
) -> dict:
    """A phase's result of two ``_streamed_qlora_runs``: the base and budgets, both runs, ``other``'s bytes moved
    and seconds a step over ``base``'s (``<ratio>_bytes``, ``<ratio>_seconds``), ``other``'s peak GPU memory."""
    first, second = runs.get(base, {}), runs.get(other, {})

    def total(run: dict) -> float | None:
        moved = run.get("bytes_moved_per_step")
        return sum(moved.values()) if moved else None

    peak = second.get("peak_gpu_bytes")
    return {
        "system": "tiertune",
        "base": {**shape.describe(), "of": s.qlora_shape.name},
        "seq": s.qlora_seq,
        "micro_batches": 8,
        "host_budget_bytes": s.accum_host_budget,
        "device_budget_bytes": s.accum_device_budget,
        "runs": runs,
        f"{ratio}_bytes": total(second) / total(first) if total(second) and total(first) else None,
        f"{ratio}_seconds": second["step_s"] / first["step_s"]
        if second.get("step_s") and first.get("step_s")
        else None,
        "peak_gpu_bytes": peak,
        "under_cap": None if peak is None else peak <= s.gpu_cap,
    }


DPO_RUNS = (("sft, 2 rows a micro-batch", "sft", 2), ("dpo, 1 pair a micro-batch", "dpo", 1))
"""The dpo phase's runs: (label, objective, --batch: rows for SFT, pairs for DPO): as many sequences each."""


def phase_dpo(ctx: Context) -> None:
    """QLoRA DPO of the 70B shape (cut to ``accum_layers`` layers, streamed from disk through the accumulation
    phase's budgets) under the GPU cap, 8 micro-batches of one pair a step (their boundaries on the device), the
    reference (the base, adapters off) in the same layer visits, against SFT of as many sequences: tokens/s, bytes
    moved per step, peak GPU memory of each; the DPO step's bytes over the SFT step's (the reference shares the
    visit: 1.0)."""
    s = ctx.settings
    began = time.perf_counter()
    shape = s.qlora_shape.with_layers(s.accum_layers)
    runs = _streamed_qlora_runs(
        ctx,
        "dpo",
        shape,
        {label: ["--objective", objective, "--batch", str(batch)] for label, objective, batch in DPO_RUNS},
    )
    values = _side_by_side(s, shape, runs, DPO_RUNS[0][0], DPO_RUNS[1][0], "dpo_over_sft")
    emit(ctx, "dpo", "dpo/tiertune", values, began)


SEVERAL_RUNS = (("1 adapter", 1), ("4 adapters", 4))
"""The several phase's runs: (label, LoRA adapters over the base, each 8 micro-batches of one row a step)."""


def phase_several(ctx: Context) -> None:
    """Several LoRA adapters over one base (``engine.several``): QLoRA of the 70B shape (cut to ``accum_layers``
    layers, streamed from disk through the accumulation phase's budgets) under the GPU cap, 4 adapters in one
    stream against 1, each adapter 8 micro-batches of one row a step: bytes moved per step (the base read once
    for all: ~1.0), the step's seconds (at most 1.3x one adapter's where reading and dequantizing bound it),
    tokens/s and peak GPU memory of each."""
    s = ctx.settings
    began = time.perf_counter()
    shape = s.qlora_shape.with_layers(s.accum_layers)
    runs = _streamed_qlora_runs(
        ctx, "several", shape, {label: ["--adapters", str(n), "--batch", "1"] for label, n in SEVERAL_RUNS}
    )
    values = _side_by_side(s, shape, runs, SEVERAL_RUNS[0][0], SEVERAL_RUNS[1][0], "n4_over_n1")
    emit(ctx, "several", "several/tiertune", values, began)


GRPO_KEYS = (
    "generation_s",
    "decoded_tokens_per_second",
    "completions",
    "completion_tokens",
    "generation_bytes",
    "layer_weights_bytes",
    "layer_passes_per_decoded_token",
)
"""What bench_qlora's ``--objective grpo`` adds to a run's figures (its generation's)."""


def phase_grpo(ctx: Context) -> None:
    """QLoRA GRPO of the 70B shape (cut to ``accum_layers`` layers, streamed from disk through the accumulation
    phase's budgets) under the GPU cap, as ``finetune.grpo`` steps: 16 completions (2 a micro-batch, 8 micro-batches)
    of ``grpo_completion`` tokens decoded together by the streamed model, then the update on them. The
    generation's seconds and decoded tokens/s, the bytes a decoded token moves per link over one pass of the
    decoder layers' weights (to the device: ~1, the layers once for every completion), the step's seconds,
    bytes moved by the update and peak GPU memory."""
    s = ctx.settings
    began = time.perf_counter()
    shape = s.qlora_shape.with_layers(s.accum_layers)
    label = f"grpo, 16 completions of {s.grpo_completion} tokens"
    own = ["--objective", "grpo", "--batch", "2", "--completion", str(s.grpo_completion)]
    run = _streamed_qlora_runs(ctx, "grpo", shape, {label: own}, GRPO_KEYS)[label]
    peak = run.get("peak_gpu_bytes")
    values = {
        "system": "tiertune",
        "base": {**shape.describe(), "of": s.qlora_shape.name},
        "seq": s.qlora_seq,
        "host_budget_bytes": s.accum_host_budget,
        "device_budget_bytes": s.accum_device_budget,
        **{k: run.get(k) for k in (*GRPO_KEYS, "step_s", "losses", "bytes_moved_per_step")},
        "peak_gpu_bytes": peak,
        "under_cap": None if peak is None else peak <= s.gpu_cap,
    }
    for what in ("error", "skipped"):
        if run.get(what):
            values[what] = run[what]
    emit(ctx, "grpo", "grpo/tiertune", values, began)


def _qlora_depth(ctx: Context, free: int, gbps: float, dtype: torch.dtype) -> tuple[Shape, str | None, int]:
    """The layers of the 70B shape that run, and the steps: all of them unless the disk cannot hold their disk
    tier next to the checkpoint's embedding, or streaming them (a step reads the base about twice: forward,
    and the recomputing backward) would not end within the phase's budget; then fewer, and why."""
    s = ctx.settings
    full = s.qlora_shape
    layer = nf4_layer_bytes(full, dtype)
    embed = full.vocab * full.hidden * (dtype.itemsize + 2)  # on the disk tier, and bf16 in the checkpoint

    def seconds(layers: int, steps: int) -> float:
        tier = (layers * layer + embed) / (gbps * 1e9)
        return 30 + tier + steps * 2.5 * tier  # start, writing the disk tier, steps

    layers, why = full.layers, None
    while layers > 1 and layers * layer + embed + s.disk_margin > free:
        layers -= 1
    if layers < full.layers:
        why = (
            f"the disk tier of {full.layers} layers ({format_size(full.layers * layer)}) does not fit the "
            f"{format_size(free)} free next to the embedding"
        )
    steps = s.qlora_steps
    left = ctx.budget.left() - s.peft_reserve_s
    if seconds(layers, steps) > left:
        steps = 2  # the first step records the trace: one steady step at least
    while layers > 1 and seconds(layers, steps) > left:
        layers = max(1, int(layers * 0.9))
        why = (
            f"time: at {gbps:.2f} GB/s from disk, {full.layers} layers would not load and stream "
            f"{steps} steps in the {left:.0f} s left"
        )
    return full.with_layers(layers), why, steps


def _peft_reference(ctx: Context, tmp: Path, dtype: torch.dtype) -> None:
    """peft + bitsandbytes on the deepest model of the qlora shape that fits the GPU cap: the depth
    ``peft_layers_that_fit`` estimates first; after an out-of-memory 15% fewer layers, after a fit 15% more
    (once), while the budget lasts. The figures are the deepest fit's."""
    s = ctx.settings
    began = time.perf_counter()
    full = s.qlora_shape
    tokens = s.qlora_batch * s.qlora_seq
    if s.dry_run:
        layers = full.layers
        chosen = "dry run: every layer of the toy shape (no GPU, so no cap to fit)"
    else:
        layers = min(full.layers, peft_layers_that_fit(full, tokens, s.gpu_cap))
        chosen = (
            f"peft_layers_that_fit estimated {layers} layers within {format_size(s.gpu_cap)} at {tokens} "
            "tokens (NF4 weights, LoRA states, checkpointed layer inputs, logits, workspace); then 15% fewer "
            "after an out-of-memory, 15% more (once) after a fit, while the budget lasted"
        )
    values: dict = {
        "system": "peft+bitsandbytes",
        "layers_chosen_by": chosen,
        "batch": s.qlora_batch,
        "seq": s.qlora_seq,
        "tokens_per_step": tokens,
        "steps": s.qlora_steps,
    }
    if layers < 1:
        emit(ctx, "qlora", "qlora/peft", values | {"error": "not even one layer fits the cap"}, began)
        return
    deepest = min(full.layers, int(layers * 1.15))
    source = tmp / "peft-nf4"
    checkpoint = write_checkpoint(source, full.with_layers(deepest), "nf4", dtype)
    attempts: list[dict] = []
    best: dict | None = None  # the deepest attempt that fit, and its figures
    result: dict = {}
    while layers not in [a["layers"] for a in attempts]:
        shape = full.with_layers(layers)
        model = tmp / f"peft-{layers}"
        subset_checkpoint(source, model, layers)
        argv = [
            *shape.args(),
            "--steps",
            str(s.qlora_steps),
            "--batch",
            str(s.qlora_batch),
            "--seq",
            str(s.qlora_seq),
            "--device",
            s.device,
            "--gpu-memory-cap",
            f"{s.gpu_cap}B",
        ]
        result = run_child("peft", {"argv": argv, "model": str(model)}, ctx.budget.left() - 5)
        attempts.append(
            {
                "layers": layers,
                "parameters": shape.parameters(),
                "outcome": result.get("error", "fit"),
                "peak_gpu_bytes": result.get("peak_gpu_bytes"),
            }
        )
        if "error" not in result:
            best = {"layers": layers, "result": result}
            grown = all(a["outcome"] == "fit" for a in attempts)  # nothing deeper failed yet: try deeper once
            layers = deepest if grown else layers
        elif result["error"] == "out of memory" and best is None:
            layers = max(1, int(layers * 0.85))
        if ctx.budget.left() < 75:
            break
    if best is not None:
        result = best["result"]
    shape = full.with_layers(best["layers"] if best else attempts[-1]["layers"])
    values |= {
        "base": {
            **shape.describe(),
            "how": "random N(0, 0.02) weights quantized by bitsandbytes' Linear4bit and "
            "saved pre-quantized (its own serialization); loaded by from_pretrained with the same "
            "BitsAndBytesConfig (NF4, double quantization)",
            "checkpoint_written": checkpoint | {"layers": deepest},
        },
        "attempts": attempts,
        "parameters_vs_tiertune_base": shape.parameters() / full.parameters(),
    }
    if best is None:
        values["error"] = result.get("error", "no attempt ran")
    else:
        values |= {
            "load_s": result["load_and_quantize_s"],
            "step_s": result["step_s"],
            "first_step_s": result["first_step_s"],
            "tokens_per_second": result["tokens_per_second"],
            "losses": result["losses"],
            "peak_gpu_bytes": result["peak_gpu_bytes"],
            "peak_rss_bytes": result["peak_rss_bytes"],
        }
    emit(ctx, "qlora", "qlora/peft", values, began)


DEEPSPEED_SKIPPED = (
    "not carried: PyPI has no binary wheel of a current DeepSpeed (checked 2026-11-23: pip download deepspeed "
    "--only-binary=:all: finds only 0.3.1.dev5, from 2020; 0.19.8 is a source distribution) and ZeRO-Offload's "
    "CPU Adam op is compiled on first use (a C++ toolchain, and hjson and pydantic, which the device lacks), "
    "which this no-network machine and its 9-minute commands leave no room for"
)


def phase_full(ctx: Context) -> None:
    """Full fine-tuning: tiertune (weights and AdamW states on the host) against FSDP2 with CPU offload, on
    the same model and batch under the same GPU cap; DeepSpeed skipped with the reason."""
    import psutil

    s = ctx.settings
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=ctx.dir, prefix="full-") as name:
        tmp = Path(name)
        env = pinned_rounding_off(s)
        plan = plan_full(
            s,
            psutil.virtual_memory().total,
            shutil.disk_usage(tmp).free,
            pinned_rounds=not s.dry_run and not env,
        )
        shape = s.full_shape.with_layers(plan["layers"])
        log(
            f"full: {shape.layers} layers, {shape.parameters() / 1e9:.2f} B parameters; plan {json.dumps(plan)}"
        )
        peak = run_child("peak", {"device": s.device}, min(120.0, ctx.budget.left() - 60), env=env)
        peak_tflops = peak.get("tflops")
        datasheet = datasheet_tflops(ctx.machine.get("gpu"))
        model = tmp / "model"
        checkpoint = write_checkpoint(model, shape, "random", torch.bfloat16)
        info = {
            **shape.describe(),
            "why_fewer_layers": plan["why_fewer_layers"],
            "checkpoint": checkpoint,
            "peak_matmul": peak,
        }
        tokens = s.full_batch * s.full_seq
        common = {
            "model": info,
            "batch": s.full_batch,
            "seq": s.full_seq,
            "tokens_per_step": tokens,
            "steps": s.full_steps,
            "max_grad_norm": 0.0,
        }
        argv = [
            *shape.args(),
            "--steps",
            str(s.full_steps),
            "--batch",
            str(s.full_batch),
            "--seq",
            str(s.full_seq),
            "--device-budget",
            f"{s.full_device_budget}B",
            "--host-budget",
            f"{plan['tiertune_host_budget_bytes']}B",
            "--max-grad-norm",
            "0",
            "--threads",
            "1" if s.dry_run else "0",
            "--device",
            s.device,
            "--dtype",
            s.dtype,
            "--gpu-memory-cap",
            f"{s.gpu_cap}B",
        ]
        limit = (ctx.budget.left() - 20) * 0.5  # the rest is FSDP2's
        ran = time.perf_counter()
        ours = run_child(
            "train", {"argv": argv, "model": str(model), "disk": str(tmp / "disk")}, limit, env=env
        )
        ours_s = time.perf_counter() - ran
        values = common | {
            "system": "tiertune",
            "plan": plan,
            "placement": {
                "weights": f"host (bf16), streamed through a {format_size(s.full_device_budget)} device tier",
                "optimizer_states": "host (fp32 master weights and Adam moments)",
                "gradients": "host (fp32, homed for the layers in flight only; each consumed by its layer's "
                "update in backward)",
                "activations": "device (each layer's input; layers recomputed in backward)",
            },
            "optimizer": "tiertune CPU AdamW (torch's fused CPU kernel) overlapped with backward, in place "
            "(no clipping)",
        }
        values |= _training_figures(ours, shape, tokens, peak_tflops, datasheet)
        if "error" not in ours:
            values |= {k: ours[k] for k in (*_OVERLAP, "load_s")} | {"peak_tier_bytes": ours["peak_bytes"]}
        emit(ctx, "full", "full/tiertune", values, began)
        began = time.perf_counter()
        params = {
            "model": str(model),
            "device": s.device,
            "gpu_cap": s.gpu_cap,
            "batch": s.full_batch,
            "seq": s.full_seq,
            "steps": s.full_steps,
            "threads": 1 if s.dry_run else 0,
            "rendezvous": str(tmp / "rendezvous"),
        }
        theirs = run_child("fsdp2", params, ctx.budget.left() - 5, env=env)
        values = common | {
            "system": "fsdp2",
            "pinned_memory_rounding": _rounding(env, s.dry_run),
            "placement": {
                "parameters": "host (fp32 shards; bf16 copies on the device, one layer at a time)",
                "gradients": "host (fp32)",
                "optimizer_states": "host (torch AdamW moments)",
                "activations": "device (transformers' activation checkpointing per layer)",
            },
        }
        values |= _training_figures(theirs, shape, tokens, peak_tflops, datasheet)
        if "error" not in theirs:
            values |= {
                k: theirs[k] for k in ("optimizer", "optimizer_s", "mixed_precision", "backend", "load_s")
            }
        emit(ctx, "full", "full/fsdp2", values, began)
        _full_delayed(ctx, argv, model, tmp, env, ours_s, common, shape, tokens, peak_tflops, datasheet)
    importable = importlib.util.find_spec("deepspeed") is not None
    reason = DEEPSPEED_SKIPPED if not importable else "installed, but this suite does not drive ZeRO-Offload"
    emit(ctx, "full", "full/deepspeed", {"reference": "deepspeed", "skipped": reason}, time.perf_counter())


def _full_delayed(
    ctx: Context,
    argv: list[str],
    model: Path,
    tmp: Path,
    env: dict[str, str],
    ours_s: float,
    common: dict,
    shape: Shape,
    tokens: int,
    peak_tflops: float | None,
    datasheet: float | None,
) -> None:
    """``full/tiertune-delayed``: the same run with ZeRO-Offload's one-step-delayed update (``delay_update``: a
    step's update runs on the CPU during the next step's compute, its forward on weights one update behind), where
    the time left holds another run as long as the first (else skipped, saying so)."""
    began = time.perf_counter()
    if ctx.budget.left() - 10 < 1.2 * ours_s:
        skipped = f"{ctx.budget.left():.0f} s left, the overlapped run took {ours_s:.0f} s: run the full phase alone"
        emit(ctx, "full", "full/tiertune-delayed", {"system": "tiertune", "skipped": skipped}, began)
        return
    params = {"argv": argv, "model": str(model), "disk": str(tmp / "disk-delayed"), "mode": "host-delayed"}
    delayed = run_child("train", params, ctx.budget.left() - 5, env=env)
    values = common | {
        "system": "tiertune",
        "placement": "as full/tiertune",
        "optimizer": "tiertune CPU AdamW, one step delayed (offload.delay_update: ZeRO-Offload's DPU): a step's "
        "update during the next step's compute; the losses differ from the exact update's (README: the "
        "delayed update's effect on the loss)",
    }
    values |= _training_figures(delayed, shape, tokens, peak_tflops, datasheet)
    if "error" not in delayed:
        values |= {k: delayed[k] for k in (*_OVERLAP, "load_s")}
    emit(ctx, "full", "full/tiertune-delayed", values, began)


def _rounding(env: dict[str, str], dry_run: bool) -> str:
    if dry_run:
        return "none (nothing is pinned on a CPU)"
    if env:
        return f"off for blocks of 64 MiB and more ({env['PYTORCH_ALLOC_CONF']})"
    return "torch's default: pinned blocks rounded up to a power of two (this torch cannot turn it off)"


def _training_figures(
    result: dict, shape: Shape, tokens: int, peak: float | None, datasheet: float | None
) -> dict:
    """A training child's step figures and its FLOPS by ``flops``; its error instead when it failed."""
    if "error" in result:
        return {"error": result["error"], "peak_gpu_bytes": result.get("peak_gpu_bytes")}
    out = {k: result[k] for k in ("step_s", "first_step_s", "losses", "peak_gpu_bytes", "peak_rss_bytes")}
    out["tokens_per_second"] = tokens / result["step_s"]
    return out | flops(shape, tokens, result["step_s"], peak, datasheet)


SHIPPED_CONFIG = ROOT / "tiertune" / "recipes" / "models" / "deepseek-ai" / "DeepSeek-V3.1" / "config.json"


def phase_shipped(ctx: Context) -> None:
    """LoRA of DeepSeek-V3.1 as it ships (FP8 e4m3 with an fp32 scale per 128 x 128 block, each routed expert a
    module of its own; ``shipped_release.py`` writes it with random values), cut to ``shipped_layers`` layers,
    read in place from its own files (no copy in the disk tier) and streamed through budgets below it under the
    GPU cap: tokens/s, bytes read from disk a step against the release's layer bytes, peak GPU memory."""
    import bench_qlora
    import shipped_release

    s = ctx.settings
    began = time.perf_counter()
    tokens = s.shipped_seq * s.shipped_micro_batches
    with tempfile.TemporaryDirectory(dir=ctx.dir, prefix="shipped-") as name:
        tmp = Path(name)
        gbps, measured_by = bench_qlora.disk_read_gbps(tmp, s.disk_probe_bytes)
        release = shipped_release.write_release(
            SHIPPED_CONFIG, tmp / "base", s.shipped_layers, s.shipped_overrides
        )
        log(
            f"shipped: {release['ships_as']} release of {s.shipped_layers} layers written, "
            f"{format_size(release['tensor_bytes'])} ({time.perf_counter() - began:.0f} s)"
        )
        argv = [
            "--steps",
            "3",
            "--batch",
            "1",
            "--seq",
            str(s.shipped_seq),
            "--micro-batches",
            str(s.shipped_micro_batches),
            "--host-budget",
            f"{s.shipped_host_budget}B",
            "--device-budget",
            f"{s.shipped_device_budget}B",
            "--device",
            s.device,
            "--gpu-memory-cap",
            f"{s.gpu_cap}B",
            "--quantize",
            "none",
        ]
        ours = run_child(
            "qlora-tiertune",
            {"argv": argv, "model": str(tmp / "base"), "disk": str(tmp / "disk")},
            ctx.budget.left() - 10,
        )
    values: dict = {
        "system": "tiertune",
        "base": {
            "config": "deepseek-ai/DeepSeek-V3.1",
            "layers_run": s.shipped_layers,
            "overrides": s.shipped_overrides,
            **release,
        },
        "micro_batches": s.shipped_micro_batches,
        "batch": 1,
        "seq": s.shipped_seq,
        "tokens_per_step": tokens,
        "steps": 3,
        "host_budget_bytes": s.shipped_host_budget,
        "device_budget_bytes": s.shipped_device_budget,
        "disk_read_gbps": gbps,
        "disk_read_measured_by": measured_by,
    }
    if "error" in ours:
        values["error"] = ours["error"]
    else:
        disk = ours["bytes_moved_per_step"].get("disk->host", 0)
        values |= {
            "load_s": ours["load_and_quantize_s"],
            "step_s": ours["step_s"],
            "first_step_s": ours["first_step_s"],
            "tokens_per_second": ours["tokens_per_second"],
            "losses": ours["losses"],
            "peak_gpu_bytes": ours["peak_gpu_bytes"],
            "peak_rss_bytes": ours["peak_rss_bytes"],
            "bytes_moved_per_step": ours["bytes_moved_per_step"],
            "disk_passes_per_step": disk / release["layer_bytes"],
            "step_over_disk_bound": ours["step_s"] / (disk / (gbps * 1e9)) if disk else None,
            "under_cap": (
                ours["peak_gpu_bytes"] <= s.gpu_cap if ours["peak_gpu_bytes"] is not None else None
            ),
        }
    emit(ctx, "shipped", "shipped/tiertune", values, began)


PHASE_FUNCS: dict[str, Callable[[Context], None]] = {
    "tests": phase_tests,
    "kernels": phase_kernels,
    "qlora": phase_qlora,
    "accumulation": phase_accumulation,
    "full": phase_full,
    "longseq": phase_longseq,
    "dpo": phase_dpo,
    "several": phase_several,
    "grpo": phase_grpo,
    "shipped": phase_shipped,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated, of {', '.join(PHASES)}")
    p.add_argument("--dry-run", action="store_true", help="every phase on the CPU at toy sizes")
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="wall-clock seconds this command may take (default 530; 600 with --dry-run)",
    )
    p.add_argument(
        "--dir", default=str(ROOT / ".tiertune-bench"), help="scratch space on the disk to measure"
    )
    p.add_argument(
        "--gpu-memory-cap", default="24GiB", help="what each measured process may allocate on the GPU"
    )
    p.add_argument("--pytest-log", default=None, help="file for the tests phase's whole pytest output")
    p.add_argument("--child", nargs=2, metavar=("NAME", "PARAMS"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(CHILDREN[args.child[0]](json.loads(args.child[1]))), flush=True)
        return 0
    phases = tuple(x for x in args.phases.split(",") if x)
    unknown = [x for x in phases if x not in PHASES]
    if unknown:
        p.error(f"unknown phase(s) {', '.join(unknown)}; phases: {', '.join(PHASES)}")
    if not args.dry_run and not torch.cuda.is_available():
        p.error("no CUDA device here: run this on the GPU machine, or --dry-run for the CPU rehearsal")
    settings = Settings.for_run(args.dry_run, parse_size(args.gpu_memory_cap, "--gpu-memory-cap"))
    directory = Path(args.dir).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    budget = Budget(args.budget_s or (600.0 if args.dry_run else 530.0))
    command = shlex.join(
        ["python", os.path.relpath(__file__, ROOT), *(argv if argv is not None else sys.argv[1:])]
    )
    ctx = Context(
        settings,
        budget,
        phases,
        describe_machine(directory),
        command,
        directory,
        pytest_log=Path(args.pytest_log) if args.pytest_log else None,
    )
    crashed = False
    for phase in phases:
        log(f"phase {phase}: {budget.left():.0f} s of the budget left")
        began = time.perf_counter()
        try:
            PHASE_FUNCS[phase](ctx)
        except Exception as exc:  # one phase's failure is reported and the others still run
            traceback.print_exc()
            crashed = True
            unprinted = [r for r in PHASE_RESULTS[phase] if r not in ctx.printed] or [
                PHASE_RESULTS[phase][-1]
            ]
            for result in unprinted:
                emit(ctx, phase, result, {"error": f"the suite failed: {exc!r}"}, began)
    log(f"done: {budget.left():.0f} s of the budget left")
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
