"""A tiny random model with a real tokenizer, for the CPU demo and the tests (no hub access needed)."""

from __future__ import annotations

import re
from pathlib import Path

import torch


def make_tokenizer(texts: list[str], directory: str | Path) -> object:
    """A word-level tokenizer over ``texts`` with <unk>, <pad> and </s>, saved in ``directory``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = sorted({w for t in texts for w in re.findall(r"\w+|[^\w\s]", t)})
    vocab = {tok: i for i, tok in enumerate(["<unk>", "<pad>", "</s>", *words])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", pad_token="<pad>", eos_token="</s>"
    )
    tok.save_pretrained(directory)
    return tok


def make_model(
    directory: str | Path, texts: list[str], layers: int = 4, hidden: int = 64, seed: int = 0
) -> Path:
    """Save a small random Llama with a tokenizer fitted to ``texts`` as a Hugging Face directory."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(texts, directory)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(seed)
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a one-shard "Writing model shards" bar says nothing here
    try:
        AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    finally:
        if shown:
            hf_logging.enable_progress_bar()
    return directory
