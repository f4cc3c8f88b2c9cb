"""Training data: files read with the ``datasets`` library, rendered by format, tokenized, batched or packed.

Files: ``.jsonl``/``.json`` (JSON lines, or a JSON list of objects), ``.parquet``, ``.csv`` and ``.txt`` (one
``text`` row per line). Formats (``data.format``):

- ``text``: the row's ``text``, plus EOS when ``data.add_eos``; the loss is on every token.
- ``alpaca``: ``instruction``, optional ``input`` and ``output``, rendered with the Stanford Alpaca prompt;
  the loss is on the response (``output`` and EOS) only.
- ``chat``: ``messages``, a list of ``{"role", "content"}``, rendered by the tokenizer's chat template;
  the loss is on the assistant turns only (found by rendering the conversation turn by turn). A content given
  as parts (TRL's vision rows: ``[{"type": "image"}, {"type": "text", "text": ...}]``) is its text parts; the
  images (video, sound, an ``images`` column) are not read, and one log line counts the rows that hold them.
- ``preference``: ``prompt``, ``chosen`` and ``rejected``, strings or conversations (TRL's standard and
  conversational preference forms; a conversational row without ``prompt`` shares its leading turns), tokenized
  as TRL's ``DPOTrainer`` does: EOS appended to a string completion that lacks it, the prompt tokenized alone
  (a conversation's with the generation prompt) and with each completion, the completion starting where they
  diverge, each sequence cut to ``max_seq_len`` from its start. A row whose prompt fills ``max_seq_len`` or
  whose two completions are the same is dropped and counted; an empty completion is a bad row. The loss is on
  the completions; a batch is its rows' chosen sequences, then their rejected ones.
- ``unpaired_preference``: ``prompt``, ``completion`` and a boolean ``label`` (desirable or not; TRL's unpaired
  preference form, KTO's), tokenized as TRL's ``KTOTrainer`` does (as ``preference`` tokenizes one completion).
  Each row also gets a KL sequence: its prompt followed by the completion of the row before it in its block of
  ``kl_block`` rows (the first row takes the block's last; TRL's rotation within a batch), cut to
  ``max_seq_len``; it stands where a pair's rejected sequence stands, and its row's ``label`` goes with it.

Sequences are cut to ``max_seq_len``; a row left without a token to predict is dropped and counted. A row
without the fields of its format raises ``DataError`` naming the file, the row and the field, or is
skipped and counted with ``data.skip_bad_rows``. Tokenization runs through ``datasets.Dataset.map``, so its
result is cached on disk (in the datasets cache, keyed by the file, the tokenizer and the settings) and
reused by the next run.

Batches (dicts of tensors; ``num_tokens`` counts the tokens that are not padding): each epoch visits the rows in file order or in a fresh shuffle seeded by ``seed + epoch``. Without
packing each batch is padded to its longest row (padding: attention 0, label -100). With packing, rows are
laid end to end into sequences of exactly ``max_seq_len`` tokens with ``position_ids`` restarting at each
row and no attention mask, from which transformers builds a block-diagonal causal mask (no attention across
rows); the first token of each row is not a target of the row before it.
"""

from __future__ import annotations

import functools
import json
import logging
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tiertune.errors import ConfigError, DataError
from tiertune.kernels.ops.linear_ce import IGNORE_INDEX

LOADERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text"}
FORMATS = ("text", "alpaca", "chat", "preference", "unpaired_preference", "prompt")
PAIRED = ("preference", "unpaired_preference")
"""The formats whose rows are pairs of completions (a preference objective's, ``engine.objective``)."""

ALPACA_PROMPT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the "
    "request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"
)
ALPACA_PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n### Instruction:\n{instruction}\n\n"
    "### Input:\n{input}\n\n### Response:\n"
)

log = logging.getLogger("tiertune.data")


@dataclass
class TokenizedData:
    """Tokenized rows (a ``datasets.Dataset`` with ``input_ids`` and ``labels``) and what was left out."""

    rows: Any  # datasets.Dataset
    skipped: int  # bad rows skipped (data.skip_bad_rows)
    dropped: int  # rows with no token to predict after cutting to max_seq_len
    path: Path

    def __len__(self) -> int:
        return len(self.rows)

    @functools.cached_property
    def tokens(self) -> int:
        """Tokens in all rows, both sequences of a pair (reads the columns once)."""
        return sum(len(ids) for column in self._id_columns for ids in self.rows[column])

    @property
    def _id_columns(self) -> list[str]:
        return [c for c in ("input_ids", "rejected_ids") if c in self.rows.column_names]

    @functools.cached_property
    def max_token_id(self) -> int:
        """The largest token id in the rows (-1 when there are none)."""
        return max(
            (max(ids) for column in self._id_columns for ids in self.rows[column] if len(ids)), default=-1
        )


