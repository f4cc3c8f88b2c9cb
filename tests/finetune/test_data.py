"""The data pipeline: file types, formats and their loss masks, bad rows, packing boundaries, shuffling,
the tokenization cache."""

import json

import pytest
import torch

from tiertune.errors import ConfigError, DataError
from tiertune.finetune.data import IGNORE_INDEX, batches, load_data

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
WORDS = [
    "the red cat sat on the mat",
    "a dog ran far away",
    "name a color",
    "blue is a color",
    "say hi",
    "hi there",
    "Below is an instruction that describes a task paired with an input that provides",
    "further context Write a response that appropriately completes the request",
    "### Instruction Input Response :",
    "<|user|> <|assistant|> <|system|> be brief",
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from tiertune.cli.demo import make_tokenizer

    tok = make_tokenizer(WORDS, tmp_path_factory.mktemp("tok"))
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _targets(tok, ids, labels):
    """The text of the tokens that carry a label."""
    return tok.decode([i for i, lab in zip(ids, labels, strict=True) if lab != IGNORE_INDEX])


def test_every_file_type_gives_the_same_rows(tmp_path, tokenizer):
    import pandas as pd

    rows = [{"text": "the red cat sat"}, {"text": "a dog ran far away"}]
    files = [
        _write(tmp_path / "d.jsonl", rows),
        tmp_path / "d.json",
        tmp_path / "d.parquet",
        tmp_path / "d.csv",
        tmp_path / "d.txt",
    ]
    files[1].write_text(json.dumps(rows))
    pd.DataFrame(rows).to_parquet(files[2])
    pd.DataFrame(rows).to_csv(files[3], index=False)
    files[4].write_text("the red cat sat\n\na dog ran far away\n")  # blank lines are not rows
    seen = []
    for path in files:
        data = load_data(path, tokenizer, "text", 64, cache_dir=str(tmp_path / "cache"))
        seen.append(data.rows["input_ids"])
    assert all(s == seen[0] for s in seen) and len(seen[0]) == 2
    assert seen[0][0][-1] == tokenizer.eos_token_id  # add_eos


def test_alpaca_trains_on_the_response_only(tmp_path, tokenizer):
    path = _write(
        tmp_path / "a.jsonl",
        [
            {"instruction": "name a color", "input": "", "output": "blue"},
            {"instruction": "say hi", "input": "be brief", "output": "hi there"},
        ],
    )
    data = load_data(path, tokenizer, "alpaca", 256, cache_dir=str(tmp_path / "cache"))
    first, second = data.rows[0], data.rows[1]
    assert _targets(tokenizer, first["input_ids"], first["labels"]) == "blue </s>"
    assert _targets(tokenizer, second["input_ids"], second["labels"]) == "hi there </s>"
    assert "Input" in tokenizer.decode(second["input_ids"]) and "Input" not in tokenizer.decode(
        first["input_ids"]
    )


def test_chat_trains_on_the_assistant_turns_only(tmp_path, tokenizer):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "name a color"},
        {"role": "assistant", "content": "blue"},
        {"role": "user", "content": "say hi"},
        {"role": "assistant", "content": "hi there"},
    ]
    path = _write(tmp_path / "c.jsonl", [{"messages": messages}])
    data = load_data(path, tokenizer, "chat", 256, cache_dir=str(tmp_path / "cache"))
    row = data.rows[0]
    assert tokenizer.decode(row["input_ids"]) == tokenizer.decode(
        tokenizer(tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False)[
            "input_ids"
        ]
    )
    assert _targets(tokenizer, row["input_ids"], row["labels"]) == "blue </s> hi there </s>"


def test_rows_with_images_train_on_their_text_and_say_so_once(tmp_path, tokenizer, caplog):
    """TRL's vision rows (an ``images`` column, messages whose content is parts with an image part): the text parts
    are the conversation, as a text-only row of the same words renders; the images are not read, and one log line
    says how many rows held them."""
    import logging

    parts = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "name a color"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "blue"}]},
    ]
    plain = [{"role": "user", "content": "name a color"}, {"role": "assistant", "content": "blue"}]
    path = _write(
        tmp_path / "v.jsonl",
        [{"messages": parts, "images": ["cat.png"]}, {"messages": parts, "images": ["dog.png"]}],
    )
    with caplog.at_level(logging.INFO, logger="tiertune.data"):
        data = load_data(path, tokenizer, "chat", 256, cache_dir=str(tmp_path / "cache"))
    text = _write(tmp_path / "t.jsonl", [{"messages": plain}])
    expected = load_data(text, tokenizer, "chat", 256, cache_dir=str(tmp_path / "cache")).rows[0]
    assert len(data) == 2 and all(row["input_ids"] == expected["input_ids"] for row in data.rows)
    assert data.rows[0]["labels"] == expected["labels"]
    said = [r.getMessage() for r in caplog.records if "images" in r.getMessage()]
    assert len(said) == 1 and "2 of 2 rows" in said[0] and "text alone" in said[0]


