"""The README's commands as printed: its multi-process block runs top to bottom (each line its own run)."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_multi_process_block_gives_each_launch_its_own_run_directory():
    # run top to bottom as printed, the accelerate line once found the torchrun line's finished run and failed
    text = README.read_text()
    block = text.split("## Several GPUs", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    lines = [line for line in block.splitlines() if line.strip()]
    assert [line.split()[0] for line in lines] == [
        ".venv/bin/tiertune",
        ".venv/bin/torchrun",
        ".venv/bin/accelerate",
    ]
    dirs = [re.search(r"training\.output_dir=(\S+)", line).group(1) for line in lines]
    assert len(set(dirs)) == len(lines), dirs
    assert all("train recipes/demo.yaml" in line for line in lines)
