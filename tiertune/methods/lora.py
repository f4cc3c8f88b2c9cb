"""LoRA adapters with peft on the streamed (possibly 4-bit) base: created, trained and saved in PEFT format.

peft wraps the model instance's linear modules (``nn.Linear`` or bitsandbytes' ``Linear4bit``) exactly as it
would in a plain QLoRA run; the base weights stay meta placeholders that the engine binds to chunk memory
layer by layer. The adapters are small: they live on the compute device as ordinary parameters, autograd
accumulates their gradients, and ``torch.optim.AdamW`` (or bitsandbytes' ``AdamW8bit``) with
``clip_grad_norm_`` updates them after backward, as the Hugging Face Trainer would (weight decay on the
adapter matrices only, not on DoRA's magnitude vectors).

DoRA (``use_dora``) is peft's own: its magnitude vectors start as the row norms of the base weights, so
they are initialized in one pass over the layers once the base is in the store (``init_dora``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tiertune.errors import ConfigError, NonFiniteError
from tiertune.files import move_files_into
from tiertune.settings import LoraSettings
from tiertune.structure import find_decoder_layers, text_decoder

log = logging.getLogger(__name__)


@contextlib.contextmanager
def peft_wrapping() -> Iterator[None]:
    """Around peft wrapping a transformers model (``get_peft_model``, ``PeftModel.from_pretrained``): peft
    reads the model's ``is_gradient_checkpointing``, which transformers 5 deprecated with a FutureWarning on
    every read; and on an MoE whose experts are modules of their own (DeepSeek-V3) peft warns, at every
    wrapping, that the rank and alpha patterns it added itself for fused experts (``gate_up_proj``) matched
    nothing (tiertune sets no pattern). Only those warnings are silenced, and only here.

    Also here: peft 0.21 remaps, on the MoE families whose experts transformers 5 fused (DeepSeek, GLM, Qwen3-MoE),
    every target ending in ``gate_proj``, ``up_proj`` or ``down_proj`` to the fused routed experts (what such a
    name meant in an adapter of transformers 4), the shared experts' and dense MLPs' own modules included
    (huggingface/peft#3711). Targets that name a module of the model by a dotted path (what ``lora_targets``
    writes) are held out of that remapping, as peft's fix for that issue does; bare names are remapped as
    peft does."""
    from peft.utils import transformers_weight_conversion as conversion

    original = conversion.convert_peft_config_for_transformers

    def convert(peft_config: Any, model: nn.Module, conversions: Any) -> None:
        targets = peft_config.target_modules
        named = _dotted_module_targets(targets, model) if isinstance(targets, (list, set, tuple)) else set()
        if not named:
            original(peft_config, model, conversions)
            return
        peft_config.target_modules = set(targets) - named
        original(peft_config, model, conversions)
        peft_config.target_modules = set(peft_config.target_modules or ()) | named

    conversion.convert_peft_config_for_transformers = convert
    try:
        with _quiet_wrapping():
            yield
    finally:
        conversion.convert_peft_config_for_transformers = original


def _dotted_module_targets(targets: Any, model: nn.Module) -> set[str]:
    """The entries of a list of ``target_modules`` that name a module of ``model`` by a dotted path (its whole
    name or the end of it)."""
    dotted = {t for t in targets if isinstance(t, str) and "." in t}
    if not dotted:
        return set()
    ends = set()
    for name, _ in model.named_modules():
        parts = name.split(".")
        ends.update(".".join(parts[i:]) for i in range(len(parts) - 1))
    return dotted & ends


@contextlib.contextmanager
def _quiet_wrapping() -> Iterator[None]:
    """``peft_wrapping``'s silenced warnings."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning
        )
        warnings.filterwarnings(
            "ignore",
            message=r"The following (rank|alpha)_pattern keys did not match any targeted module",
            category=RuntimeWarning,
        )
        yield


def local_base_path(name_or_path: str | None) -> str | None:
    """An adapter's ``base_model_name_or_path`` as it should be saved: a local directory made absolute and
    resolved (a relative one would only load from the directory the run started in), a hub id unchanged."""
    if name_or_path and Path(name_or_path).exists():
        return str(Path(name_or_path).resolve())
    return name_or_path


