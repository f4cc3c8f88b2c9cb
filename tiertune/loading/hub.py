"""``model.path`` as a Hugging Face model id: the model downloaded into the hub's cache, as ``from_pretrained``
does (``huggingface_hub``), or, for ``estimate``, its config.json alone (shipped in the package for the
built-in recipes' models, so that estimating them needs no network).

Offline, a model that is not in the cache fails at once with one line naming what to do, not after the hub
client's minute of retries: the Hub is probed first with a short connection timeout.
"""

from __future__ import annotations

import contextlib
import logging
import re
import socket
from pathlib import Path
from urllib.parse import urlparse

from tiertune.errors import ModelError
from tiertune.logs import held_back

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
"""A Hugging Face model id (``organization/name``)."""

SHIPPED = Path(__file__).resolve().parents[1] / "recipes" / "models"
"""config.json of the built-in recipes' models, by model id (``SHIPPED / id / "config.json"``)."""

WEIGHTS_AND_TOKENIZER = ["*.json", "*.safetensors", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"]
"""What a run reads of a model repository: configs, safetensors (with their index), the tokenizer's files."""

PROBE_SECONDS = 3.0


def is_hub_id(path: str) -> bool:
    """Whether ``model.path`` names a Hugging Face model (``org/name``) rather than a local directory."""
    return not Path(path).expanduser().exists() and bool(HUB_ID.fullmatch(path))


def shipped_config(model_id: str) -> Path | None:
    """The directory holding the shipped config.json of ``model_id``, if tiertune ships it."""
    directory = SHIPPED / model_id
    return directory if (directory / "config.json").is_file() else None


def config_directory(path: str) -> str:
    """``model.path`` as a directory holding the model's config.json (for ``estimate``: nothing else is
    needed): the path itself; for a model id, the model in the hub's cache, else its shipped config, else its
    config.json alone fetched into the cache. Raises ModelError saying what to do when it cannot be fetched."""
    if not is_hub_id(path):
        return path
    cached = _cached(path, ["config.json"])
    if cached is not None:
        return cached
    shipped = shipped_config(path)
    if shipped is not None:
        return str(shipped)
    return _download(path, ["config.json"], "its config.json")


def model_directory(path: str) -> str:
    """``model.path`` as a local model directory (for ``train``): the path itself, or for a model id its
    snapshot in the hub's cache, downloaded there first when it is not (configs, safetensors, tokenizer).
    Raises ModelError saying what to do when it cannot be downloaded (offline, unknown or gated)."""
    if not is_hub_id(path):
        return path
    cached = _cached(path, WEIGHTS_AND_TOKENIZER)
    if cached is not None and any(Path(cached).glob("*.safetensors")):
        return cached
    return _download(path, WEIGHTS_AND_TOKENIZER, "the model")


def _cached(model_id: str, patterns: list[str]) -> str | None:
    from huggingface_hub import snapshot_download

    try:
        with _quiet():
            return snapshot_download(model_id, allow_patterns=patterns, local_files_only=True)
    except Exception:  # not in the cache (or an incomplete snapshot): downloaded below
        return None


def _download(model_id: str, patterns: list[str], what: str) -> str:
    from huggingface_hub import constants, snapshot_download

    advice = (
        f"download it where the Hub is reachable (`hf download {model_id}`, into the same cache: HF_HOME), "
        "then run with HF_HUB_OFFLINE=1; or set model.path to a local directory saved with save_pretrained"
    )
    if constants.HF_HUB_OFFLINE:
        raise ModelError(
            f"model.path {model_id!r} is not in the Hugging Face cache and HF_HUB_OFFLINE is set; {advice}"
        )
    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=PROBE_SECONDS).close()
    except OSError as exc:
        raise ModelError(
            f"model.path {model_id!r} is not a local directory nor in the Hugging Face cache, and the Hub "
            f"({constants.ENDPOINT}) cannot be reached ({exc.strerror or exc}); {advice}"
        ) from None
    try:
        with _quiet():
            return snapshot_download(model_id, allow_patterns=patterns)
    except Exception as exc:  # unknown repository, gated, connection lost
        why = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise ModelError(
            f"model.path {model_id!r}: {what} could not be downloaded from the Hugging Face Hub "
            f"({type(exc).__name__}: {why}); check the id (and `hf auth login` for a gated model), or {advice}"
        ) from None


def _quiet() -> contextlib.AbstractContextManager[None]:
    """Without the hub client's retry warnings (what went wrong is said once, in the error)."""
    return held_back("huggingface_hub", logging.ERROR)