class _BadRow(Exception):
    def __init__(self, field: str, found: str) -> None:
        super().__init__(field, found)
        self.field, self.found = field, found


MEDIA_PARTS = ("image", "image_url", "video", "audio", "input_audio")
"""Kinds of a message's content parts that are not text (TRL's and transformers' multimodal chat forms)."""

MEDIA_FIELDS = ("images", "image", "videos", "audios")
"""Row fields that hold images, video or sound beside the text (TRL's vision datasets: ``images``)."""


def _text_messages(messages: Any, field: str, row: dict) -> list[dict]:
    """A conversation's ``{"role", "content"}`` messages with string contents: a content given as parts
    (``[{"type": "image"}, {"type": "text", "text": ...}]``) is its text parts, joined by newlines (images, video
    and sound are not read: ``_holds_media`` counts the rows that hold them). Raises ``_BadRow`` for anything
    else."""
    out = []
    for m in messages if isinstance(messages, list) else [None]:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and all(isinstance(p, dict) and "type" in p for p in content):
            texts = [p.get("text") for p in content if p["type"] == "text"]
            content = "\n".join(t for t in texts if isinstance(t, str))
        if not (isinstance(content, str) and m.get("role")):  # type: ignore[union-attr]
            found = "no such field" if messages is None else "something else"
            raise _BadRow(
                f"a list {field!r} of {{'role', 'content'}} objects", f"{found} (the row has {_keys(row)})"
            )
        out.append({"role": m["role"], "content": content})  # type: ignore[index]
    return out


def read_rows(path: str | Path, skip_bad_rows: bool = False, cache_dir: str | None = None) -> Any:
    """The rows of a data file as a ``datasets.Dataset``; a file that cannot be parsed raises ``DataError``
    naming the first bad line (or, with ``skip_bad_rows``, JSON lines that do not parse are left out)."""
    import datasets

    path = Path(path)
    if path.is_dir():
        found = sorted(p.name for p in path.iterdir() if p.suffix in LOADERS and p.is_file())
        there = f"; files there: {', '.join(found[:5])}{', ...' if len(found) > 5 else ''}" if found else ""
        raise DataError(
            f"data.path {path} is a directory; point data.path at a {', '.join(LOADERS)} file in it{there}"
        )
    if not path.is_file():
        raise DataError(f"data file {path} does not exist; set data.path to a {', '.join(LOADERS)} file")
    loader = LOADERS.get(path.suffix)
    if loader is None:
        raise DataError(
            f"data file {path} must end in {', '.join(LOADERS)} (got {path.suffix or 'no extension'})"
        )
    if path.stat().st_size == 0:
        raise DataError(f"{path} holds no rows")
    if loader != "parquet":  # the JSON reader takes bytes that are not UTF-8 and fails on the first row read
        _check_utf8(path)
    datasets.disable_progress_bars()
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its parser's complaint: said below, once
    try:
        rows = datasets.load_dataset(loader, data_files=str(path), split="train", cache_dir=cache_dir)
    except Exception as exc:  # datasets raises several kinds for a file its parser rejects
        if path.suffix == ".jsonl" or (path.suffix == ".json" and _is_json_lines(path)):
            return _json_lines(path, skip_bad_rows)
        cause = exc.__cause__ or exc
        raise DataError(f"{path} could not be read as {loader}: {cause}") from exc
    finally:
        datasets.logging.set_verbosity(verbosity)
    if loader == "text":  # one row per non-empty line
        rows = rows.filter(lambda text: bool(text.strip()), input_columns="text")
    if len(rows) == 0:
        raise DataError(f"{path} holds no rows")
    return rows