def test_chat_needs_a_template(tmp_path, tokenizer):
    from tiertune.cli.demo import make_tokenizer

    plain = make_tokenizer(WORDS, tmp_path / "plain")
    path = _write(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(ConfigError, match="has none; use a model whose tokenizer has one"):
        load_data(path, plain, "chat", 64)


@pytest.mark.parametrize(
    ("fmt", "rows", "message"),
    [
        (
            "text",
            [{"text": "the red cat"}, {"prompt": "x"}],
            r"rows.jsonl, row 2: expected a string field 'text', found no such field \(the row has keys \['prompt'\]\)",
        ),
        (
            "alpaca",
            [{"instruction": "say hi", "output": "hi"}, {"instruction": "say hi", "output": 3}],
            r"row 2: expected a string field 'output', found an int",
        ),
        (
            "chat",
            [
                {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hi"}]},
                {"messages": "hi"},
            ],
            r"row 2: expected a list 'messages' of \{'role', 'content'\} objects",
        ),
    ],
)
def test_a_bad_row_is_named_or_skipped_and_counted(tmp_path, tokenizer, fmt, rows, message):
    path = _write(tmp_path / "rows.jsonl", rows)
    with pytest.raises(DataError, match=message):
        load_data(path, tokenizer, fmt, 64, cache_dir=str(tmp_path / "cache"))
    data = load_data(path, tokenizer, fmt, 64, skip_bad_rows=True, cache_dir=str(tmp_path / "cache"))
    assert (len(data), data.skipped) == (1, 1)


def test_unparseable_lines_and_empty_files(tmp_path, tokenizer):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"text": "the red cat"}\n\n{"text": oops}\n')
    with pytest.raises(DataError, match=r"broken.jsonl, line 3: not valid JSON"):
        load_data(path, tokenizer, "text", 64)
    assert len(load_data(path, tokenizer, "text", 64, skip_bad_rows=True)) == 1
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match="holds no rows"):
        load_data(empty, tokenizer, "text", 64)
    with pytest.raises(DataError, match="must end in"):
        load_data(tmp_path / "rows.xml", tokenizer, "text", 64) if (tmp_path / "rows.xml").write_text(
            "x"
        ) else None
    short = _write(
        tmp_path / "short.jsonl", [{"instruction": "the red cat sat on the mat", "output": "blue"}]
    )
    with pytest.raises(DataError, match="1 with nothing to predict within data.max_seq_len 4"):
        load_data(short, tokenizer, "alpaca", 4)  # the response is cut away


def test_tokenization_is_cached_and_reused(tmp_path, tokenizer):
    path = _write(tmp_path / "d.jsonl", [{"text": "the red cat sat"}, {"text": "a dog ran"}])
    cache = str(tmp_path / "cache")
    first = load_data(path, tokenizer, "text", 64, cache_dir=cache)
    files = {f["filename"] for f in first.rows.cache_files}
    assert files and all(str(tmp_path / "cache") in f for f in files)
    mtimes = {f: (tmp_path / f).stat().st_mtime_ns for f in files}
    again = load_data(path, tokenizer, "text", 64, cache_dir=cache)
    assert {f["filename"] for f in again.rows.cache_files} == files  # the same fingerprint: read back
    assert {f: (tmp_path / f).stat().st_mtime_ns for f in files} == mtimes  # not rewritten
    other = load_data(path, tokenizer, "text", 3, cache_dir=cache)  # other settings: tokenized anew
    assert {f["filename"] for f in other.rows.cache_files} != files


def test_a_change_of_the_tokenization_code_is_not_served_from_the_cache(tmp_path, tokenizer, monkeypatch):
    """datasets fingerprints the map function by its name: tiertune's code is part of the key, so an upgrade that
    tokenizes differently never reads what the previous version cached."""
    from tiertune.finetune import data as module

    path = _write(tmp_path / "d.jsonl", [{"text": "the red cat sat"}, {"text": "a dog ran"}])
    cache = str(tmp_path / "cache")
    first = {f["filename"] for f in load_data(path, tokenizer, "text", 64, cache_dir=cache).rows.cache_files}
    monkeypatch.setattr(module, "_code_version", lambda: "another version of data.py")
    again = {f["filename"] for f in load_data(path, tokenizer, "text", 64, cache_dir=cache).rows.cache_files}
    assert again and again.isdisjoint(first)


