"""The settings of a fine-tuning method and objective, defined once: a recipe's ``method.lora``,
``method.galore`` and ``objective`` sections are these dataclasses (``config.recipe`` checks their names, types and choices), and the engine takes them as
they are (``EngineConfig.lora``/``galore``/``objective``). Nothing here imports torch, so reading a recipe stays light; ``parse_size`` reads a size a user writes."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from tiertune.errors import ConfigError

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | str, setting: str = "size") -> int:
    """Parse ``512KiB``, ``20GiB``, ``1.5GB`` or a plain byte count into bytes.

    Raises ConfigError naming ``setting`` when the value is not a non-negative size.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{setting}: expected a size like '20GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{setting}: a size cannot be negative, got {value}")
        return value
    match = _SIZE.match(str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise ConfigError(
            f"{setting}: cannot read {value!r} as a size; write a number with a unit "
            f"(B, KiB, MiB, GiB, TiB, KB, MB, GB, TB), e.g. '20GiB'"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def choices(*values: str) -> dict[str, tuple[str, ...]]:
    """A field's metadata saying which values it takes (``config.recipe`` checks them)."""
    return {"choices": values}


SVD_METHODS = ("exact", "randomized")
"""``method.galore.svd``: how GaLore's projections are computed."""


@dataclass
class LoraSettings:
    """``method.lora`` (names as peft's ``LoraConfig``)."""

    r: int = 16
    alpha: int = 32
    dropout: float = 0.05
    target_modules: str | list[str] = "all-linear"  # a name, "all-linear", or a list of module names
    # parameters adapted as such (peft's target_parameters), e.g. MoE experts' "mlp.experts.gate_up_proj"; on
    # transformers 5, peft adds MoE experts and routers itself to "all-linear" for the architectures it maps
    target_parameters: list[str] | None = None
    use_dora: bool = False  # DoRA: a trained magnitude per output row on top of the LoRA direction
    seed: int | None = None  # of the adapters' initialization; None: training.seed (42 outside a recipe)


@dataclass
class GaloreSettings:
    """``method.galore`` (names as galore-torch's parameter-group options)."""

    rank: int = 128
    update_proj_gap: int = 200
    scale: float = 0.25
    target_modules: str | list[str] = (
        "all-linear"  # linear layers of the decoder layers whose weights are projected
    )
    # exact: torch.linalg.svd, as galore-torch; randomized: a randomized range finder of rank r + oversampling
    # (Halko, Martinsson and Tropp), then an exact SVD of that small sketch
    svd: str = field(default="exact", metadata=choices(*SVD_METHODS))


OBJECTIVES = ("sft", "dpo", "simpo", "orpo", "kto", "distill", "grpo")
PAIRED = ("dpo", "simpo", "orpo", "kto")
"""The objectives whose micro-batches are pairs of sequences (``ObjectiveSettings.paired``)."""
DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge")
GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
"""GRPO's importance weights: a token's ratio each, or one a completion (GSPO: the mean of its tokens' log-ratios)."""
BETA = {"distill": 0.5, "grpo": 0.0}
"""``objective.beta``'s default by ``objective.type`` where it is not DPO's 0.1 (TRL's GKD: 0.5; GRPO: 0.0, no KL
term and no reference)."""
LOSS_TYPE = {"grpo": "dapo"}
"""``objective.loss_type``'s default by ``objective.type`` where it is not DPO's ``sigmoid`` (TRL's)."""
TOP_K = {"distill": 64, "grpo": 0}
"""``objective.top_k``'s default by ``objective.type``: the teacher's logits kept a token (distill), the
sampling's top-k (GRPO's rollouts: 0, every token)."""
SCALE_REWARDS = ("group", "batch", "none")
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
"""How GRPO's advantages combine several reward functions (TRL's ``multi_objective_aggregation``): their weighted
sum normalised in its group, or each normalised in its group and their weighted sum over the batch (GDPO)."""
ROLLOUT_ENGINES = ("tiertune", "llama_cpp", "vllm", "sglang")
"""Who samples GRPO's completions: the streamed model itself, a llama.cpp server the run starts, or a vLLM or
SGLang server the user runs (``rollout_url``)."""
SERVING_ENGINES = ("vllm", "sglang")
"""The rollout engines the user starts (the run pushes its adapter to them at ``objective.rollout_url``)."""
GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")
"""The weight types tiertune writes GGUF files in (``tiertune export --gguf-type``, ``rollout_gguf_type``)."""


@dataclass
class TeacherSettings:
    """``objective.teacher``: the model a ``distill`` objective learns from, read as ``model`` reads a base (any
    model tiertune reads: a path or a hub id, ``dtype``, ``quantize``), streamed within the run's offload
    budgets."""

    path: str = ""
    dtype: str = field(default="auto", metadata=choices("auto", "float32", "bfloat16", "float16"))
    quantize: str = field(default="none", metadata=choices("none", "nf4", "fp4", "int8"))
    # rows of the data a teacher pass's wave runs through each layer (its weights read once a wave); 0: as many
    # as keep the wave's hidden states within a quarter of the device budget (``finetune.teacher``)
    wave_size: int = 0


@dataclass
class ObjectiveSettings:
    """``objective`` (names as TRL's configs): ``type`` ``sft`` (the default: the mean cross-entropy of the target
    tokens), ``dpo`` (``DPOConfig``: ``beta``, ``loss_type``), ``simpo`` (``CPOConfig`` with ``loss_type:
    simpo``: ``beta``, ``simpo_gamma``, ``cpo_alpha``), ``orpo`` (``ORPOConfig``: ``beta`` is the paper's
    lambda), ``kto`` (``KTOConfig``: ``beta``, ``desirable_weight``, ``undesirable_weight``; unpaired rows) or
    ``distill`` (``GKDConfig``'s ``beta``, 0 the forward KL, 1 the reverse, between the generalized JSD, and
    ``temperature``; ``teacher``; ``top_k`` logits kept per token from the teacher, 0 the whole vocabulary;
    ``alpha``: the loss is ``alpha`` x the cross-entropy on the data + (1 - ``alpha``) x the divergence);
    ``engine.objective`` and ``kernels.ops.distill`` have the formulas. ``beta`` left unset takes the type's
    default (``BETA``; 0.1). ``disable_dropout`` (TRL's default) sets every dropout of the model and its
    adapters to 0 for a preference or distillation objective.

    ``grpo`` (``GRPOConfig``'s names and defaults, TRL 1.16): online RL from rewards. Each step samples
    ``num_generations`` completions of each prompt (at most ``max_completion_length`` tokens, at
    ``temperature``, ``top_p``, ``top_k``), scores them with ``reward_funcs`` (``module:function`` names, TRL's
    reward-function signature) weighted by ``reward_weights``, and trains on their advantages (``scale_rewards``)
    with the clipped objective (``epsilon``, ``epsilon_high``, ``delta``; ``importance_sampling_level``
    ``sequence``: GSPO's one ratio a completion), ``beta`` times the KL to the reference (0: none), each
    generation used for ``num_iterations`` steps, normalised per ``loss_type`` (``engine.grpo``: also CISPO's
    clipped weights, SAPO's soft gate, LUSPO's length-scaled sequences);
    ``mask_truncated_completions`` leaves completions without an EOS out of the loss; an evaluation samples
    ``num_generations_eval`` completions of each held-out prompt (``finetune.grpo_evaluation``)."""

    type: str = field(default="sft", metadata=choices(*OBJECTIVES))
    beta: float | None = None
    loss_type: str | None = field(default=None, metadata=choices(*DPO_LOSS_TYPES, *GRPO_LOSS_TYPES))
    simpo_gamma: float = 0.5  # SimPO's target reward margin
    cpo_alpha: float = 1.0  # SimPO (TRL's CPOTrainer): the weight of the chosen completions' cross-entropy
    desirable_weight: float = 1.0  # KTO: the weight of a desirable completion's loss
    undesirable_weight: float = 1.0  # KTO: the weight of an undesirable completion's loss
    disable_dropout: bool = True
    teacher: TeacherSettings = field(default_factory=TeacherSettings)  # distill: the teacher model
    # distill: both distributions are softmax(logits / temperature); grpo: the rollouts' sampling temperature
    temperature: float = 1.0
    # distill: the teacher's logits kept per token (0: every one, the teacher beside the student); grpo: the
    # rollouts' top-k (0: all); unset: ``TOP_K``
    top_k: int | None = None
    alpha: float = 0.0  # distill: the weight of the cross-entropy on the data (1 - alpha: the divergence's)
    # grpo (GRPOConfig's names and defaults)
    num_generations: int = 8  # completions sampled per prompt (a group)
    # an evaluation's completions per held-out prompt (training.eval_strategy; null: num_generations)
    num_generations_eval: int | None = None
    max_completion_length: int = 512  # a completion's tokens at most
    top_p: float = 1.0
    epsilon: float = 0.2  # the ratio's clip below (and above, without epsilon_high)
    epsilon_high: float | None = None  # cispo: the importance weight's bound itself (ScaleRL: 5.0)
    delta: float | None = None  # INTELLECT-2's two-sided clip: the unclipped ratio bounded above by it
    importance_sampling_level: str = field(default="token", metadata=choices(*IMPORTANCE_SAMPLING_LEVELS))
    sapo_temperature_pos: float = 1.0  # sapo's gate's temperature for a positive advantage
    sapo_temperature_neg: float = 1.05  # ... for any other
    # the share of each micro-batch's completion tokens the policy term trains on: those of the highest entropy
    # ("Beyond the 80/20 rule"; TRL's; 1.0: every token)
    top_entropy_quantile: float = 1.0
    num_iterations: int = 1  # steps each generation batch trains
    # a generation's micro-batches a process (TRL's; null: gradient_accumulation_steps, a generation a step), or
    # its completions over the processes: a multiple of a step's feeds that many steps, decoded together
    steps_per_generation: int | None = None
    generation_batch_size: int | None = None
    scale_rewards: str = field(default="group", metadata=choices(*SCALE_REWARDS))
    multi_objective_aggregation: str = field(default="sum_then_normalize", metadata=choices(*AGGREGATIONS))
    mask_truncated_completions: bool = False
    use_bias_correction_kl: bool = True  # the KL term times the ratio (TRL 1.16's default)
    reward_funcs: list[str] | None = None  # module:function names (TRL's reward-function signature)
    reward_weights: list[float] | None = None  # one per reward function (None: each 1.0)
    # grpo: who samples (``tiertune``: the streamed model; ``llama_cpp``: a llama.cpp server the run starts,
    # the base written once as a GGUF in ``rollout_gguf_type``, the adapter pushed to it as a GGUF LoRA before
    # each generation; ``vllm``, ``sglang``: that server at ``rollout_url``, started by the user over the base
    # with runtime LoRA loading, the adapter written in PEFT format and loaded through its endpoint before each
    # generation); above ``rollout_logp_tolerance`` (the mean |served - trained| log-probability of the
    # sampled tokens, TRL's sampling/sampling_logp_difference/mean) the run stops: the served policy is not
    # the trained one (null: not checked, and the server is not asked for log-probabilities)
    rollout_engine: str = field(default="tiertune", metadata=choices(*ROLLOUT_ENGINES))
    rollout_gguf_type: str = field(default="f16", metadata=choices(*GGUF_TYPES))
    rollout_logp_tolerance: float | None = 0.1
    rollout_url: str | None = None  # vllm, sglang: the server's address (http://host:port)

    def __post_init__(self) -> None:
        if self.beta is None:
            self.beta = BETA.get(self.type, 0.1)
        if self.loss_type is None:
            self.loss_type = LOSS_TYPE.get(self.type, "sigmoid")
        if self.top_k is None:
            self.top_k = TOP_K.get(self.type, 64)

    @property
    def paired(self) -> bool:
        """Whether the objective's micro-batches are pairs of sequences (``data.format: preference``: chosen and
        rejected; ``unpaired_preference``, KTO's: a row's completion and, for its KL term, another row's
        completion after the same prompt)."""
        return self.type in PAIRED

    @property
    def data_format(self) -> tuple[str, ...]:
        """The ``data.format`` the objective trains on."""
        single = ("text", "alpaca", "chat")
        return {
            "sft": single,
            "distill": single,
            "kto": ("unpaired_preference",),
            "grpo": ("prompt",),
        }.get(self.type, ("preference",))

    @property
    def reference(self) -> bool:
        """Whether the objective compares the policy with a reference model."""
        return self.type in ("dpo", "kto") or (self.type == "grpo" and self.beta != 0.0)

    @property
    def whole_sequences(self) -> bool:
        """Whether the objective needs every token's loss of the chosen sequences, the prompt's too (ORPO's
        cross-entropy term), not only the completions'."""
        return self.type == "orpo"

    @property
    def rollouts(self) -> bool:
        """Whether a step trains on completions the model samples itself, scored by rewards (``type: grpo``)."""
        return self.type == "grpo"

    @property
    def generations_eval(self) -> int:
        """GRPO: the completions an evaluation samples of each held-out prompt (``num_generations_eval``, else
        ``num_generations``)."""
        return self.num_generations_eval or self.num_generations

    @property
    def distills(self) -> bool:
        """Whether a step learns from a teacher's distributions (``type: distill``)."""
        return self.type == "distill"

    @property
    def beside(self) -> bool:
        """Whether the teacher runs beside the student in every step, over the whole vocabulary (``top_k: 0``),
        rather than once before training into a cache of its top-k."""
        return self.distills and self.top_k == 0
