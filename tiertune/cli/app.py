"""``tiertune`` commands. Each is a thin layer over the Python API; usage errors exit with code 2."""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import shutil
import signal
import time
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from tiertune.units import format_size

app = typer.Typer(
    name="tiertune",
    help="Fine-tune language models far larger than GPU memory: GPU, host memory and NVMe as one.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"tiertune {metadata.version('tiertune')}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", "-V", callback=_print_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    """Fine-tune language models far larger than GPU memory: GPU, host memory and NVMe as one."""


_PACKAGES = ("tiertune", "torch", "bitsandbytes", "peft", "transformers", "accelerate", "safetensors")


def environment(disk_path: Path | None = None) -> dict[str, Any]:
    """What tiertune sees of this machine: package versions, compute devices, RAM, GPU memory, and the
    free space and O_DIRECT support of ``disk_path``. Initializes CUDA if a GPU is present."""
    import psutil
    import torch

    versions = {}
    for name in _PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(i)
            gpus.append(
                {"index": i, "name": torch.cuda.get_device_name(i), "total_bytes": total, "free_bytes": free}
            )
    mem = psutil.virtual_memory()
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": versions,
        "cpu_count": os.cpu_count(),
        "compute_device": "cuda" if gpus else "cpu",
        "gpus": gpus,
        "ram_total_bytes": mem.total,
        "ram_available_bytes": mem.available,
    }
    if disk_path is not None:
        from tiertune.offload.disk import supports_o_direct

        info["disk"] = {
            "path": str(disk_path.resolve()),
            "free_bytes": shutil.disk_usage(disk_path).free,
            "o_direct": supports_o_direct(disk_path),
        }
    return info


@app.command()
def env(
    disk_path: Annotated[
        Path | None,
        typer.Option(help="Directory the disk tier would use: report its free space and O_DIRECT support."),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object instead of a table.")
    ] = False,
    probe: Annotated[
        bool,
        typer.Option("--probe", help="Measure the disk's read/write bandwidth at --disk-path (256 MiB)."),
    ] = False,
) -> None:
    """Show versions, compute devices, memory and disk facts that decide what fits.

    Example: tiertune env --disk-path /mnt/nvme/tiertune --probe
    """
    if disk_path is not None and not disk_path.is_dir():
        raise typer.BadParameter(f"{disk_path} is not an existing directory", param_hint="--disk-path")
    if probe and disk_path is None:
        raise typer.BadParameter("--probe measures the disk at --disk-path; give one", param_hint="--probe")
    with _user_errors():
        info = environment(disk_path)
        if probe:
            from tiertune.estimates.speed import probe_disk

            read, write = probe_disk(disk_path)  # type: ignore[arg-type]
            info["disk"]["read_bytes_per_second"], info["disk"]["write_bytes_per_second"] = read, write
    if as_json:
        typer.echo(json.dumps(info, indent=2))
        return
    rows = [("python", info["python"]), ("platform", info["platform"])]
    rows += [(name, version or "not installed") for name, version in info["packages"].items()]
    rows.append(("cpus", str(info["cpu_count"])))
    rows.append(
        (
            "ram",
            f"{format_size(info['ram_available_bytes'])} available of {format_size(info['ram_total_bytes'])}",
        )
    )
    rows.append(("compute device", info["compute_device"]))
    for gpu in info["gpus"]:
        rows.append(
            (
                f"gpu {gpu['index']}",
                f"{gpu['name']}, {format_size(gpu['free_bytes'])} free of {format_size(gpu['total_bytes'])}",
            )
        )
    if "disk" in info:
        disk = info["disk"]
        rows.append(("disk path", disk["path"]))
        rows.append(("disk free", format_size(disk["free_bytes"])))
        rows.append(("O_DIRECT", "yes" if disk["o_direct"] else "no (buffered I/O fallback)"))
        if "read_bytes_per_second" in disk:
            rows.append(("disk read", f"{disk['read_bytes_per_second'] / 1e9:.2f} GB/s (probe, 256 MiB)"))
            rows.append(("disk write", f"{disk['write_bytes_per_second'] / 1e9:.2f} GB/s (probe, 256 MiB)"))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        typer.echo(f"{key:<{width}}  {value}")


_Quiet = Annotated[
    bool, typer.Option("--quiet", "-q", help="Print only errors and the final line (no banner, no progress).")
]
_Verbose = Annotated[bool, typer.Option("--verbose", "-v", help="Also print tiertune's debug log.")]
_Source = Annotated[
    str,
    typer.Argument(
        help="A model directory or Hugging Face id, a run directory (training.output_dir) or a checkpoint."
    ),
]


@app.command()
def train(
    recipe: Annotated[
        Path, typer.Argument(help="A YAML recipe, or a built-in one by name (`tiertune recipes`).")
    ],
    overrides: Annotated[
        list[str] | None,
        typer.Argument(
            help="Dotted overrides for every recipe, e.g. training.learning_rate=1e-4; and more recipes (files or "
            "built-in names), each a LoRA adapter trained over the first's base in the same run."
        ),
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the resolved recipe and plan, then exit.")
    ] = False,
    quiet: _Quiet = False,
    verbose: _Verbose = False,
) -> None:
    """Fine-tune a model as a recipe says; writes trainer_log.jsonl, checkpoints and the model to
    training.output_dir. Relative paths are relative to the current directory.

    Exit codes: 0 done; 2 a setting, file or directory to fix (the message says which); 3 a step's loss
    or gradient norm was not finite; 130/143 stopped by Ctrl-C/SIGTERM (the message says how to resume).

    Example: tiertune train recipes/demo.yaml training.max_steps=20 offload.disk_path=/mnt/nvme/tt

    Several recipes (or one with a sweep: section) train one LoRA adapter each over one base, streamed once a
    step for all of them: tiertune train a.yaml b.yaml training.max_steps=100
    """
    _console_log(quiet, verbose)
    with _user_errors():
        from tiertune.config.plan import plan
        from tiertune.config.recipe import load_recipe
        from tiertune.finetune.train import train as run

        _imports_settled()
        # arguments that name a recipe file or a built-in recipe are recipes; the rest, overrides for all
        from tiertune.config.recipe import recipe_path

        more = [a for a in overrides or () if "=" not in a and recipe_path(a).is_file()]
        overrides = [a for a in overrides or () if a not in more]
        if more or "sweep" in _raw_keys(recipe):
            from tiertune.config.sweep import load_recipes
            from tiertune.finetune.several import train_several

            recipes = load_recipes([recipe, *more], tuple(overrides))
            if dry_run:
                for each in recipes:
                    typer.echo(each.with_absolute_paths().to_yaml())
                return
            if len(recipes) > 1:
                results = train_several(recipes, progress=not quiet)
                if any(r.error is not None for r in results):  # left out: said in the table, the others done
                    raise typer.Exit(1)
                return
            loaded = recipes[0]  # a sweep of one combination: a run of one
        else:
            loaded = load_recipe(recipe, tuple(overrides))
        resolved = loaded.with_absolute_paths()
        if dry_run:
            from tiertune.loading.hub import config_directory

            typer.echo(resolved.to_yaml())
            resolved.model.path = config_directory(resolved.model.path)  # nothing downloaded but a config
            store, engine = plan(resolved)
            typer.echo(
                f"plan: device={store.device} params={engine.params} optimizer_states={engine.optimizer_states} "
                f"gradients={engine.gradients} dtype={str(engine.dtype).removeprefix('torch.')} "
                f"device_budget={format_size(store.device_budget)} host_budget={format_size(store.host_budget)} "
                f"disk_path={store.disk_path}"
            )
            return
        result = run(resolved, progress=not quiet)
    from tiertune.distributed.world import World

    if World.from_env().is_main:  # of several ranks, one reports
        _report(result)


def _raw_keys(recipe: Path) -> list[str]:
    """The top-level sections of a recipe file (none when it cannot be read: ``load_recipe`` says why)."""
    from tiertune.config.recipe import read_raw
    from tiertune.errors import ConfigError

    try:
        return list(read_raw(recipe))
    except ConfigError:
        return []


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def launch(ctx: typer.Context) -> None:
    """Train on several processes: torchrun's launcher, its options first, then the tiertune command.

    The same as `torchrun [OPTIONS] -m tiertune.cli train RECIPE ...`, except how it ends: a stop (SIGTERM,
    Ctrl-C) exits 128 + the signal once every rank has stopped through its clean-up, a rank's error exits with
    that rank's code (2: a setting to fix), each with one line, not torchrun's traceback.

    Example: tiertune launch --standalone --nproc_per_node 2 train recipes/demo.yaml
    """
    from tiertune.finetune.ranks import launch as run

    args = list(ctx.args)
    if "train" not in args:
        _usage_error(
            "give torchrun's options, then the command: tiertune launch --nproc_per_node 2 train RECIPE"
        )
    at = args.index("train")
    code, said = run(args[:at], args[at:])
    if said:
        typer.echo(said, err=True)
    raise typer.Exit(code)


@app.command()
def estimate(
    recipe: Annotated[
        Path, typer.Argument(help="A YAML recipe, or a built-in one by name (`tiertune recipes`).")
    ],
    overrides: Annotated[
        list[str] | None, typer.Argument(help="Dotted overrides, e.g. offload.host_budget=32GiB.")
    ] = None,
    no_probe: Annotated[
        bool, typer.Option("--no-probe", help="Measure nothing (disk, optimizer, compute): no step time.")
    ] = False,
    gpu: Annotated[
        str,
        typer.Option(
            "--gpu",
            help="What computes: auto (this machine's GPU, measured; else its CPU), cpu, or a GPU by its stated "
            "peak: rtx3090, rtx4090, a6000, l40s, a100, h100, h200.",
        ),
    ] = "auto",
    as_json: Annotated[bool, typer.Option("--json", help="Print the estimate as one JSON object.")] = False,
    processes: Annotated[
        int,
        typer.Option(
            "--processes", help="Launched as N ranks (torchrun / accelerate): per rank, per node, wire."
        ),
    ] = 1,
    per_node: Annotated[
        int | None, typer.Option("--per-node", help="Ranks on each node (default: all of --processes).")
    ] = None,
    layer_ms: Annotated[
        str | None,
        typer.Option(
            "--layer-ms",
            help="F,B: a decoder layer's forward and backward milliseconds a micro-batch as given (a GPU's, "
            "measured elsewhere) instead of measured here; the rest of the step is measured on this machine.",
        ),
    ] = None,
    longest: Annotated[
        bool,
        typer.Option(
            "--longest",
            help="Also search the longest data.max_seq_len that fits (the plan estimated at each length tried: "
            "a minute or so).",
        ),
    ] = False,
    quiet: _Quiet = False,
    verbose: _Verbose = False,
) -> None:
    """Will a recipe fit (each budget, and this machine), how much disk, how fast: bytes per tier and the step
    time with its parts, tokens/s and time to finish, without training or downloading the model.

    model.path may be a directory with only config.json, or a Hugging Face model id (its config.json alone is
    fetched). Example: tiertune estimate recipes/llama3-70b-qlora-nvme.yaml --gpu rtx4090

    Several recipes (or one with a sweep: section): their adapters over one base, a step of all of them beside
    one's alone, and the most of them that fit: tiertune estimate a.yaml b.yaml c.yaml
    """
    import json

    from tiertune.config.recipe import load_recipe
    from tiertune.estimates.report import estimate as predict
    from tiertune.estimates.report import format_estimate

    _console_log(quiet, verbose)
    with _user_errors():
        _imports_settled()
        from tiertune.config.recipe import recipe_path

        more = [a for a in overrides or () if "=" not in a and recipe_path(a).is_file()]
        overrides = [a for a in overrides or () if a not in more]
        if more or "sweep" in _raw_keys(recipe):  # several adapters over one base
            from tiertune.config.sweep import load_recipes
            from tiertune.estimates.adapters import estimate_adapters, format_adapters

            recipes = load_recipes([recipe, *more], tuple(overrides))
            if len(recipes) > 1:
                several = estimate_adapters(recipes, measure=not no_probe, gpu=gpu)
                if as_json:
                    typer.echo(json.dumps(several.as_json(), indent=1))
                else:
                    typer.echo(
                        format_adapters(several, f"tiertune estimate {recipe} ({len(recipes)} adapters)")
                    )
                if not several.fits:
                    raise typer.Exit(1)
                return
            resolved = recipes[0]  # a sweep of one combination: a run of one
        else:
            resolved = load_recipe(recipe, tuple(overrides or ()))
        est = predict(
            resolved,
            measure=not no_probe,
            gpu=gpu,
            processes=processes,
            per_node=per_node,
            layer_seconds=_layer_seconds(layer_ms),
        )
        found = None
        if longest:
            from tiertune.estimates.longest import longest_sequence

            found = longest_sequence(resolved, gpu=gpu)
    if as_json:
        typer.echo(
            json.dumps(
                {**est.as_json(), **({"longest_sequence": found.as_json()} if found else {})}, indent=1
            )
        )
    else:
        typer.echo(format_estimate(est, f"tiertune estimate {recipe}"))
        if found is not None:
            typer.echo(
                f"longest sequence within the budgets: {found.tokens:,} tokens a row (data.max_seq_len, a multiple "
                f"of {found.multiple:,}; {found.batch} row(s) a micro-batch; {len(found.tried)} lengths estimated)"
            )
    if not est.fits:
        raise typer.Exit(1)


def _layer_seconds(given: str | None) -> tuple[float, float] | None:
    """``--layer-ms F,B`` as (forward, backward) seconds; a ConfigError that says the form otherwise."""
    from tiertune.errors import ConfigError

    if given is None:
        return None
    try:
        forward, backward = (float(x) / 1e3 for x in given.split(","))
    except ValueError:
        raise ConfigError(f"--layer-ms takes F,B (milliseconds, e.g. 3,9), got {given!r}") from None
    if min(forward, backward) < 0:
        raise ConfigError(f"--layer-ms takes milliseconds >= 0, got {given!r}")
    return forward, backward


@app.command()
def generate(
    source: _Source,
    overrides: Annotated[
        list[str] | None, typer.Argument(help="Dotted overrides, e.g. offload.device_budget=4GiB.")
    ] = None,
    prompt: Annotated[list[str] | None, typer.Option("--prompt", help="A prompt (repeatable).")] = None,
    prompts: Annotated[
        Path | None, typer.Option("--prompts", help="A file of prompts: a line each, or .jsonl rows' prompt.")
    ] = None,
    max_new_tokens: Annotated[
        int, typer.Option("--max-new-tokens", help="At most this many new tokens.")
    ] = 64,
    temperature: Annotated[float, typer.Option("--temperature", help="0: greedy; else sampled.")] = 0.0,
    top_p: Annotated[float, typer.Option("--top-p", help="Sample from the smallest set of this mass.")] = 1.0,
    top_k: Annotated[int, typer.Option("--top-k", help="Sample from the k likeliest tokens (0: all).")] = 0,
    seed: Annotated[
        int, typer.Option("--seed", help="The sampling's seed: the same seed, the same text.")
    ] = 0,
    quiet: _Quiet = False,
    verbose: _Verbose = False,
) -> None:
    """Complete prompts with a model, or with a trained run (a LoRA run's adapter over its base as trained),
    the model streamed as the run streams it: all prompts in one batch, each layer read once a token.

    Prints each completion, one per prompt, in order. Example: tiertune generate runs/demo/out --prompt "The cat"
    """
    _console_log(quiet, verbose)
    with _user_errors():
        from tiertune.finetune.generation import generate_text, load_generator, read_prompts, source_of
        from tiertune.finetune.signals import stop_on_signals
        from tiertune.finetune.train import tokenizer_of

        _imports_settled()
        texts = read_prompts(prompt or (), prompts)
        found = source_of(source, tuple(overrides or ()))
        tokenizer = tokenizer_of(found.model)
        with stop_on_signals() as stop, stop.at_safe_points():
            trainer = load_generator(found, safe_point=stop.check)
            try:
                out = generate_text(
                    trainer, tokenizer, texts, max_new_tokens, temperature, top_p, top_k, seed
                )
            finally:
                trainer.close()
    for text in out:
        typer.echo(text)


@app.command()
def evaluate(
    source: _Source,
    data: Annotated[
        Path, typer.Argument(help="The held-out rows: a .jsonl, .json, .parquet, .csv or .txt file.")
    ],
    overrides: Annotated[
        list[str] | None, typer.Argument(help="Dotted overrides, e.g. data.max_seq_len=2048.")
    ] = None,
    data_format: Annotated[
        str | None,
        typer.Option(
            "--format",
            help="text, alpaca, chat, preference, unpaired_preference, or prompt (a GRPO run's: sampled and "
            "rewarded) (default: the run's data.format, or text).",
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the record as one JSON line.")] = False,
    quiet: _Quiet = False,
    verbose: _Verbose = False,
) -> None:
    """The loss of a model, or of a trained run or checkpoint (a LoRA run's adapter over its base as trained), on
    held-out rows: the eval_loss a run logs (training.eval_strategy), the model streamed as the run streams it; a
    GRPO run's prompts sampled and rewarded by its reward functions (eval_reward).

    Example: tiertune evaluate runs/demo/out held_out.jsonl
    """
    _console_log(quiet, verbose)
    with _user_errors():
        from tiertune.finetune.generation import evaluate_source
        from tiertune.finetune.signals import stop_on_signals

        _imports_settled()
        with stop_on_signals() as stop, stop.at_safe_points():
            record = evaluate_source(source, data, tuple(overrides or ()), data_format, safe_point=stop.check)
    if as_json:
        typer.echo(json.dumps(record))
        return
    if "eval_reward" in record:  # a GRPO run's prompts, sampled and rewarded
        rewards = [k for k in record if k.startswith("eval_rewards/") and k.endswith("/mean")]
        extra = "".join(
            f", {k.removeprefix('eval_rewards/').removesuffix('/mean')} {record[k]:.4f}" for k in rewards
        )
        typer.echo(
            f"eval_reward {record['eval_reward']:.4f} (std {record['eval_reward_std']:.4f}){extra}, eval_loss "
            f"{record['eval_loss']:.4f} over {record['eval_rows']:,} prompts in {record['eval_runtime']:.1f} s"
        )
        return
    loss = record["eval_loss"]
    tokens = record.get("eval_tokens")
    over = (
        f"{record['eval_rows']:,} rows, {tokens:,} tokens"
        if tokens is not None
        else f"{record['eval_rows']:,} {'labelled rows' if 'eval_kl' in record else 'pairs'}"
    )
    metrics = [k for k in record if "/" in k or k == "eval_kl"]  # TRL's metrics of a preference objective
    extra = "".join(f", {k.removeprefix('eval_')} {record[k]:.4f}" for k in metrics)
    perplexity = f" (perplexity {math.exp(loss):.4g})" if tokens is not None and loss < 700 else ""
    typer.echo(f"eval_loss {loss:.4f}{perplexity}{extra} over {over} in {record['eval_runtime']:.1f} s")


_Overwrite = Annotated[
    bool,
    typer.Option("--overwrite", help="Replace --out when it holds a model or a run (the whole directory)."),
]


@app.command()
def export(
    source: Annotated[
        Path, typer.Argument(help="A run directory (training.output_dir) or a checkpoint-<step> in it.")
    ],
    out: Annotated[Path, typer.Option("--out", help="The directory to write.")],
    fmt: Annotated[
        str,
        typer.Option(
            "--format",
            help="hf (a model; a LoRA run's merged into its base), peft (a LoRA run's "
            "adapter), gguf (llama.cpp / Ollama), gguf-lora (a LoRA run's adapter for llama.cpp's --lora) "
            "or auto (peft for a LoRA run, else hf).",
        ),
    ] = "auto",
    gguf_type: Annotated[
        str, typer.Option("--gguf-type", help="The GGUF weights' type: f32, f16, bf16 or q8_0.")
    ] = "f16",
    overwrite: _Overwrite = False,
    quiet: _Quiet = False,
    verbose: _Verbose = False,
) -> None:
    """Write a run or checkpoint for serving: a Hugging Face model (vLLM, SGLang, transformers), a PEFT adapter
    (vLLM --enable-lora), a GGUF file with an Ollama Modelfile (llama.cpp, Ollama), or a GGUF LoRA adapter.

    A LoRA run's hf or gguf export is its adapter merged into the base, streamed tensor by tensor (a
    quantized base dequantized first: what the adapter was trained against). A checkpoint is verified
    against its checksums first. --out must be new or empty (or hold a model or a run that --overwrite
    replaces); it is never the run itself nor the model it trained. The export is written beside --out and
    renamed into place, so it is never left partial.

    Example: tiertune export runs/demo/out --format gguf --out exported/   (then: ollama create demo -f
    exported/Modelfile)
    """
    from tiertune.export.commands import export as run

    _console_log(quiet, verbose)
    with _user_errors():
        path, what = run(source, out, fmt, overwrite, gguf_type)
    first, *notes = what.split("\n")
    typer.echo(f"wrote {first} to {path}")
    for note in notes:
        typer.echo(note)


@app.command()
def merge(
    adapter: Annotated[
        Path, typer.Argument(help="A PEFT adapter directory (a LoRA run's output or checkpoint).")
    ],
    out: Annotated[Path, typer.Option("--out", help="The directory to write the merged model to.")],
    base: Annotated[
        str | None, typer.Option(help="The base model directory (default: the adapter's).")
    ] = None,
    dtype: Annotated[
        str | None,
        typer.Option(help="The merged weights' dtype, e.g. bfloat16 (default: the base model's own dtype)."),
    ] = None,
    overwrite: _Overwrite = False,
    quiet: _Quiet = False,
    verbose: _Verbose = False,
) -> None:
    """Fold a LoRA adapter into its base model and write the merged Hugging Face model.

    The merged weights are written in the base model's dtype (its config's, else its weights') unless --dtype
    says otherwise; the command says which. An adapter trained on a quantized base is added to the
    dequantized base weights, the weights it was trained against; the command says so too.

    Example: tiertune merge runs/llama3-8b-qlora --out merged/
    """
    from tiertune.export.commands import merge as run

    _console_log(quiet, verbose)
    with _user_errors():
        path, what = run(adapter, out, base, dtype, overwrite)
    typer.echo(f"merged: {what}; wrote {path}")


RECIPES = Path(__file__).resolve().parents[1] / "recipes"  # shipped with the package


@app.command()
def recipes(
    name: Annotated[
        str | None, typer.Argument(help="A built-in recipe to print, or to copy with --to (see the list).")
    ] = None,
    to: Annotated[
        Path | None, typer.Option(help="Copy the recipe here (a file or a directory) instead of printing it.")
    ] = None,
) -> None:
    """List the built-in recipes, with their hardware and what `tiertune estimate` predicts; print or copy one.

    Example: tiertune recipes llama3-8b-qlora-24gb > my-recipe.yaml   (or: --to my-recipe.yaml)
    """
    import re
    import textwrap

    found = {p.stem: p for p in sorted(RECIPES.glob("*.yaml"))}
    if name is None:
        columns = max(40, shutil.get_terminal_size().columns - 1)

        def show(text: str) -> None:
            typer.echo(
                textwrap.fill(
                    text,
                    columns,
                    initial_indent="  ",
                    subsequent_indent="    ",
                    break_long_words=False,
                    break_on_hyphens=False,
                )
            )

        from tiertune.config.recipe import recipe_notes

        for stem, path in found.items():
            description, entries = recipe_notes(path)
            typer.echo(stem)
            if description:
                show(description)
            for entry in entries:
                if entry.startswith(("Hardware:", "estimate", "peaks:")):
                    show(entry)
                elif entry.startswith("how fast") and (bound := re.search(r"a step takes >= .*", entry)):
                    show(entry.split(":", 1)[0] + ": " + bound.group(0))
            typer.echo("")
        typer.echo(
            textwrap.fill(
                "`tiertune recipes NAME` prints one (with the whole estimate); --to FILE copies it.",
                columns,
                break_on_hyphens=False,
            )
        )
        return
    if name not in found:
        _usage_error(f"no built-in recipe {name!r}; `tiertune recipes` lists: {', '.join(found)}")
    if to is None:
        typer.echo(found[name].read_text(), nl=False)
        return
    target = to / f"{name}.yaml" if to.is_dir() else to
    if target.exists():
        _usage_error(f"{target} exists; choose another --to")
    try:
        with open(target, "x") as f:  # never over a file made meanwhile
            f.write(found[name].read_text())
    except OSError as exc:
        _usage_error(f"cannot write {target} ({exc.strerror or exc}); choose a writable --to")
    typer.echo(
        f"copied {name} to {target}; edit model.path (and the budgets) before `tiertune train {target}`"
    )


@app.command()
def demo(
    workdir: Annotated[Path, typer.Option(help="Where the demo model, offload files and run go.")] = Path(
        "runs/demo"
    ),
    steps: Annotated[int | None, typer.Option(help="Override training.max_steps.")] = None,
    quiet: _Quiet = False,
    verbose: _Verbose = False,
) -> None:
    """Fine-tune a small random model on the bundled data, on the CPU, with weights and optimizer states on disk.

    Each run starts the demo over (training.overwrite_output_dir); an interrupted one says how to resume it.

    Example: tiertune demo --steps 20
    """
    if steps is not None and steps < 1:
        _usage_error(f"--steps must be >= 1 (the steps to train), got {steps}")
    _console_log(quiet, verbose)
    recipes = RECIPES
    data = recipes / "data" / "demo.jsonl"
    overrides = [
        f"model.path={workdir / 'model'}",
        f"data.path={data}",
        f"training.output_dir={workdir / 'out'}",
        f"offload.disk_path={workdir / 'offload'}",
        "training.overwrite_output_dir=true",
    ]
    if steps is not None:
        overrides.append(f"training.max_steps={steps}")
    with _user_errors():
        from tiertune.cli.demo import make_model
        from tiertune.config.recipe import load_recipe
        from tiertune.finetune.data import read_rows
        from tiertune.finetune.train import train as run

        recipe = load_recipe(recipes / "demo.yaml", tuple(overrides))
        if not (workdir / "model" / "config.json").is_file():
            if not quiet:
                typer.echo(
                    f"making the demo model in {workdir / 'model'} (random weights, tokenizer fitted to the data)"
                )
            make_model(workdir / "model", read_rows(data)["text"], layers=8, hidden=256, tokenizer="bpe")
        result = run(recipe, progress=not quiet)
    _report(result)


def _usage_error(message: str) -> NoReturn:
    """End the command with exit code 2 and one line saying what to change."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


_CONSOLE: list = []  # the console handler, once made


def _console_log(quiet: bool, verbose: bool) -> None:
    """tiertune's log on the console (stderr, above the progress bar): what it did that a user should know
    (checkpoints saved and removed, resumes, fallbacks); with --verbose its debug log too; with --quiet only
    errors."""
    import logging
    import sys

    class AboveBar(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            from tqdm.auto import tqdm

            tqdm.write(self.format(record), file=sys.stderr)

    if not _CONSOLE:
        _CONSOLE.append(AboveBar())
        logging.getLogger("tiertune").addHandler(_CONSOLE[0])
    handler = _CONSOLE[0]
    handler.setFormatter(
        logging.Formatter("%(levelname)s %(name)s: %(message)s" if verbose else "%(message)s")
    )
    level = logging.ERROR if quiet else logging.DEBUG if verbose else logging.INFO
    handler.setLevel(level)
    logging.getLogger("tiertune").setLevel(level)


RANK_ZERO_GRACE_S = 10.0  # how long a silent rank waits before it exits with rank 0's error


def _said_by_rank_zero() -> bool:
    """Whether this process is a rank other than 0 of a launched run that has not joined its process group
    yet: what fails before then (the recipe, its files, the budgets) is read from what every rank shares and
    fails alike on every rank, so rank 0 alone says it."""
    from tiertune.distributed.world import World

    world = World.from_env()
    if world.size == 1 or world.is_main:
        return False
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized())


def _imports_settled() -> None:
    """Move what torch and transformers made at import (millions of objects, none ever garbage) out of the
    cyclic collector's sight (``gc.freeze``): its full collections would scan them again and again while a
    model of a hundred layers is built (``estimate`` of the 70B recipe: 0.83x the time). Done by the heavy
    commands in their own process; the Python API leaves the user's interpreter as it is."""
    import gc

    import torch  # noqa: F401
    import transformers  # noqa: F401

    gc.freeze()


@contextlib.contextmanager
def _user_errors() -> Iterator[None]:
    """Errors a user can fix end the command with exit code 2 and their message, never a traceback; a
    non-finite step with 3; SIGINT/SIGTERM with 128 + the signal, once cleaned up (a run says how to resume).
    Before this block (parsing the command line) SIGTERM keeps its default: nothing has been done yet."""
    from tiertune.errors import Interrupted, NonFiniteError, Signalled, TiertuneError
    from tiertune.finetune.signals import stop_on_signals

    try:
        with stop_on_signals():  # SIGTERM, as Ctrl-C, ends the command through its clean-up
            yield
    except NonFiniteError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(3) from None
    except TiertuneError as exc:
        if _said_by_rank_zero():  # wait for rank 0 to say it: the launcher stops every rank once one exits
            time.sleep(
                RANK_ZERO_GRACE_S
            )  # (SIGTERM's default again here: the launcher ends the wait cleanly)
            raise typer.Exit(2) from None
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    except Interrupted as exc:
        from tiertune.distributed.world import World

        _STOPPED.append(128 + exc.signal)

        if not World.from_env().is_main:  # every rank got the signal: rank 0 says where the run stopped
            raise typer.Exit(128 + exc.signal) from None
        resume = ""
        if exc.recipe is not None and Path(exc.recipe).is_file():
            world = World.from_env()
            command = f"train {exc.recipe} training.resume_from_checkpoint=auto"
            if world.size == 1:
                launcher = "tiertune"
            elif world.local_size == world.size:  # one node
                launcher = f"tiertune launch --standalone --nproc_per_node {world.size}"
            else:
                launcher = f"(your launch of {world.size} processes) -m tiertune.cli"
            resume = f"; resume with: {launcher} {command}"
        typer.echo(f"tiertune: {exc}{resume}", err=True)
        raise typer.Exit(128 + exc.signal) from None
    except KeyboardInterrupt as exc:  # outside a run (loading, checking, exporting): nothing to resume
        signum = exc.signum if isinstance(exc, Signalled) else signal.SIGINT
        typer.echo(f"tiertune: stopped by {signal.Signals(signum).name}", err=True)
        _STOPPED.append(128 + signum)
        raise typer.Exit(128 + signum) from None


def _report(result: Any) -> None:
    what = "adapter" if (result.output_dir / "adapter_config.json").is_file() else "model"
    ran = f"{result.steps} steps" if result.first_step == 1 else f"steps {result.first_step}-{result.steps}"
    loss = f", loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}" if result.losses else ""
    counts = result.optimizer_counts
    during = counts.get("speculative", 0)
    redone = counts.get("redone", 0)
    how = ""
    if during or redone:  # the streamed optimizer overlapped backward: say how often that held
        after = counts.get("after_backward", 0)
        how = f"; optimizer during backward in {during} steps, after it in {redone + after} (clipped: {redone} redone)"
        if after > during:  # most steps followed a clipped one: their updates waited for backward's norm
            how += (
                " (a step after a clipped one updates after backward; offload.delay_update: true runs every update "
                "behind the next step, one step stale)"
            )
    evaluated = result.evaluations
    metric, greater = result.best_metric
    compared = [r for r in evaluated if r.get(metric) is not None]
    if compared:  # the held-out figure the run compares (eval_loss; GRPO's eval_reward): first, last, best
        best = (max if greater else min)(compared, key=lambda r: r[metric])
        how += (
            f"; {metric} {compared[0][metric]:.4f} -> {compared[-1][metric]:.4f} (best "
            f"{best[metric]:.4f} at step {best['step']})"
        )
    rewarded = [r for r in evaluated if r.get("eval_reward") is not None]
    if rewarded and metric != "eval_reward":  # GRPO's: what its held-out prompts' completions earned
        how += f"; eval_reward {rewarded[0]['eval_reward']:.4f} -> {rewarded[-1]['eval_reward']:.4f}"
    if result.stopped_early:
        how += f"; stopped early after step {result.stopped_early} (training.early_stopping_patience)"
    typer.echo(
        f"done: {ran} in {result.seconds:.1f}s{loss}{how}; {what} and {result.log_path.name} in {result.output_dir}"
    )


def _stop_at_once(signum: int, frame: object) -> None:
    """SIGINT or SIGTERM outside a command's work (parsing the command line, printing its result): nothing to
    clean up, so one line and exit 128 + the signal (not Python's KeyboardInterrupt traceback, nor click's
    "Aborted!" with exit 1)."""
    import sys

    print(f"tiertune: stopped by {signal.Signals(signum).name}", file=sys.stderr, flush=True)
    _STOPPED.append(128 + signum)
    raise SystemExit(128 + signum)


_STOPPED: list[int] = []
"""The exit code of a command a signal stopped (once it cleaned up), if one did."""


def _exit_stopped(code: int) -> None:
    """End a command a signal stopped, its clean-up done: the exit handlers run (logs flushed, temporary
    files and child processes ended), then the process exits without the interpreter's teardown, which with
    torch and transformers imported takes over a second on a quiet machine (measured 1.3 s, 2 cores) and
    several on a busy one: a stop must not wait on it."""
    import atexit
    import sys

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def main() -> None:
    """Console-script entry point. Each command's work runs in ``_user_errors``, whose handling of the signals
    (through the command's clean-up) replaces ``_stop_at_once`` for that time."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _stop_at_once)
    # transformers' own warnings (a default token id outside the vocabulary, a setting it fixed up) are not the
    # user's to act on: tiertune says what matters in its own lines; TRANSFORMERS_VERBOSITY=warning shows them
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        app()
    except SystemExit as exc:
        if _STOPPED and exc.code == _STOPPED[-1]:
            _exit_stopped(_STOPPED[-1])
        raise


if __name__ == "__main__":
    main()