def _check_utf8(path: Path) -> None:
    """Raise DataError naming the first byte of ``path`` that is not UTF-8 (its offset and line)."""
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = line = 0
    with path.open("rb") as f:
        while True:
            block = f.read(1 << 20)
            try:
                decoder.decode(block, final=not block)
            except UnicodeDecodeError as exc:
                # the decoder may hold back up to 3 bytes of an unfinished character from the block before
                held = len(exc.object) - len(block)
                at = offset - held + exc.start
                line += block[: max(0, exc.start - held)].count(b"\n")
                bad = exc.object[exc.start : exc.start + 1].hex()
                raise DataError(
                    f"{path} is not UTF-8 text: byte 0x{bad} at byte offset {at} (line {line + 1}) "
                    f"cannot be decoded ({exc.reason}); convert the file to UTF-8, e.g. "
                    f"`iconv -f latin1 -t utf-8 {path.name} > utf8-{path.name}`"
                ) from None
            if not block:
                return
            offset += len(block)
            line += block.count(b"\n")


def _is_json_lines(path: Path) -> bool:
    with path.open() as f:
        return f.read(1) == "{"


def _json_lines(path: Path, skip_bad_rows: bool) -> Any:
    """JSON lines parsed one by one: the line that does not parse is named, or skipped."""
    import datasets

    records = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if skip_bad_rows:
                continue
            raise DataError(
                f"{path}, line {n}: not valid JSON ({exc.msg}); fix it or set data.skip_bad_rows: true"
            ) from exc
        if not isinstance(record, dict):
            if skip_bad_rows:
                continue
            kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
                type(record), "a number"
            )
            raise DataError(
                f"{path}, line {n}: {kind}, not a JSON object with the fields of data.format; fix the line or set "
                "data.skip_bad_rows: true"
            )
        records.append(record)
    if not records:
        raise DataError(f"{path} holds no rows")
    # rows with different keys: every column present in every row (missing ones None), as datasets does
    keys = sorted({k for r in records for k in r})
    return datasets.Dataset.from_list([{k: r.get(k) for k in keys} for r in records])


def load_data(
    path: str | Path,
    tokenizer: Any,
    fmt: str,
    max_seq_len: int,
    add_eos: bool = True,
    skip_bad_rows: bool = False,
    cache_dir: str | None = None,
    kl_block: int = 2,
) -> TokenizedData:
    """Read, render and tokenize a data file (the tokenization is cached by ``datasets``). ``kl_block``: the rows
    of ``unpaired_preference`` data whose completions rotate into their KL sequences (a micro-batch's rows)."""
    if fmt not in FORMATS:
        raise ValueError(f"the data formats are {', '.join(FORMATS)} (a recipe's data.format), got {fmt!r}")
    if fmt == "chat" and not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            "data.format: chat renders conversations with the tokenizer's chat template, and this "
            "tokenizer has none; use a model whose tokenizer has one, or data.format: text or alpaca"
        )
    eos = getattr(tokenizer, "eos_token_id", None)
    if add_eos and eos is None and fmt != "chat":
        raise DataError("data.add_eos is set but the tokenizer has no EOS token; set data.add_eos: false")
    rows = read_rows(path, skip_bad_rows, cache_dir)
    settings = {
        "tokenizer": tokenizer,
        "fmt": fmt,
        "max_seq_len": max_seq_len,
        "add_eos": add_eos,
        "skip_bad_rows": skip_bad_rows,
        "source": str(path),
        # datasets fingerprints the function by its name only: a change of this module's code must not find
        # the tokenization the previous code cached
        "code": _code_version(),
    }
    # a prompt's other columns stay: GRPO's reward functions take them (TRL's)
    kept_columns = {"input_ids", "labels", "bad", "useful", "lossy", "media"}
    encoded = rows.map(
        _encode,
        batched=True,
        with_indices=True,
        remove_columns=rows.column_names
        if fmt != "prompt"
        else [c for c in rows.column_names if c in kept_columns],
        fn_kwargs=settings,
        desc="tokenizing",
    )
    skipped = sum(encoded["bad"])
    lossy = sum(encoded["lossy"])
    if lossy * 2 > len(encoded):  # skipped one by one with data.skip_bad_rows, but not most of the data
        first = encoded["lossy"].index(True) + 1
        raise DataError(
            f"{path}: the tokenizer transformers picked for this model ({type(tokenizer).__name__}) loses most of "
            f"the text of {lossy} of {len(encoded)} rows (row {first} first): it is not this data's tokenizer. "
            f"{_TOKENIZER_HINT}"
        )
    media = sum(encoded["media"])
    if media:
        log.info(
            "data: %d of %d rows of %s hold images, video or sound; tiertune trains on their text alone (those "
            "are not read)",
            media,
            len(encoded),
            path,
        )
    kept = encoded.filter(lambda bad, useful: useful and not bad, input_columns=["bad", "useful"])
    dropped = len(encoded) - skipped - len(kept)
    kept = kept.remove_columns(["bad", "useful", "lossy", "media"])
    if fmt == "unpaired_preference" and len(kept):
        kept = kept.map(
            _kl_sequences,
            batched=True,
            batch_size=kl_block,
            remove_columns=["completion_ids", "prompt_len"],
            fn_kwargs={"max_seq_len": max_seq_len, "code": settings["code"]},
            desc="KL sequences",
        )
    if len(kept) == 0:
        raise DataError(
            f"{path} has no usable rows ({skipped} skipped as bad, {dropped} with nothing to predict within "
            f"data.max_seq_len {max_seq_len}"
            + (
                ", a prompt that fills it, or a chosen completion equal to the rejected one)"
                if fmt in PAIRED
                else ")"
            )
        )
    return TokenizedData(kept, skipped, dropped, Path(path))


