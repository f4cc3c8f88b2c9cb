"""A Hugging Face model directory written as one GGUF file for llama.cpp (and Ollama), with the ``gguf`` package.

Tensors are streamed: the file's header and tensor table are written from the checkpoint's shapes, then each
tensor is read (``Checkpoint``), transformed as llama.cpp expects it and written, one at a time. What llama.cpp
expects, per architecture, follows its own converter (``convert_hf_to_gguf.py``): the tensor names of
``gguf.get_tensor_name_map``; Llama-family q/k rows reordered for llama.cpp's interleaved rotary embedding;
Gemma's norms stored as ``1 + w``; norms, biases and other 1-D tensors kept in F32, the other weights in the
chosen type (``q8_0`` falls back to F16 for rows that are not a multiple of 32 long, as llama.cpp's converter
does). The tokenizer goes in the metadata so llama.cpp tokenizes as the Hugging Face tokenizer does: its
tokens and their types, merges, special tokens, whether BOS/EOS are added, the chat template, and the
pre-tokenizer, recognised from the tokenizer's own split pattern.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tiertune.errors import ConfigError
from tiertune.formats import ADAPTER_FILE, PEFT_PREFIX
from tiertune.loading.weights import Checkpoint
from tiertune.settings import GGUF_TYPES


@dataclass(frozen=True)
class Arch:
    """How llama.cpp holds one Hugging Face architecture: its ``gguf`` MODEL_ARCH name, whether q/k rows are
    reordered for its interleaved rotary embedding (``permute``), whether norms are stored as ``1 + w``,
    whether the LM head is dropped (the embedding always serves) or must be present."""

    name: str
    permute: bool = False
    norm_plus_one: bool = False
    no_output: bool = False
    needs_output: bool = False


ARCHS = {
    "llama": Arch("LLAMA", permute=True),
    "mistral": Arch("LLAMA", permute=True),
    "granite": Arch("GRANITE", permute=True),
    "qwen2": Arch("QWEN2"),
    "qwen3": Arch("QWEN3"),
    "gemma": Arch("GEMMA", norm_plus_one=True, no_output=True),
    "gemma2": Arch("GEMMA2", norm_plus_one=True, no_output=True),
    "phi3": Arch("PHI3"),
    "olmo2": Arch("OLMO2", needs_output=True),
}

# the pre-tokenizers llama.cpp knows, by the split pattern of a Hugging Face tokenizer.json: Llama 3's
# (also OLMo-2's), Qwen2's (single digits); a bare ByteLevel is GPT-2's
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)
_QWEN2 = LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")
PRE_TOKENIZERS = {LLAMA3_PATTERN: "llama-bpe", _QWEN2: "qwen2"}


def _arch(config: Any) -> Arch:
    arch = ARCHS.get(config.model_type)
    if arch is None:
        raise ConfigError(
            f"--format gguf: llama.cpp export supports {', '.join(sorted(ARCHS))}; this model is a "
            f"{config.model_type!r}: export it as hf (a Hugging Face model directory) instead"
        )
    return arch


@dataclass(frozen=True)
class _Tensor:
    """One tensor of the GGUF file: its name and shape (as written), and where its values come from: checkpoint
    tensor ``key`` (transposed when ``transposed``, its rows reordered for ``heads`` rotary heads when that is
    set, 1 added for a Gemma norm), or ``values`` computed here."""

    name: str
    shape: tuple[int, ...]
    key: str = ""
    heads: int = 0
    plus_one: bool = False
    values: torch.Tensor | None = None
    transposed: bool = False

    def values_from(self, checkpoint: Checkpoint) -> torch.Tensor:
        if self.values is not None:
            return self.values
        out = torch.empty(checkpoint.entries[self.key].shape, dtype=torch.float32)
        checkpoint.read_into(self.key, out)
        if self.transposed:
            out = out.T.contiguous()
        if self.heads:
            out = _permute(out, self.heads)
        return out + 1 if self.plus_one else out


def _ggml_type(name: str, shape: tuple[int, ...], out_type: str) -> Any:
    """The GGML type a tensor is stored in: F32 for norms, biases and 1-D tensors; else (a weight, or a LoRA
    factor of one) ``out_type`` (Q8_0 only where rows are a multiple of its 32-element blocks, else F16)."""
    from gguf import GGMLQuantizationType as T

    if (
        len(shape) <= 1
        or name.endswith("_norm.weight")
        or not name.endswith((".weight", ".lora_a", ".lora_b"))
    ):
        return T.F32
    if out_type == "q8_0" and shape[-1] % 32:
        return T.F16
    return {"f32": T.F32, "f16": T.F16, "bf16": T.BF16, "q8_0": T.Q8_0}[out_type]


def _nbytes(shape: tuple[int, ...], ggml_type: Any) -> int:
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[ggml_type]
    return math.prod(shape) // block * size


def _permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a q or k projection (or bias) reordered from Hugging Face's half-split rotary layout to the
    interleaved pairs llama.cpp's Llama computes with (each head's row j and j + d/2 side by side)."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _rope_parameters(config: Any) -> dict:
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    if "rope_theta" not in params and getattr(config, "rope_theta", None) is not None:
        params["rope_theta"] = config.rope_theta
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def _llama3_rope_factors(config: Any, head_dim: int) -> torch.Tensor:
    """Llama 3.1's frequency-dependent rope scaling as llama.cpp takes it: a factor per frequency."""
    rope = _rope_parameters(config)
    base = rope.get("rope_theta", 10000.0)
    factor, low, high = (
        rope.get("factor", 8.0),
        rope.get("low_freq_factor", 1.0),
        rope.get("high_freq_factor", 4.0),
    )
    original = rope.get("original_max_position_embeddings", 8192)
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factors = []
    for freq in freqs.tolist():
        wavelength = 2 * math.pi / freq
        if wavelength < original / high:
            factors.append(1.0)
        elif wavelength > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)


