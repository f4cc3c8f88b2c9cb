"""Recipes: the YAML a run is described by, validated into typed sections.

Every key has a default; an unknown key is an error that suggests the nearest known one; a value of the
wrong type or out of range is an error naming the key and what is expected. Names and defaults of the
``training`` section follow Hugging Face ``TrainingArguments``. Command-line overrides use dotted paths:
``training.learning_rate=1e-4``.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tiertune.errors import ConfigError
from tiertune.kernels import KERNEL_CHOICES
from tiertune.loading.hub import is_hub_id
from tiertune.settings import (
    DPO_LOSS_TYPES,
    GRPO_LOSS_TYPES,
    SERVING_ENGINES,
    GaloreSettings,
    LoraSettings,
    ObjectiveSettings,
    choices,
)

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
"""The built-in recipes, shipped with the package (``load_recipe`` takes one by its name)."""
EVAL_FORMATS = ("text", "alpaca", "chat", "preference", "unpaired_preference")
"""The data formats a run evaluates (``training.eval_strategy``): single sequences scored by cross-entropy, and
preference pairs (KTO's labelled rows) scored by their objective."""
EVAL_OBJECTIVES = ("sft", "dpo", "simpo", "orpo", "kto", "distill")
"""The objectives a run evaluates by scoring the held-out rows: SFT by cross-entropy, the preference objectives and
distillation by their own loss (and GRPO, whose held-out prompts are sampled and rewarded:
``finetune.grpo_evaluation``)."""


@dataclass
class ModelSection:
    path: str = ""
    dtype: str = field(default="auto", metadata=choices("auto", "float32", "bfloat16", "float16"))
    quantize: str = field(default="none", metadata=choices("none", "nf4", "fp4", "int8"))


@dataclass
class MethodSection:
    type: str = field(default="full", metadata=choices("full", "lora", "galore"))
    lora: LoraSettings = field(default_factory=LoraSettings)
    galore: GaloreSettings = field(default_factory=GaloreSettings)


@dataclass
class DataSection:
    path: str = ""
    format: str = field(
        default="text",
        metadata=choices("text", "alpaca", "chat", "preference", "unpaired_preference", "prompt"),
    )
    max_seq_len: int = 1024
    packing: bool = False
    shuffle: bool = True
    add_eos: bool = True
    skip_bad_rows: bool = False
    # a held-out set in the same format, its loss logged every training.eval_steps (finetune.evaluation)
    eval_path: str | None = None


@dataclass
class TrainingSection:
    output_dir: str = "runs/tiertune"
    max_steps: int = -1
    num_train_epochs: float = 3.0
    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    learning_rate: float = 5e-5
    lr_scheduler_type: str = field(
        default="linear", metadata=choices("constant", "linear", "cosine", "constant_with_warmup")
    )
    warmup_steps: int = 0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    optim: str = field(default="adamw_torch", metadata=choices("adamw_torch", "adamw_bnb_8bit"))
    # full fine-tuning's copy of the weights the optimizer updates: float32 master weights beside bf16 ones (4
    # bytes a parameter), or bfloat16: the bf16 weights are their own master, updated with stochastic rounding
    master_weights: str = field(default="float32", metadata=choices("float32", "bfloat16"))
    seed: int = 42
    save_steps: int = 500
    save_total_limit: int | None = None
    resume_from_checkpoint: str | None = None
    # start over in an output_dir that holds another run (its checkpoints, log and model are removed)
    overwrite_output_dir: bool = False
    # resume although the checkpoint's recipe differs in what makes a run (model, method, data, batch, ...)
    allow_recipe_changes: bool = False
    logging_steps: int = 500
    report_to: str = field(default="auto", metadata=choices("auto", "none", "tensorboard", "wandb"))
    # the loss on data.eval_path every eval_steps (null: logging_steps) and after the last step, or at each
    # epoch's end, as the Trainer's eval_strategy: steps | epoch; eval_on_start: before the first step too
    eval_strategy: str = field(default="no", metadata=choices("no", "steps", "epoch"))
    eval_steps: int | None = None
    eval_on_start: bool = False
    # stop after this many evaluations in a row that do not beat the best metric_for_best_model by more than
    # the threshold (transformers' EarlyStoppingCallback; 0: never)
    early_stopping_patience: int = 0
    early_stopping_threshold: float = 0.0
    # export the checkpoint of the best evaluation at the end, not the last step's (kept by save_total_limit)
    load_best_model_at_end: bool = False
    # what early stopping and the best checkpoint compare (the Trainer's names: "loss" is eval_loss; GRPO's
    # eval_reward, the mean reward of the held-out prompts' completions); greater_is_better null: the Trainer's
    # rule (lower is better for a loss, higher for anything else)
    metric_for_best_model: str = field(
        default="eval_loss", metadata=choices("eval_loss", "loss", "eval_reward", "reward")
    )
    greater_is_better: bool | None = None


@dataclass
class OffloadSection:
    device_budget: str = "auto"
    host_budget: str = "auto"
    disk_path: str | None = None
    params: str = field(default="auto", metadata=choices("auto", "device", "host", "disk"))
    optimizer_states: str = field(default="auto", metadata=choices("auto", "device", "host", "disk"))
    activations: str = field(default="auto", metadata=choices("auto", "device", "host"))
    prefetch_depth: int = 2
    # a layer's MLP computed this many tokens at a time (0: untiled; auto: engine.config.SEQUENCE_TILE)
    sequence_tile: int | str = field(default="auto", metadata=choices("auto"))
    # the CPU optimizer during backward (true), after it (false), or during it when its twin states fit
    overlap_optimizer: bool | str = field(default="auto", metadata=choices("auto"))
    # ZeRO-Offload's one-step-delayed update: a step's CPU update runs during the next step, which computes on
    # the weights before it (one step stale; EngineConfig.delay_update)
    delay_update: bool = False


@dataclass
class Recipe:
    """A whole run. ``load_recipe`` builds one from YAML; the sections can also be built in Python."""

    model: ModelSection = field(default_factory=ModelSection)
    method: MethodSection = field(default_factory=MethodSection)
    data: DataSection = field(default_factory=DataSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    offload: OffloadSection = field(default_factory=OffloadSection)
    objective: ObjectiveSettings = field(default_factory=ObjectiveSettings)
    kernels: str = field(default="auto", metadata=choices(*KERNEL_CHOICES))

    def __post_init__(self) -> None:
        t = self.training
        checks = [
            (t.learning_rate >= 0, "training.learning_rate", f"must be >= 0, got {t.learning_rate}"),
            (t.per_device_train_batch_size >= 1, "training.per_device_train_batch_size", "must be >= 1"),
            (t.gradient_accumulation_steps >= 1, "training.gradient_accumulation_steps", "must be >= 1"),
            (
                t.max_steps > 0 or t.num_train_epochs > 0,
                "training.max_steps",
                "or num_train_epochs must be > 0",
            ),
            (t.num_train_epochs >= 0, "training.num_train_epochs", f"must be >= 0, got {t.num_train_epochs}"),
            (t.warmup_steps >= 0, "training.warmup_steps", "must be >= 0"),
            (t.weight_decay >= 0, "training.weight_decay", f"must be >= 0, got {t.weight_decay}"),
            (t.adam_epsilon >= 0, "training.adam_epsilon", f"must be >= 0, got {t.adam_epsilon}"),
            (
                t.max_grad_norm >= 0,
                "training.max_grad_norm",
                f"must be >= 0 (0: no clipping), got {t.max_grad_norm}",
            ),
            (
                t.save_steps >= 0,
                "training.save_steps",
                f"must be >= 0 (0: no checkpoints), got {t.save_steps}",
            ),
            (
                t.save_total_limit is None or t.save_total_limit >= 0,
                "training.save_total_limit",
                f"must be >= 0 (0 or null: keep every checkpoint), got {t.save_total_limit}",
            ),
            (
                0 <= t.seed < 2**64,
                "training.seed",
                f"must be in [0, 2**64) (torch's generators take 64 bits), got {t.seed}",
            ),
            (
                0 <= t.adam_beta1 < 1 and 0 <= t.adam_beta2 < 1,
                "training.adam_beta1/adam_beta2",
                "must be in [0, 1)",
            ),
            (t.logging_steps >= 1, "training.logging_steps", "must be >= 1"),
            (
                t.eval_steps is None or t.eval_steps >= 1,
                "training.eval_steps",
                f"must be >= 1 (or null: logging_steps), got {t.eval_steps}",
            ),
            (
                t.early_stopping_patience >= 0,
                "training.early_stopping_patience",
                f"must be >= 0 (0: never stop early), got {t.early_stopping_patience}",
            ),
            (
                t.early_stopping_threshold >= 0,
                "training.early_stopping_threshold",
                f"must be >= 0, got {t.early_stopping_threshold}",
            ),
            *self._eval_checks(),
            (
                self.offload.sequence_tile == "auto"
                or (type(self.offload.sequence_tile) is int and self.offload.sequence_tile >= 0),
                "offload.sequence_tile",
                f"must be auto or a number of tokens >= 0 (0: untiled), got {self.offload.sequence_tile}",
            ),
            (self.data.max_seq_len >= 2, "data.max_seq_len", "must be >= 2 (a token and its target)"),
            (self.method.lora.r >= 1, "method.lora.r", "must be >= 1"),
            (
                self.method.lora.seed is None or 0 <= self.method.lora.seed < 2**64,
                "method.lora.seed",
                f"must be in [0, 2**64) or null, got {self.method.lora.seed}",
            ),
            (0 <= self.method.lora.dropout < 1, "method.lora.dropout", "must be in [0, 1)"),
            (self.method.galore.rank >= 1, "method.galore.rank", "must be >= 1"),
            (self.method.galore.update_proj_gap >= 1, "method.galore.update_proj_gap", "must be >= 1"),
            (self.method.galore.scale > 0, "method.galore.scale", "must be > 0"),
            (
                self.objective.distills
                or self.objective.beta > 0
                or (self.objective.rollouts and self.objective.beta == 0),
                "objective.beta",
                f"must be > 0{' (or 0: no KL term)' if self.objective.rollouts else ''}, got {self.objective.beta}",
            ),
            (
                self.objective.loss_type in (GRPO_LOSS_TYPES if self.objective.rollouts else DPO_LOSS_TYPES),
                "objective.loss_type",
                f"must be one of {', '.join(GRPO_LOSS_TYPES if self.objective.rollouts else DPO_LOSS_TYPES)} for "
                f"objective.type {self.objective.type}; got {self.objective.loss_type!r}",
            ),
            *self._distill_checks(),
            *self._grpo_checks(),
            (
                self.data.format in self.objective.data_format,
                "objective.type",
                f"{self.objective.type} trains on "
                + {
                    "preference": "pairs: set data.format: preference (rows of prompt, chosen, rejected)",
                    "unpaired_preference": "unpaired rows: set data.format: unpaired_preference (rows of prompt, "
                    "completion, label)",
                    "prompt": "prompts: set data.format: prompt (rows with a prompt, a string or a conversation; "
                    "other columns go to the reward functions)",
                }.get(
                    self.objective.data_format[0],
                    f"single sequences; data.format: {self.data.format} needs "
                    + (
                        "objective.type: kto"
                        if self.data.format == "unpaired_preference"
                        else "objective.type: grpo"
                        if self.data.format == "prompt"
                        else "objective.type: dpo, simpo or orpo"
                    ),
                ),
            ),
            (
                self.objective.type != "kto" or self.training.per_device_train_batch_size >= 2,
                "training.per_device_train_batch_size",
                "must be >= 2 for kto: its KL term pairs each row's prompt with another row's completion of the "
                "same micro-batch (TRL's rule)",
            ),
            (
                not (self.objective.paired and self.data.packing),
                "data.packing",
                "must be false for a preference objective (a pair's sequences are scored whole)",
            ),
        ]
        for name, value in flatten(self.to_dict()):
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{name} must be a finite number; got {value}")
        _check_choices(self)
        for ok, key, what in checks:
            if not ok:
                raise ConfigError(f"{key} {what}")

    def _eval_checks(self) -> list[tuple[bool, str, str]]:
        """The evaluation settings' checks (``finetune.evaluation``)."""
        t, d, o = self.training, self.data, self.objective
        evaluating = t.eval_strategy != "no"
        return [
            (
                evaluating or not (t.early_stopping_patience or t.eval_on_start),
                "training.early_stopping_patience" if t.early_stopping_patience else "training.eval_on_start",
                "needs the evaluation loss: set training.eval_strategy: steps (or epoch) and data.eval_path (a "
                "held-out set)",
            ),
            (
                not t.load_best_model_at_end
                or (
                    t.eval_strategy == "steps"
                    and t.save_steps > 0
                    and t.save_steps % max(1, self.eval_every) == 0
                ),
                "training.load_best_model_at_end",
                "exports the checkpoint of the best evaluation: set training.eval_strategy: steps and "
                f"save_steps a multiple of the steps between evaluations ({self.eval_every or 'eval_steps'}), as "
                f"the Trainer asks (save_steps is {t.save_steps})",
            ),
            (
                not evaluating or bool(d.eval_path),
                "training.eval_strategy",
                f"{t.eval_strategy} evaluates the loss on a held-out set: set data.eval_path to a file of "
                f"data.format {d.format}, or eval_strategy: no",
            ),
            (
                not evaluating
                or (o.type in EVAL_OBJECTIVES and d.format in EVAL_FORMATS)
                or (o.rollouts and d.format == "prompt"),
                "training.eval_strategy",
                f"{t.eval_strategy} scores single sequences by their cross-entropy (a distillation's: its loss "
                "against the teacher), preference pairs by their objective (objective.type "
                f"{', '.join(EVAL_OBJECTIVES)}) and GRPO's prompts by their completions' rewards: objective.type "
                f"{o.type} with data.format {d.format} is not evaluated in this release; set "
                "training.eval_strategy: no",
            ),
            (
                self.best_metric[0] != "eval_reward" or o.rollouts,
                "training.metric_for_best_model",
                f"{t.metric_for_best_model} is GRPO's (its held-out prompts' mean reward); objective.type {o.type} "
                "logs eval_loss: set metric_for_best_model: eval_loss",
            ),
        ]

    @property
    def best_metric(self) -> tuple[str, bool]:
        """What early stopping and ``load_best_model_at_end`` compare: the record's key (the Trainer's rule:
        ``eval_`` before a name without it) and whether greater is better (``greater_is_better``, else the
        Trainer's default: lower for a loss)."""
        t = self.training
        name = t.metric_for_best_model
        name = name if name.startswith("eval_") else f"eval_{name}"
        greater = t.greater_is_better if t.greater_is_better is not None else not name.endswith("loss")
        return name, greater

    @property
    def eval_every(self) -> int:
        """The steps between evaluations with ``eval_strategy: steps`` (``eval_steps``, else ``logging_steps``);
        0 otherwise."""
        t = self.training
        if t.eval_strategy != "steps":
            return 0
        return t.eval_steps if t.eval_steps is not None else t.logging_steps

    @property
    def evaluates(self) -> bool:
        """Whether the run evaluates a held-out set (``training.eval_strategy`` steps or epoch)."""
        return self.training.eval_strategy != "no"

    @property
    def reference_beside(self) -> bool:
        """Whether a frozen copy of the initial weights (``model.path`` as it ships) streams beside the policy:
        GRPO's KL term (``objective.beta`` not 0) on a full or GaLore fine-tune, whose completions are new every
        generation, so no pass before training can score them (with LoRA the reference is the base, adapters
        off, in the policy's own layer visits)."""
        o = self.objective
        return o.rollouts and o.beta != 0 and self.method.type != "lora"

    @property
    def beside(self) -> bool:
        """Whether a second, frozen model streams beside the trained one through the run (a distillation's
        teacher over the whole vocabulary, or GRPO's reference): each is planned within a share of the budgets
        (``config.plan.BESIDE_SHARE``)."""
        return self.objective.beside or self.reference_beside

    def _grpo_checks(self) -> list[tuple[bool, str, str]]:
        """A ``grpo`` objective's settings (TRL's ``GRPOConfig`` rules): (holds, setting, what it must be)."""
        o, t = self.objective, self.training
        if not o.rollouts:
            return []
        funcs = o.reward_funcs or []
        completions = t.per_device_train_batch_size * t.gradient_accumulation_steps
        return [
            (
                bool(funcs)
                and all(
                    ":" in f or (Path(f).expanduser() / "config.json").is_file() or is_hub_id(f)
                    for f in funcs
                ),
                "objective.reward_funcs",
                "must name one or more reward functions as module:function (e.g. rewards:accuracy, imported with "
                "the directory tiertune runs in on the Python path), path/to/rewards.py:function, or a reward "
                f"model (a sequence-classification model's directory or hub id); got {funcs!r}",
            ),
            (
                o.reward_weights is None or len(o.reward_weights) == len(funcs),
                "objective.reward_weights",
                f"must give one weight per reward function ({len(funcs)}); got {o.reward_weights!r}",
            ),
            (
                o.num_generations >= 2,
                "objective.num_generations",
                f"must be >= 2 (a group's rewards are compared), got {o.num_generations}",
            ),
            (
                completions % o.num_generations == 0,
                "training.per_device_train_batch_size",
                f"x gradient_accumulation_steps ({completions} completions a step) must be a multiple of "
                f"objective.num_generations ({o.num_generations}): each prompt's completions train in one step",
            ),
            (
                1 <= o.max_completion_length < self.data.max_seq_len,
                "objective.max_completion_length",
                f"must be >= 1 and below data.max_seq_len ({self.data.max_seq_len}: a prompt and its completion); "
                f"got {o.max_completion_length}",
            ),
            (
                o.temperature > 0,
                "objective.temperature",
                f"must be > 0 for grpo's sampling, got {o.temperature}",
            ),
            (0 < o.top_p <= 1, "objective.top_p", f"must be in (0, 1], got {o.top_p}"),
            (o.top_k >= 0, "objective.top_k", f"must be >= 0 (0: every token), got {o.top_k}"),
            (o.epsilon > 0, "objective.epsilon", f"must be > 0, got {o.epsilon}"),
            (
                o.epsilon_high is None or o.epsilon_high > 0,
                "objective.epsilon_high",
                f"must be > 0 or null (epsilon's), got {o.epsilon_high}",
            ),
            (o.num_iterations >= 1, "objective.num_iterations", f"must be >= 1, got {o.num_iterations}"),
            (
                o.steps_per_generation is None or o.generation_batch_size is None,
                "objective.steps_per_generation",
                "and generation_batch_size say the same thing: set one of them (TRL's rule)",
            ),
            (
                o.steps_per_generation is None
                or (
                    o.steps_per_generation >= 1
                    and o.steps_per_generation % t.gradient_accumulation_steps == 0
                ),
                "objective.steps_per_generation",
                f"must be a multiple of gradient_accumulation_steps ({t.gradient_accumulation_steps}): a "
                f"generation feeds whole steps; got {o.steps_per_generation}",
            ),
            (
                o.generation_batch_size is None
                or (o.generation_batch_size >= 1 and o.generation_batch_size % o.num_generations == 0),
                "objective.generation_batch_size",
                f"must be a multiple of num_generations ({o.num_generations}); got {o.generation_batch_size}",
            ),
            (
                o.loss_type != "cispo" or o.epsilon_high is not None,
                "objective.epsilon_high",
                "bounds cispo's importance weights themselves (not 1 + epsilon_high: ScaleRL recommends 5.0); "
                "set it (unset, it would be epsilon, and every weight at most that)",
            ),
            (
                o.delta is None or o.delta > 0,
                "objective.delta",
                "bounds the unclipped ratio above (INTELLECT-2's two-sided clip; TRL recommends above 1 + "
                f"epsilon_high): it must be > 0 or null, got {o.delta}",
            ),
            (
                0 < o.top_entropy_quantile <= 1,
                "objective.top_entropy_quantile",
                f"must be in (0, 1] (the share of completion tokens trained on; 1: all), got {o.top_entropy_quantile}",
            ),
            (
                o.sapo_temperature_pos > 0 and o.sapo_temperature_neg > 0,
                "objective.sapo_temperature_pos",
                f"and sapo_temperature_neg must be > 0, got {o.sapo_temperature_pos} and {o.sapo_temperature_neg}",
            ),
            (
                o.num_generations_eval is None or o.num_generations_eval >= 1,
                "objective.num_generations_eval",
                f"must be >= 1 or null (num_generations), got {o.num_generations_eval}",
            ),
            (
                not self.data.packing,
                "data.packing",
                "must be false for grpo (each completion is scored whole)",
            ),
            *self._served_checks(),
        ]

    def _served_checks(self) -> list[tuple[bool, str, str]]:
        """GRPO's rollouts from a server (``objective.rollout_engine`` llama_cpp, vllm, sglang): what it can
        serve."""
        o, lora = self.objective, self.method.lora
        if o.rollout_engine == "tiertune":
            return []
        url = o.rollout_url or ""
        return [
            (
                self.method.type == "lora" and not lora.use_dora and not lora.target_parameters,
                "objective.rollout_engine",
                f"{o.rollout_engine} serves the base with a plain LoRA adapter pushed each step: it needs method.type "
                "lora without use_dora or target_parameters (rollout_engine: tiertune samples any method)",
            ),
            (
                o.rollout_engine not in SERVING_ENGINES or url.startswith(("http://", "https://")),
                "objective.rollout_url",
                f"must be the {o.rollout_engine} server's address (e.g. http://127.0.0.1:8000), started by you over "
                f"model.path with runtime LoRA loading; got {o.rollout_url!r}",
            ),
            (
                o.rollout_logp_tolerance is None or o.rollout_logp_tolerance > 0,
                "objective.rollout_logp_tolerance",
                f"must be > 0 or null (not checked), got {o.rollout_logp_tolerance}",
            ),
        ]

    def _distill_checks(self) -> list[tuple[bool, str, str]]:
        """A ``distill`` objective's settings: (holds, setting, what it must be)."""
        o = self.objective
        if not o.distills:
            return []
        teacher = o.teacher
        return [
            (0 <= o.beta <= 1, "objective.beta", f"must be in [0, 1] for distill (TRL's GKD), got {o.beta}"),
            (o.temperature > 0, "objective.temperature", f"must be > 0, got {o.temperature}"),
            (o.top_k >= 0, "objective.top_k", f"must be >= 0 (0: the whole vocabulary), got {o.top_k}"),
            (0 <= o.alpha <= 1, "objective.alpha", f"must be in [0, 1], got {o.alpha}"),
            (
                bool(teacher.path),
                "objective.teacher.path",
                "must name the teacher model (a directory or a hub id) for objective.type: distill",
            ),
            (
                teacher.dtype in ("auto", "float32", "bfloat16", "float16"),
                "objective.teacher.dtype",
                f"must be one of auto, float32, bfloat16, float16; got {teacher.dtype!r}",
            ),
            (
                teacher.wave_size >= 0,
                "objective.teacher.wave_size",
                f"must be >= 0 (0: auto), got {teacher.wave_size}",
            ),
            (
                teacher.quantize in ("none", "nf4", "fp4", "int8"),
                "objective.teacher.quantize",
                f"must be one of none, nf4, fp4, int8; got {teacher.quantize!r}",
            ),
        ]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def with_absolute_paths(self) -> Recipe:
        """A copy whose paths are absolute: relative paths, in a recipe file as on the command line, are
        relative to the directory tiertune runs in (as for Hugging Face's ``output_dir``); the run directory,
        its checkpoints and the saved adapter then name their inputs wherever they are read from."""
        out = copy.deepcopy(self)
        sections = (
            (out.model, "path"),
            (out.data, "path"),
            (out.data, "eval_path"),
            (out.training, "output_dir"),
            (out.offload, "disk_path"),
            (out.training, "resume_from_checkpoint"),
            (out.objective.teacher, "path"),
        )
        for section, key in sections:
            value = getattr(section, key)
            if (section is out.model or section is out.objective.teacher) and is_hub_id(
                value
            ):  # a Hugging Face model id, not a path
                continue
            if value and value != "auto":
                setattr(section, key, os.path.abspath(os.path.expanduser(value)))
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def recipe_notes(path: str | Path) -> tuple[str, list[str]]:
    """A recipe file's header comment: its description (the lines before ``Hardware:``) and its entries (a
    line with its indented continuation lines, ``#   ...``), each with its whitespace collapsed."""
    description: list[str] = []
    entries: list[str] = []
    for line in Path(path).read_text().splitlines():
        if not line.startswith("#"):
            break
        text = line[1:].strip()
        if not entries and not text.startswith("Hardware:"):
            description.append(text)
        elif entries and line.startswith("#  "):
            entries[-1] += " " + text
        else:
            entries.append(text)
    return " ".join(" ".join(description).split()), [" ".join(e.split()) for e in entries]


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Read a YAML recipe, apply ``key.path=value`` overrides, and validate. Raises ConfigError."""
    raw = read_raw(path)
    if "sweep" in raw:
        raise ConfigError(
            f"recipe {path} has a sweep: section, several recipes in one: train it with `tiertune train` "
            "(config.sweep.load_recipes reads it)"
        )
    return build(Recipe, apply_overrides(raw, overrides), "")


def recipe_path(path: str | Path) -> Path:
    """``path``, or the built-in recipe of that name (``tiertune recipes`` lists them)."""
    path = Path(path)
    if not path.exists() and path.name == str(path) and (RECIPES / f"{path}.yaml").is_file():
        return RECIPES / f"{path}.yaml"
    return path


def read_raw(path: str | Path) -> dict:
    """A YAML recipe's sections as a mapping, not yet checked (ConfigError when it cannot be read)."""
    path = recipe_path(path)
    if path.is_dir():
        found = sorted(p.name for p in path.glob("*.y*ml"))[:5]
        there = f" (YAML files there: {', '.join(found)})" if found else ""
        raise ConfigError(f"recipe {path} is a directory; give a YAML recipe file{there}")
    if not path.is_file():
        raise ConfigError(f"recipe {path} does not exist; `tiertune recipes` lists the built-in ones")
    raw = parse_yaml(_utf8(path), f"recipe {path}") or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"recipe {path} must be a mapping of sections (model:, data:, training:, ...)")
    return raw


def apply_overrides(raw: dict, overrides: list[str] | tuple[str, ...]) -> dict:
    """``raw`` with ``key.path=value`` overrides set in it (ConfigError for one that is not of that form)."""
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(
                f"override {item!r} must look like section.key=value, e.g. training.learning_rate=1e-4"
            )
        parsed = parse_yaml(value, f"override {item!r}") if value.strip() else None
        _set(raw, key.strip().split("."), parsed)
    return raw


def _utf8(path: Path) -> str:
    """A recipe file's text; ConfigError naming the first byte that is not UTF-8."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise ConfigError(
            f"recipe {path} is not UTF-8 text: byte 0x{data[exc.start]:02x} at byte offset {exc.start} (line "
            f"{line}) cannot be decoded; save the recipe as UTF-8"
        ) from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (plain YAML keeps the last one)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if isinstance(key, str | int | float | bool) and key in seen:
                raise ConfigError(
                    f"`{key}` is given twice in one section (lines {seen[key]} and {line}); keep one"
                )
            seen.setdefault(key, line)
        return super().construct_mapping(node, deep=deep)


def parse_yaml(text: str, what: str) -> Any:
    """``text`` as YAML (a recipe, or an override's value); ConfigError naming ``what`` and where it fails, or
    the key given twice."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except ConfigError as exc:
        raise ConfigError(f"{what}: {exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or exc
        hint = "; quote a value that is meant as text" if what.startswith("override") else ""
        raise ConfigError(f"{what} is not valid YAML{where}: {problem}{hint}") from None


def build(cls: type, data: Any, prefix: str) -> Any:
    """Build the dataclass ``cls`` from ``data``, checking names, types and choices."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        what = f"section {prefix.rstrip('.')}" if prefix else "the recipe"
        raise ConfigError(
            f"{what} must be a mapping of settings (key: value, one per line), got a {type(data).__name__}"
        )
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    values = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f"; did you mean `{prefix}{close[0]}`?" if close else f"; known keys: {', '.join(fields)}"
            raise ConfigError(f"unknown key `{name}`{hint}")
        values[key] = _coerce(hints[key], value, name)
    return cls(**values)


def _check_choices(recipe: Recipe) -> None:
    """Every setting with a fixed set of values (a field's ``choices``) holds one of them: a recipe read from
    YAML and one built in Python alike."""
    sections = [("", recipe)] + [
        (f"{f.name}.", getattr(recipe, f.name))
        for f in dataclasses.fields(recipe)
        if dataclasses.is_dataclass(getattr(recipe, f.name))
    ]
    for prefix, section in sections:
        for f in dataclasses.fields(section):
            options = f.metadata.get("choices")
            value = getattr(section, f.name)
            numeric = isinstance(value, int) and not isinstance(value, bool) and "int" in str(f.type)
            if options is None or isinstance(value, bool) or numeric or value in options:
                continue
            listed = ", ".join((*options, "true", "false") if "bool" in str(f.type) else options)
            raise ConfigError(f"{prefix}{f.name} must be one of {listed}; got {value!r}")


def _coerce(hint: Any, value: Any, name: str) -> Any:
    if dataclasses.is_dataclass(hint):
        return build(hint, value, f"{name}.")
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None:
        if type(None) in allowed:
            return None
        raise ConfigError(f"{name} cannot be empty")
    if Any in allowed:
        return value
    for typ in allowed:
        if typing.get_origin(typ) is list and typing.get_args(typ) == (float,):  # a list of numbers
            items = [value] if isinstance(value, int | float) and not isinstance(value, bool) else value
            if isinstance(items, list) and all(
                isinstance(v, int | float) and not isinstance(v, bool) for v in items
            ):
                return [float(v) for v in items]
            continue
        if typing.get_origin(typ) is list:  # a list of strings; one string alone is a list of one
            items = [value] if isinstance(value, str) else value
            if isinstance(items, list) and items and all(isinstance(v, str) and v for v in items):
                return list(items)
            continue
        if typ is bool and isinstance(value, bool):
            return value
        if typ is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if typ is float and isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if typ is float and isinstance(value, str):
            try:  # YAML reads 1e-4 (no dot) as a string
                return float(value)
            except ValueError:
                pass
        if typ is str and isinstance(value, str | int | float) and not isinstance(value, bool):
            return str(value)
    expected = " or ".join(_describe(t) for t in allowed if t is not type(None))
    raise ConfigError(f"{name} must be {expected}; got {value!r}")


def _describe(typ: Any) -> str:
    if typ is float:
        return "a number"
    if typ is str:
        return "a string"
    if typing.get_origin(typ) is list:
        return "a list of numbers" if typing.get_args(typ) == (float,) else "a list of names"
    return typ.__name__


def flatten(tree: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """``(dotted.key, value)`` for every setting of a recipe's dict."""
    out = []
    for key, value in tree.items():
        if isinstance(value, dict):
            out += flatten(value, f"{prefix}{key}.")
        else:
            out.append((f"{prefix}{key}", value))
    return out


def _set(tree: dict[str, Any], keys: list[str], value: Any) -> None:
    node = tree
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override path {'.'.join(keys)}: {key} is a value, not a section")
        node = child
    node[keys[-1]] = value