@functools.cache
def _code_version() -> str:
    """A hash of this module's source (part of the tokenization's cache key)."""
    import hashlib

    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


_TOKENIZER_HINT = (
    "Save the model's own tokenizer in model.path (tokenizer.save_pretrained); if it is there, check that "
    "tokenizer_config.json's tokenizer_class and config.json's model_type name the same tokenizer"
)
KEPT_FRACTION = 0.5
"""A row whose tokens decode to fewer than this fraction of its text's characters (whitespace aside) has lost its
text to the tokenizer (unknown words, or a tokenizer class that does not match its vocabulary)."""


def _encode(batch: dict, indices: list[int], **settings: Any) -> dict[str, list]:
    """``datasets.map`` function: a batch of rows to ``input_ids`` and ``labels`` (module level, so that
    datasets can fingerprint it and cache its result)."""
    paired = settings["fmt"] == "preference"
    unpaired = settings["fmt"] == "unpaired_preference"
    prompts = settings["fmt"] == "prompt"
    out: dict[str, list] = {"input_ids": [], "labels": [], "bad": [], "useful": [], "lossy": [], "media": []}
    if paired:
        out.update(rejected_ids=[], rejected_labels=[])
    if unpaired:
        out.update(completion_ids=[], prompt_len=[], label=[])
    tokenizer = settings["tokenizer"]
    for k, index in enumerate(indices):
        row = {key: values[k] for key, values in batch.items()}
        lossy = False
        rejected: tuple[list[int], list[int]] = ([], [])
        unpaired_row: tuple[list[int], int, bool] = ([], 0, False)
        try:
            if unpaired:
                ids, labels, unpaired_row, parts = _render_unpaired(
                    row, tokenizer, settings["max_seq_len"], settings["add_eos"]
                )
            elif paired:
                ids, labels, rejected, parts = _render_pair(
                    row, tokenizer, settings["max_seq_len"], settings["add_eos"]
                )
            elif prompts:
                ids, parts = _render_prompt(row, tokenizer, settings["max_seq_len"])
                labels = []
            else:
                ids, labels, parts = _render(
                    row, tokenizer, settings["fmt"], settings["max_seq_len"], settings["add_eos"]
                )
            kept, total = _characters_kept(tokenizer, parts)
            if kept < KEPT_FRACTION * total:
                lossy = True
                if not settings["skip_bad_rows"]:
                    raise DataError(
                        f"{settings['source']}, row {index + 1}: the tokenizer transformers picked for this model "
                        f"({type(tokenizer).__name__}) keeps {kept} of the row's {total} characters (whitespace "
                        f"aside; {len(ids)} tokens): it cannot represent this text. {_TOKENIZER_HINT}; or set "
                        "data.skip_bad_rows: true to leave such rows out"
                    )
                ids, labels, rejected = [], [], ([], [])
        except _BadRow as exc:
            if not settings["skip_bad_rows"]:
                raise DataError(
                    f"{settings['source']}, row {index + 1}: expected {exc.field}, found {exc.found}; fix the "
                    "row or set data.skip_bad_rows: true"
                ) from None
            ids, labels, rejected = [], [], ([], [])
        out["input_ids"].append(ids)
        out["labels"].append(labels)
        out["bad"].append(not ids)
        out["lossy"].append(lossy)
        out["media"].append(_holds_media(row))
        # the loss predicts token t+1 from token t: a row needs a target after its first token
        useful = any(lab != IGNORE_INDEX for lab in labels[1:]) or (prompts and bool(ids))
        if paired:
            out["rejected_ids"].append(rejected[0])
            out["rejected_labels"].append(rejected[1])
            # and a pair two different completions, each with a target
            useful = useful and any(lab != IGNORE_INDEX for lab in rejected[1][1:]) and rejected[0] != ids
        if unpaired:
            out["completion_ids"].append(unpaired_row[0])
            out["prompt_len"].append(unpaired_row[1])
            out["label"].append(unpaired_row[2])
        out["useful"].append(useful)
    return out


