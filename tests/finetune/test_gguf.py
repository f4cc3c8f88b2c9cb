"""GGUF export checked by llama.cpp itself (llama-cpp-python): its tokenizer against the Hugging Face one, its
logits against transformers', for each architecture the export supports and for a fine-tuned LoRA run."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import CAT_TEXTS
from tiertune.errors import ConfigError
from tiertune.export.commands import export
from tiertune.formats.gguf import write_gguf

TEXTS = [
    *CAT_TEXTS,
    "Hello, world! 12345 don't  stop\n\nnew line\ttab",
    "ünïcödé текст 中文 emoji 🙂 and I'M here, you'll see",
    "   leading spaces, trailing ones   ",
]


def _llama(path: Path):
    llama_cpp = pytest.importorskip("llama_cpp")
    return llama_cpp.Llama(model_path=str(path), n_ctx=128, logits_all=True, verbose=False, n_threads=2)


def _gguf_logits(path: Path, ids: list[int]) -> np.ndarray:
    llm = _llama(path)
    try:
        llm.eval(ids)
        return np.array(llm.scores[: len(ids)])
    finally:
        llm.close()


def _hf_logits(model_dir: Path, ids: list[int]) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


@pytest.fixture(scope="module")
def bpe_model(tmp_path_factory):
    from tiertune.cli.demo import make_model

    return make_model(tmp_path_factory.mktemp("bpe-model"), TEXTS, layers=2, hidden=64, tokenizer="bpe")


def test_llama_cpp_tokenizes_as_the_hugging_face_tokenizer(tmp_path, bpe_model):
    from transformers import AutoTokenizer

    file = tmp_path / "model.gguf"
    write_gguf(bpe_model, file, "f32")
    tokenizer = AutoTokenizer.from_pretrained(bpe_model)
    llm = _llama(file)
    try:
        for text in [*TEXTS, "<|begin_of_text|>the cat<|end_of_text|>", "unseen wörds 987654321"]:
            ids = tokenizer(text)["input_ids"]
            assert llm.tokenize(text.encode(), add_bos=True, special=True) == ids, text
            assert llm.detokenize(ids[1:], special=True).decode() == tokenizer.decode(ids[1:]), text
    finally:
        llm.close()


def _model_of(family: str, like: Path, directory: Path) -> Path:
    """A small random model of ``family`` with the BPE tokenizer of ``like`` (as the family's tokenizer class
    loads it: Qwen2's adds its <|endoftext|>) and a few unused embedding rows past it, as models have."""
    import shutil

    from tiny import tiny_config
    from transformers import AutoModelForCausalLM, AutoTokenizer, GraniteConfig

    if family == "granite":
        config = GraniteConfig(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            embedding_multiplier=2.0,
            residual_multiplier=0.5,
            attention_multiplier=0.2,
            logits_scaling=4.0,
        )
    elif family == "llama3.1":  # frequency-dependent rope scaling: llama.cpp's rope_freqs tensor
        config = tiny_config("llama", layers=2)
        config.rope_parameters = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    elif family == "qwen2-yarn":
        config = tiny_config("qwen2", layers=2)
        config.rope_parameters = {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32,
        }
    else:
        config = tiny_config(family, layers=2)
    # llama.cpp scales Gemma's attention by 1/sqrt(head_dim), as these models do
    if family.startswith("gemma"):
        config.query_pre_attn_scalar = config.head_dim
    directory.mkdir()
    config.save_pretrained(directory)
    for f in like.glob("tokenizer*"):
        shutil.copy2(f, directory / f.name)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    config.vocab_size = len(tokenizer) + 5
    config.bos_token_id, config.eos_token_id, config.pad_token_id = (
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # norms away from 1 (and Gemma's from 0): their handling shows in the logits
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
            if any(k in name for k in ("q_proj", "k_proj", "qkv_proj")):  # sharp attention: the rotary
                p.mul_(6)  # embedding's layout and scaling show in the logits too
    model.save_pretrained(directory)
    return directory


FAMILIES = [
    "llama",
    "llama3.1",
    "mistral",
    "qwen2",
    "qwen2-yarn",
    "qwen3",
    "gemma",
    "gemma2",
    "phi3",
    "olmo2",
    "granite",
]


@pytest.mark.parametrize("family", FAMILIES)
def test_each_architectures_gguf_computes_the_logits_of_transformers(tmp_path, bpe_model, family):
    model_dir = _model_of(family, bpe_model, tmp_path / family)
    file = tmp_path / "model.gguf"
    write_gguf(model_dir, file, "f32", name="tiny")  # (llama.cpp sets token attributes by a phi3 name)
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_dir)(" ".join(TEXTS[:8]))["input_ids"]
    got, expected = _gguf_logits(file, ids), _hf_logits(model_dir, ids)
    scale = np.abs(expected).max()
    assert np.abs(got - expected).max() <= 2e-3 * max(scale, 1), (family, np.abs(got - expected).max(), scale)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, bpe_model):
    from tests.conftest import _write_recipe
    from tiertune.finetune.train import train

    tmp = tmp_path_factory.mktemp("gguf-run")
    path = _write_recipe(
        tmp,
        bpe_model,
        texts=TEXTS,
        training={"max_steps": 12, "learning_rate": "2e-2", "report_to": "none"},
        method={"type": "lora", "lora": {"r": 4, "dropout": 0.0}},
    )
    return train(path, progress=False)


