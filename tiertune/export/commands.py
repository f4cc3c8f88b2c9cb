"""Writing models out: Hugging Face directories streamed shard by shard, a checkpoint exported as a model or
an adapter, and a LoRA adapter merged into its base.

Every output is written under a temporary name in the destination, each file fsynced, and moved into place
with the file that marks it complete (the index, or the config) last: an interrupted export never leaves a
directory that looks complete.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from tiertune.errors import ConfigError, DiskFullError
from tiertune.files import fsync_dir, fsync_file
from tiertune.finetune.checkpoint import (
    CHECKSUMS,
    PREFIX,
    RECIPE_FILE,
    STATE_FILE,
    is_disk_full,
    latest_checkpoint,
    read_state,
    verify,
)
from tiertune.finetune.hf_model import write_hf
from tiertune.units import format_size


def _recipe_of(directory: Path) -> Any:
    from tiertune.config.recipe import load_recipe

    candidates = [directory / RECIPE_FILE]
    if _is_checkpoint(directory):  # a checkpoint's own recipe, else its run's
        candidates.append(directory.parent / RECIPE_FILE)
    for candidate in candidates:
        if candidate.is_file():
            return load_recipe(candidate)
    raise ConfigError(
        f"{directory} has no {RECIPE_FILE} (nor its run directory); export a tiertune run or checkpoint"
    )


def _is_checkpoint(path: Path) -> bool:
    return path.name.startswith(PREFIX) or (path / CHECKSUMS).is_file() or (path / "state").is_dir()


def check_out(out: Path, overwrite: bool, protected: list[tuple[Path, str]]) -> None:
    """ConfigError unless ``out`` may receive an export: never one of the ``protected`` directories (the model
    a run trained, the run or adapter being exported), nor a directory around or inside one; never a live run's
    directory; a non-empty directory only when it holds a model or a run and ``overwrite`` says to replace it
    whole (one that holds other files is never replaced)."""
    from tiertune.finetune.rundir import LOCK_FILE, RunDirectory, lock_holder

    target = out.resolve()
    for path, what in protected:
        if not str(path):
            continue
        kept = path.resolve()
        if target == kept or target.is_relative_to(kept) or kept.is_relative_to(target):
            where = "is" if target == kept else "is inside" if target.is_relative_to(kept) else "holds"
            raise ConfigError(f"--out {out} {where} {what}, {path}; write the export to another directory")
    if not out.exists():
        return
    if not out.is_dir():
        raise ConfigError(f"--out {out} is a file; give a directory (new or empty) to write the export to")
    entries = sorted(p.name for p in out.iterdir())
    if not entries:
        return
    holder = lock_holder(out / LOCK_FILE)
    if holder is not None:
        raise ConfigError(
            f"--out {out} is the directory of a live run (pid {holder}); choose another directory"
        )
    run = RunDirectory(out).is_run()
    model = any(n in ("config.json", "adapter_config.json") or n.endswith(".safetensors") for n in entries)
    if not (run or model):
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        raise ConfigError(
            f"--out {out} holds files that are neither a model nor a run ({shown}); write the export to a new or "
            "empty directory"
        )
    if not overwrite:
        what = "a tiertune run" if run else "a model"
        raise ConfigError(
            f"--out {out} holds {what}; choose a new or empty directory, or pass --overwrite to replace it "
            "(the whole directory)"
        )


@contextlib.contextmanager
def _writing(out: Path, needed: int) -> Iterator[Path]:
    """A temporary directory beside ``out`` to write an export into; once the block completes, its files are
    fsynced and it becomes ``out`` (an existing ``out``, which ``check_out`` allowed, is replaced whole). A failure
    leaves ``out`` as it was and nothing else behind; a full disk is a DiskFullError."""
    out = out.absolute()
    parent = out.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(parent).free
    except OSError as exc:
        raise ConfigError(
            f"cannot write to {parent} ({exc.strerror or exc}); choose a writable --out"
        ) from None
    if needed > free:
        raise _no_room(out, needed, free)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=parent))
    except OSError as exc:
        if is_disk_full(exc):
            raise _no_room(out, needed, shutil.disk_usage(parent).free) from None
        raise ConfigError(
            f"cannot write to {parent} ({exc.strerror or exc}); choose a writable --out"
        ) from None
    try:
        yield tmp
        for path in tmp.rglob("*"):
            if path.is_file():
                fsync_file(path)
        fsync_dir(tmp)
        if out.exists() and any(out.iterdir()):  # replaced whole (check_out allowed it)
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.replaced-", dir=parent))
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)  # rename(2) takes the place of an empty directory
        fsync_dir(parent)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(exc):
            raise _no_room(out, needed, shutil.disk_usage(parent).free) from None
        raise


def _no_room(out: Path, needed: int, free: int) -> DiskFullError:
    return DiskFullError(
        f"no room to write {out}: the export needs about {format_size(needed)} and the filesystem has "
        f"{format_size(free)} free; free space there or choose --out on a larger disk (nothing was written)"
    )


FORMATS = ("auto", "hf", "peft", "gguf", "gguf-lora")


def export(
    source: str | os.PathLike[str],
    out: str | os.PathLike[str],
    fmt: str = "auto",
    overwrite: bool = False,
    gguf_type: str = "f16",
) -> tuple[Path, str]:
    """Export a run directory or one of its checkpoints: ``hf`` (a Hugging Face model directory: a full or
    GaLore run's model, or a LoRA run's adapter merged into its base, streamed), ``peft`` (a LoRA run's
    adapter, with what vLLM needs to serve it said), ``gguf`` (one GGUF file for llama.cpp, weights in
    ``gguf_type``, and an Ollama Modelfile beside it) or ``gguf-lora`` (a LoRA run's adapter as a GGUF LoRA,
    for llama.cpp's ``--lora`` over a GGUF of the base); ``auto`` picks ``peft`` for a LoRA run, else ``hf``. A
    checkpoint is verified against its checksums first (IntegrityError naming a damaged file). ``out`` must
    be new or empty, or hold a model or a run that ``overwrite`` replaces whole; it is never the run itself nor
    its model. The export is written beside ``out`` and renamed into place: never partial. Returns the output
    and what was written."""
    from tiertune.formats.gguf import GGUF_TYPES

    source, out = Path(source), Path(out)
    if not source.is_dir():
        raise ConfigError(
            f"{source} does not exist; give a tiertune run directory or a checkpoint-<step> in it"
        )
    checkpoint = _is_checkpoint(source)
    try:
        recipe = _recipe_of(source)
    except ConfigError:
        if checkpoint:  # a damaged recipe.yaml is named as the checkpoint's damage
            verify(source)
        raise
    lora = recipe.method.type == "lora"
    fmt = ("peft" if lora else "hf") if fmt == "auto" else fmt
    if fmt not in FORMATS:
        raise ConfigError(f"--format takes {', '.join(FORMATS)}; got {fmt!r}")
    if fmt in ("peft", "gguf-lora") and not lora:
        raise ConfigError(
            f"{source} is a {recipe.method.type} run, which has no adapter: export it as hf or gguf"
        )
    if gguf_type not in GGUF_TYPES:
        raise ConfigError(f"--gguf-type takes {', '.join(GGUF_TYPES)}; got {gguf_type!r}")
    if fmt.startswith("gguf"):
        from tiertune.formats.gguf import check

        check(recipe.model.path)  # what llama.cpp cannot run is said before anything else
    run_dir = source.parent if checkpoint else source
    check_out(
        out,
        overwrite,
        [
            (Path(recipe.model.path), "the model the run trained (model.path)"),
            (run_dir, "the run being exported"),
        ],
    )
    if checkpoint:
        verify(source)  # a damaged checkpoint never exports as a model
    elif not (source / "adapter_config.json" if lora else source / STATE_FILE).is_file():
        newest = latest_checkpoint(source)
        raise ConfigError(
            f"{source} is a run that has not finished: export one of its checkpoints"
            + (f", e.g. {newest}" if newest else " (it has none yet)")
        )
    if fmt == "peft":
        return out, _export_adapter(source, recipe, out)
    if fmt == "gguf-lora":
        from tiertune.formats.gguf import write_gguf_lora

        with _writing(out, 2 * os.path.getsize(source / "adapter_model.safetensors") + (1 << 20)) as tmp:
            file = tmp / f"adapter-{gguf_type}.gguf"
            write_gguf_lora(source, Path(recipe.model.path), file, gguf_type)
        return out, (
            f"GGUF LoRA adapter ({gguf_type}) of {recipe.model.path}; apply it over a GGUF of that base: "
            f"llama-cli -m BASE.gguf --lora {out / file.name} (Ollama: ADAPTER in a Modelfile)"
        )
    base = Path(recipe.model.path)
    dtype = getattr(torch, base_dtype(base)[0]) if lora else None
    # a finished full run's model is a Hugging Face directory already: a GGUF is converted from it in place
    in_place = fmt == "gguf" and not lora and not checkpoint and bool(_final_model_files(source))
    copies = (fmt == "gguf") + (not in_place)
    needed = (_model_bytes(base, dtype) if lora else _run_model_bytes(source, checkpoint)) * copies
    with _writing(out, needed + (1 << 20)) as tmp:
        hf_dir = source if in_place else tmp if fmt == "hf" else tmp / ".hf"
        if in_place:
            what = "the run's final model"
        elif lora:
            hf_dir.mkdir(exist_ok=True)
            what = _merge_into(source, base, dtype, recipe, hf_dir)
        else:
            hf_dir.mkdir(exist_ok=True)
            what = _model_into(source, recipe, checkpoint, hf_dir)
        if fmt == "gguf":
            from tiertune.export.serving import modelfile
            from tiertune.formats.gguf import write_gguf

            file = tmp / f"model-{gguf_type}.gguf"
            info = write_gguf(hf_dir, file, gguf_type, name=run_dir.name, tokenizer_dir=base)
            if not in_place:
                shutil.rmtree(hf_dir)
            (tmp / "Modelfile").write_text(modelfile(file.name, info))
            return (
                out,
                f"GGUF ({gguf_type}, llama.cpp's {info['architecture']}) of {what}, and an Ollama Modelfile",
            )
    return out, f"Hugging Face model: {what}"


def _export_adapter(source: Path, recipe: Any, out: Path) -> str:
    """Copy a LoRA run's adapter (with its base's tokenizer) to ``out``; says what vLLM needs to serve it."""
    from transformers import AutoTokenizer

    from tiertune.export.serving import vllm_notes

    files = ("adapter_model.safetensors", "adapter_config.json")
    with _writing(out, sum(os.path.getsize(source / f) for f in files)) as tmp:
        for name in files:
            shutil.copy2(source / name, tmp / name)
        AutoTokenizer.from_pretrained(recipe.model.path).save_pretrained(tmp)
    notes = vllm_notes(json.loads((source / "adapter_config.json").read_text()), recipe.model.path, out)
    return f"PEFT adapter of {recipe.model.path}" + "".join(f"\n{n}" for n in notes)


def _run_model_bytes(source: Path, checkpoint: bool) -> int:
    """The bytes of a full or GaLore run's model as it is exported."""
    if not checkpoint:
        return sum(f.stat().st_size for f in source.glob("*.safetensors"))
    from tiertune.finetune.state_index import StateReader

    with StateReader(source, read_state(source / STATE_FILE)) as reader:
        return sum(reader.nbytes(f"weights/{name}") for name in reader.keys("weights"))


