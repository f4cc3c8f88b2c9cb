"""Where each tensor of a checkpoint's training state lies, whatever the number of processes that wrote it.

The training state is a set of tensors named ``<role>/<parameter>``: ``weights``, ``master`` (fp32 master
weights), ``exp_avg`` and ``exp_avg_sq`` (Adam's moments; an 8-bit moment is its uint8 values and, as
``<parameter>.absmax``, one fp32 absmax per 256-element block) and ``proj`` (GaLore's projections). One process
holds each whole; a rank of several holds the elements it owns of each (``distributed.ownership``), a flat
range of the flattened tensor. A checkpoint writes what each process holds, one safetensors file per chunk
(``state/<chunk>.safetensors``, or ``state/rank-<r>/<chunk>.safetensors`` for rank r), and ``state/index.json``
records, for every tensor, its whole shape and dtype and the pieces that tile it: (file, name in the file,
first element, end element). Resuming reads each range a process needs from whichever pieces hold it, so a
checkpoint written by N processes resumes in M (elastic resume), and ``tiertune export`` assembles whole tensors
from it. Nothing is gathered to one rank to write it.

A checkpoint written before the index existed (one process, whole tensors) is read through an index built
from its files.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tiertune.engine.layout import ROLES, STATE_ROLES
from tiertune.errors import ConfigError, IntegrityError, StateError
from tiertune.loading.weights import SAFETENSORS_DTYPES
from tiertune.methods.optim import BLOCK_8BIT

if TYPE_CHECKING:
    from tiertune.engine import StreamedTrainer

INDEX_FILE = "index.json"  # in the checkpoint's state/ directory
FORMAT = "tiertune-state/1"
ABSMAX = ".absmax"  # the suffix of an 8-bit moment's per-block absmax
_OPEN_FILES = 32  # files a reader keeps open (memory-mapped) at once


@dataclass(frozen=True)
class Placement:
    """One tensor of a process's state chunk: ``name`` in the chunk (and its file), of shape ``local``, holds
    elements ``[start, end)`` of the flattened state tensor ``key``, whose whole shape and dtype are ``shape``
    and ``dtype``."""

    name: str
    local: tuple[int, ...]
    key: str
    start: int
    end: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def placements(trainer: StreamedTrainer) -> dict[int, list[Placement]]:
    """For each chunk of ``trainer``'s training state (``state_chunks``), where its tensors lie in the run's
    state: whole tensors for one process, this rank's owned ranges for a rank of several."""
    return {
        chunk.id: [
            _placement(role, t.name, tuple(t.shape), t.dtype, params, trainer.part) for t in chunk.tensors
        ]
        for role, chunk, params in trainer.state_parts()
    }