@pytest.mark.parametrize("gguf_type", ["f16", "bf16", "q8_0"])
def test_a_lora_runs_gguf_carries_the_fine_tune(tmp_path, bpe_model, lora_run, gguf_type):
    from transformers import AutoTokenizer

    out, what = export(lora_run.output_dir, tmp_path / "gguf", "gguf", gguf_type=gguf_type)
    assert f"GGUF ({gguf_type}, llama.cpp's llama)" in what and "merged" not in what.split(";")[0]
    file = out / f"model-{gguf_type}.gguf"
    assert sorted(p.name for p in out.iterdir()) == ["Modelfile", file.name]  # the merged HF copy is gone
    modelfile = (out / "Modelfile").read_text()
    assert modelfile.startswith(f"FROM ./{file.name}\n") and 'PARAMETER stop "<|end_of_text|>"' in modelfile
    merged, _ = export(lora_run.output_dir, tmp_path / "merged", "hf")
    tokenizer = AutoTokenizer.from_pretrained(merged)
    ids = tokenizer(" ".join(CAT_TEXTS[:4]))["input_ids"]
    got, fine_tuned, base = _gguf_logits(file, ids), _hf_logits(merged, ids), _hf_logits(bpe_model, ids)
    error = np.abs(got - fine_tuned).max()
    assert error <= 0.15, error  # llama.cpp's own converter: 0.06 in f16 on a 135M model
    assert (got.argmax(-1) == fine_tuned.argmax(-1)).mean() >= 0.95
    # the fine-tune moved the logits far beyond the export's error, and the GGUF has moved with them
    assert np.abs(fine_tuned - base).max() > 10 * error
    assert np.abs(got - fine_tuned).mean() < 0.1 * np.abs(got - base).mean()


def test_a_full_runs_checkpoint_exports_to_gguf(tmp_path, bpe_model):
    from tests.conftest import _write_recipe
    from tiertune.finetune.train import train

    path = _write_recipe(
        tmp_path,
        bpe_model,
        texts=TEXTS,
        training={"max_steps": 2, "save_steps": 2, "learning_rate": "1e-2", "report_to": "none"},
    )
    result = train(path, progress=False)
    out, what = export(result.output_dir / "checkpoint-2", tmp_path / "gguf", "gguf", gguf_type="f32")
    assert "model at step 2" in what
    hf, _ = export(result.output_dir / "checkpoint-2", tmp_path / "hf", "hf")
    ids = [0, 5, 9, 13, 40, 41]
    assert np.abs(_gguf_logits(out / "model-f32.gguf", ids) - _hf_logits(hf, ids)).max() < 1e-3
    # the finished run's model (the README's export), converted from the run directory as it is
    final, what = export(result.output_dir, tmp_path / "final", "gguf", gguf_type="f32")
    assert "of the run's final model" in what and sorted(p.name for p in final.iterdir()) == [
        "Modelfile",
        "model-f32.gguf",
    ]
    got = _gguf_logits(final / "model-f32.gguf", ids)
    assert np.abs(got - _hf_logits(result.output_dir, ids)).max() < 1e-3


