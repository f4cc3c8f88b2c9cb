"""Unmodified Hugging Face causal LMs, taken apart the way the streaming engine needs them.

The model is built on the meta device from its local directory (parameters take no memory; buffers such as
rotary caches are real, computed as the model computes them), its stack of decoder layers is found
generically, and its parameters are grouped: input embeddings, one group per decoder layer, the rest
(final norm and the like) and the output head when it is not tied to the input embeddings. Each group is
registered in a ``ChunkStore`` and its weights are streamed from the safetensors shards straight into the
chunks, converting dtype on the way: peak host memory is the store's host budget plus one tensor.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import os
import re
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tiertune.distributed.ownership import shard_layout
from tiertune.errors import ModelError, StateError
from tiertune.loading.weights import AsSaved, Checkpoint
from tiertune.offload.chunk import ALIGN, Chunk, ChunkLayout, TensorSpec, layout_views, pack_tensors
from tiertune.offload.inplace import FileTensor, InPlace, can_map, plan_in_place
from tiertune.offload.store import ChunkStore
from tiertune.offload.tiers import Tier
from tiertune.quant import NF4, Quantizer, SavedWeight, experts, is_quantized, shipped
from tiertune.quant.experts import is_quantized_experts
from tiertune.structure import DECODERS, find_decoder_layers
from tiertune.units import round_up

if TYPE_CHECKING:
    from tiertune.loading.quant_cache import QuantCache


@dataclass
class ParamGroup:
    """Parameters that move together: ``kind`` is embed, layer, rest or head."""

    name: str
    kind: str
    params: dict[str, nn.Parameter]
    chunks: list[Chunk] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params.values())


@dataclass
class ModelParts:
    """A model's decoder stack, embeddings and head, and its parameters grouped for streaming."""

    model: nn.Module
    layers_name: str
    layers: nn.ModuleList
    embed: nn.Module
    head: nn.Module | None
    tied: bool
    groups: list[ParamGroup]


SAME_ARCHITECTURE = {"kimi_k2": "deepseek_v3"}
"""Model types of releases whose architecture transformers has under another type (Kimi-K2's config names
``kimi_k2`` and remote code that is DeepSeek-V3's): built as that type's config and model, not remote code."""


