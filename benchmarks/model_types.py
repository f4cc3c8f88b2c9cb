"""Every model type transformers knows, through `tiertune estimate`: estimated, or refused with one line.

For each model type of transformers' ``CONFIG_MAPPING`` with a default config, a config-only directory
(``config.json`` alone, as a user hands `estimate` one) is written with its layers cut to ``--layers``
(``--full`` keeps the default's size), and `tiertune estimate RECIPE model.path=DIR` runs as a command of its
own: a process forked from a server that imported tiertune once (so 800 types take minutes, not an hour),
its stdout and stderr in files, its exit code the command's. Each type is then

- ``estimated``: exit 0 or 1 with the estimate printed (1: it does not fit the recipe's budgets);
- ``refused``: exit 2 and one line on stderr, ``error: ...``;
- ``traceback`` (anything else: a traceback, another exit code, more lines, no exit within ``--timeout``).

``--train`` runs `tiertune train RECIPE model.path=DIR` (one step, a line of chat data) instead: with no
weights in the directory no type trains, and each must end as ``refused`` (which gate stopped it: the config,
the budgets, the tokenizer, the weights), never in a traceback.

Prints one JSON object per type and a summary; with ``--markdown FILE`` also the table (model type ->
estimated / refused and why), as BENCHMARKS.md gives it. Exits 1 when any type ended otherwise than estimated
or refused.

    python benchmarks/model_types.py --dir /tmp/mt --markdown /tmp/mt/table.md
    python benchmarks/model_types.py --dir /tmp/mt --types llama,bert,t5,gemma3,mixtral --full
    python benchmarks/model_types.py --dir /tmp/mt --train
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import re
import sys
import time
from pathlib import Path

RECIPE = "llama3-8b-qlora-24gb"  # QLoRA on one 24 GB GPU: the quantizer and LoRA see every layer
LAYER_KEYS = (
    "num_hidden_layers",
    "num_layers",
    "n_layer",
    "n_layers",
    "num_decoder_layers",
    "decoder_layers",
    "encoder_layers",
    "num_encoder_layers",
    "text_layers",
)


def cut(config: object, layers: int) -> None:
    """Cut ``config`` (and its sub-configs) to at most ``layers`` layers; lists with an entry per layer (layer
    types, per-layer window sizes...) are cut with them."""
    from transformers import PretrainedConfig

    for key in LAYER_KEYS:
        old = getattr(config, key, None)
        if not isinstance(old, int) or isinstance(old, bool) or old <= layers:
            continue
        try:
            setattr(config, key, layers)
        except (AttributeError, ValueError, TypeError):
            continue
        for name, value in list(vars(config).items()):
            if isinstance(value, list) and len(value) == old:
                try:  # the first layers and the last (which patterns such as Gemma's require to be global)
                    setattr(config, name, value[: layers - 1] + value[-1:])
                except (AttributeError, ValueError, TypeError):
                    continue
            elif isinstance(value, dict) and value and all(isinstance(k, int) for k in value):
                with contextlib.suppress(AttributeError, ValueError, TypeError):  # settings by layer index
                    setattr(config, name, {k: v for k, v in value.items() if k < layers})
    for value in list(vars(config).values()):
        if isinstance(value, PretrainedConfig):
            cut(value, layers)


def write_config(model_type: str, directory: Path, layers: int | None) -> str | None:
    """``model_type``'s default config as ``directory/config.json`` (cut to ``layers``); why not, if it has
    none."""
    from transformers import CONFIG_MAPPING

    try:
        config = CONFIG_MAPPING[model_type]()
        if layers is not None:
            cut(config, layers)
        directory.mkdir(parents=True, exist_ok=True)
        config.save_pretrained(directory)
    except Exception as exc:  # some types need arguments (sub-configs, a backbone) to make a config at all
        return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}"
    return None


def _command(argv: list[str], out: str, err: str) -> None:
    """The console script's entry point, in this (forked) process, its stdout and stderr in files."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 (the process ends with the command)
    sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
    sys.argv = ["tiertune", *argv]
    from tiertune.cli.app import main

    code = 0
    try:
        main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # what the interpreter would print for an uncaught exception
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def classify(code: int | None, out: str, err: str) -> tuple[str, str]:
    """``(result, why)`` of one estimate's exit code and output."""
    lines = [line for line in err.splitlines() if line.strip()]
    if code is None:
        return "traceback", "no exit within the timeout"
    if "Traceback (most recent call last)" in out + err:
        last = next((line for line in reversed(lines) if line and not line.startswith(" ")), "")
        return "traceback", last[:200]
    if code == 0 and out.startswith("done:"):
        return "trained", out.splitlines()[0][:160]
    if code in (0, 1) and "parameters" in out:
        fits = "fits" if code == 0 else "does not fit the recipe's budgets"
        first = out.splitlines()[0] if out else ""
        return "estimated", f"{fits}; {first[:160]}"
    if code == 2 and len(lines) == 1 and lines[0].startswith("error: "):
        return "refused", lines[0][len("error: ") :]
    return "traceback", f"exit {code}, {len(lines)} lines on stderr: {' | '.join(lines)[:200]}"


