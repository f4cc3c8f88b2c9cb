"""Where a model's parts are, found from its modules alone (no table of architectures): the stack of decoder
layers, and the text decoder of a model of text or of a multimodal class. A leaf module: any layer may use it."""

from __future__ import annotations

from torch import nn

from tiertune.errors import ModelError

DECODERS = "set model.path to a decoder-only model such as Llama, Qwen, Mistral or Gemma"


def find_decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The model's stack of decoder layers: among lists of modules all of one class, the one holding the
    most parameters. Works for any architecture built as a list of blocks, without a table of names."""
    best: tuple[int, str, nn.ModuleList] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        if len({type(child) for child in module}) != 1:
            continue
        size = sum(p.numel() for p in module.parameters())
        if size and (best is None or size > best[0]):
            best = (size, name, module)
    if best is None:
        found = ", ".join(f"{n}: {type(m).__name__}" for n, m in model.named_children()) or "nothing"
        raise ModelError(
            f"{type(model).__name__} has no recognizable stack of decoder layers (a list of identical blocks "
            f"holding parameters, which tiertune streams one at a time); its top-level modules are {found}; "
            f"{DECODERS}"
        )
    return best[1], best[2]


def text_decoder(model: nn.Module) -> nn.Module:
    """The module whose forward gives the text decoder's last hidden states: ``model.get_decoder()``, or, where
    that is a causal LM of its own (the language model of Llama 4's multimodal class), its base model."""
    decoder = model.get_decoder()
    inner = getattr(decoder, "model", None)  # transformers' name of a causal LM's decoder
    if decoder is not model and decoder.get_output_embeddings() is not None and isinstance(inner, nn.Module):
        decoder = inner
    return decoder
