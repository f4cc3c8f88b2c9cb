"""The offload package type-checks under mypy with no ``type: ignore``: its types say what it holds (a chunk's
copies are allocations, a store's config resolved values), not what a checker is told to overlook."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

OFFLOAD = Path(__file__).parents[2] / "tiertune" / "offload"


def test_the_offload_package_has_no_type_ignore():
    found = [
        f"{p.name}:{n}"
        for p in sorted(OFFLOAD.glob("*.py"))
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"#\s*type:\s*ignore", line)
    ]
    assert found == []


def test_the_offload_package_type_checks():
    pytest.importorskip("mypy", reason="mypy is in the dev extra")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            str(OFFLOAD),
            "--ignore-missing-imports",
            "--follow-imports=silent",
            "--cache-dir",
            "/dev/null",
        ],
        capture_output=True,
        text=True,
        cwd=OFFLOAD.parents[1],
    )
    assert out.returncode == 0, out.stdout + out.stderr