def walk(
    types: list[str],
    directory: Path,
    layers: int | None,
    recipe: str,
    extra: list[str],
    timeout: float,
    jobs: int,
    command: str = "estimate",
) -> list[dict]:
    """Each of ``types`` through `tiertune estimate` (or ``train``), ``jobs`` at a time; one dict per type."""
    # the server imports transformers once for all; tiertune's entry point sets this before transformers is
    # imported in a process of its own (``cli.app.main``), so the server does it first too
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["tiertune.cli.app", "tiertune.estimates.report", "transformers"])
    results: list[dict] = []
    pending = list(types)
    running: dict[str, tuple[multiprocessing.process.BaseProcess, float, Path]] = {}
    while pending or running:
        while pending and len(running) < jobs:
            model_type = pending.pop(0)
            place = directory / model_type
            why = write_config(model_type, place, layers)
            if why is not None:
                row = {"model_type": model_type, "result": "no default config", "why": why}
                results.append(row)
                print(json.dumps(row), flush=True)
                continue
            if command == "train":  # a step of the recipe on a config-only directory: as far as it gets
                data = directory / "data.jsonl"
                chat = {
                    "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
                }
                data.write_text(json.dumps(chat) + "\n")
                argv = [
                    "train",
                    recipe,
                    f"model.path={place}",
                    f"data.path={data}",
                    f"offload.disk_path={place / 'nvme'}",
                    f"training.output_dir={place / 'run'}",
                    "training.max_steps=1",
                    *extra,
                    "-q",
                ]
            else:
                argv = ["estimate", recipe, f"model.path={place}", *extra]
            proc = ctx.Process(target=_command, args=(argv, str(place / "out.txt"), str(place / "err.txt")))
            proc.start()
            running[model_type] = (proc, time.monotonic(), place)
        time.sleep(0.05)
        for model_type, (proc, began, place) in list(running.items()):
            late = time.monotonic() - began > timeout
            if proc.is_alive() and not late:
                continue
            if proc.is_alive():
                proc.kill()
            proc.join()
            del running[model_type]
            code = None if late else proc.exitcode
            out, err = ((place / f).read_text(errors="replace") for f in ("out.txt", "err.txt"))
            result, why = classify(code, out, err)
            row = {
                "model_type": model_type,
                "result": result,
                "why": why,
                "exit": code,
                "seconds": round(time.monotonic() - began, 1),
                "dir": str(place),
            }
            results.append(row)
            print(json.dumps(row), flush=True)
    return sorted(results, key=lambda r: r["model_type"])


PREFIX = r"^tiertune fine-tunes decoder-only causal LMs \(AutoModelForCausalLM\); \S+ is a \S+ \([^)]*\), "
"""What every refusal of a config begins with (the model's directory, type and architectures)."""