def _final_model_files(source: Path) -> list[str]:
    """The files of a finished full or GaLore run's model in its directory; none without its weights."""
    from tiertune.finetune.rundir import model_files

    files = model_files(source)
    return files if any(f.endswith(".safetensors") for f in files) else []


def _model_into(source: Path, recipe: Any, checkpoint: bool, tmp: Path) -> str:
    """Write a full or GaLore run's model (its final export, or a checkpoint's weights) into ``tmp``."""
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(recipe.model.path)
    if not checkpoint:  # the run's final model: its files as they are
        files = _final_model_files(source)
        if not files:
            raise ConfigError(
                f"{source} is a finished run without its model files; export its newest checkpoint"
            )
        for name in files:
            shutil.copy2(source / name, tmp / name)
        tokenizer.save_pretrained(tmp)
        return "the run's final model"
    from tiertune.finetune.state_index import StateReader

    trainer_state = read_state(source / STATE_FILE)
    config = AutoConfig.from_pretrained(recipe.model.path)
    with StateReader(source, trainer_state) as reader:  # whole tensors, whatever the ranks that wrote them
        names = reader.keys("weights")
        write_hf(({name: reader.whole(f"weights/{name}")} for name in names), config, tokenizer, tmp)
    return f"the model at step {trainer_state['global_step']}"