def _hyperparameters(writer: Any, config: Any, arch: Arch, out_type: str) -> None:
    """The model's shape and attention settings, under the keys llama.cpp reads for ``arch``."""
    from gguf import LlamaFileType, RopeScalingType

    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(getattr(config, "num_key_value_heads", None) or heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = _rope_parameters(config)
    if arch.name.startswith("GEMMA"):  # llama.cpp takes Gemma's rope from the head size
        if arch.name == "GEMMA2":
            # llama.cpp scales Gemma 2's attention by 1/sqrt(head_dim) (27B, 46 layers: hidden/heads); the
            # config says what the model was trained with
            expected = config.hidden_size // heads if config.num_hidden_layers == 46 else head_dim
            if getattr(config, "query_pre_attn_scalar", expected) != expected:
                raise ConfigError(
                    f"--format gguf: this Gemma 2 scales attention by query_pre_attn_scalar "
                    f"{config.query_pre_attn_scalar}, llama.cpp by {expected}: export it as hf"
                )
            writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
            writer.add_final_logit_softcapping(config.final_logit_softcapping)
            writer.add_sliding_window(config.sliding_window)
    else:
        writer.add_rope_freq_base(rope.get("rope_theta", 10000.0))
        rotary = int(
            rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) * head_dim
        )
        writer.add_rope_dimension_count(rotary)
    kind = rope["rope_type"]
    if kind == "linear":
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    elif kind == "yarn":
        writer.add_rope_scaling_type(RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    elif kind not in ("default", "llama3"):
        raise ConfigError(
            f"--format gguf: rope scaling {kind!r} of this {config.model_type} is not exported yet"
        )
    if arch.name == "PHI3":
        writer.add_rope_scaling_orig_ctx_len(
            rope.get("original_max_position_embeddings", config.max_position_embeddings)
        )
        writer.add_sliding_window(getattr(config, "sliding_window", None) or 0)
    if arch.name == "GRANITE":
        for key, add in (
            ("attention_multiplier", writer.add_attention_scale),
            ("embedding_multiplier", writer.add_embedding_scale),
            ("residual_multiplier", writer.add_residual_scale),
            ("logits_scaling", writer.add_logit_scale),
        ):
            if getattr(config, key, None):
                add(getattr(config, key))
    if arch.name in ("LLAMA", "GRANITE"):
        writer.add_vocab_size(config.vocab_size)
    files = {
        "f32": LlamaFileType.ALL_F32,
        "f16": LlamaFileType.MOSTLY_F16,
        "bf16": LlamaFileType.MOSTLY_BF16,
        "q8_0": LlamaFileType.MOSTLY_Q8_0,
    }
    writer.add_file_type(files[out_type])


def _pre_tokenizer(spec: dict | None) -> str | None:
    """llama.cpp's name for a tokenizer.json ``pre_tokenizer``, or None when it knows no such one."""
    if not spec:
        return None
    parts = spec.get("pretokenizers", [spec]) if spec.get("type") == "Sequence" else [spec]
    kinds = [p.get("type") for p in parts]
    if kinds == ["ByteLevel"] and parts[0].get("use_regex", True):
        return "gpt-2"
    if (
        kinds == ["Digits", "ByteLevel"]
        and parts[0].get("individual_digits")
        and parts[1].get("use_regex", True)
    ):
        return "smollm"
    if kinds == ["Split", "ByteLevel"] and not parts[1].get("use_regex", True):
        return PRE_TOKENIZERS.get((parts[0].get("pattern") or {}).get("Regex"))
    return None


def _looks_special(token: str) -> bool:
    return (
        token in ("<pad>", "<mask>")
        or (token.startswith("<|") and token.endswith("|>"))
        or token.startswith("<unused")
    )


def _tokenizer_kind(model_dir: Path) -> str:
    """How llama.cpp reads the tokenizer of ``model_dir``: ``spm`` (its SentencePiece model, tokenizer.model)
    or the name of its byte-level BPE pre-tokenizer; ConfigError when llama.cpp cannot tokenize as it does."""
    if (model_dir / "tokenizer.model").is_file():
        return "spm"
    spec_file = model_dir / "tokenizer.json"
    spec = json.loads(spec_file.read_text()) if spec_file.is_file() else {}
    model = (spec.get("model") or {}).get("type")
    pre = _pre_tokenizer(spec.get("pre_tokenizer")) if model == "BPE" else None
    if pre is None:
        what = f"a {model} tokenizer" if model else "no tokenizer.json"
        raise ConfigError(
            f"--format gguf: llama.cpp tokenizes with SentencePiece (tokenizer.model) or byte-level BPE (GPT-2, "
            f"Llama 3, Qwen2 and SmolLM pre-tokenizers); {model_dir} has {what}"
            + (
                f" whose pre-tokenizer llama.cpp does not know ({json.dumps(spec.get('pre_tokenizer'))[:120]})"
                if model == "BPE"
                else ""
            )
            + ": export it as hf and convert it with llama.cpp's convert_hf_to_gguf.py"
        )
    return pre


def check(model_dir: str | Path) -> None:
    """ConfigError, before anything is written, unless the model of ``model_dir`` exports to GGUF: an
    architecture llama.cpp runs, a tokenizer it reads."""
    from transformers import AutoConfig

    _arch(AutoConfig.from_pretrained(model_dir))
    _tokenizer_kind(Path(model_dir))


def _bpe_tokens(tokenizer: Any, vocab_size: int) -> tuple[list[str], list[float] | None, list[int]]:
    """A byte-level BPE's tokens (as its vocabulary spells them) and their types, padded to the embedding."""
    from gguf import TokenType

    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    added, decoder = tokenizer.get_added_vocab(), tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        token = by_id.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            types.append(TokenType.UNUSED)
            continue
        tokens.append(token)
        if token not in added:
            types.append(TokenType.NORMAL)
        elif decoder[i].special or _looks_special(token):
            types.append(TokenType.CONTROL)
        else:
            types.append(TokenType.USER_DEFINED)
    return tokens, None, types


def _spm_tokens(
    tokenizer: Any, model_dir: Path, vocab_size: int
) -> tuple[list[bytes], list[float], list[int]]:
    """A SentencePiece model's pieces, scores and types (``gguf``'s reading of tokenizer.model), then the
    Hugging Face tokenizer's added tokens past them, padded to the embedding."""
    from gguf import SentencePieceVocab, TokenType

    try:
        pieces = list(SentencePieceVocab(model_dir).sentencepiece_tokens())
    except RuntimeError as exc:  # gguf's "sentencepiece is not installed"
        raise ConfigError(
            f"--format gguf of a SentencePiece tokenizer: {exc} (pip install sentencepiece)"
        ) from None
    tokens = [t for t, _, _ in pieces]
    scores = [s for _, s, _ in pieces]
    types = [int(k) for _, _, k in pieces]
    for i, added in tokenizer.added_tokens_decoder.items():  # the chat tokens among the pieces (Gemma's)
        if i < len(tokens) and types[i] == TokenType.NORMAL:
            tokens[i] = added.content.encode()
            special = added.special or _looks_special(added.content)
            types[i] = TokenType.CONTROL if special else TokenType.USER_DEFINED
    for i in range(len(tokens), vocab_size):
        added = tokenizer.added_tokens_decoder.get(i)
        if added is None:
            tokens.append(f"[PAD{i}]".encode())
            scores.append(-10000.0)
            types.append(TokenType.UNUSED)
        else:
            tokens.append(added.content.encode())
            scores.append(-1000.0)
            types.append(
                TokenType.CONTROL
                if added.special or _looks_special(added.content)
                else TokenType.USER_DEFINED
            )
    return tokens, scores, types


def _add_dummy_prefix(model_dir: Path) -> bool:
    """Whether the SentencePiece model prepends a space to the text (its normalizer's add_dummy_prefix)."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString((model_dir / "tokenizer.model").read_bytes())
    return proto.normalizer_spec.add_dummy_prefix


def _vocabulary(writer: Any, model_dir: Path, vocab_size: int) -> dict[str, Any]:
    """The tokenizer as llama.cpp reads it: a SentencePiece model's pieces and scores, or a byte-level BPE's
    tokens, merges and pre-tokenizer; its special tokens, whether BOS/EOS are added, its chat template.
    Returns the chat template and the texts of its end-of-sequence tokens (the generation config's too)."""
    from gguf import SpecialVocab
    from transformers import AutoTokenizer

    kind = _tokenizer_kind(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    largest = max(tokenizer.get_vocab().values())
    if largest >= vocab_size:
        raise ConfigError(
            f"--format gguf: the tokenizer of {model_dir} has token ids up to {largest}, the model's embedding "
            f"only {vocab_size} rows (config.json's vocab_size): resize the embeddings to the tokenizer first"
        )
    if kind == "spm":
        tokens, scores, types = _spm_tokens(tokenizer, model_dir, vocab_size)
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_add_space_prefix(_add_dummy_prefix(model_dir))
    else:
        tokens, scores, types = _bpe_tokens(tokenizer, vocab_size)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(kind)
    writer.add_token_list(tokens)
    if scores is not None:
        writer.add_token_scores(scores)
    writer.add_token_types(types)
    special = SpecialVocab(model_dir, load_merges=kind != "spm", n_vocab=len(tokens))
    # whether BOS/EOS are added, as the Hugging Face tokenizer does it (llama.cpp's defaults differ by tokenizer)
    ids = tokenizer("a")["input_ids"]
    special.add_special_token["bos"] = tokenizer.bos_token_id is not None and ids[:1] == [
        tokenizer.bos_token_id
    ]
    special.add_special_token["eos"] = tokenizer.eos_token_id is not None and ids[-1:] == [
        tokenizer.eos_token_id
    ]
    template = getattr(tokenizer, "chat_template", None)
    if template and special.chat_template is None:
        special.chat_template = template
    special.add_to_gguf(writer, quiet=True)
    stops = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    with contextlib.suppress(OSError, ValueError):
        eos = json.loads((model_dir / "generation_config.json").read_text()).get("eos_token_id")
        stops += eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else []
    texts = [tokenizer.convert_ids_to_tokens(i) for i in dict.fromkeys(stops)]
    return {"chat_template": special.chat_template, "stop": [t for t in texts if t]}


def _write_file(
    writer: Any, out_file: Path, plan: list[_Tensor], checkpoint: Checkpoint, out_type: str
) -> None:
    """Write the GGUF file: ``writer``'s metadata, the table of ``plan``'s tensors in their GGML types (from the
    shapes alone), then each tensor read, transformed and converted, one at a time."""
    import gguf
    from tqdm.auto import tqdm

    kinds = [_ggml_type(t.name, t.shape, out_type) for t in plan]
    for tensor, kind in zip(plan, kinds, strict=True):
        writer.add_tensor_info(
            tensor.name, tensor.shape, np.dtype(np.float32), _nbytes(tensor.shape, kind), raw_dtype=kind
        )
    writer.write_header_to_file(path=out_file)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor, kind in tqdm(
        list(zip(plan, kinds, strict=True)), desc="gguf", unit="tensor", disable=None, leave=False
    ):
        writer.write_tensor_data(gguf.quants.quantize(tensor.values_from(checkpoint).numpy(), kind))
    writer.close()


def write_gguf(
    model_dir: Path,
    out_file: Path,
    out_type: str = "f16",
    name: str | None = None,
    tokenizer_dir: Path | None = None,
) -> dict[str, Any]:
    """Write the Hugging Face model directory ``model_dir`` (safetensors weights, config, tokenizer) as the GGUF
    file ``out_file``, its weights in ``out_type`` (``GGUF_TYPES``), tensor by tensor; the tokenizer from
    ``tokenizer_dir`` when given (a base model's, with its SentencePiece tokenizer.model, which transformers
    5 does not save again). Returns what llama.cpp and Ollama need to know of it: the architecture, the
    tokenizer's stop tokens and chat template."""
    import gguf
    from transformers import AutoConfig

    if out_type not in GGUF_TYPES:
        raise ConfigError(f"--gguf-type takes {', '.join(GGUF_TYPES)}; got {out_type!r}")
    config = AutoConfig.from_pretrained(model_dir)
    arch = _arch(config)
    model_arch = getattr(gguf.MODEL_ARCH, arch.name)
    names = gguf.get_tensor_name_map(model_arch, config.num_hidden_layers)
    checkpoint = Checkpoint(model_dir)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    plan: list[_Tensor] = []  # in the order written
    for key, entry in checkpoint.entries.items():
        if key.endswith(("rotary_emb.inv_freq", "attention.masked_bias", "attention.bias")):
            continue
        if arch.no_output and key == "lm_head.weight":
            continue
        suffix = next((s for s in (".weight", ".bias") if key.endswith(s)), "")
        mapped = names.get_name(key.removesuffix(suffix))
        if mapped is None:
            raise ConfigError(f"--format gguf: llama.cpp's {arch.name.lower()} has no tensor for {key!r}")
        rows = 0
        if arch.permute and key.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
            rows = heads if ".q_proj." in key else kv_heads
        plus_one = arch.norm_plus_one and key.endswith("norm.weight")
        plan.append(_Tensor(mapped + suffix, entry.shape, key, rows, plus_one))
    if arch.needs_output and not any(t.name == "output.weight" for t in plan):
        embedding = "model.embed_tokens.weight"
        plan.append(_Tensor("output.weight", checkpoint.entries[embedding].shape, embedding))
    rope = _rope_parameters(config)
    if rope["rope_type"] == "llama3" and arch.name == "LLAMA":
        factors = _llama3_rope_factors(config, head_dim)
        plan.append(_Tensor("rope_freqs.weight", tuple(factors.shape), values=factors))

    writer = gguf.GGUFWriter(path=None, arch=gguf.MODEL_ARCH_NAMES[model_arch])
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name or model_dir.name)
    _hyperparameters(writer, config, arch, out_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    vocabulary = _vocabulary(writer, Path(tokenizer_dir or model_dir), config.vocab_size)
    _write_file(writer, out_file, plan, checkpoint, out_type)
    return {"architecture": gguf.MODEL_ARCH_NAMES[model_arch], "tensors": len(plan), **vocabulary}


def write_gguf_lora(adapter: Path, base: Path, out_file: Path, out_type: str = "f16") -> dict[str, Any]:
    """Write the PEFT LoRA ``adapter`` of the model in ``base`` as a GGUF LoRA adapter (llama.cpp's ``--lora``,
    Ollama's ``ADAPTER``), to apply over a GGUF of the base: ``lora_a`` and ``lora_b`` of each adapted weight
    under its GGUF name (``lora_b``'s rows reordered as the weight's are), the alpha llama.cpp scales by
    (``alpha / rank``; an rsLoRA adapter's alpha times sqrt(rank), so the scale is the same). ConfigError for
    what llama.cpp cannot apply as a LoRA: DoRA, modules_to_save, lora_B biases, per-module alphas."""
    import gguf
    from transformers import AutoConfig

    settings = json.loads((adapter / "adapter_config.json").read_text())
    refused = [
        what
        for what, bad in (
            ("DoRA (use_dora)", settings.get("use_dora")),
            ("modules_to_save", settings.get("modules_to_save")),
            ("lora_B biases (lora_bias)", settings.get("lora_bias")),
            ("per-module alphas (alpha_pattern)", settings.get("alpha_pattern")),
            ("adapted parameters (target_parameters)", settings.get("target_parameters")),
        )
        if bad
    ]
    if refused:
        raise ConfigError(
            f"--format gguf-lora: llama.cpp applies plain LoRA only; this adapter has {', '.join(refused)}: "
            "export the merged model (--format gguf) instead"
        )
    config = AutoConfig.from_pretrained(base)
    arch = _arch(config)
    model_arch = getattr(gguf.MODEL_ARCH, arch.name)
    names = gguf.get_tensor_name_map(model_arch, config.num_hidden_layers)
    tensors = Checkpoint(adapter, files=[ADAPTER_FILE])
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    plan: list[_Tensor] = []
    ranks = set()
    for key in tensors.entries:
        module = key.removeprefix(PEFT_PREFIX)
        embedding = module.endswith(".lora_embedding_A")
        if not (module.endswith(".lora_A.weight") or embedding):
            if module.endswith((".lora_B.weight", ".lora_embedding_B")):
                continue
            raise ConfigError(
                f"--format gguf-lora: adapter tensor {key} is not a LoRA factor llama.cpp applies"
            )
        module = module[: module.rindex(".lora_")]
        mapped = names.get_name(module)
        if mapped is None or (arch.no_output and module == "lm_head"):
            raise ConfigError(
                f"--format gguf-lora: llama.cpp's {arch.name.lower()} has no weight for {module}"
            )
        b = key.replace(".lora_A.weight", ".lora_B.weight").replace("lora_embedding_A", "lora_embedding_B")
        rows = 0
        if arch.permute and module.endswith(("q_proj", "k_proj")):
            rows = heads if module.endswith("q_proj") else kv_heads
        a_shape = tensors.entries[key].shape
        plan.append(
            _Tensor(
                f"{mapped}.weight.lora_a", a_shape[::-1] if embedding else a_shape, key, transposed=embedding
            )
        )
        plan.append(_Tensor(f"{mapped}.weight.lora_b", tensors.entries[b].shape, b, heads=rows))
        ranks.add(tensors.entries[key].shape[0])
    alpha = float(settings.get("lora_alpha", 8))
    if settings.get("use_rslora"):
        if len(ranks) > 1:
            raise ConfigError(
                "--format gguf-lora: an rsLoRA adapter with several ranks has no one alpha llama.cpp "
                "can scale by: export the merged model (--format gguf) instead"
            )
        alpha *= math.sqrt(ranks.pop())

    writer = gguf.GGUFWriter(path=None, arch=gguf.MODEL_ARCH_NAMES[model_arch])
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    writer.add_name(adapter.name)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _write_file(writer, out_file, plan, tensors, out_type)
    return {"architecture": gguf.MODEL_ARCH_NAMES[model_arch], "tensors": len(plan), "alpha": alpha}