REASONS = (  # a refusal's kind, by what its line says
    ("not a causal LM", "not a causal LM"),
    ("an encoder-decoder model", "encoder-decoder"),
    ("an encoder-only model", "encoder-only"),
    ("a multimodal model", "multimodal class"),
    ("no recognizable stack of decoder layers", "no stack of identical decoder layers"),
    ("cannot build a config", "transformers cannot read the config"),
    (" cannot build ", "transformers cannot build the model from the config"),
    ("whose config names no", "no hidden size / layers / vocabulary"),
    ("method.lora", "the recipe's LoRA targets"),
)


def kind(row: dict) -> str:
    """A row's result in a few words: estimated, or which kind of refusal."""
    if row["result"] != "refused":
        return row["result"]
    return next((name for text, name in REASONS if text in row["why"]), "refused")


def markdown(results: list[dict]) -> str:
    """The table BENCHMARKS.md gives: each model type that transformers has a causal LM for -> estimated, or
    refused and why (the line, shortened); then the types refused as no causal LM at all, by name."""
    rows = ["| model type | result | why (the refusal's line, from its reason on) |", "|---|---|---|"]
    others = []
    for r in results:
        if kind(r) == "not a causal LM":
            others.append(r["model_type"])
            continue
        why = (
            ""
            if r["result"] == "estimated"
            else re.sub(PREFIX, "", r["why"]).replace(r.get("dir", "\0"), "DIR")
        )
        why = (why[:200] + ("..." if len(why) > 200 else "")).replace("|", "\\|")
        rows.append(f"| `{r['model_type']}` | {kind(r)} | {why} |")
    tail = f"\nRefused as not a causal LM ({len(others)}): " + ", ".join(f"`{t}`" for t in others) + ".\n"
    return "\n".join(rows) + "\n" + (tail if others else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", required=True, help="where the config-only directories go")
    parser.add_argument(
        "--types", help="comma-separated model types (default: every type transformers knows)"
    )
    parser.add_argument("--layers", type=int, default=4, help="layers each config is cut to")
    parser.add_argument("--full", action="store_true", help="the default configs at their full size")
    parser.add_argument("--recipe", default=RECIPE, help="the recipe whose model.path each type replaces")
    parser.add_argument(
        "--set",
        action="append",
        default=["method.lora.dropout=0"],
        help="more overrides of the recipe (default: method.lora.dropout=0, which MoE experts need)",
    )
    parser.add_argument("--probe", action="store_true", help="measure the machine too (default: --no-probe)")
    parser.add_argument(
        "--train",
        action="store_true",
        help="`tiertune train` instead (one step; the directory has no weights: how far it gets)",
    )
    parser.add_argument("--gpu", default="rtx4090", help="estimate's --gpu")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one estimate may take")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--markdown", help="also write the table to this file")
    args = parser.parse_args()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    types = args.types.split(",") if args.types else sorted(CONFIG_MAPPING_NAMES)
    extra = (
        args.set if args.train else [*args.set, "--gpu", args.gpu, *([] if args.probe else ["--no-probe"])]
    )
    began = time.monotonic()
    results = walk(
        types,
        Path(args.dir),
        None if args.full else args.layers,
        args.recipe,
        extra,
        args.timeout,
        args.jobs,
        "train" if args.train else "estimate",
    )
    counts: dict[str, int] = {}
    for r in results:
        counts[r["result"]] = counts.get(r["result"], 0) + 1
    import transformers

    print(
        json.dumps(
            {
                "bench": "model_types",
                "command": "train" if args.train else "estimate",
                "types": len(results),
                "counts": counts,
                "transformers": transformers.__version__,
                "recipe": args.recipe,
                "layers": None if args.full else args.layers,
                "seconds": round(time.monotonic() - began, 1),
                "tracebacks": [r["model_type"] for r in results if r["result"] == "traceback"],
            }
        )
    )
    if args.markdown:
        Path(args.markdown).write_text(markdown(results))
    return 1 if counts.get("traceback") else 0


if __name__ == "__main__":
    sys.exit(main())