def test_what_llama_cpp_cannot_read_is_refused_before_anything_is_written(tmp_path, cat_model, bpe_model):
    from typer.testing import CliRunner

    from tiertune.cli.app import app

    with pytest.raises(
        ConfigError, match="llama.cpp tokenizes with SentencePiece.*byte-level BPE.*WordLevel"
    ):
        write_gguf(cat_model(2), tmp_path / "x.gguf")
    neox = _model_of("gpt_neox", bpe_model, tmp_path / "neox")
    with pytest.raises(ConfigError, match="supports gemma, gemma2, granite, llama.*'gpt_neox'"):
        write_gguf(neox, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()
    run = tmp_path / "run"
    run.mkdir()
    (run / "recipe.yaml").write_text(json.dumps({"model": {"path": str(cat_model(2))}}))
    result = CliRunner().invoke(app, ["export", str(run), "--format", "gguf", "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "WordLevel" in result.output and not (tmp_path / "o").exists()
    for args, said in (
        (["--format", "onnx"], "--format takes auto, hf, peft, gguf, gguf-lora; got 'onnx'"),
        (["--format", "gguf", "--gguf-type", "q4_k"], "--gguf-type takes f32, f16, bf16, q8_0"),
    ):
        result = CliRunner().invoke(app, ["export", str(run), *args, "--out", str(tmp_path / "o")])
        assert result.exit_code == 2 and said in result.output and "Traceback" not in result.output, (
            result.output
        )


def test_a_gguf_lora_over_the_bases_gguf_computes_the_merged_model(tmp_path, bpe_model, lora_run):
    llama_cpp = pytest.importorskip("llama_cpp")
    from transformers import AutoTokenizer

    out, what = export(lora_run.output_dir, tmp_path / "lora", "gguf-lora", gguf_type="f32")
    assert "GGUF LoRA adapter (f32)" in what and "--lora" in what
    base = tmp_path / "base.gguf"
    write_gguf(bpe_model, base, "f32")
    merged, _ = export(lora_run.output_dir, tmp_path / "merged", "hf")
    ids = AutoTokenizer.from_pretrained(merged)(" ".join(CAT_TEXTS[:4]))["input_ids"]
    llm = llama_cpp.Llama(
        model_path=str(base),
        lora_path=str(out / "adapter-f32.gguf"),
        n_ctx=128,
        logits_all=True,
        verbose=False,
        n_threads=2,
    )
    try:
        llm.eval(ids)
        got = np.array(llm.scores[: len(ids)])
    finally:
        llm.close()
    fine_tuned, original = _hf_logits(merged, ids), _hf_logits(bpe_model, ids)
    error = np.abs(got - fine_tuned).max()
    assert (
        error < 2e-3 * max(1, np.abs(fine_tuned).max()) and np.abs(fine_tuned - original).max() > 50 * error
    )


def test_gguf_lora_refuses_what_llama_cpp_does_not_apply(tmp_path, bpe_model):
    from tests.finetune.test_merge_stream import _adapter
    from tiertune.formats.gguf import write_gguf_lora

    adapter = _adapter(bpe_model, tmp_path / "dora", use_dora=True)
    with pytest.raises(ConfigError, match="DoRA.*--format gguf"):
        write_gguf_lora(adapter, bpe_model, tmp_path / "a.gguf")
    rslora = _adapter(bpe_model, tmp_path / "rs", use_rslora=True, r=4)
    info = write_gguf_lora(rslora, bpe_model, tmp_path / "rs.gguf", "f32")
    assert info["alpha"] == pytest.approx(
        8 * 2
    )  # alpha * sqrt(4): llama.cpp's alpha / r is then rsLoRA's scale


def _spm_model(directory: Path) -> Path:
    """A small random Llama with a SentencePiece BPE tokenizer (byte fallback, digits split) trained on
    ``TEXTS``, loaded by transformers as Llama's tokenizer is: the kind of Llama 2, Mistral and Gemma."""
    import sentencepiece
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    directory.mkdir()
    corpus = directory.parent / "corpus.txt"
    corpus.write_text("\n".join(TEXTS * 20))
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(directory / "sp"),
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        split_digits=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        minloglevel=2,
        user_defined_symbols=["<|turn|>"],  # a chat token among the pieces, as Gemma's <start_of_turn>
    )
    (directory / "sp.model").rename(directory / "tokenizer.model")
    (directory / "sp.vocab").unlink()
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "LlamaTokenizer",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "add_bos_token": True,
                "extra_special_tokens": ["<|turn|>"],
                "legacy": True,  # Llama 2's: a space after a special token, as llama.cpp's SentencePiece puts one
            }
        )
    )
    tokenizer = AutoTokenizer.from_pretrained(directory)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


def test_a_sentencepiece_tokenizer_is_written_as_llama_cpp_reads_it(tmp_path):
    pytest.importorskip("sentencepiece")
    import sentencepiece
    from transformers import AutoTokenizer

    model_dir = _spm_model(tmp_path / "spm")
    file = tmp_path / "model.gguf"
    write_gguf(model_dir, file, "f32")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    reference = sentencepiece.SentencePieceProcessor(model_file=str(model_dir / "tokenizer.model"))
    llm = _llama(file)
    try:
        turn = tokenizer.convert_tokens_to_ids("<|turn|>")
        ids = llm.tokenize(b"<|turn|>the cat", add_bos=True, special=True)
        assert ids[:2] == [1, turn] and ids == tokenizer("<|turn|>the cat")["input_ids"]
        for text in [*TEXTS, "unseen wörds 987654321", "ç"]:
            ids = llm.tokenize(text.encode(), add_bos=True, special=True)
            assert ids == [1, *reference.encode(text)], text  # the model's own tokenizer, always
            # transformers' Llama tokenizer drops one of several leading spaces that sentencepiece keeps
            if not text.startswith("  "):
                assert ids == tokenizer(text)["input_ids"], text
    finally:
        llm.close()
    ids = tokenizer(TEXTS[0])["input_ids"]
    assert np.abs(_gguf_logits(file, ids) - _hf_logits(model_dir, ids)).max() < 2e-3
