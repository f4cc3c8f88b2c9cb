"""examples/quickstart.ipynb runs top to bottom on the CPU (a fresh kernel, as a user would run it) and leaves
nothing in the temporary directory."""

from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "quickstart.ipynb"


@pytest.mark.timeout(600)
def test_quickstart_notebook_runs_top_to_bottom(tmp_path):
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    outputs = "".join(
        o.get("text", "") + str(o.get("data", {}).get("text/plain", ""))
        for c in nb.cells
        for o in c.get("outputs", [])
    )
    assert "Error" not in outputs and "IProgress" not in outputs  # no widget warning without ipywidgets
    printed = "".join(o.get("text", "") for o in nb.cells[1].outputs)  # the first cell prints its directory
    work = Path(next(w for w in printed.split() if "tiertune-quickstart-" in w))
    assert work.name.startswith("tiertune-quickstart-") and not work.exists()  # the last cell removed it
    assert "s per step" in outputs and "how fast:" in outputs and "checkpoint-8" in outputs
    assert "eval_loss by step: {4: " in outputs  # the held-out rows, every 4 steps
    assert "teacher pass:" in outputs and "'tokens_per_second'" in outputs  # the distillation's
