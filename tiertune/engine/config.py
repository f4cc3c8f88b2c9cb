"""The engine's configuration (``EngineConfig``: hyper-parameters and placements, validated)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tiertune.settings import GaloreSettings, LoraSettings, ObjectiveSettings

STACK_TOKENS = 2048
"""The most tokens a quantized layer's visit runs as one batch by default (``EngineConfig.stack_tokens``)."""

SEQUENCE_TILE = 2048
"""The tokens a layer's MLP computes at a time by default (``EngineConfig.sequence_tile``, ``engine.tiling``)."""


@dataclass
class EngineConfig:
    """Hyper-parameters and placements of the streamed engine (names as Hugging Face TrainingArguments)."""

    dtype: torch.dtype = torch.float32  # compute dtype of the weights
    learning_rate: float = 5e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0  # 0 or less: no clipping
    lr_scheduler_type: str = "linear"
    warmup_steps: int = 0
    max_steps: int = 1
    params: str = "host"  # home tier of the compute-dtype weights
    optimizer_states: str = "host"  # home tier of the fp32 master weights and Adam moments
    gradients: str = "host"  # home tier of the fp32 gradient accumulators
    # on: the optimizer runs during backward (speculatively, into twin states, when clipping is on);
    # off: after backward; auto: on when the twin states fit the budgets, else off
    overlap_optimizer: str | bool = "auto"
    # the run's memory plan decided whether the speculative step's twins are made (``engine.memory``, checked
    # against the budgets before loading): None, the engine decides from the store's room
    twins: bool | None = None
    # how a speculative step that clips is redone: "twins", from the speculation's twins and the untouched
    # sources (``methods.optim.adamw_redo``: no gradient needed, so each is dropped once its update read it
    # and the host holds the gradients of the layers in flight; equal to clip-then-step to fp32 rounding);
    # "gradients": AdamW again on the kept gradients times the coefficient, bit for bit torch's clip-then-step
    # (the step's gradients held until its norm is known). 8-bit moments and GaLore always redo from gradients
    redo: str = "twins"
    # the optimizer's copy of the weights: "float32", fp32 master weights beside weights of a lower ``dtype``
    # (4 bytes a parameter more); "bfloat16", the bf16 weights are their own master, each update computed in
    # fp32 and rounded stochastically into them (``methods.optim.adamw_stochastic``: an unbiased rounding, so
    # updates below half a bf16 step still move the weights on average); needs dtype bfloat16
    master_weights: str = "float32"
    # ZeRO-Offload's one-step-delayed update: step t's update runs on the CPU during step t + 1, whose forward
    # and backward compute on the weights before it (one step stale: W_t-1 where a plain loop has W_t); the
    # clipping norm is known before the update starts, so it is exact with no speculation and no twins; fp32
    # master weights are kept beside the weights even in fp32 (the weights written from them once step t + 1's
    # backward is done with a layer: ``Updater``); not with GaLore nor bf16 master weights
    delay_update: bool = False
    # backward hands a layer's gradients to the host after launching the next layer's backward (1) or right
    # after its own (0): on a GPU the copy then runs on a stream of its own and the host's part of the hand-off
    # (the copy's wait, the norms, the optimizer's unit) overlaps the next layer's backward, for one more
    # layer's fp32 gradient on the device. None: 1 computing on a CUDA device with weights and optimizer states
    # off the disk, else 0 (a CPU gains nothing; a step bound by the disk gains nothing worth that memory)
    handoff_lag: int | None = None
    activations: str = "device"  # where the hidden states at the layer boundaries wait: device or host
    activation_tokens: int = 0  # batch x sequence length of the largest micro-batch (needed for host)
    # micro-batches run through each layer while it is loaded (a wave, ``engine.schedule``): 0, a whole
    # step's (with activations on the host, gradient_accumulation_steps: the slots of the boundary chunks)
    wave_size: int = 0
    # a layer's visit runs consecutive micro-batches of a wave as one batch of at most this many tokens (batch
    # x sequence) where that computes the same (``engine.schedule.stacks``): a quantized layer dequantized once
    # for all of them, not once each; the weight gradients are then summed inside the matmuls, so they differ
    # from one-at-a-time's in the last bits. A layer's temporaries are at most those of a micro-batch of this
    # many tokens. 0: each on its own; None: STACK_TOKENS for a quantized base, else 0 (unquantized products
    # cost the same either way, and one at a time the sums keep a plain loop's order, bit for bit)
    stack_tokens: int | None = None
    # a layer's MLP computed this many tokens at a time in forward and backward (``engine.tiling``): its
    # intermediate activations exist for one tile, not the whole sequence; 0: untiled
    sequence_tile: int = SEQUENCE_TILE
    # micro-batches per step: with more than one, GaLore sums its projected weights' full gradients in host
    # accumulators, placed up front (a step with more micro-batches than said adds them when it needs them)
    gradient_accumulation_steps: int = 1
    # full: every weight trained with AdamW; lora: a frozen base with peft LoRA adapters; galore: every weight
    # trained, the decoder layers' linear weights with Adam in a low-rank projection of their gradients; frozen:
    # nothing trained, no step (a distillation's teacher: its passes alone, ``StreamedTrainer.teacher_topk``)
    method: str = "full"
    quantize: str = "none"  # none, nf4, fp4 or int8: how the layers' linear weights are stored and streamed
    lora: LoraSettings = field(default_factory=LoraSettings)
    galore: GaloreSettings = field(default_factory=GaloreSettings)
    quant_cache: str | None = None  # directory of quantized chunks reused across runs (None: no cache)
    optim: str = "adamw_torch"  # or adamw_bnb_8bit: Adam moments in 8 bits (bitsandbytes' AdamW8bit)
    # auto: Triton kernels on a CUDA device with Triton, else the ops' torch references; torch; triton; none:
    # the model's own modules and unfused loss (the plain-loop oracle of the parity tests)
    kernels: str = "auto"
    # what a step minimizes: the target tokens' cross-entropy (sft), or a preference objective over pairs
    objective: ObjectiveSettings = field(default_factory=ObjectiveSettings)
    # several LoRA adapters over one base (``StreamedTrainer.step_adapters``): the settings of the 2nd, 3rd, ...
    # adapter, each its own recipe's (its ``lora``, learning rate and schedule, AdamW's settings, clipping, steps)
    others: tuple[EngineConfig, ...] = ()
    # of several adapters, the seed of this adapter's micro-batches' random streams (``training.seed``): its
    # dropout masks are its own, whichever adapters share its steps; one adapter's come from torch's generator
    seed: int = 0

    def layer_dtype(self, device: torch.device) -> torch.dtype:
        """The dtype the decoder layers' products run in on ``device``: the compute dtype, but for a quantized
        base the dtype its weights dequantize to, one products run fast in here (fp32 on a CPU without
        native bf16: ``kernels.ops.backend.matmul_dtype``)."""
        from tiertune.kernels.ops.backend import matmul_dtype

        return matmul_dtype(self.dtype, device) if self.quantize != "none" else self.dtype

    @property
    def stack_limit(self) -> int:
        """``stack_tokens`` resolved: the most tokens a layer's visit runs as one batch (0: one at a time)."""
        if self.stack_tokens is not None:
            return self.stack_tokens
        return STACK_TOKENS if self.quantize != "none" else 0

    @property
    def adapter_configs(self) -> tuple[EngineConfig, ...]:
        """Each adapter's settings, in ``Adapters.names``' order: this config's, then ``others``'."""
        return (self, *self.others)

    @property
    def trains_base(self) -> bool:
        """Whether the model's own weights are trained (full, GaLore), not frozen (LoRA's base, a teacher)."""
        return self.method not in ("lora", "frozen")

    @property
    def clips(self) -> bool:
        """Whether a step clips the gradient's global norm (``max_grad_norm`` set and positive)."""
        return bool(self.max_grad_norm and self.max_grad_norm > 0)

    def __post_init__(self) -> None:
        # resolved values: the recipe checks each setting, ``config.plan`` the rules between them
        if isinstance(self.overlap_optimizer, bool):
            self.overlap_optimizer = "on" if self.overlap_optimizer else "off"
        if self.redo not in ("twins", "gradients"):
            raise ValueError(f"EngineConfig.redo is 'twins' or 'gradients', got {self.redo!r}")
        if self.handoff_lag not in (None, 0, 1):
            raise ValueError(f"EngineConfig.handoff_lag is None, 0 or 1, got {self.handoff_lag!r}")
        if self.master_weights not in ("float32", "bfloat16"):
            raise ValueError(
                f"EngineConfig.master_weights is 'float32' or 'bfloat16', got {self.master_weights!r}"
            )
        if self.master_weights == "bfloat16" and self.dtype != torch.bfloat16:
            raise ValueError(f"EngineConfig.master_weights bfloat16 needs dtype bfloat16, got {self.dtype}")
        if self.master_weights == "bfloat16" and (self.method != "full" or self.optim != "adamw_torch"):
            raise ValueError("EngineConfig.master_weights bfloat16 is for method full with optim adamw_torch")
        if self.delay_update and (
            self.master_weights != "float32" or self.method != "full" or self.overlap_optimizer == "on"
        ):
            raise ValueError(
                "EngineConfig.delay_update is for method full with fp32 master weights, overlap_optimizer not on"
            )

    def lag(self, device: torch.device) -> int:
        """``handoff_lag`` resolved for a run computing on ``device``."""
        if self.handoff_lag is not None:
            return self.handoff_lag
        return int(device.type == "cuda" and "disk" not in (self.params, self.optimizer_states))

    @property
    def fp32_master(self) -> bool:
        """Whether fp32 master weights are kept beside the weights (their dtype is lower, or the update is
        delayed, ``master_weights`` float32)."""
        return (self.dtype != torch.float32 or self.delay_update) and self.master_weights == "float32"