def load_config(directory: str | os.PathLike[str]) -> Any:
    """The transformers config of the model in ``directory`` (``model.path``), checked to be one tiertune can
    train: a decoder-only causal LM. Raises ModelError naming the file and what is wrong with it."""
    import transformers
    from transformers import AutoConfig

    path = Path(directory)
    file = path / "config.json"
    if not file.is_file():
        raise ModelError(
            f"{path} is not a Hugging Face model directory (no config.json); set model.path to one"
        )
    restore = "restore the config.json saved with the model (save_pretrained writes one), e.g. download it"
    try:
        raw = json.loads(file.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        where = f" at line {exc.lineno}, column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else ""
        what = exc.msg if isinstance(exc, json.JSONDecodeError) else "not UTF-8 text"
        raise ModelError(f"{file} is not valid JSON ({what}{where}); {restore}") from None
    if not isinstance(raw, dict):
        raise ModelError(
            f"{file} holds a JSON {type(raw).__name__}, expected an object of model settings; {restore}"
        )
    model_type = raw.get("model_type")
    if not model_type:
        raise ModelError(
            f'{file} has no "model_type" key, so the architecture it describes is unknown (expected e.g. '
            f'"model_type": "llama"); {restore}'
        )
    try:
        if (
            model_type in SAME_ARCHITECTURE
        ):  # a release that names its own type for a transformers architecture
            from transformers import CONFIG_MAPPING

            alias = SAME_ARCHITECTURE[model_type]
            config = CONFIG_MAPPING[alias].from_dict({**raw, "model_type": alias})
        else:
            config = AutoConfig.from_pretrained(path)
    except Exception as exc:  # transformers and huggingface_hub validate configs with errors of their own
        raise ModelError(
            f"{file}: transformers {transformers.__version__} cannot build a config of model_type "
            f"{model_type!r} from it ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); upgrade "
            f"transformers if the model is newer than it, or {restore}"
        ) from exc
    why = not_trainable(config)
    if why:
        architectures = ", ".join(getattr(config, "architectures", None) or []) or "no architectures listed"
        raise ModelError(
            f"tiertune fine-tunes decoder-only causal LMs (AutoModelForCausalLM); {path} is a {config.model_type} "
            f"({architectures}), {why}"
        )
    return config


def decoder_config(directory: str | os.PathLike[str]) -> Any:
    """The config of the decoder ``AutoModelForCausalLM`` builds from ``directory`` (``load_config``'s checks
    first): the config itself, or the text decoder's of a config that also describes other parts (Llama 4's
    and Qwen3.5's hold a vision encoder's too; their causal LM is the text decoder alone). Its dimensions
    (``hidden_size``, ``num_hidden_layers``, ``vocab_size``) are the model's."""
    return load_config(directory).get_text_config(decoder=True)


DIMENSIONS = ("hidden_size", "num_hidden_layers", "vocab_size")
"""What tiertune reads of a decoder's config: the width of its hidden states, its layers, its vocabulary."""


MULTIMODAL_INPUTS = (
    "pixel_values",
    "pixel_values_videos",
    "input_features",
    "input_values",
    "audio_values",
    "image_embeds",
    "image_patches",
)
"""Arguments of a model's forward that only a model of images, video or sound takes."""


def vocabulary_size(directory: str | os.PathLike[str]) -> int:
    """The model's vocabulary (its decoder config's ``vocab_size``)."""
    return int(decoder_config(directory).vocab_size)


def not_trainable(config: Any) -> str:
    """Why tiertune cannot fine-tune the model ``config`` describes, and what to do instead ("" when it can):
    it must be a decoder-only causal LM (what ``AutoModelForCausalLM`` builds from it), or a multimodal class
    whose language model is a decoder (Gemma 3's, Llama 4's, Qwen3-VL's ``ForConditionalGeneration``, the last
    with no causal LM of its own), trained on text (its tower is never read). Encoder-decoder models,
    encoder-only ones (BERT: its causal-LM head is bidirectional attention unless ``is_decoder``), and other
    multimodal classes are refused."""
    import transformers
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    model_type = config.model_type
    if getattr(config, "is_encoder_decoder", False):
        return f"an encoder-decoder model; {DECODERS}"
    text = config.get_text_config(decoder=True)
    if (
        model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        and model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
        and text is not config
        and not getattr(text, "is_encoder_decoder", False)
        and all(isinstance(getattr(text, key, None), int) for key in DIMENSIONS)
    ):
        return ""  # a multimodal class with no causal LM of its own (Qwen3-VL): trained on text, through its decoder
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return f"not a causal LM; {DECODERS}"
    if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", False):
        return (
            "an encoder-only model (pretrained with bidirectional attention: a masked LM, not a decoder); "
            f"{DECODERS}"
        )
    missing = [key for key in DIMENSIONS if not isinstance(getattr(text, key, None), int)]
    if missing:
        return (
            f"a model whose config names no {' or '.join(missing)} (not one stack of decoder layers over a hidden "
            f"size, which tiertune streams a layer at a time); {DECODERS}"
        )
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    cls = getattr(transformers, name, None)
    takes = set(inspect.signature(cls.forward).parameters) if cls is not None else set()
    inputs = sorted(takes & set(MULTIMODAL_INPUTS))
    decoder_of = text is not config and text.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    if inputs and decoder_of and not not_trainable(text):
        return ""  # a multimodal class trained on text: its language model streams, its tower is never read
    if inputs:
        return (
            f"a multimodal model ({name} takes {', '.join(inputs)}) whose language model is not a decoder tiertune "
            f"streams (tiertune trains multimodal classes on text through their decoder); {DECODERS}"
        )
    return ""


def no_cache(model: nn.Module) -> None:
    """No KV cache in a training pass: the model's config and its text decoder's (a multimodal class's language
    model reads its own: with one, a layer recomputed in backward would attend to its forward's keys too)."""
    model.config.use_cache = False
    model.config.get_text_config(decoder=True).use_cache = False


def model_class(config: Any) -> type:
    """The transformers class tiertune builds for ``config``: the checkpoint's own class when the checkpoint
    is a multimodal one (``Llama4ForConditionalGeneration``) whose text decoder tiertune streams, although
    ``AutoModelForCausalLM`` would build the text decoder alone from it (Llama 4, Qwen3-VL); else
    ``AutoModelForCausalLM``'s class. So the parameters are named as the checkpoint names them, an adapter's
    keys are peft's names for the modules of the class the checkpoint is, and a merged export is that class
    with its tower."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    mapping = AutoModelForCausalLM._model_mapping
    if type(config) not in mapping:  # a multimodal class with no causal LM of its own (Qwen3-VL)
        mapping = AutoModelForImageTextToText._model_mapping
    causal = mapping[type(config)]
    named = [getattr(transformers, a, None) for a in getattr(config, "architectures", None) or []]
    for cls in named:
        if (
            cls is not None
            and cls is not causal
            and cls.__name__.endswith("ForConditionalGeneration")
            and getattr(cls, "config_class", None) is type(config)
            and config.get_text_config(decoder=True) is not config
        ):
            return cls
    return causal


def build_skeleton(directory: str | os.PathLike[str], dtype: torch.dtype = torch.float32) -> nn.Module:
    """The model of a local Hugging Face directory (``model_class``'s) with its parameters on the meta device
    (no memory)."""
    from accelerate import init_empty_weights

    config = load_config(directory)
    try:
        # no initializer runs: the parameters are on the meta device, their values never exist (on meta,
        # torch runs each initializer through its Python reference kernels: seconds for a 70B skeleton)
        with init_empty_weights(include_buffers=False), _no_init_weights(), _LargeOnMeta():
            model = _build(config, dtype)
    except Exception as exc:  # transformers' model code on a config it cannot use (missing or odd settings)
        import transformers

        try:
            name = model_class(config).__name__
        except Exception:  # a config transformers maps to no class: the message names none
            name = "its causal LM"
        why = (str(exc).splitlines() or [""])[0][:200]
        raise ModelError(
            f"transformers {transformers.__version__} cannot build {name} from {Path(directory) / 'config.json'} "
            f"({type(exc).__name__}: {why}); the config lacks or mis-sets a setting that model needs: use the "
            "config.json saved with the model (save_pretrained writes one), or a newer transformers"
        ) from exc
    # init_empty_weights re-creates each registered parameter on meta, which undoes the tying that
    # from_config did: tie again so a tied head is the embedding's own parameter
    model.tie_weights()
    return model


def _build(config: Any, dtype: torch.dtype) -> nn.Module:
    """``model_class(config)`` built from ``config``: through its auto class where it is the auto mapping's (which
    hands a composite config's text part to a text-only class: Llama 4's config without architectures), else the
    checkpoint's own class directly."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    cls = model_class(config)
    for auto in (AutoModelForCausalLM, AutoModelForImageTextToText):
        if type(config) in auto._model_mapping and auto._model_mapping[type(config)] is cls:
            return auto.from_config(config, dtype=dtype)
    return cls._from_config(config, dtype=dtype)


class _LargeOnMeta(torch.overrides.TorchFunctionMode):
    """Tensors of more than ``LARGE_AT_INIT`` bytes that a model's ``__init__`` makes with a factory and no
    device (``torch.zeros``) are made on the meta device: they are parameters, which ``init_empty_weights``
    moves to meta anyway, but only after they were made; zero-filled, they were memory written (transformers
    5.24's Llama 4 experts: ``torch.zeros`` of 43 GB for Maverick's). Buffers, which stay real, are small."""

    FACTORIES = frozenset({torch.zeros, torch.ones, torch.empty, torch.full, torch.rand, torch.randn})

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func in self.FACTORIES and kwargs.get("device") is None and args:
            first = args[0]
            shape = first if isinstance(first, (tuple, list, torch.Size)) else args
            if all(isinstance(n, int) for n in shape) and math.prod(shape) * 4 > LARGE_AT_INIT:
                kwargs = {**kwargs, "device": "meta"}
        return func(*args, **kwargs)


LARGE_AT_INIT = 64 << 20
"""Bytes (at 4 a value) above which a factory tensor made in a model's ``__init__`` is made on meta."""


def _no_init_weights() -> contextlib.AbstractContextManager:
    """transformers' own switch that turns torch's and its models' weight initializers off for a block."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # a transformers without it: the initializers run, on meta
        return contextlib.nullcontext()
    return no_init_weights()


def split_model(model: nn.Module) -> ModelParts:
    """Find the decoder layers, embeddings and head, and group every parameter exactly once."""
    layers_name, layers = find_decoder_layers(model)
    embed = model.get_input_embeddings()
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is embed.weight
    owner = {id(p): n for n, p in model.named_parameters()}  # named_parameters yields a tied weight once
    groups = [ParamGroup("embed", "embed", {owner[id(p)]: p for p in embed.parameters()})]
    for i, layer in enumerate(layers):
        groups.append(
            ParamGroup(f"{layers_name}.{i}", "layer", {owner[id(p)]: p for p in layer.parameters()})
        )
    taken = {n for g in groups for n in g.params}
    head_params = {} if head is None or tied else {owner[id(p)]: p for p in head.parameters()}
    # a multimodal class trained on text: its vision or audio tower is never read nor trained (no group)
    taken |= set(tower_parameters(model))
    rest = {n: p for n, p in model.named_parameters() if n not in taken and n not in head_params}
    if rest:
        groups.append(ParamGroup("rest", "rest", rest))
    if head_params:
        groups.append(ParamGroup("head", "head", head_params))
    return ModelParts(model, layers_name, layers, embed, head, tied, groups)


def tower_parameters(model: nn.Module) -> list[str]:
    """The parameters of a multimodal class outside its language model and head (its vision or audio tower and
    projector), which text does not reach: none for a model of text alone."""
    if model.config.get_text_config(decoder=True) is model.config:
        return []
    decoder = model.get_decoder()
    head = model.get_output_embeddings()
    inside = {id(p) for p in decoder.parameters()} | ({id(p) for p in head.parameters()} if head else set())
    return [n for n, p in model.named_parameters() if id(p) not in inside]


@dataclass(frozen=True)
class TensorSource:
    """Where a model parameter's values are in a checkpoint: one tensor (``pieces`` is ``[(key, ())]``), or,
    for a tensor transformers fuses on load (MoE experts), the checkpoint tensors that fill each part of it:
    ``(key, index)`` with ``index`` a contiguous block of the parameter (e.g. expert ``e``'s rows)."""

    pieces: tuple[tuple[str, tuple], ...]

    def read_into(self, checkpoint: Checkpoint, out: torch.Tensor) -> None:
        """Fill ``out`` (the parameter's buffer, any dtype) from the checkpoint, one piece at a time."""
        for key, index in self.pieces:
            checkpoint.read_into(key, out[index] if index else out)


def checkpoint_names(
    model: nn.Module, checkpoint: Checkpoint, split: list[str] | None = None
) -> dict[str, TensorSource]:
    """Map the model's parameter names to where their values are in the checkpoint.

    Checkpoints may use older names than the model's modules (GPT-NeoX saves ``embed_out.weight`` for
    ``lm_head.weight``), and mixture-of-experts checkpoints keep one tensor per expert where transformers 5
    builds one fused 3-D tensor per layer (Mixtral's ``experts.3.w1.weight`` and ``w3`` become rows of
    ``experts.gate_up_proj``). transformers keeps these conversions per architecture; they are applied here
    as ``from_pretrained`` applies them, but as a plan of reads into each fused tensor's parts, so the
    streaming loader never holds more than the tensor it fills. Conversions other than renaming, stacking
    experts (``MergeModulelist``) and joining along a later dimension (``Concatenate``) raise ModelError
    rather than loading wrong weights. A tensor transformers splits into several parameters (Kimi K2.5's tower
    keeps its attention's ``wqkv`` as one) is the source of none; ``split`` collects their keys.
    """
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming
    except ImportError:  # transformers < 5: checkpoint names are the model's names
        return {name: TensorSource(((name, ()),)) for name in checkpoint.entries}
    transforms = get_model_conversion_mapping(model) or []
    names: dict[str, TensorSource] = {}
    fused: dict[str, list[tuple[int, int, str]]] = {}  # target -> (source pattern, expert, checkpoint key)
    converters: dict[str, object] = {}
    for key in checkpoint.entries:
        # a compressed-tensors weight ships as its packed integers: named as the weight it is
        target = key.removesuffix("_packed") if key.endswith(".weight_packed") else key
        for transform in transforms:
            renamed, matched = transform.rename_source_key(target)
            if matched is None:
                continue
            if not isinstance(transform, WeightRenaming):
                if "*" not in matched:  # one tensor split into several (a vision tower's fused qkv): not
                    target = None  # experts; no parameter of the decoder is read from it
                    if split is not None:
                        split.append(key)
                    break
                k = transform.source_patterns.index(matched)
                fused.setdefault(renamed, []).append((k, _expert(matched, target, key, model), key))
                converters[renamed] = transform
            target = renamed
        if target is not None and target not in fused:
            names[target] = TensorSource(((key, ()),))
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    for target, parts in fused.items():
        quantized = next((key for _, _, key in parts if _quantized_key(key, checkpoint)), None)
        if quantized is not None:
            raise ModelError(
                f"the checkpoint in {checkpoint.directory} stores {target}'s experts quantized one tensor per "
                f"expert ({quantized!r} has a bitsandbytes quant_state: a transformers 4 save of a quantized "
                "MoE); tiertune does not read per-expert quantized experts yet: use the model's unquantized "
                "checkpoint (its experts are quantized to NF4 on load, and cached beside offload.disk_path)"
            )
        if target in shapes:
            names[target] = _fused_source(target, shapes[target], parts, converters[target], checkpoint)
    for name in shapes:  # gpt-oss's MXFP4 experts: the weight ships as its blocks (and scales)
        if name not in names and f"{name}_blocks" in checkpoint:
            names[name] = TensorSource(((f"{name}_blocks", ()),))
    return names


def _expert(pattern: str, name: str, key: str, model: nn.Module) -> int:
    """The expert index the ``*`` of a converter's source pattern matches in ``name``."""
    match = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), name)
    if match is None:
        raise ModelError(
            f"checkpoint tensor {key!r}: no expert index where {pattern!r} expects one "
            f"({type(model).__name__})"
        )
    return int(match.group(1))