def _characters_kept(tokenizer: Any, parts: list[tuple[list[int], str]]) -> tuple[int, int]:
    """Of the characters (whitespace aside) of each text of ``parts``, how many its tokens decode back to (special
    tokens, an unknown word's among them, decode to nothing), and how many there are."""
    special = [t for t in getattr(tokenizer, "all_special_tokens", []) if t]
    kept = total = 0
    for ids, text in parts:
        for token in special:  # written in the text, they decode to nothing
            text = text.replace(token, "")
        total += _visible(text)
        kept += _visible(tokenizer.decode(ids, skip_special_tokens=True)) if ids else 0
    return min(kept, total), total


def _visible(text: str) -> int:
    return sum(1 for ch in text if not ch.isspace())


def _render(
    row: dict, tokenizer: Any, fmt: str, max_seq_len: int, add_eos: bool
) -> tuple[list[int], list[int], list[tuple[list[int], str]]]:
    """A row's ``input_ids`` and ``labels`` cut to ``max_seq_len``, and the row's own texts (not a template's)
    with the tokens each becomes (for ``_characters_kept``)."""
    eos = [tokenizer.eos_token_id] if add_eos else []
    if fmt == "text":
        text = _string(row, "text")
        content = list(tokenizer(text)["input_ids"])
        ids = content + eos
        labels = list(ids)
        parts = [(content, text)]
    elif fmt == "alpaca":
        instruction, output = _string(row, "instruction"), _string(row, "output")
        extra = row.get("input")
        if extra is not None and not isinstance(extra, str):
            raise _BadRow("a string 'input' (or none)", _a(type(extra).__name__))
        template = ALPACA_PROMPT_WITH_INPUT if extra else ALPACA_PROMPT
        prompt = list(tokenizer(template.format(instruction=instruction, input=extra))["input_ids"])
        answer = list(tokenizer(output, add_special_tokens=False)["input_ids"])
        response = answer + eos
        ids = prompt + response
        labels = [IGNORE_INDEX] * len(prompt) + response
        parts = [(_content_ids(tokenizer, t), t) for t in (instruction, extra or "")] + [(answer, output)]
    else:
        ids, labels, contents = _chat(row, tokenizer)
        parts = [(_content_ids(tokenizer, c), c) for c in contents]
    return ids[:max_seq_len], labels[:max_seq_len], parts


def prompt_of(row: dict) -> str | list[dict]:
    """A ``prompt`` row's prompt as TRL takes it: a string, or a conversation (its messages, string contents)."""
    value = row.get("prompt")
    if isinstance(value, str):
        return value
    return _text_messages(value, "prompt", row)


def _render_prompt(row: dict, tokenizer: Any, max_len: int) -> tuple[list[int], list[tuple[list[int], str]]]:
    """A ``prompt`` row's ids as TRL's GRPO tokenizes it (a string as the tokenizer encodes it; a conversation
    through the chat template with the generation prompt), its first tokens cut where it is longer than
    ``max_len`` (the end, where the completion follows, kept)."""
    prompt = prompt_of(row)
    if isinstance(prompt, str):
        ids = list(tokenizer(prompt)["input_ids"])
        parts = [(_content_ids(tokenizer, prompt), prompt)]
    else:
        ids = _chat_ids(tokenizer, prompt, add_generation_prompt=True)
        parts = [(_content_ids(tokenizer, m["content"]), m["content"]) for m in prompt]
    return ids[-max_len:], parts