def _placement(
    role: str,
    name: str,
    local: tuple[int, ...],
    dtype: torch.dtype,
    params: dict,
    part_of: Callable[[str], tuple[int, int] | None],
) -> Placement:
    numel = math.prod(local)
    key = f"{role}/{name}"
    param = name.removesuffix(ABSMAX)
    part = part_of(param)
    if part is None:  # the whole tensor (one process), in the shape this state holds it
        return Placement(name, local, key, 0, numel, local, dtype)
    start, end = part
    whole = tuple(params[param].shape)
    if param == name:
        return Placement(name, local, key, start, end, whole, dtype)
    if start % BLOCK_8BIT:  # shards start on an 8-bit block (tensor_align): a bug if not
        raise StateError(f"{param}: this rank's part starts at element {start}, inside an 8-bit block")
    first = start // BLOCK_8BIT
    blocks = -(-math.prod(whole) // BLOCK_8BIT)
    return Placement(name, local, key, first, first + numel, (blocks,), dtype)


def rank_index(chunks: list[tuple[str, list[Placement]]]) -> dict[str, dict]:
    """The index entries of one process's files: ``chunks`` pairs each file (relative to the checkpoint) with
    the placements of the chunk written there."""
    out: dict[str, dict] = {}
    for file, placed in chunks:
        for p in placed:
            entry = out.setdefault(
                p.key, {"shape": list(p.shape), "dtype": dtype_name(p.dtype), "pieces": []}
            )
            entry["pieces"].append([file, p.name, p.start, p.end])
    return out


def merge(parts: list[dict[str, dict]], world_size: int) -> dict:
    """One index from the processes' entries (``rank_index``), its pieces sorted; StateError unless the
    pieces of every tensor tile it exactly (a checkpoint that would not resume is never committed)."""
    tensors: dict[str, dict] = {}
    for part in parts:
        for key, entry in part.items():
            mine = tensors.setdefault(key, {"shape": entry["shape"], "dtype": entry["dtype"], "pieces": []})
            if (mine["shape"], mine["dtype"]) != (entry["shape"], entry["dtype"]):
                raise StateError(f"the ranks disagree on the shape or dtype of {key}")
            mine["pieces"] += entry["pieces"]
    for key, entry in tensors.items():
        entry["pieces"].sort(key=lambda piece: piece[2])
        at = 0
        for _, _, start, end in entry["pieces"]:
            if start != at:
                raise StateError(f"the pieces of {key} do not tile it (a gap or overlap at element {at})")
            at = end
        if at != _numel(entry["shape"]):
            raise StateError(f"the pieces of {key} cover {at} of its {_numel(entry['shape'])} elements")
    return {"format": FORMAT, "world_size": world_size, "tensors": tensors}


def _numel(shape: list[int]) -> int:
    return math.prod(shape)


def _role_of_file(file: str) -> str | None:
    """The role whose chunks a state file holds (``state/[rank-<r>/]<chunk>.safetensors``, the chunk named
    ``<weight chunk>.<role's suffix>`` or, for the weights, the weight chunk's own name); None for a path
    outside the state directory."""
    parts = file.split("/")
    inside = (
        len(parts) in (2, 3) and parts[0] == "state" and (len(parts) == 2 or parts[1].startswith("rank-"))
    )
    if not inside or not parts[-1].endswith(".safetensors") or ".." in parts:
        return None
    stem = parts[-1].removesuffix(".safetensors")
    return next((r for r in STATE_ROLES[1:] if stem.endswith(f".{ROLES[r][0]}")), "weights")


class StateReader:
    """Reads ranges of a checkpoint's state tensors from the pieces that hold them (memory-mapped, a few
    files open at a time). ``with StateReader(path, trainer_state) as reader: reader.read(...)``."""

    def __init__(self, path: Path, trainer_state: dict) -> None:
        self.path = Path(path)
        index_file = self.path / "state" / INDEX_FILE
        self._open: OrderedDict[str, Any] = OrderedDict()
        if index_file.is_file():
            try:
                index = json.loads(index_file.read_text())
                self.tensors: dict[str, dict] = index["tensors"]
                self.world_size = int(index["world_size"])
            except (
                OSError,
                UnicodeDecodeError,
                json.JSONDecodeError,
                KeyError,
                TypeError,
                ValueError,
            ) as exc:
                raise IntegrityError(
                    f"{index_file} cannot be read ({exc}): the checkpoint is damaged"
                ) from None
        else:
            self.tensors = self._legacy(trainer_state)
            self.world_size = 1
        for key, entry in self.tensors.items():
            self._check_entry(key, entry)
        self._checked: set[tuple[str, str]] = set()  # (file, name) pieces whose stored tensor was checked

    def __enter__(self) -> StateReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        while self._open:
            _, handle = self._open.popitem()
            handle.__exit__(None, None, None)

    def check(self, wanted: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
        """ConfigError unless the checkpoint holds exactly the tensors ``wanted`` (key -> whole shape, dtype):
        a checkpoint of other training state (model, method, optimizer or dtype differ) cannot continue it."""
        found = {k: (tuple(e["shape"]), e["dtype"]) for k, e in self.tensors.items()}
        want = {k: (tuple(shape), dtype_name(dtype)) for k, (shape, dtype) in wanted.items()}
        if found == want:
            return
        missing = sorted(want.keys() - found.keys())
        extra = sorted(found.keys() - want.keys())
        differ = sorted(k for k in want.keys() & found.keys() if want[k] != found[k])
        what = (
            f"it lacks {missing[0]}"
            if missing
            else f"it holds {extra[0]}, which this run has no use for"
            if extra
            else f"{differ[0]} is {found[differ[0]]} there, {want[differ[0]]} here"
        )
        raise ConfigError(
            f"checkpoint {self.path} was written by a run with other training state ({what}: model, method.type, "
            "optim or model.dtype differ); resume with the recipe that wrote it"
        )

    def read(self, key: str, start: int, end: int, out: torch.Tensor) -> None:
        """Copy elements ``[start, end)`` of state tensor ``key`` (flattened) into ``out`` (flat)."""
        entry = self.tensors[key]
        for file, name, a, b in entry["pieces"]:
            lo, hi = max(a, start), min(b, end)
            if lo < hi:
                self._check_piece(key, entry["dtype"], file, name, b - a)
                out[lo - start : hi - start].copy_(self._range(file, name, lo - a, hi - a))

    def _damaged(self, what: str) -> IntegrityError:
        return IntegrityError(f"{self.path / 'state' / INDEX_FILE}: {what}: the checkpoint is damaged")

    def _check_entry(self, key: str, entry: Any) -> None:
        """IntegrityError unless ``entry`` is a well-formed index entry of state tensor ``key``: a known role and
        dtype, and pieces that tile the tensor, each from a file of the state directory that holds that role's
        chunks (an index edited to read one role's tensor from another's file is refused)."""
        role, _, param = key.partition("/")
        if role not in STATE_ROLES or not param:
            raise self._damaged(
                f"{key!r} is not a state tensor (<role>/<parameter>, role one of {STATE_ROLES})"
            )
        try:
            shape, dtype, pieces = list(entry["shape"]), entry["dtype"], list(entry["pieces"])
            ok = all(type(n) is int and n >= 0 for n in shape) and isinstance(
                getattr(torch, dtype, None), torch.dtype
            )
        except (KeyError, TypeError):
            ok = False
        if not ok:
            raise self._damaged(f"the entry of {key} is malformed")
        at = 0
        for piece in pieces:
            if not (
                isinstance(piece, list)
                and len(piece) == 4
                and isinstance(piece[0], str)
                and isinstance(piece[1], str)
                and all(type(n) is int for n in piece[2:])
            ):
                raise self._damaged(f"a piece of {key} is malformed ({piece!r})")
            file, name, start, end = piece
            if start != at or end <= start:
                raise self._damaged(f"the pieces of {key} do not tile it (a gap or overlap at element {at})")
            at = end
            if name != param:
                raise self._damaged(f"a piece of {key} names {name!r}, another tensor")
            if _role_of_file(file) != role:
                raise self._damaged(f"a piece of {key} lies in {file}, which holds another role's state")
        if at != _numel(shape):
            raise self._damaged(f"the pieces of {key} cover {at} of its {_numel(shape)} elements")

    def _check_piece(self, key: str, dtype: str, file: str, name: str, numel: int) -> None:
        """IntegrityError unless the stored tensor ``name`` of ``file`` has the dtype and size its piece of
        ``key`` says (checked once per piece)."""
        if (file, name) in self._checked:
            return
        try:
            piece = self._file(file).get_slice(name)
            found = SAFETENSORS_DTYPES.get(piece.get_dtype())
            size = math.prod(piece.get_shape())
        except IntegrityError:
            raise
        except Exception as exc:  # safetensors' errors: no such tensor, a damaged header
            raise IntegrityError(
                f"{self.path / file} cannot be read ({type(exc).__name__}: {exc}): the checkpoint is damaged"
            ) from None
        if found is None or dtype_name(found) != dtype or size != numel:
            raise IntegrityError(
                f"{self.path / file}: {name} is {piece.get_dtype()} of {size} elements, its index entry ({key}) "
                f"says {dtype} of {numel}: the checkpoint is damaged"
            )
        self._checked.add((file, name))

    def whole(self, key: str) -> torch.Tensor:
        """State tensor ``key`` assembled whole, in its shape."""
        entry = self.tensors[key]
        out = torch.empty(_numel(entry["shape"]), dtype=getattr(torch, entry["dtype"]))
        self.read(key, 0, out.numel(), out)
        return out.view(entry["shape"])

    def nbytes(self, key: str) -> int:
        """Bytes of state tensor ``key`` whole."""
        entry = self.tensors[key]
        return _numel(entry["shape"]) * getattr(torch, entry["dtype"]).itemsize

    def keys(self, role: str) -> list[str]:
        """The parameter names of the state tensors of ``role`` (e.g. ``weights``), in index order."""
        return [k.split("/", 1)[1] for k in self.tensors if k.split("/", 1)[0] == role]

    def _range(self, file: str, name: str, start: int, end: int) -> torch.Tensor:
        """Elements ``[start, end)`` of tensor ``name`` of ``file`` (flattened), reading only the rows that
        hold them."""
        try:
            piece = self._file(file).get_slice(name)
            shape = piece.get_shape()
            if len(shape) <= 1:
                return piece[start:end]
            inner = math.prod(shape[1:])
            first, last = start // inner, -(-end // inner)
            rows = piece[first:last].reshape(-1)
            return rows[start - first * inner : end - first * inner]
        except IntegrityError:
            raise
        except Exception as exc:  # safetensors' errors for a truncated or damaged file
            raise IntegrityError(
                f"{self.path / file} cannot be read ({type(exc).__name__}: {exc}): the checkpoint is damaged"
            ) from None

    def _file(self, file: str) -> Any:
        from safetensors import safe_open

        if file in self._open:
            self._open.move_to_end(file)
            return self._open[file]
        path = self.path / file
        if not path.is_file():
            raise IntegrityError(f"{path} is missing: the checkpoint is damaged")
        opened = safe_open(str(path), framework="pt")
        handle = opened.__enter__()
        self._open[file] = opened
        if len(self._open) > _OPEN_FILES:
            _, oldest = self._open.popitem(last=False)
            oldest.__exit__(None, None, None)
        return handle

    def _legacy(self, trainer_state: dict) -> dict[str, dict]:
        """The index of a one-process checkpoint written before the index existed: its chunk files (named by
        ``state_chunks``) hold whole tensors."""
        names = trainer_state.get("tiertune", {}).get("state_chunks")
        if names is None:
            raise IntegrityError(f"{self.path / 'state' / INDEX_FILE} is missing: the checkpoint is damaged")
        tensors: dict[str, dict] = {}
        for chunk in names:
            file = f"state/{chunk}.safetensors"
            role = _role_of_file(file)
            handle = self._file(file)
            for name in handle.keys():  # noqa: SIM118 (safe_open has keys(), it is not iterable)
                piece = handle.get_slice(name)
                shape = list(piece.get_shape())
                dtype = SAFETENSORS_DTYPES.get(piece.get_dtype())
                if dtype is None:
                    raise IntegrityError(
                        f"{self.path / file}: {name} has dtype {piece.get_dtype()}, not a state's"
                    )
                tensors[f"{role}/{name}"] = {
                    "shape": shape,
                    "dtype": dtype_name(dtype),
                    "pieces": [[file, name, 0, _numel(shape)]],
                }
        return tensors
