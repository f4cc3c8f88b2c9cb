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


def make_bpe_tokenizer(texts: list[str], directory: str | Path, vocab_size: int = 1000) -> object:
    """A byte-level BPE tokenizer trained on ``texts`` as Llama 3's is built (its split pattern, every byte in
    the alphabet, BOS added, <|begin_of_text|>, <|end_of_text|> and <|pad|> special), saved in ``directory``:
    one that llama.cpp reads, for tests and demos of a GGUF export."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from tiertune.formats.gguf import LLAMA3_PATTERN

    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    core.train_from_iterator(texts, trainer)
    core.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A",
        pair="<|begin_of_text|> $A $B",
        special_tokens=[("<|begin_of_text|>", core.token_to_id("<|begin_of_text|>"))],
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=specials[0], eos_token=specials[1], pad_token=specials[2]
    )
    tok.save_pretrained(directory)
    return tok


def make_model(
    directory: str | Path,
    texts: list[str],
    layers: int = 4,
    hidden: int = 64,
    seed: int = 0,
    tokenizer: str = "word",
) -> Path:
    """Save a small random Llama with a tokenizer fitted to ``texts`` as a Hugging Face directory: a word-level
    one (``tokenizer="word"``), or a byte-level BPE (``"bpe"``, as Llama 3's: llama.cpp reads it)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok = (make_bpe_tokenizer if tokenizer == "bpe" else make_tokenizer)(texts, directory)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
    )
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