def _render_pair(
    row: dict, tokenizer: Any, max_seq_len: int, add_eos: bool
) -> tuple[list[int], list[int], tuple[list[int], list[int]], list[tuple[list[int], str]]]:
    """A preference row's chosen sequence and labels, its rejected ones, and its texts, as TRL's DPOTrainer
    tokenizes them (the module's docstring)."""
    chosen, rejected = row.get("chosen"), row.get("rejected")
    prompt = row.get("prompt")
    conversational = isinstance(chosen, list)
    if conversational:
        for field in ("chosen", "rejected") + (("prompt",) if prompt is not None else ()):
            _messages(row, field)
        if prompt is None:  # an implicit prompt: the turns the two conversations share
            shared = 0
            while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
                shared += 1
            prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
        if not chosen or not rejected:
            raise _BadRow("a chosen and a rejected turn after the prompt", "an empty completion")
        texts = [m["content"] for m in (*prompt, *chosen, *rejected)]
        prompt_ids = _chat_ids(tokenizer, prompt, add_generation_prompt=True)
        pair_ids = [_chat_ids(tokenizer, prompt + c) for c in (chosen, rejected)]
    else:
        prompt, chosen, rejected = _string(row, "prompt"), _string(row, "chosen"), _string(row, "rejected")
        if not chosen.strip() or not rejected.strip():
            raise _BadRow("non-empty strings 'chosen' and 'rejected'", "an empty completion")
        texts = [prompt, chosen, rejected]
        eos = tokenizer.eos_token if add_eos else None
        if eos:
            chosen, rejected = (c if c.endswith(eos) else c + eos for c in (chosen, rejected))
        prompt_ids = list(tokenizer(prompt)["input_ids"])
        pair_ids = [list(tokenizer(prompt + c)["input_ids"]) for c in (chosen, rejected)]
    # the completion starts where the prompt alone and prompt + completion diverge (TRL's common prefix)
    start = min(_common_prefix(prompt_ids, ids) for ids in pair_ids)
    parts = [(_content_ids(tokenizer, t), t) for t in texts]
    # a prompt that fills max_seq_len leaves no target: the row is dropped (TRL's filter)
    (ids, labels), second = (
        (ids[:max_seq_len], ([IGNORE_INDEX] * start + ids[start:])[:max_seq_len]) for ids in pair_ids
    )
    return ids, labels, second, parts


def _render_unpaired(
    row: dict, tokenizer: Any, max_seq_len: int, add_eos: bool
) -> tuple[list[int], list[int], tuple[list[int], int, bool], list[tuple[list[int], str]]]:
    """An unpaired preference row's sequence and labels (as ``_render_pair`` renders one completion), its whole
    completion's tokens, its prompt's length and its label, and its texts."""
    label = row.get("label")
    if not isinstance(label, bool):
        found = "no such field" if label is None else _a(type(label).__name__)
        raise _BadRow(
            "a boolean 'label' (true: a desirable completion)", f"{found} (the row has {_keys(row)})"
        )
    prompt, completion = row.get("prompt"), row.get("completion")
    if isinstance(completion, list):
        prompt, completion = _messages(row, "prompt"), _messages(row, "completion")
        if not completion:
            raise _BadRow("a turn in 'completion'", "an empty completion")
        texts = [m["content"] for m in (*prompt, *completion)]
        prompt_ids = _chat_ids(tokenizer, prompt, add_generation_prompt=True)
        whole = _chat_ids(tokenizer, prompt + completion)
    else:
        prompt, completion = _string(row, "prompt"), _string(row, "completion")
        if not completion.strip():
            raise _BadRow("a non-empty string 'completion'", "an empty completion")
        texts = [prompt, completion]
        eos = tokenizer.eos_token if add_eos else None
        if eos and not completion.endswith(eos):
            completion += eos
        prompt_ids = list(tokenizer(prompt)["input_ids"])
        whole = list(tokenizer(prompt + completion)["input_ids"])
    start = _common_prefix(prompt_ids, whole)
    ids = whole[:max_seq_len]
    labels = ([IGNORE_INDEX] * start + whole[start:])[:max_seq_len]
    return ids, labels, (whole[start:], start, label), [(_content_ids(tokenizer, t), t) for t in texts]