def _fused_source(
    target: str, shape: tuple, parts: list[tuple[int, int, str]], converter: object, checkpoint: Checkpoint
) -> TensorSource:
    """The reads that build fused parameter ``target`` (of ``shape``): each expert's tensors stacked along
    dimension 0, the source patterns' tensors side by side along the converter's ``Concatenate`` dimension."""
    ops = [(type(op).__name__, getattr(op, "dim", None)) for op in converter.operations]  # type: ignore[attr-defined]
    concat = ops[1][1] if len(ops) == 2 and ops[1][0] == "Concatenate" else None
    if not ops or ops[0] != ("MergeModulelist", 0) or (len(ops) > 1 and (concat is None or concat < 1)):
        raise ModelError(
            f"{target} is built from {[p for _, _, p in parts][:2]}... by {ops}; the streaming loader only "
            "stacks experts and joins their tensors along a later dimension"
        )
    experts = shape[0]
    patterns = len(converter.source_patterns)  # type: ignore[attr-defined]
    by_slot = {(k, e): key for k, e, key in parts}
    missing = [(k, e) for k in range(patterns) for e in range(experts) if (k, e) not in by_slot]
    if missing:
        k, e = missing[0]
        raise ModelError(
            f"the checkpoint in {checkpoint.directory} lacks expert {e}'s "
            f"{converter.source_patterns[k]!r} for {target}"  # type: ignore[attr-defined]
        )
    pieces = []
    for e in range(experts):
        offset = 0
        for k in range(patterns):
            key = by_slot[(k, e)]
            if concat is None:
                pieces.append((key, (e,)))
                continue
            size = checkpoint.entries[key].shape[concat - 1]
            index = (e,) + (slice(None),) * (concat - 1) + (slice(offset, offset + size),)
            pieces.append((key, index))
            offset += size
        if concat is not None and offset != shape[concat]:
            raise ModelError(
                f"{target}: its parts in the checkpoint add up to {offset} along dimension "
                f"{concat}, the model expects {shape[concat]}"
            )
    return TensorSource(tuple(pieces))