_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def base_dtype(model_dir: str | os.PathLike[str]) -> tuple[str, str]:
    """The dtype a Hugging Face model directory is stored in, and where that was read: its config's ``dtype``
    (``torch_dtype`` before transformers 5), else the floating dtype holding most of its safetensors weights
    (read from the files' headers, nothing loaded), else float32 (what transformers loads by default)."""
    model_dir = Path(model_dir)
    with contextlib.suppress(OSError, ValueError):
        config = json.loads((model_dir / "config.json").read_text())
        for key in ("dtype", "torch_dtype"):
            if isinstance(getattr(torch, str(config.get(key)), None), torch.dtype):
                return str(config[key]), f"its config.json's {key}"
    counts: dict[str, int] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with contextlib.suppress(OSError, ValueError), open(file, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
            for name, info in header.items():
                if name != "__metadata__" and info.get("dtype") in _SAFETENSORS_DTYPES:
                    start, end = info["data_offsets"]
                    dtype = _SAFETENSORS_DTYPES[info["dtype"]]
                    counts[dtype] = counts.get(dtype, 0) + end - start
    if counts:
        return max(counts, key=counts.__getitem__), "its safetensors weights"
    return "float32", "transformers' default: neither its config nor its weights name one"


def merge(
    adapter: str | os.PathLike[str],
    out: str | os.PathLike[str],
    base: str | None = None,
    dtype: str | None = None,
    overwrite: bool = False,
) -> tuple[Path, str]:
    """Fold a LoRA adapter into its base and write the merged model, in ``dtype`` (default: the base model's
    own, see ``base_dtype``). For an adapter trained on a quantized base, the adapter is added to the base's
    dequantized weights, the weights it was trained against. ``out`` as for ``export`` (never the base nor
    the adapter; replaced whole only with ``overwrite``); an adapter that is a checkpoint is verified first.
    The merge streams tensor by tensor (``merging``), the base never whole in memory, except for adapters it
    does not cover, which peft merges in memory. Returns the output and a sentence saying what was merged into
    what, how, and in which dtype it was written."""
    adapter, out = Path(adapter), Path(out)
    if not (adapter / "adapter_config.json").is_file():
        raise ConfigError(f"{adapter} is not a PEFT adapter directory (no adapter_config.json)")
    try:
        base = base or json.loads((adapter / "adapter_config.json").read_text()).get(
            "base_model_name_or_path"
        )
    except ValueError as exc:
        raise ConfigError(f"{adapter / 'adapter_config.json'} is not valid JSON ({exc})") from None
    if not base or not (Path(base) / "config.json").is_file():
        raise ConfigError(f"the adapter's base model {base!r} is not a local model directory; pass --base")
    protected = [(Path(base), "the base model"), (adapter, "the adapter")]
    if _is_checkpoint(adapter):
        protected.append((adapter.parent, "the adapter's run"))
    check_out(out, overwrite, protected)
    if _is_checkpoint(adapter) and (adapter / STATE_FILE).is_file():
        verify(adapter)
    recipe = None
    with contextlib.suppress(ConfigError):  # an adapter from elsewhere: no recipe, an unquantized base
        recipe = _recipe_of(adapter)
    if dtype is None:
        dtype, source = base_dtype(base)
        written = f"written in {dtype}, the base model's dtype ({source}; --dtype to change)"
    else:
        written = f"written in {dtype} (as asked)"
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ConfigError(f"--dtype must be a torch dtype such as bfloat16 or float32, got {dtype!r}")
    with _writing(out, _model_bytes(Path(base), torch_dtype) + (1 << 20)) as tmp:
        what = _merge_into(adapter, Path(base), torch_dtype, recipe, tmp)
    return out, f"{what}; {written}"


def _model_bytes(model_dir: Path, dtype: torch.dtype) -> int:
    """The bytes of ``model_dir``'s weights written in ``dtype`` (its quantized ones unpacked)."""
    from tiertune.loading.weights import Checkpoint

    entries = Checkpoint(model_dir).entries.values()  # uint8: bitsandbytes' 4-bit codes, two a byte
    return sum(
        e.nbytes // e.dtype.itemsize * (1 + (e.dtype == torch.uint8)) * dtype.itemsize for e in entries
    )


def _merge_into(adapter: Path, base: Path, dtype: torch.dtype, recipe: Any, tmp: Path) -> str:
    """Write the merge of ``adapter`` into ``base`` into directory ``tmp``, in ``dtype``: streamed, or by peft
    in memory for what the stream does not cover. Returns what was merged into what, and how."""
    from tiertune.export.merging import plan_merge

    quantize = recipe.model.quantize if recipe is not None else "none"
    # a quantized base is quantized from the dtype the run loaded it in (what the adapter saw)
    loaded = getattr(torch, recipe.model.dtype, dtype) if recipe is not None else dtype
    plan = plan_merge(adapter, base, quantize, loaded)
    how = ""
    if isinstance(plan, str):
        quantize = _merge_in_memory(adapter, tmp, str(base), dtype, quantize)
        how = f"; merged by peft in memory, the whole model at once (not streamed: {plan})"
    else:
        quantize = plan.quant.settings()["quantize"] if plan.quant is not None else "none"
        _merge_streamed(plan, adapter, tmp, base, dtype)
    if quantize != "none":
        return f"the adapter added to the dequantized {quantize} weights of {base} (what it was trained against){how}"
    return f"the adapter added to the weights of {base}{how}"


def _merge_streamed(plan: Any, adapter: Path, tmp: Path, base: Path, dtype: torch.dtype) -> None:
    """Write the merge of ``plan`` (``merging.plan_merge``) into ``tmp``, one tensor at a time, with the base's
    config (unquantized, in ``dtype``), generation config and the adapter's tokenizer (else the base's)."""
    from transformers import AutoConfig, AutoTokenizer

    from tiertune.export.merging import write_merged

    write_merged(plan, base, adapter, dtype, tmp)
    config = AutoConfig.from_pretrained(base)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = dtype
    config.save_pretrained(tmp)
    if (base / "generation_config.json").is_file():
        shutil.copy2(base / "generation_config.json", tmp / "generation_config.json")
    AutoTokenizer.from_pretrained(
        adapter if (adapter / "tokenizer_config.json").is_file() else base
    ).save_pretrained(tmp)


def _merge_in_memory(adapter: Path, tmp: Path, base: str, torch_dtype: torch.dtype, quantize: str) -> str:
    """peft's ``merge_and_unload`` on the whole base in memory (what the streamed merge does not cover), written
    into ``tmp``; returns the base's quantization."""
    from peft import PeftModel
    from transformers import AutoConfig, AutoTokenizer

    from tiertune.loading.model import model_class
    from tiertune.methods.lora import peft_wrapping
    from tiertune.quant import make_quantizer, saved_quantization
    from tiertune.quant.experts import round_trip

    kwargs: dict[str, Any] = {}
    saved = saved_quantization(AutoConfig.from_pretrained(base), base)
    if saved is not None:  # a pre-quantized base (bnb-4bit): transformers loads it as saved
        quantize = saved["kind"]
    elif quantize != "none":
        kwargs["quantization_config"] = make_quantizer(quantize, torch_dtype).config()  # type: ignore[union-attr]
    cls = model_class(AutoConfig.from_pretrained(base))  # the class the run trained (a multimodal one's own)
    model = cls.from_pretrained(base, dtype=torch_dtype, device_map="cpu", **kwargs)
    if quantize != "none":
        model = model.dequantize()
        model.to(torch_dtype)
        # transformers leaves MoE experts unquantized; tiertune trained on them 4-bit (tiertune.quant.experts)
        quant = make_quantizer(quantize, torch_dtype, saved, base)
        round_trip(model, quant)
    with peft_wrapping():
        merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    merged.config.quantization_config = None
    if hasattr(merged, "hf_quantizer"):
        merged.hf_quantizer = None
        merged.is_quantized = False
    merged.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(
        adapter if (adapter / "tokenizer_config.json").is_file() else Path(base)
    ).save_pretrained(tmp)
    return quantize
