"""Training data, ``text`` format: each row's ``text`` becomes ``tokenizer(text)["input_ids"]`` plus EOS when
``data.add_eos``, cut to ``max_seq_len``; labels are the inputs (the loss shifts them), padding is ``-100``.

Files: ``.jsonl`` (one JSON object per line), ``.json`` (a list of objects) or ``.txt`` (one row per non-empty
line). A row without a string ``text`` raises ``DataError`` naming the file, the row and the field, or is
skipped and counted when ``data.skip_bad_rows`` is set. (The ``alpaca`` and ``chat`` formats, parquet/csv
and packing come with the data pipeline of the product surface.)
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from tiertune.errors import DataError

IGNORE_INDEX = -100


@dataclass
class TextData:
    """Tokenized rows, in file order, and how many bad rows were skipped."""

    sequences: list[list[int]]
    skipped: int
    path: Path

    @property
    def tokens(self) -> int:
        return sum(len(s) for s in self.sequences)


def read_text_rows(
    path: str | Path, skip_bad_rows: bool = False, field: str = "text"
) -> tuple[list[str], int]:
    """The ``field`` of every row of a .jsonl, .json or .txt file, and the number of bad rows skipped."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file {path} does not exist; set data.path to a .jsonl, .json or .txt file")
    rows: list[tuple[int, object]]
    if path.suffix == ".txt":
        return [line for line in path.read_text().splitlines() if line.strip()], 0
    if path.suffix == ".jsonl":
        rows = []
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append((n, json.loads(line)))
            except json.JSONDecodeError as exc:
                if not skip_bad_rows:
                    raise DataError(f"{path}, row {n}: not valid JSON ({exc.msg})") from exc
                rows.append((n, None))
    elif path.suffix == ".json":
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise DataError(f"{path} is not valid JSON: {exc}") from exc
        if not isinstance(data, list):
            raise DataError(f'{path} must hold a JSON list of rows, e.g. [{{"text": "..."}}]')
        rows = list(enumerate(data, 1))
    else:
        raise DataError(
            f"data file {path} must end in .jsonl, .json or .txt (got {path.suffix or 'no extension'})"
        )
    texts, skipped = [], 0
    for n, row in rows:
        value = row.get(field) if isinstance(row, dict) else None
        if isinstance(value, str):
            texts.append(value)
        elif skip_bad_rows:
            skipped += 1
        else:
            got = "a non-object row" if not isinstance(row, dict) else f"keys {sorted(row)}"
            raise DataError(
                f"{path}, row {n}: expected a string field {field!r}, found {got}; fix the row or set "
                "data.skip_bad_rows: true"
            )
    return texts, skipped


def load_text(
    path: str | Path, tokenizer: object, max_seq_len: int, add_eos: bool = True, skip_bad_rows: bool = False
) -> TextData:
    """Read and tokenize a ``text``-format file."""
    rows, skipped = read_text_rows(path, skip_bad_rows)
    eos = getattr(tokenizer, "eos_token_id", None)
    if add_eos and eos is None:
        raise DataError("data.add_eos is set but the tokenizer has no EOS token; set data.add_eos: false")
    sequences = []
    for text in rows:
        ids = list(tokenizer(text)["input_ids"])  # type: ignore[operator]
        if add_eos:
            ids.append(eos)
        if len(ids) >= 2:  # a single token has no target
            sequences.append(ids[:max_seq_len])
    if not sequences:
        raise DataError(f"{path} has no usable rows ({skipped} skipped); each needs at least two tokens")
    return TextData(sequences, skipped, Path(path))


def batches(
    data: TextData, batch_size: int, pad_id: int, shuffle: bool, seed: int
) -> Iterator[dict[str, torch.Tensor]]:
    """Endless batches, epoch after epoch: file order, or a fresh seeded shuffle each epoch. Each batch is
    padded to its longest row; padding has attention 0 and label -100."""
    order = list(range(len(data.sequences)))
    epoch = 0
    while True:
        if shuffle:
            random.Random(seed + epoch).shuffle(order)
        for start in range(0, len(order), batch_size):
            rows = [data.sequences[i] for i in order[start : start + batch_size]]
            width = max(len(r) for r in rows)
            ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            for r, row in enumerate(rows):
                ids[r, : len(row)] = torch.tensor(row)
                mask[r, : len(row)] = 1
            yield {
                "input_ids": ids,
                "attention_mask": mask,
                "labels": ids.masked_fill(mask == 0, IGNORE_INDEX),
            }
        epoch += 1