def saved_checkpoint(
    directory: str | os.PathLike[str], model: nn.Module, quant: Quantizer | None, saved: dict | None
):
    """The checkpoint of ``directory`` (its safetensors headers), or, where it has a config.json alone, the
    one transformers would save for ``model`` (``weights.AsSaved``): its parameters in the config's dtype,
    named and split as the checkpoint stores them (transformers' own ``revert_weight_conversion``: an MoE's
    experts one tensor each), a weight the config says is saved quantized (``saved``) as bitsandbytes stores
    it (``quant.saved_tensors``). ``model``: the skeleton, converted as the run converts it."""
    import json

    try:
        return Checkpoint(directory)
    except ModelError:
        if not (Path(directory) / "config.json").is_file():
            raise
    from transformers.modeling_utils import revert_weight_conversion

    raw = json.loads((Path(directory) / "config.json").read_text())
    stored = getattr(
        torch, str(raw.get("dtype") or raw.get("torch_dtype") or "float32").removeprefix("torch.")
    )
    plain: dict[str, torch.Tensor] = {}
    packed: dict[str, torch.Tensor] = {}
    stored_experts: dict[
        str, torch.Tensor
    ] = {}  # a shipped format's experts: saved one tensor per expert, quantized
    for name, p in model.named_parameters():
        kept = saved is not None and quant is not None and is_quantized(p)
        if shipped.is_shipped_format(quant) and is_quantized_experts(p):
            stored_experts[name] = torch.empty(tuple(p.shape), device="meta")
            continue
        (packed if kept else plain)[name] = torch.empty(tuple(p.shape), device="meta")
    # the modules transformers keeps in fp32 in a bf16/fp16 model (an MoE's router) are saved so
    kept = [re.compile(rf"(^|\.){re.escape(k)}($|\.)") for k in model._get_dtype_plan(stored)]

    def dtype_of(key: str) -> torch.dtype:
        return torch.float32 if any(p.search(key) for p in kept) else stored

    tensors = [
        (k, tuple(t.shape), dtype_of(k), None) for k, t in revert_weight_conversion(model, plain).items()
    ]
    for prefix, module in model.named_modules():  # persistent buffers are saved too, in their own dtype
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and name not in module._non_persistent_buffers_set:
                tensors.append((f"{prefix}.{name}" if prefix else name, tuple(buf.shape), buf.dtype, None))
    names = {id(t): n for n, t in packed.items()}
    for key, t in revert_weight_conversion(model, packed).items():  # renamed, never split: linear weights
        tensors += quant.saved_tensors(key, tuple(packed[names[id(t)]].shape), stored)  # type: ignore[union-attr]
    for key, t in revert_weight_conversion(model, stored_experts).items():  # split: one tensor per expert
        tensors += quant.saved_tensors(key, tuple(t.shape), stored)  # type: ignore[union-attr]
    return AsSaved(directory, tensors)