def _kl_sequences(batch: dict, **settings: Any) -> dict[str, list]:
    """``datasets.map`` function over a block of rows: each row's KL sequence, its prompt followed by the block's
    previous row's completion (the first row the last's), cut to ``max_seq_len``, as ``rejected_ids`` and
    ``rejected_labels``."""
    limit = settings["max_seq_len"]
    completions = batch["completion_ids"]
    rotated = completions[-1:] + completions[:-1]
    out = dict(batch)
    out["rejected_ids"], out["rejected_labels"] = [], []
    for ids, start, completion in zip(batch["input_ids"], batch["prompt_len"], rotated, strict=True):
        prompt = list(ids[:start])
        out["rejected_ids"].append((prompt + list(completion))[:limit])
        out["rejected_labels"].append(([IGNORE_INDEX] * len(prompt) + list(completion))[:limit])
    return out


def _messages(row: dict, field: str) -> list[dict]:
    return _text_messages(row.get(field), field, row)


def _chat_ids(tokenizer: Any, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            "conversational rows (preference pairs, GRPO's prompts) are rendered with the tokenizer's chat "
            "template, and this tokenizer has none; use a model whose tokenizer has one, or rows whose prompt and "
            "completions are strings"
        )
    messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    out = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, add_generation_prompt=add_generation_prompt
    )
    return list(out["input_ids"])


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _content_ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def _holds_media(row: dict) -> bool:
    """Whether a row holds images, video or sound (in a field of its own, or as parts of its messages)."""
    if any(row.get(k) for k in MEDIA_FIELDS):
        return True
    conversations = [v for v in row.values() if isinstance(v, list)]
    return any(
        isinstance(m, dict)
        and isinstance(m.get("content"), list)
        and any(isinstance(p, dict) and p.get("type") in MEDIA_PARTS for p in m["content"])
        for conversation in conversations
        for m in conversation
    )


def _a(noun: str) -> str:
    """``noun`` with its indefinite article."""
    return f"{'an' if noun[:1] in 'aeiou' else 'a'} {noun}"


def _string(row: dict, field: str) -> str:
    value = row.get(field)
    if not isinstance(value, str):
        found = "no such field" if value is None else _a(type(value).__name__)
        raise _BadRow(f"a string field {field!r}", f"{found} (the row has {_keys(row)})")
    return value


def _keys(row: dict) -> str:
    present = sorted(k for k, v in row.items() if v is not None)
    return f"keys {present}" if present else "no keys"


def _chat(row: dict, tokenizer: Any) -> tuple[list[int], list[int], list[str]]:
    """A conversation through the chat template; labels only on the assistant turns' tokens."""
    messages = _text_messages(row.get("messages") or None, "messages", row)
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []  # character spans of the assistant turns, found by rendering the conversation turn by turn
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        through = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (text.startswith(before) and text.startswith(through)):
            raise ConfigError(
                "data.format: chat needs a chat template that renders a conversation's turns as prefixes of "
                "the whole; this tokenizer's does not, so the assistant turns cannot be found"
            )
        spans.append((len(before), len(through)))
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoded["input_ids"])
    labels = [
        tok if any(s <= start < e for s, e in spans) else IGNORE_INDEX
        for tok, (start, _) in zip(ids, encoded["offset_mapping"], strict=True)
    ]
    return ids, labels, [m["content"] for m in messages]


def pad_id_of(tokenizer: Any) -> int:
    """The token padded batches are filled with: the tokenizer's pad token, else its EOS token, else 0."""
    if tokenizer.pad_token_id is not None:
        return int(tokenizer.pad_token_id)
    return int(tokenizer.eos_token_id or 0)


def batches(
    data: TokenizedData,
    batch_size: int,
    pad_id: int,
    shuffle: bool,
    seed: int,
    packing: bool = False,
    max_seq_len: int = 0,
) -> Iterator[dict[str, torch.Tensor]]:
    """Endless batches, epoch after epoch (see the module's docstring)."""
    epoch = 0
    while True:
        order = list(range(len(data)))
        if shuffle:
            random.Random(seed + epoch).shuffle(order)
        rows = ({**data.rows[i], "row": i} for i in order)
        if packing:
            yield from _packed(rows, batch_size, pad_id, max_seq_len)
        elif "rejected_ids" in data.rows.column_names:  # pairs: each batch its chosen rows, then its rejected
            group = []
            for i in order:
                group.append({**data.rows[i], "row": i})
                if len(group) == batch_size:
                    yield _paired(group, pad_id)
                    group = []
            if group:
                yield _paired(group, pad_id)
        else:
            group: list[dict] = []
            for row in rows:
                group.append(row)
                if len(group) == batch_size:
                    yield _padded(group, pad_id)
                    group = []
            if group:
                yield _padded(group, pad_id)
        epoch += 1


