from __future__ import annotations

import logging

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def disk_dir(tmp_path):
    """A directory on the real disk (tmp_path lives on the root filesystem here, not tmpfs)."""
    d = tmp_path / "disk"
    d.mkdir()
    return d


@pytest.fixture(autouse=True)
def _offload_logs(caplog):
    caplog.set_level(logging.DEBUG, logger="tiertune.offload")


@pytest.fixture(autouse=True, scope="session")
def _datasets_cache(tmp_path_factory):
    """The datasets library's cache (tokenized data) in the test session's temporary directory, not ~/.cache."""
    import os

    path = str(tmp_path_factory.mktemp("hf-datasets"))
    os.environ["HF_DATASETS_CACHE"] = path
    import datasets

    datasets.config.HF_DATASETS_CACHE = path