def weight_entries(group: ParamGroup, dtype: torch.dtype, quant: Quantizer | None = None) -> list:
    """The chunk entries (name, shape, dtype) of a group's weights: in ``dtype``, or quantized where ``quant``
    converted the module."""
    entries = []
    for n, p in group.params.items():
        if quant is not None and is_quantized(p):
            entries += quant.entries(n, tuple(p.shape))
        elif isinstance(quant, NF4) and is_quantized_experts(p):  # one 4-bit matrix per expert
            entries += experts.entries(quant, n, tuple(p.shape))
        elif shipped.is_shipped_format(quant) and is_quantized_experts(p):  # each expert as shipped
            entries += quant.experts_entries(n, tuple(p.shape))  # type: ignore[union-attr]
        else:
            entries.append((n, tuple(p.shape), dtype))
    return entries


def load_into_store(
    parts: ModelParts,
    checkpoint: Checkpoint,
    store: ChunkStore,
    homes: dict[str, Tier | str] | Tier | str,
    dtype: torch.dtype,
    quant: Quantizer | None = None,
    chunk_size: int | None = None,
    cache: QuantCache | None = None,
    safe_point: Callable[[], None] | None = None,
    in_place: bool = False,
) -> dict[str, TensorSource]:
    """Register every group's parameters as chunks (in ``dtype``) on its home tier and stream the weights in.

    ``homes`` maps a group kind (embed, layer, rest, head) to a tier, or gives one tier for all. Returns the
    map of parameter names to checkpoint tensor names (``checkpoint_names``). Weights of modules that
    ``quant`` converted are read as they are from a pre-quantized checkpoint (``quant.saved``), else
    quantized on the way in, one tensor at a time, or read from ``cache`` when an earlier run quantized them
    already. A quantized weight and its statistics always share a chunk.

    ``in_place`` says the weights are frozen (adapters are trained on them): those homed on disk whose
    checkpoint tensor holds exactly the bytes they train with (a pre-quantized weight and its statistics, or
    an unquantized weight in the compute dtype) are not copied into the disk tier but read from the
    checkpoint's files in place (``ChunkStore.add_in_place``); the rest of the group gets ordinary chunks.
    Those quantized on load with a ``cache`` are read in place from the cache's images instead
    (``ChunkStore.home_in_file``): the disk tier never holds them.

    Raises ModelError naming the tensor and file when the checkpoint lacks a weight or has the wrong shape.
    ``safe_point`` is called after each group (where the load may be abandoned: a run stopped by a signal).
    """
    source = _sources(parts, checkpoint)
    for group in parts.groups:
        if safe_point is not None:
            safe_point()
        home = homes if isinstance(homes, Tier | str) else homes[group.kind]
        units = _units(group, weight_entries(group, dtype, quant))
        owner = _weight_of(units)
        saved = _saved_weights(group, source, checkpoint, quant)
        mapped: list[FileTensor] = []
        if in_place and Tier(home) is Tier.DISK:
            units, mapped = _split_in_place(units, group, source, saved, checkpoint)
        cached = cache if quant is not None and quantized_on_load(group, saved) else None
        # a frozen group quantized on load and homed on disk: the cache's image is its disk copy
        from_cache = cached is not None and cached.images and in_place and Tier(home) is Tier.DISK
        group.chunks = store.add_in_place(mapped, group.name, chunk_size) if mapped else []
        if units:
            name = f"{group.name}.more" if mapped else group.name
            group.chunks += store.add(units, home=home, name=name, chunk_size=chunk_size, in_file=from_cache)
        block = store.aio.block_size
        for chunk in group.chunks:
            if store.in_place(chunk) is not None:
                continue
            if from_cache and (found := cached.image(chunk, block)) is not None:  # type: ignore[union-attr]
                store.home_in_file(chunk, *found)
                cached.hits += 1  # type: ignore[union-attr]
                continue
            written = None
            with store.writing(chunk) as views:
                if cached is None or not cached.load(chunk, views):
                    if not store.ledger:  # a ledger's chunks hold no bytes: nothing is read into them
                        fill = dict.fromkeys(owner[s.name] for s in chunk.tensors)
                        _fill(group, fill, views, saved, source, checkpoint, dtype, quant)
                    if cached is not None:
                        written = cached.save(chunk, views, block)
            if from_cache:  # never written to the disk tier: only the cache holds it
                if written is None:  # a cache with no image of it to give, yet one to read from
                    raise StateError(f"the quantized cache kept no image of {chunk.name}")
                store.home_in_file(chunk, *written)
    return source