@contextlib.contextmanager
def _no_parametrization(active_adapters: list[str]) -> Iterator[None]:
    """Stands in for ``ParamWrapper._activate_lora`` on a 4-bit expert weight: no parametrization (the experts
    forward adds the adapters itself)."""
    yield


def _expert_factors(wrapper: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
    """The active adapters of peft's ``ParamWrapper`` on a fused expert weight (experts, out, in) as
    ``(B (experts, out, r), A (experts, r, in), scaling)``: ``ParamWrapper.get_delta_factors``'s layout, whose
    ``scaling * B_e @ A_e`` is expert ``e``'s delta weight."""
    if wrapper.disable_adapters:
        return []
    out = []
    experts = wrapper.num_experts
    for adapter in wrapper.active_adapters:
        if adapter not in wrapper.lora_A:
            continue
        a = wrapper.lora_A[adapter].weight  # (r * experts, in)
        b = wrapper.lora_B[adapter].weight  # (out, r * experts)
        a = a.reshape(experts, -1, a.shape[-1])
        b = b.reshape(b.shape[0], -1, experts).permute(2, 0, 1)
        out.append((b, a, wrapper.scaling[adapter]))
    return out


ROUTERS = ("gate", "router", "shared_expert_gate")
"""Names transformers gives the modules of an MoE block that route tokens (or gate a shared expert)."""


def _under_experts(path: str) -> bool:
    """Whether ``path`` (a module's name in a decoder layer) is a routed experts module or inside one."""
    return "experts" in path.split(".")


def _is_experts(path: str) -> bool:
    """Whether ``path`` (a module's name in a decoder layer) is a routed experts module (transformers' name)."""
    return path.rsplit(".", 1)[-1] == "experts"


def _is_router(path: str, module: nn.Module) -> bool:
    """Whether the module at ``path`` routes tokens: named as transformers names routers, or a Router class."""
    return path.rsplit(".", 1)[-1] in ROUTERS or type(module).__name__.endswith("Router")


def _moe(layers: nn.Module) -> bool:
    """Whether the decoder ``layers`` hold routed experts (a mixture of experts)."""
    return any(_under_experts(path) for path, _ in layers.named_modules())


def lora_targets(model: nn.Module, settings: LoraSettings) -> tuple[str | list[str], list[str] | None]:
    """``method.lora``'s targets as peft should take them for ``model``: ``(target_modules,
    target_parameters)``.

    - A dense model of text: as they are (peft resolves ``all-linear`` and names).
    - A mixture of experts: ``all-linear`` means attention, shared experts and dense MLPs, never the routed
      experts nor the routers; ``experts`` adds the routed experts' weights (``target_parameters``, one
      low-rank term per expert) and ``routers`` the routers'. The modules are named by their path in a layer
      (``mlp.shared_experts.gate_proj``), which peft's remapping of transformers 4 adapters leaves alone
      (``peft_wrapping``).
    - A multimodal class trained on text: the full names of its language model's modules, so that names its
      tower shares (``q_proj``) adapt the decoder only.

    The adapter's keys are peft's names for those modules of the checkpoint's class."""
    names = (
        [settings.target_modules]
        if isinstance(settings.target_modules, str)
        else list(settings.target_modules)
    )
    parameters = list(settings.target_parameters or [])
    multimodal = model.config.get_text_config(decoder=True) is not model.config
    decoder = model.get_decoder() if multimodal else model
    prefix = next(n for n, m in model.named_modules() if m is decoder) if multimodal else ""
    layers_name, layers = find_decoder_layers(decoder)
    moe = _moe(layers)
    if not moe and not multimodal:
        if {"experts", "routers"} & set(names):
            raise ConfigError(
                f"method.lora.target_modules {settings.target_modules!r} names experts or routers, but "
                f"{type(model).__name__} is not a mixture of experts; use all-linear or module names"
            )
        return settings.target_modules, parameters or None

    def full(relative: str) -> str:  # a name peft matches: in a multimodal class, the module's whole name
        return ".".join(p for p in (prefix, layers_name, relative) if p) if multimodal else relative

    found: dict[str, None] = {}
    for i, layer in enumerate(layers):
        for path, module in layer.named_modules():
            if not path:
                continue
            where = f"{i}.{path}" if multimodal else path
            linear = isinstance(module, nn.Linear)
            router = _is_router(path, module)
            if _under_experts(path):
                if "experts" in names and linear:  # experts as modules of their own
                    found[full(where)] = None
                elif "experts" in names and _is_experts(path):
                    for pname, p in module.named_parameters(recurse=False):
                        if p.dim() == 3:
                            parameters.append(full(f"{where}.{pname}"))
            elif router:
                if "routers" in names and linear:
                    found[full(where)] = None
                elif "routers" in names and isinstance(getattr(module, "weight", None), torch.Tensor):
                    parameters.append(full(f"{where}.weight"))
            elif linear and (
                "all-linear" in names or any(path == n or path.endswith(f".{n}") for n in names)
            ):
                found[full(where)] = None
    if not multimodal:  # a text model: each kind of module once, by its path in a layer
        found = dict.fromkeys(sorted(found))
    parameters = list(dict.fromkeys(parameters))
    if not found and not parameters:
        raise ConfigError(
            f"method.lora.target_modules {settings.target_modules!r} names no module of {type(model).__name__}'s "
            f"decoder layers ({type(layers[0]).__name__}); name its layers' modules (e.g. q_proj, v_proj), "
            "all-linear, and on a mixture of experts experts or routers"
        )
    return list(found), parameters or None


def expert_adapter_note(model: nn.Module, settings: LoraSettings, four_bit: bool = False) -> str:
    """What LoRA on an MoE's routed experts costs or gives, for ``estimate``: when ``settings`` leave the experts
    out, the parameters, and the device bytes of adapters and states, that ``experts`` would add; when they name
    them, what the experts' adapters are of the trained parameters. "" for a model without routed experts.
    ``four_bit``: the base is quantized 4-bit, where experts stored (experts, in, out) take no adapter."""
    from tiertune.units import format_size

    _, layers = find_decoder_layers(text_decoder(model))
    r = settings.r
    experts = [module for layer in layers for path, module in layer.named_modules() if _is_experts(path)]
    added = sum(
        r * p.shape[0] * (p.shape[1] + p.shape[2])
        for module in experts
        for p in module.parameters(recurse=False)
        if p.dim() == 3
    )
    if not added:
        return ""
    names = [settings.target_modules] if isinstance(settings.target_modules, str) else settings.target_modules
    if four_bit and any(getattr(m, "is_transposed", False) for m in experts):
        return (
            "LoRA leaves the routed experts out; they are stored (experts, in, out) and here 4-bit, where "
            "tiertune adapts none yet (model.quantize: none adapts them)"
        )
    if "experts" in names:
        return f"LoRA on the routed experts (target_modules: experts): {added:,} of the trained parameters"
    return (
        f"LoRA leaves the routed experts out (all-linear on an MoE is attention, shared experts and dense MLPs); "
        f"adding experts to method.lora.target_modules would train {added:,} more parameters "
        f"({format_size(added * 16)} more of adapters and their states on the GPU) and needs dropout 0"
    )


def as_peft_loads(config: Any, model_type: str) -> Any:
    """``config`` as ``adapter_config.json`` should say it for peft 0.21 to load the adapter as trained: on the
    MoE families whose module targets ending in ``gate_proj``, ``up_proj`` or ``down_proj`` peft takes for the
    routed experts (huggingface/peft#3711), those targets (a shared expert's, a dense MLP's) are written as their
    weights, ``target_parameters``, which peft adapts alike (W + s B A, the same keys and factors), and
    ``lora_dropout`` 0, as peft requires of those (dropout is a setting of training, not of the adapter's
    function). Any other config is returned as it is."""
    import copy

    from peft.utils.transformers_weight_conversion import (
        _MODEL_TO_CONVERSION_PATTERN,
        _MOE_TARGET_MODULE_MAPPING,
    )

    remapped = _MOE_TARGET_MODULE_MAPPING.get(_MODEL_TO_CONVERSION_PATTERN.get(model_type, ""), {})
    targets = config.target_modules
    if not remapped or isinstance(targets, str):
        return config
    moved = sorted(t for t in targets if "." in t and t.rsplit(".", 1)[-1] in remapped)
    if not moved:
        return config
    written = copy.deepcopy(config)
    written.target_modules = sorted(set(targets) - set(moved))
    written.target_parameters = sorted({*(config.target_parameters or ()), *(f"{t}.weight" for t in moved)})
    if written.lora_dropout:
        log.info(
            "adapter_config.json names the shared experts' and dense MLPs' projections as target_parameters with "
            "lora_dropout 0 (trained with %s): peft 0.21 would take their module names for the routed experts "
            "(huggingface/peft#3711), and adapts parameters without dropout; the adapter is the same",
            written.lora_dropout,
        )
        written.lora_dropout = 0.0
    return written


FIRST = "default"
"""The first adapter's name: peft's (``LoraConfig``'s default adapter)."""


def adapter_name(index: int) -> str:
    """The name of the ``index``-th adapter of several over one base (0: peft's ``default``)."""
    return FIRST if index == 0 else f"adapter-{index}"


class Adapters:
    """The LoRA adapters of a model: peft's wrapping, their parameters in model order, their optimizer.

    Several adapters over one base (``more``: the settings of the 2nd, 3rd, ...; ``tiertune train a.yaml b.yaml``)
    are peft adapters of the one wrapped model (``adapter_name``), each with its own targets, rank, DoRA,
    init seed and optimizer; ``activate`` picks the one a micro-batch runs through (the others add nothing)."""

    def __init__(
        self,
        model: nn.Module,
        settings: LoraSettings,
        device: torch.device,
        optim: str = "adamw_torch",
        more: tuple[LoraSettings, ...] = (),
    ) -> None:
        from peft import LoraConfig, get_peft_model

        self.settings = settings
        self.model_type = model.config.model_type
        self.names = [adapter_name(i) for i in range(1 + len(more))]
        self.settings_of = dict(zip(self.names, (settings, *more), strict=True))
        self.config_of: dict[str, Any] = {}
        for name, each in self.settings_of.items():
            modules, parameters = lora_targets(model, each)
            if parameters and more:
                raise ConfigError(
                    "several adapters over one base adapt no MoE expert or router parameters yet "
                    f"(target_parameters {parameters}): list method.lora.target_modules without them, or run "
                    "one recipe"
                )
            self.config_of[name] = LoraConfig(
                r=each.r,
                lora_alpha=each.alpha,
                lora_dropout=each.dropout,
                target_modules=modules,
                target_parameters=parameters,
                task_type="CAUSAL_LM",
            )
        self.config = self.config_of[FIRST]
        try:
            # on the meta device: peft would give each adapter memory and an init, then move it to the base
            # weights' device (meta); ``_materialize`` gives them both, once
            with peft_wrapping(), torch.device("meta"):
                self.peft_model = get_peft_model(model, self.config)
                for name in self.names[1:]:
                    self.peft_model.add_adapter(name, self.config_of[name])
        except ValueError as exc:  # peft: no module matched target_modules, and the like
            if "ParamWrapper" in str(exc) and "dropout" in str(exc):
                raise ConfigError(
                    f"method.lora.dropout is {settings.dropout}, but peft adapts this model's MoE experts or "
                    "routers as parameters (target_parameters: on transformers 5 it adds them itself to "
                    "target_modules all-linear), and peft has no dropout there; set method.lora.dropout: 0, "
                    "or list target_modules without them (e.g. [q_proj, k_proj, v_proj, o_proj])"
                ) from exc
            raise ConfigError(f"method.lora: {exc}") from exc
        from peft.tuners.tuners_utils import BaseTunerLayer

        # every adapted module, found now: a streaming engine takes the decoder layers out of the module tree
        self.tuner_layers = [m for m in self.peft_model.modules() if isinstance(m, BaseTunerLayer)]
        self.quantized_experts = self._adapt_quantized_experts()
        # the base as a path that loads from any directory, resolved now (against the one it was loaded from)
        for config in (*self.config_of.values(), *self.peft_model.peft_config.values()):
            config.base_model_name_or_path = local_base_path(config.base_model_name_or_path)
        self._materialize(device)
        # DoRA's magnitudes start as the norms of the base weights, which are not in memory yet: peft wraps
        # the layers as plain LoRA, then each layer gets peft's DoRA variant, initialized by ``init_dora``
        # while the engine has that layer's base weights bound
        self.pending_dora: list[tuple[nn.Module, str]] = [
            held for name in self.names if self.settings_of[name].use_dora for held in self._add_dora(name)
        ]
        self._optimizers: dict[str | None, torch.optim.Optimizer] = {}
        self._optim = optim
        self._active: str | None = None
        self._rows: list[str] | None = None  # a mixed stack's adapter of each row (``mix``)
        if more:  # peft leaves an added adapter frozen until it is made the active one: all of them train
            for n, p in self.peft_model.named_parameters():
                if any(f".{name}." in n for name in self.names):
                    p.requires_grad_(True)
            from peft.tuners.lora import LoraLayer
            from peft.tuners.lora.layer import ParamWrapper

            for m in self.tuner_layers:
                if isinstance(m, LoraLayer) and not isinstance(m, ParamWrapper):
                    m.register_forward_pre_hook(self._route, with_kwargs=True)
        self.collect()

    def _adapt_quantized_experts(self) -> list[str]:
        """peft's adapters of 4-bit fused expert weights (``tiertune.quant.experts``): peft would add their
        delta to the weight through a parametrization, which a 4-bit weight cannot take; the wrapper leaves
        the weight as it is and the experts forward adds each expert's low-rank term from peft's own factors
        (the same sum). Returns the adapted weights' names."""
        from peft.tuners.lora.layer import ParamWrapper

        from tiertune.quant.experts import add_lora, is_quantized_experts

        adapted = []
        for name, module in self.peft_model.named_modules():
            if not isinstance(module, ParamWrapper) or not is_quantized_experts(module.get_param()):
                continue
            if not module._did_swap_in_out_features:  # (experts, in, out): convert_experts leaves those
                raise ConfigError(f"method.lora: {name} is a transposed 4-bit expert weight: no LoRA there")
            module._activate_lora = _no_parametrization  # an instance attribute: this wrapper only
            add_lora(module.get_base_layer(), module.parameter_name, partial(_expert_factors, module))
            adapted.append(f"{name}.{module.parameter_name}")
        return adapted

    def parametrized(self) -> list[tuple[nn.Module, str]]:
        """The parameters peft adapts through a parametrization (``ParamWrapper``: MoE routers, unquantized
        experts), as (module, parameter name): registering it calls ``set_`` on the parameter."""
        from peft.tuners.lora.layer import ParamWrapper

        from tiertune.quant.experts import is_quantized_experts

        return [
            (m.get_base_layer(), m.parameter_name)
            for m in self.peft_model.modules()
            if isinstance(m, ParamWrapper) and not is_quantized_experts(m.get_param())
        ]

    def collect(self) -> None:
        """Gather the trainable adapter parameters, in model order (again after ``init_dora``), and each
        adapter's (``named_of``)."""
        self.named = [(n, p) for n, p in self.peft_model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in self.named]
        self.named_of = {
            name: [(n, p) for n, p in self.named if f".{name}." in n or len(self.names) == 1]
            for name in self.names
        }

    def params_of(self, name: str | None) -> list[nn.Parameter]:
        """The trainable parameters of adapter ``name`` (None: of every adapter)."""
        return self.params if name is None else [p for _, p in self.named_of[name]]

    def activate(self, name: str | None) -> None:
        """Make adapter ``name`` the one the model's adapted modules add (None: leave them as they are)."""
        self._rows = None
        if name is None or name == self._active:
            return
        for m in self.tuner_layers:
            m._active_adapter = name  # a module that adapter does not target adds nothing (peft's forward)
        self._active = name

    def drop_nothing(self, name: str) -> None:
        """Adapter ``name``'s dropout set to drop nothing (TRL's ``disable_dropout`` for that adapter alone)."""
        for m in self.tuner_layers:
            if name in m.lora_dropout and isinstance(m.lora_dropout[name], nn.Dropout):
                m.lora_dropout[name].p = 0.0

    def mixes(self, name: str | None) -> bool:
        """Whether adapter ``name``'s rows may share a batch with other adapters' (``mix``): peft's mixed
        batches take no DoRA."""
        return name is not None and not self.settings_of[name].use_dora

    def mix(self, rows: list[str]) -> None:
        """The adapter of each row of the batches the adapted modules see next (peft's mixed-batch forward,
        ``adapter_names``: the base's product once for all the rows, each row's own adapter's term added)."""
        self._rows = rows

    def _route(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if self._rows is None:
            return None
        if len(args[0]) != len(self._rows):
            raise RuntimeError(
                f"a mixed batch of {len(self._rows)} rows reached {type(module).__name__} as {len(args[0])}: "
                "its rows flattened before the adapters; run one adapter at a time"
            )
        return args, {**kwargs, "adapter_names": self._rows}

    def _add_dora(self, adapter: str) -> list[tuple[nn.Module, str]]:
        from peft import LoraConfig
        from peft.tuners.lora import LoraLayer

        self.config_of[adapter].use_dora = True
        self.peft_model.peft_config[adapter].use_dora = True
        dora = LoraConfig(r=self.settings_of[adapter].r, use_dora=True)
        pending = []
        for name, module in self.peft_model.named_modules():
            if not isinstance(module, LoraLayer) or adapter not in module.lora_A:
                continue
            variant = module.resolve_lora_variant(config=dora)
            if variant is None:
                raise ConfigError(
                    f"method.lora.use_dora: peft has no DoRA for {name} ({type(module).__name__})"
                )
            module.lora_variant[adapter] = variant
            module.use_dora[adapter] = True
            pending.append((module, adapter))
        return pending

    def init_dora(self, layer: nn.Module) -> None:
        """Initialize the DoRA magnitudes inside ``layer`` with peft's own init (its base weights bound)."""
        inside = {id(m) for m in layer.modules()}
        for module, adapter in self.pending_dora:
            if id(module) in inside:
                module.lora_variant[adapter].init(module, adapter_name=adapter)
        self.pending_dora = [(m, a) for m, a in self.pending_dora if id(m) not in inside]

    def _materialize(self, device: torch.device) -> None:
        """peft put the adapters where the base weights are (meta): give them memory and peft's own init,
        from ``settings.seed`` (42 when None; fp32, as peft keeps adapters of low-precision bases)."""
        from peft.tuners.lora import LoraLayer

        for adapter in self.names:  # each from its own seed, as it would be alone
            seed = self.settings_of[adapter].seed
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(42 if seed is None else seed)
                for module in self.peft_model.modules():
                    if not isinstance(module, LoraLayer) or adapter not in module.lora_A:
                        continue
                    for part in (module.lora_A[adapter], module.lora_B[adapter]):
                        part.to_empty(device=device)
                        part.float()
                    if device.type != "meta":  # (a ledger's: no values to initialize)
                        module.reset_lora_parameters(adapter, init_lora_weights=True)

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """The model without its adapters for the block (the base: a preference objective's reference); their
        parameters and what requires gradients stay as they are (peft's ``disable_adapter`` would change both)."""
        layers = self.tuner_layers
        before = [m._disable_adapters for m in layers]
        rows, self._rows = self._rows, None  # a mixed batch's rows are the policy's, not the base's
        for m in layers:
            m._disable_adapters = True
        try:
            yield
        finally:
            self._rows = rows
            for m, was in zip(layers, before, strict=True):
                m._disable_adapters = was

    def in_module(self, module: nn.Module) -> list[nn.Parameter]:
        """The trainable adapter parameters inside ``module`` (a decoder layer), in model order."""
        inside = {id(p) for p in module.parameters()}
        return [p for p in self.params if id(p) in inside]

    def step(
        self,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float],
        eps: float,
        max_grad_norm: float | None,
        name: str | None = None,
    ) -> float:
        """Clip to ``max_grad_norm`` (as ``clip_grad_norm_``; None: no clipping), update with AdamW and zero the
        gradients of adapter ``name`` (None: every adapter, one optimizer); returns the gradient norm."""
        params = [p for p in self.params_of(name) if p.grad is not None]
        if max_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        else:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
        if not math.isfinite(float(norm)):  # the adapter stays as it was; its run stops
            self.zero_grad(name)
            raise NonFiniteError(f"the adapters' gradient norm is {float(norm)}")
        optimizer = self.optimizer(weight_decay, betas, eps, name)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        optimizer.zero_grad()
        return float(norm)

    def zero_grad(self, name: str | None = None) -> None:
        """Drop the gradients of adapter ``name`` (None: every adapter's)."""
        for p in self.params_of(name):
            p.grad = None

    def optimizer(
        self, weight_decay: float, betas: tuple[float, float], eps: float, name: str | None = None
    ) -> torch.optim.Optimizer:
        """The optimizer of adapter ``name`` (None: of every adapter; made on first use): weight decay on the
        matrices only."""
        if name not in self._optimizers:
            params = self.params_of(name)
            decay = [p for p in params if p.dim() >= 2]
            rest = [p for p in params if p.dim() < 2]
            groups = [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]
            if self._optim == "adamw_bnb_8bit":
                import bitsandbytes as bnb

                self._optimizers[name] = bnb.optim.AdamW8bit(groups, lr=0.0, betas=betas, eps=eps)
            else:
                self._optimizers[name] = torch.optim.AdamW(groups, lr=0.0, betas=betas, eps=eps, fused=True)
        return self._optimizers[name]

    def training_state(self, name: str | None = None) -> dict[str, Any]:
        """The weights of adapter ``name`` (None: every adapter's) and its optimizer's state (a checkpoint)."""
        optimizer = self._optimizers.get(name)
        return {
            "params": [p.detach().to("cpu", copy=True) for p in self.params_of(name)],
            "optimizer": None if optimizer is None else optimizer.state_dict(),
        }

    def load_training_state(
        self,
        state: dict[str, Any],
        weight_decay: float,
        betas: tuple[float, float],
        eps: float,
        name: str | None = None,
    ) -> None:
        """Put back what ``training_state`` returned: the weights, and the optimizer's moments and step."""
        params = self.params_of(name)
        if len(state["params"]) != len(params):
            raise ConfigError(
                f"the checkpoint holds {len(state['params'])} adapter tensors, this run has {len(params)}; "
                "resume with the method.lora settings the checkpoint was trained with"
            )
        with torch.no_grad():
            for p, saved in zip(params, state["params"], strict=True):
                p.copy_(saved)
        if state["optimizer"] is not None:
            self.optimizer(weight_decay, betas, eps, name).load_state_dict(state["optimizer"])

    def state_dict(self, name: str = FIRST) -> dict[str, torch.Tensor]:
        """Adapter ``name``'s weights as peft saves them (keys without the adapter name), on the CPU."""
        own = {n: p.detach().to("cpu", copy=True) for n, p in self.named_of[name]}
        # peft's key format by its own rules (DoRA's magnitude without ".weight", the adapter's name removed):
        # ``get_peft_model_state_dict`` selects by the model's tuner prefixes, and keeps none where the streamed
        # engine holds the decoder layers outside the module tree
        from peft.tuners.lora import LoraModel

        dora = f"lora_magnitude_vector.{name}.weight"
        return {
            LoraModel._remove_adapter_name_from_key(
                k.removesuffix(".weight") if k.endswith(dora) else k, name
            ): v
            for k, v in own.items()
        }

    def load(self, directory: str | Path, name: str = FIRST) -> None:
        """Adapter ``name``'s weights from a PEFT adapter directory (``save``'s, or peft's own for the same
        settings); ConfigError naming what differs where its tensors are not this adapter's."""
        from safetensors.torch import load_file

        file = Path(directory) / "adapter_model.safetensors"
        if not file.is_file():
            raise ConfigError(f"{directory} holds no PEFT adapter (no adapter_model.safetensors)")
        tensors = load_file(str(file))
        keys = list(self.state_dict(name))  # peft's key of each of the adapter's tensors, in order
        params = [p for _, p in self.named_of[name]]
        missing = [k for k in keys if k not in tensors]
        if missing or len(tensors) != len(keys):
            raise ConfigError(
                f"{file} holds {len(tensors)} tensors, this adapter {len(keys)} (first not found: "
                f"{(missing or ['-'])[0]}): its rank, targets or model are not this recipe's method.lora"
            )
        with torch.no_grad():
            for key, p in zip(keys, params, strict=True):
                if tensors[key].shape != p.shape:
                    raise ConfigError(
                        f"{file}: {key} is {tuple(tensors[key].shape)}, this adapter's {tuple(p.shape)} (another "
                        "rank or model)"
                    )
                p.copy_(tensors[key])

    def save(self, directory: str | Path, name: str = FIRST) -> Path:
        """Write ``adapter_model.safetensors`` and ``adapter_config.json`` (what ``PeftModel.from_pretrained``
        reads) into ``directory``: each file under a temporary name, fsynced, then renamed into place, the
        config last, so an interrupted save never leaves a directory that looks complete."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".adapter-", dir=directory))
        try:
            # base_model_name_or_path absolute (see ``__init__``)
            as_peft_loads(self.config_of[name], self.model_type).save_pretrained(str(tmp))
            tensors = {k: v.contiguous() for k, v in self.state_dict(name).items()}
            save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
            move_files_into(tmp, directory, last="adapter_config.json")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return directory
