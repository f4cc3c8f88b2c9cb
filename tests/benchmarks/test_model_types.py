"""A sample of transformers' model types through `tiertune estimate` (``benchmarks/model_types.py``), a family
of each kind: each is estimated, or refused with one line saying why and what to do; none ends in a traceback.
The whole walk (every model type) is the benchmark's, reported in BENCHMARKS.md."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "model_types.py"

EXPECTED = {
    "llama": ("estimated", ""),  # dense decoder
    "qwen3_moe": ("estimated", ""),  # mixture of experts
    "llama4": ("estimated", ""),  # its causal LM is the text decoder of a multimodal config
    "gemma3": ("estimated", ""),  # a multimodal class trained on text: its language model streams
    "qwen3_vl": ("estimated", ""),  # a multimodal class with no causal LM of its own, trained on text
    "mllama": ("refused", "no recognizable stack of decoder layers"),
    "bert": ("refused", "an encoder-only model"),
    "roberta": ("refused", "an encoder-only model"),
    "t5": ("refused", "an encoder-decoder model"),
    "whisper": ("refused", "an encoder-decoder model"),
    "vit": ("refused", "not a causal LM"),
}


def _walk(tmp_path: Path, types: list[str], *flags: str) -> dict[str, dict]:
    out = subprocess.run(
        [sys.executable, str(BENCH), "--dir", str(tmp_path), "--types", ",".join(types), *flags],
        capture_output=True,
        text=True,
        timeout=900,
    )
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    summary = rows[-1]
    assert summary["bench"] == "model_types" and summary["types"] == len(types), out.stdout[-3000:]
    assert out.returncode == 0 and not summary["tracebacks"], out.stdout[-3000:] + out.stderr[-3000:]
    return {r["model_type"]: r for r in rows[:-1]}


@pytest.mark.timeout(900)
def test_a_family_of_each_kind_is_estimated_or_refused_in_one_line(tmp_path):
    results = _walk(tmp_path, list(EXPECTED))
    for model_type, (result, why) in EXPECTED.items():
        row = results[model_type]
        assert row["result"] == result and why in row["why"], row
        if result == "refused":  # what to do instead is said too
            assert "set model.path to" in row["why"] or "which tiertune trains" in row["why"], row
    assert "multimodal" not in results["gemma3"]["why"]  # Gemma 3's multimodal class: estimated, not refused


@pytest.mark.timeout(900)
def test_full_size_default_configs_are_estimated(tmp_path):
    """A config-only directory is what users hand `estimate`: the default configs at their full size (a 7B
    dense decoder, a 30B mixture of experts, one whose layers differ in their heads: a heterogeneous config,
    whose per-layer settings read from the whole config are an error) are estimated as well as cut ones."""
    results = _walk(tmp_path, ["mistral", "qwen3_moe", "dots3_note_text"], "--full")
    assert all(r["result"] == "estimated" for r in results.values()), results