def load_shards(
    parts: ModelParts,
    checkpoint: Checkpoint,
    store: ChunkStore,
    homes: dict[str, Tier | str] | Tier | str,
    dtype: torch.dtype,
    rank: int,
    world_size: int,
    quant: Quantizer | None = None,
    chunk_size: int | None = None,
    safe_point: Callable[[], None] | None = None,
    in_place: bool = False,
    cache: QuantCache | None = None,
) -> tuple[dict[str, TensorSource], dict[int, ChunkLayout]]:
    """``load_into_store`` for rank ``rank`` of ``world_size`` (ZeRO-3): every group is laid out in chunks as one
    process would lay it out, padded for ``world_size`` shards, and this rank registers and fills only its
    shard of each (``shard_layout``). Each weight (quantized on the way in, or read pre-quantized, as one process
    does) is read only by the ranks whose shards its bytes reach, one weight at a time, and only their bytes
    are kept: the node's ranks together hold the model once. Returns the checkpoint names
    (``checkpoint_names``) and each shard chunk's whole layout by chunk id (what a gather reassembles).

    ``in_place`` (a frozen base, as for ``load_into_store``): a group homed on disk is read in place, each
    rank's shard from its byte range of the files: the checkpoint's own where they hold the weights as they
    train, else the ``cache``'s image of each whole chunk, quantized once for the node's ranks
    (``QuantCache.shared``). The disk tier then holds no copy of the base on any rank."""
    source = _sources(parts, checkpoint)
    full: dict[int, ChunkLayout] = {}
    size = store.config.chunk_size if chunk_size is None else chunk_size
    for group in parts.groups:
        if safe_point is not None:
            safe_point()
        home = homes if isinstance(homes, Tier | str) else homes[group.kind]
        units = _units(group, weight_entries(group, dtype, quant))
        saved = _saved_weights(group, source, checkpoint, quant)
        first = _weight_of(units)
        frozen_on_disk = in_place and Tier(home) is Tier.DISK
        mapped: list[FileTensor] = []
        if frozen_on_disk:
            units, mapped = _split_in_place(units, group, source, saved, checkpoint)
        group.chunks = []
        for layout, place in plan_in_place(mapped, size) if mapped else ():  # the checkpoint's own files
            whole = ChunkLayout(layout.tensors, round_up(layout.capacity, ALIGN * world_size), world_size)
            [chunk] = store.add_placed(
                [(shard_layout(whole, rank, world_size), place.part(*whole.shard_range(rank)))],
                f"{group.name}.{len(group.chunks)}",
            )
            full[chunk.id] = whole
            group.chunks.append(chunk)
        layouts = pack_tensors(units, size, world_size) if units else []
        if frozen_on_disk and cache is not None and quant is not None and quantized_on_load(group, saved):
            for layout in layouts:  # the cache's image of the whole chunk, shared by the node's ranks
                name = f"{group.name}.{len(group.chunks)}.of{world_size}"
                weights = list(dict.fromkeys(first[t.name] for t in layout.tensors))
                path, _ = cache.shared(
                    name,
                    layout,
                    lambda views, g=group, w=weights, sv=saved: _fill(
                        g, w, views, sv, source, checkpoint, dtype, quant
                    ),
                    store.aio.block_size,
                )
                [chunk] = store.add_placed(
                    [
                        (
                            shard_layout(layout, rank, world_size),
                            InPlace.image(path, *layout.shard_range(rank), stamped=not store.ledger),
                        )
                    ],
                    name,
                )
                full[chunk.id] = layout
                group.chunks.append(chunk)
            continue
        shards = [shard_layout(layout, rank, world_size) for layout in layouts]
        added = store.add_layouts(shards, home, group.name) if shards else []
        group.chunks += added
        for chunk, layout in zip(added, layouts, strict=True):
            full[chunk.id] = layout
            start, end = layout.shard_range(rank, world_size)
            by_weight: dict[str, list[TensorSpec]] = {}
            for spec in layout.tensors:
                by_weight.setdefault(first[spec.name], []).append(spec)
            with store.writing(chunk):
                flat = store.buffer(chunk)
                flat.zero_()
                for weight, specs in by_weight.items():
                    lo, hi = specs[0].offset, max(t.offset + t.nbytes for t in specs)
                    if hi <= start or lo >= end:
                        continue  # no byte of it in this rank's shard
                    image = torch.zeros(hi - lo, dtype=torch.uint8)
                    moved = ChunkLayout(tuple(replace(t, offset=t.offset - lo) for t in specs), hi - lo)
                    _fill(
                        group, [weight], layout_views(moved, image), saved, source, checkpoint, dtype, quant
                    )
                    a, b = max(lo, start), min(hi, end)
                    flat[a - start : b - start].copy_(image[a - lo : b - lo])
    return source, full