def _mismatched_model(tmp_path):
    """What a user met: a directory whose config says Qwen2 beside a word-level tokenizer.json. transformers
    builds Qwen2's tokenizer class, which turns every row into a token or two."""
    from transformers import AutoTokenizer, Qwen2Config

    from tiertune.cli.demo import make_tokenizer

    tok = make_tokenizer(WORDS, tmp_path)
    Qwen2Config(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    ).save_pretrained(tmp_path)
    return AutoTokenizer.from_pretrained(tmp_path)


def test_a_tokenizer_that_loses_the_text_is_refused(tmp_path, tokenizer):
    """Rows that tokenize to (almost) nothing would train "fine" on BOS/EOS alone (the loss falls to 0.3 in 3
    steps): each is refused naming the tokenizer class transformers picked and the row; with
    data.skip_bad_rows a few are left out and counted, most of the data is still an error."""
    qwen = _mismatched_model(tmp_path / "model")
    rows = [{"text": "the red cat sat on the mat"}, {"text": "a dog ran far away"}, {"text": "hi there"}]
    path = _write(tmp_path / "d.jsonl", rows)
    with pytest.raises(
        DataError,
        match=rf"d.jsonl, row 1: the tokenizer .* \({type(qwen).__name__}\) keeps \d+ of "
        r"the row's 20 characters",
    ):
        load_data(path, qwen, "text", 64)
    with pytest.raises(DataError, match=r"loses most of the text of 3 of 3 rows \(row 1 first\)"):
        load_data(path, qwen, "text", 64, skip_bad_rows=True)
    for fmt, row in [
        ("alpaca", {"instruction": "name a color", "output": "blue is a color"}),
        (
            "chat",
            {
                "messages": [
                    {"role": "user", "content": "say hi"},
                    {"role": "assistant", "content": "hi there"},
                ]
            },
        ),
    ]:
        qwen.chat_template = CHAT_TEMPLATE
        with pytest.raises(DataError, match="row 1: the tokenizer"):
            load_data(_write(tmp_path / f"{fmt}.jsonl", [row]), qwen, fmt, 64)
        assert len(load_data(_write(tmp_path / f"{fmt}-ok.jsonl", [row]), tokenizer, fmt, 64)) == 1
    # the right tokenizer: one row of unknown words among known ones is left out and counted
    mixed = _write(tmp_path / "mixed.jsonl", [*rows, {"text": "zebras juggle lanterns"}])
    with pytest.raises(DataError, match="row 4: the tokenizer .* keeps 0 of the row's 20 characters"):
        load_data(mixed, tokenizer, "text", 64)
    data = load_data(mixed, tokenizer, "text", 64, skip_bad_rows=True)
    assert (len(data), data.skipped) == (3, 1)


def test_shuffling_is_deterministic_per_seed_and_epoch(tmp_path, tokenizer):
    rows = [{"text": " ".join(["the"] * (n + 2))} for n in range(12)]
    data = load_data(_write(tmp_path / "d.jsonl", rows), tokenizer, "text", 64, cache_dir=str(tmp_path / "c"))

    def lengths(seed, n_batches):
        stream = batches(data, 4, 0, True, seed)
        return [tuple(int(m.sum()) for m in next(stream)["attention_mask"]) for _ in range(n_batches)]

    assert lengths(1, 6) == lengths(1, 6)
    assert lengths(1, 6) != lengths(2, 6)
    first, second = lengths(1, 6)[:3], lengths(1, 6)[3:]
    assert sorted(sum(first, ())) == sorted(sum(second, ()))  # each epoch sees every row once
    assert first != second  # in another order