def row_batches(
    data: TokenizedData, rows: list[int], batch_size: int, pad_id: int
) -> list[dict[str, torch.Tensor]]:
    """``rows`` of ``data``, in order, as padded batches of ``batch_size`` (a pass over part of the data)."""
    picked = [{**data.rows[i], "row": i} for i in rows]
    return [_padded(picked[i : i + batch_size], pad_id) for i in range(0, len(picked), batch_size)]


def _padded(rows: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(r["input_ids"]) for r in rows)
    batch = _padded_rows(rows, pad_id, width)
    if "row" in rows[0]:  # each sequence's row of the data (a teacher's figures are kept by row)
        batch["row_ids"] = torch.tensor([[r["row"]] for r in rows])
    return batch


def _padded_rows(rows: list[dict], pad_id: int, width: int) -> dict[str, torch.Tensor]:
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, row in enumerate(rows):
        n = len(row["input_ids"])
        ids[r, :n] = torch.tensor(row["input_ids"])
        labels[r, :n] = torch.tensor(row["labels"])
        mask[r, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, "num_tokens": mask.sum()}


def _paired(rows: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Preference rows as one padded batch of their chosen sequences, then their rejected ones; ``pairs``
    counts the rows, ``rows`` holds their indices in the data (a reference's log-probabilities are kept by
    row: ``finetune.reference``)."""
    rejected = [{"input_ids": r["rejected_ids"], "labels": r["rejected_labels"]} for r in rows]
    both = [*rows, *rejected]
    batch = _padded_rows(both, pad_id, max(len(r["input_ids"]) for r in both))
    batch["pairs"] = torch.tensor(len(rows))
    batch["rows"] = torch.tensor([r["row"] for r in rows])
    if "label" in rows[0]:  # KTO's: whether each row's completion is desirable
        batch["label"] = torch.tensor([bool(r["label"]) for r in rows])
    return batch


def _packed(
    rows: Iterator[dict], batch_size: int, pad_id: int, width: int
) -> Iterator[dict[str, torch.Tensor]]:
    """Rows laid end to end into ``batch_size`` x ``width`` batches (a row never split across sequences;
    what does not fit starts the next sequence)."""
    if width < 2:
        raise ConfigError("data.packing needs data.max_seq_len >= 2")
    sequences: list[tuple[list[int], list[int], list[int], list[int]]] = []
    ids: list[int] = []
    labels: list[int] = []
    positions: list[int] = []
    members: list[int] = []  # the data's rows in the sequence, in order
    for row in rows:
        if len(ids) + len(row["input_ids"]) > width:
            sequences.append((ids, labels, positions, members))
            ids, labels, positions, members = [], [], [], []
            if len(sequences) == batch_size:
                yield _pack_batch(sequences, pad_id, width)
                sequences = []
        n = len(row["input_ids"])
        ids += row["input_ids"]
        # the first token of a row is not predicted from the row before it
        labels += [IGNORE_INDEX, *row["labels"][1:]]
        positions += list(range(n))
        members.append(row["row"])
    if ids:
        sequences.append((ids, labels, positions, members))
    if sequences:
        yield _pack_batch(sequences, pad_id, width)


def _pack_batch(sequences: list, pad_id: int, width: int) -> dict[str, torch.Tensor]:
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    labels = torch.full((len(sequences), width), IGNORE_INDEX, dtype=torch.long)
    positions = torch.zeros((len(sequences), width), dtype=torch.long)
    real = sum(len(seq[0]) for seq in sequences)
    most = max(len(seq[3]) for seq in sequences)
    members = torch.full((len(sequences), most), -1, dtype=torch.long)  # each sequence's rows of the data
    for r, (seq_ids, seq_labels, seq_positions, seq_rows) in enumerate(sequences):
        members[r, : len(seq_rows)] = torch.tensor(seq_rows)
        n = len(seq_ids)
        ids[r, :n] = torch.tensor(seq_ids)
        labels[r, :n] = torch.tensor(seq_labels)
        positions[r, :n] = torch.tensor(seq_positions)
        positions[r, n:] = torch.arange(width - n)  # the padding is a block of its own
    return {
        "input_ids": ids,
        "labels": labels,
        "position_ids": positions,
        "num_tokens": torch.tensor(real),
        "row_ids": members,
    }