def _sources(parts: ModelParts, checkpoint: Checkpoint) -> dict[str, TensorSource]:
    """``checkpoint_names``, with a ModelError naming the first parameter the checkpoint lacks; the model's
    persistent buffers read from the checkpoint on the way (``load_buffers``)."""
    source = checkpoint_names(parts.model, checkpoint)
    for group in parts.groups:
        missing = [n for n in group.params if n not in source]
        if missing:
            raise ModelError(
                f"the checkpoint in {checkpoint.directory} has no tensor {missing[0]!r} ({group.name})"
            )
    load_buffers(parts.model, checkpoint, source)
    return source


def load_buffers(model: nn.Module, checkpoint: Checkpoint, source: dict[str, TensorSource]) -> list[str]:
    """Read the persistent buffers ``checkpoint`` holds into ``model``'s (built with their initial values:
    DeepSeek-V3's, Kimi-K2's and GLM-4.5's routers' ``e_score_correction_bias`` are zeros until read, and
    the trained ones choose each token's experts); returns their names. A checkpoint laid out from a config
    alone (``AsSaved``) has no values: nothing is read."""
    from tiertune.loading.weights import AsSaved

    if isinstance(checkpoint, AsSaved):
        return []
    read = []
    for prefix, module in model.named_modules():
        for name, buf in module.named_buffers(recurse=False):
            full = f"{prefix}.{name}" if prefix else name
            found = source.get(full)
            if buf is None or buf.is_meta or name in module._non_persistent_buffers_set or found is None:
                continue
            entry = checkpoint.entries[found.pieces[0][0]]
            if len(found.pieces) != 1 or found.pieces[0][1] or math.prod(entry.shape) != buf.numel():
                raise ModelError(
                    f"buffer {full} of shape {tuple(buf.shape)}: the checkpoint's {entry.name!r} in "
                    f"{entry.file} is {tuple(entry.shape)}"
                )
            with torch.no_grad():
                found.read_into(checkpoint, buf)
            read.append(full)
    return read


def quantized_on_load(group: ParamGroup, saved: Container[str]) -> bool:
    """Whether ``group`` has a weight quantized as it is loaded (a bf16 base's linear weights; an MoE's experts,
    which transformers saves unquantized even in a bitsandbytes checkpoint) rather than read pre-quantized
    (``saved`` names those): such groups are kept in the quantized cache."""
    return any(
        (is_quantized(p) or is_quantized_experts(p)) and n not in saved for n, p in group.params.items()
    )


def _fill(
    group: ParamGroup,
    names: Iterable[str],
    views: dict[str, torch.Tensor],
    saved: dict[str, SavedWeight],
    source: dict[str, TensorSource],
    checkpoint: Checkpoint,
    dtype: torch.dtype,
    quant: Quantizer | None,
) -> None:
    """Fill a chunk's ``views`` with weights ``names`` of ``group`` from the checkpoint: pre-quantized bytes as
    they are, quantized on the way in, or read (converting the dtype)."""
    for name in names:
        param = group.params[name]
        if name in saved:  # pre-quantized: its bytes as they are (those of this chunk)
            saved[name].read_into(checkpoint, views)
        elif quant is not None and is_quantized(param):
            # read in the dtype a plain load quantizes from, one weight at a time
            weight = torch.empty(tuple(param.shape), dtype=dtype)
            source[name].read_into(checkpoint, weight)
            quant.quantize_into(name, weight, views)
        elif isinstance(quant, NF4) and is_quantized_experts(param):  # one expert at a time
            shape = tuple(param.shape)
            experts.quantize_into(
                quant,
                name,
                shape,
                dtype,
                source[name].pieces,
                checkpoint.read_into,
                views,
                bool(getattr(param, "transposed", False)),
            )
        else:
            _refuse_quantized(name, source[name], checkpoint)
            source[name].read_into(checkpoint, views[name])