def test_packing_restarts_positions_and_never_attends_across_rows(tmp_path, tokenizer):
    """Packed rows give the same logits as each row alone, and no row predicts the next one's first token."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    rows = [{"text": t} for t in ("the red cat sat on the mat", "a dog ran", "name a color", "hi there")]
    data = load_data(_write(tmp_path / "d.jsonl", rows), tokenizer, "text", 16, cache_dir=str(tmp_path / "c"))
    batch = next(batches(data, 2, tokenizer.pad_token_id, False, 0, packing=True, max_seq_len=16))
    assert batch["input_ids"].shape == (2, 16) and "attention_mask" not in batch
    lengths = [len(ids) for ids in data.rows["input_ids"]]  # 8, 4, 4, 3: [8 + 4 + 4] and [3 + padding]
    assert batch["position_ids"][0].tolist() == [*range(8), *range(4), *range(4)]
    assert batch["position_ids"][1].tolist() == [*range(3), *range(13)]
    starts = [0, 8, 12]
    assert all(batch["labels"][0, s] == IGNORE_INDEX for s in starts)
    assert (batch["labels"][1, 3:] == IGNORE_INDEX).all()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.config.use_cache = False  # as in training: transformers detects packed rows only without a cache
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        for s, n in zip(starts, lengths[:3], strict=True):
            alone = model(input_ids=batch["input_ids"][:1, s : s + n]).logits
            torch.testing.assert_close(packed[:1, s : s + n], alone, rtol=1e-5, atol=1e-5)


def test_the_engine_trains_packed_rows_like_the_plain_model(tmp_path, tokenizer, disk_dir):
    """A packed micro-batch through the streamed engine gives the loss the plain model gives it."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tiertune.engine import EngineConfig, StreamedTrainer
    from tiertune.offload.store import StoreConfig

    rows = [{"text": t} for t in ("the red cat sat on the mat", "a dog ran", "name a color", "hi there")]
    data = load_data(_write(tmp_path / "d.jsonl", rows), tokenizer, "text", 16, cache_dir=str(tmp_path / "c"))
    batch = next(batches(data, 2, tokenizer.pad_token_id, False, 0, packing=True, max_seq_len=16))
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_cache=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path / "model")
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    expected = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), batch["labels"][:, 1:].reshape(-1), ignore_index=-100
    )
    store = StoreConfig.resolve(device_budget="8MiB", host_budget="8MiB", disk_path=str(disk_dir))
    trainer = StreamedTrainer(str(tmp_path / "model"), store, EngineConfig(learning_rate=0.0))
    try:
        loss = trainer.step([batch])
    finally:
        trainer.close()
    assert loss == pytest.approx(float(expected), rel=1e-6)


@pytest.mark.parametrize(
    ("name", "content", "where"),
    [
        ("d.jsonl", b'{"text": "the red cat"}\n{"text": "caf\xe9 au lait"}\n', "byte offset 37 (line 2)"),
        ("d.json", b'[{"text": "caf\xe9"}]', "byte offset 14 (line 1)"),
        ("d.csv", b"text\nthe red cat\ncaf\xe9\n", "byte offset 20 (line 3)"),
        ("d.txt", b"the red cat\ncaf\xe9\n", "byte offset 15 (line 2)"),
    ],
    ids=["jsonl", "json", "csv", "txt"],
)
def test_a_file_that_is_not_utf8_is_named_with_the_byte(tmp_path, tokenizer, name, content, where):
    path = tmp_path / name
    path.write_bytes(content)  # latin-1
    with pytest.raises(DataError) as err:
        load_data(path, tokenizer, "text", 64, cache_dir=str(tmp_path / "cache"))
    assert str(err.value).startswith(f"{path} is not UTF-8 text: byte 0xe9 at {where} cannot be decoded")
    assert "convert the file to UTF-8" in str(err.value)


def test_a_directory_as_data_path_is_named_with_the_files_in_it(tmp_path, tokenizer):
    (tmp_path / "train.jsonl").write_text('{"text": "the red cat"}\n')
    (tmp_path / "eval.csv").write_text("text\nthe red cat\n")
    (tmp_path / "notes.md").write_text("not data")
    with pytest.raises(
        DataError,
        match=rf"data.path {tmp_path} is a directory; point data.path at a .jsonl, "
        r".json, .parquet, .csv, .txt file in it; files there: eval.csv, "
        r"train.jsonl$",
    ):
        load_data(tmp_path, tokenizer, "text", 64)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(
        DataError,
        match=rf"data.path {empty} is a directory; point data.path at a .jsonl, .json, "
        r".parquet, .csv, .txt file in it$",
    ):
        load_data(empty, tokenizer, "text", 64)


def test_the_readme_states_the_alpaca_prompts_the_rows_are_wrapped_in():
    # to prompt a model trained on alpaca rows, a user needs the template: the README prints it, as the code has it
    from pathlib import Path

    from tiertune.finetune.data import ALPACA_PROMPT, ALPACA_PROMPT_WITH_INPUT

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    blocks = [b.split("```", 1)[0] for b in readme.split("```text\n")[1:]]
    assert ALPACA_PROMPT in blocks and ALPACA_PROMPT_WITH_INPUT in blocks