def read_in_place(
    group: ParamGroup,
    dtype: torch.dtype,
    quant: Quantizer | None,
    checkpoint: Checkpoint,
    source: dict[str, TensorSource],
) -> tuple[list[FileTensor], list]:
    """How ``load_into_store`` lays out frozen group ``group`` homed on disk: the tensors it reads in place
    from the checkpoint's files, and the entries that get ordinary chunks (``source``: ``checkpoint_names``)."""
    units = _units(group, weight_entries(group, dtype, quant))
    rest, mapped = _split_in_place(
        units, group, source, _saved_weights(group, source, checkpoint, quant), checkpoint
    )
    return mapped, [entry for unit in rest for entry in unit]


def _weight_of(units: list[list]) -> dict[str, str]:
    """Each entry of ``units`` (``_units``) -> the weight whose unit it is in (a weight's statistics -> it)."""
    return {entry[0]: unit[0][0] for unit in units for entry in unit}


def _units(group: ParamGroup, entries: list) -> list[list[tuple[str, tuple[int, ...], torch.dtype]]]:
    """``entries`` grouped as each parameter with the statistics that follow it (kept in one chunk)."""
    units: list[list] = []
    for entry in entries:
        if entry[0] in group.params or not units:
            units.append([entry])
        else:
            units[-1].append(entry)
    return units


def _saved_weights(
    group: ParamGroup, source: dict[str, TensorSource], checkpoint: Checkpoint, quant: Quantizer | None
) -> dict[str, SavedWeight]:
    """The group's quantized weights that the checkpoint holds pre-quantized, and where their bytes are."""
    saved = {}
    if quant is None:
        return saved
    for name, param in group.params.items():
        pieces = source[name].pieces
        if shipped.is_shipped_format(quant) and is_quantized_experts(param):  # each expert, as shipped
            found = quant.experts_saved(name, tuple(param.shape), pieces, checkpoint)  # type: ignore[union-attr]
        elif not is_quantized(param) or len(pieces) != 1 or pieces[0][1]:
            continue  # unquantized, or built from several tensors (fused experts): quantized on load
        else:
            found = quant.saved(name, pieces[0][0], tuple(param.shape), checkpoint)
        if found is not None:
            saved[name] = found
        elif shipped.is_shipped_format(quant):  # a shipped format is read, never made
            key = pieces[0][0]
            raise ModelError(
                f"{name}: the checkpoint in {checkpoint.directory} stores {key!r} unquantized, although its "
                "quantization_config says its layers are FP8 and does not list the module in "
                "modules_to_not_convert; add the module's name there (config.json), or use a checkpoint whose "
                "config matches its weights"
            )
    return saved


def _split_in_place(
    units: list[list],
    group: ParamGroup,
    source: dict[str, TensorSource],
    saved: dict[str, SavedWeight],
    checkpoint: Checkpoint,
) -> tuple[list[list], list[FileTensor]]:
    """Split a frozen group's entries into those read in place from the checkpoint (as ``FileTensor``s) and
    the units that still need a chunk: statistics the checkpoint keeps in JSON, and unquantized weights it
    stores in another dtype or builds from several tensors (cast or fused on load: an MoE's fp32 router, its
    16-bit experts). A group with a weight quantized on load is not split: it all gets ordinary chunks (the
    quantized cache's image is then its disk copy)."""
    rest: list[list] = []
    mapped: list[FileTensor] = []
    for unit in units:
        name = unit[0][0]
        keys: dict[str, str] = {}
        if name in saved:
            keys = dict(saved[name].tensors)
        elif not is_quantized(group.params[name]):
            pieces = source[name].pieces
            if len(pieces) == 1 and not pieces[0][1]:
                keys = {name: pieces[0][0]}
        left = []
        for entry_name, shape, dtype in unit:
            key = keys.get(entry_name)
            stored = checkpoint.entries.get(key) if key else None
            tensor = None
            if stored is not None and stored.dtype == dtype and math.prod(stored.shape) == math.prod(shape):
                tensor = FileTensor(entry_name, tuple(shape), dtype, stored.file, stored.start)
            if tensor is not None and can_map(tensor):
                mapped.append(tensor)
            elif name in saved and entry_name in saved[name].values:
                left.append((entry_name, shape, dtype))  # a number in the checkpoint's JSON
            elif name not in saved and not is_quantized(group.params[name]):
                left.append((entry_name, shape, dtype))  # cast or fused on load
            else:
                return units, []  # quantized on load: the whole group is loaded as before
        if left:
            rest.append(left)
    return rest, mapped


def _quantized_key(key: str, checkpoint: Checkpoint) -> bool:
    """Whether checkpoint tensor ``key`` holds a bitsandbytes-quantized weight's packed bytes."""
    return any(
        f"{key}.{s}" in checkpoint for s in ("quant_state.bitsandbytes__nf4", "quant_state.bitsandbytes__fp4")
    ) or (key.endswith("weight") and key.removesuffix("weight") + "SCB" in checkpoint)


def _refuse_quantized(name: str, source: TensorSource, checkpoint: Checkpoint) -> None:
    """A weight the model keeps unquantized must not be read from a quantized tensor's packed bytes."""
    key = source.pieces[0][0]
    if _quantized_key(key, checkpoint):
        raise ModelError(
            f"{name} is saved quantized in {checkpoint.entries[key].file} ({key!r}), but the model keeps it "
            "unquantized (llm_int8_skip_modules of its quantization_config?); tiertune does not dequantize "
            "a saved base: use a checkpoint whose quantization_config matches its weights"
        )
