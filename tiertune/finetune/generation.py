"""Text from a model or a trained run (``tiertune generate``): the model streamed as a run streams it (its
recipe's offload settings; a model directory's defaults), prompts tokenized by its tokenizer, decoded in one
batch (``engine.generate``), each completion printed as text; and its loss on held-out rows (``tiertune
evaluate``: ``evaluate_source``, by ``finetune.evaluation``; a GRPO run's held-out prompts sampled and rewarded
by its reward functions, by ``finetune.grpo_evaluation``).

A source is a Hugging Face model directory (or hub id), a run directory (``training.output_dir``) or one of its
``checkpoint-<step>`` directories: a LoRA run's adapter is applied over its base as trained (the base as the
recipe holds it, NF4 for QLoRA; the adapter never merged into it); a full fine-tune's run directory holds its
exported model. Generation stops at the model's EOS tokens (its generation config's, else its tokenizer's)."""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tiertune.config.plan import plan
from tiertune.config.recipe import Recipe, apply_overrides, build, load_recipe
from tiertune.errors import ConfigError, DataError
from tiertune.finetune.checkpoint import RECIPE_FILE
from tiertune.finetune.data import pad_id_of
from tiertune.loading.hub import model_directory


@dataclasses.dataclass(frozen=True)
class Source:
    """What ``tiertune generate`` reads: the model's directory, the recipe to stream it by, and the LoRA adapter's
    directory (None: none)."""

    model: str
    recipe: Recipe
    adapter: Path | None


def source_of(source: str | Path, overrides: Sequence[str] = ()) -> Source:
    """The model, recipe and adapter of a model directory, a run directory or a checkpoint (the module
    docstring); ConfigError saying what the directory lacks."""
    path = Path(source)
    recipe_file = path / RECIPE_FILE
    if recipe_file.is_file():  # a run, or a checkpoint of one
        recipe = load_recipe(recipe_file, tuple(overrides)).with_absolute_paths()
        if recipe.method.type == "lora":
            if not (path / "adapter_model.safetensors").is_file():
                raise ConfigError(
                    f"{path} is a LoRA run without its adapter yet (no adapter_model.safetensors): point "
                    "tiertune generate at one of its checkpoint-<step> directories, or at the run once it ends"
                )
            return Source(model_directory(recipe.model.path), recipe, path)
        if not (path / "config.json").is_file():
            raise ConfigError(
                f"{path} holds no model to generate with (a full fine-tune's checkpoint keeps chunks, not a "
                f"model): export it first (tiertune export {path} --format hf --out DIR), then generate from DIR"
            )
        recipe.model.path = str(path)
        recipe.model.quantize = "none"
        recipe.training.output_dir = f"{path}-generate"  # (nothing is written: not the model's own directory)
        return Source(str(path), recipe, None)
    recipe = build(Recipe, apply_overrides({}, tuple(overrides)), "")
    recipe.model.path = model_directory(str(source))
    return Source(recipe.model.path, recipe, None)


def load_generator(source: Source, safe_point: Callable[[], None] | None = None) -> Any:
    """A trainer over ``source``'s model as its recipe streams it, its adapter loaded (nothing trained)."""
    from tiertune.engine import StreamedTrainer

    planned = source.recipe
    if (
        source.adapter is None and planned.model.quantize != "none"
    ):  # (plan's rule: a quantized base is frozen)
        planned = copy.deepcopy(planned)
        planned.method.type = "lora"
    store, engine = plan(planned)
    if source.adapter is None:
        engine = dataclasses.replace(engine, method="frozen")
    trainer = StreamedTrainer(source.model, store, engine, safe_point=safe_point)
    if source.adapter is not None:
        try:
            trainer.adapters.load(source.adapter)
        except BaseException:
            trainer.close()
            raise
    return trainer


def read_prompts(texts: Sequence[str], file: str | Path | None) -> list[str]:
    """The prompts of ``--prompt`` and of ``--prompts FILE`` (a line each; a ``.jsonl`` file's rows' ``prompt``);
    DataError for a file that cannot be read, ConfigError for none at all."""
    prompts = list(texts)
    if file is not None:
        path = Path(file)
        try:
            lines = path.read_text().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise DataError(f"--prompts {path} cannot be read ({exc})") from None
        if path.suffix == ".jsonl":
            for n, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    prompts.append(str(row["prompt"]))
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise DataError(f"{path}:{n} is not a JSON object with a prompt") from None
        else:
            prompts += [line for line in lines if line.strip()]
    if not prompts:
        raise ConfigError("no prompt: give --prompt TEXT (repeatable) or --prompts FILE")
    return prompts


def generate_text(
    trainer: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
) -> list[str]:
    """Each prompt's completion as text (special tokens left out), decoded in one batch by ``trainer``."""
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    config = getattr(trainer.model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    pad = pad_id_of(tokenizer)
    out = trainer.generate(ids, max_new_tokens, temperature, top_p, top_k, seed, eos, pad)
    return [tokenizer.decode(tokens, skip_special_tokens=True) for tokens in out]


def evaluate_source(
    source: str | Path,
    data_path: str | Path,
    overrides: Sequence[str] = (),
    fmt: str | None = None,
    safe_point: Any = None,
) -> dict[str, float]:
    """The held-out loss of a model, a trained run or one of its checkpoints (``tiertune evaluate``; a source as
    ``tiertune generate`` reads it: a LoRA run's adapter over its base as trained) on the rows of ``data_path``,
    in ``fmt`` (a run's ``data.format``, else ``text``), the model streamed as the run streams it, in its batch
    shapes: the record a run logs (``finetune.evaluation.evaluate``), with ``eval_rows`` (of preference data:
    its pairs) and, but of pairs, ``eval_tokens`` (the tokens scored) added. Preference pairs are scored by the
    run's objective (DPO's reference is the base, the adapter off: a LoRA run's), KTO's labelled rows
    (``unpaired_preference``) by KTO's; other data by cross-entropy.
    ConfigError for what cannot be evaluated."""
    from tiertune.config.recipe import EVAL_FORMATS, EVAL_OBJECTIVES
    from tiertune.finetune.data import load_data
    from tiertune.finetune.evaluation import eval_batches, evaluate, scored_tokens
    from tiertune.finetune.train import tokenizer_of
    from tiertune.settings import ObjectiveSettings

    found = source_of(source, tuple(overrides))
    recipe = copy.deepcopy(found.recipe)
    fmt = fmt or recipe.data.format
    if fmt == "prompt" and recipe.objective.rollouts:  # a GRPO run's prompts: sampled and rewarded
        return _evaluate_prompts(found, recipe, source, data_path, safe_point)
    if fmt not in EVAL_FORMATS:
        raise ConfigError(
            f"--format {fmt}: evaluated are {', '.join(EVAL_FORMATS)} data"
            + (
                " (prompts are sampled and rewarded by a GRPO run's reward functions: set training.eval_strategy "
                "and data.eval_path in its recipe)"
                if fmt == "prompt"
                else ""
            )
        )
    if fmt in ("preference", "unpaired_preference"):
        # the run's objective where it reads this format; a model's pairs (labelled rows): DPO's (KTO's) view
        kind = "kto" if fmt == "unpaired_preference" else "dpo"
        if not (fmt in recipe.objective.data_format and recipe.objective.type in EVAL_OBJECTIVES):
            recipe.objective = ObjectiveSettings(type=kind)
        if recipe.objective.reference and found.adapter is None:
            what = "pairs" if kind == "dpo" else "labelled rows"
            raise ConfigError(
                f"{recipe.objective.type.upper()} scores {what} against a reference: of a LoRA run, its base (the "
                "adapter off); a model or a full fine-tune has none here (its initial weights): evaluate them in "
                "the run (training.eval_strategy: steps), or a LoRA run's adapter"
            )
    else:  # single sequences: their cross-entropy
        recipe.objective = ObjectiveSettings()
    recipe.data.format = fmt
    tokenizer = tokenizer_of(found.model)
    d = recipe.data
    data = load_data(
        data_path,
        tokenizer,
        fmt,
        d.max_seq_len,
        d.add_eos,
        d.skip_bad_rows,
        kl_block=recipe.training.per_device_train_batch_size,
    )
    passes = eval_batches(data, recipe, pad_id_of(tokenizer))
    trainer = load_generator(dataclasses.replace(found, recipe=recipe), safe_point)
    try:
        record = evaluate(trainer, passes, recipe.objective)
    finally:
        trainer.close()
    record["eval_rows"] = len(data)  # (of pairs, its pairs)
    if not recipe.objective.paired:
        record["eval_tokens"] = sum(scored_tokens(b) for g in passes for b in g)
    return record


def _evaluate_prompts(
    found: Source, recipe: Any, source: str | Path, data_path: str | Path, safe_point: Any
) -> dict[str, float]:
    """A GRPO run's (or checkpoint's) record of ``data_path``'s prompts as the run evaluates them
    (``finetune.grpo_evaluation``), by its reward functions, sampled by the streamed model, ``trainer_state``
    its step; with ``eval_rows``, the prompts."""
    from tiertune.distributed.world import World
    from tiertune.finetune.data import load_data
    from tiertune.finetune.grpo import Rollouts
    from tiertune.finetune.grpo_evaluation import evaluate_rollouts
    from tiertune.finetune.train import tokenizer_of

    o, d = recipe.objective, recipe.data
    if o.beta != 0.0 and found.adapter is None:
        raise ConfigError(
            "GRPO's KL term (objective.beta) scores against its reference, the initial weights: a full "
            "fine-tune's are not here; evaluate in the run (training.eval_strategy: steps), or set objective.beta=0"
        )
    tokenizer = tokenizer_of(found.model)
    data = load_data(
        data_path, tokenizer, "prompt", d.max_seq_len - o.max_completion_length, d.add_eos, d.skip_bad_rows
    )
    state = Path(source) / "trainer_state.json"  # the rewards' trainer_state: the source's step
    step = int(json.loads(state.read_text()).get("global_step", 0)) if state.is_file() else 0
    trainer = load_generator(found, safe_point)
    try:
        rollouts = Rollouts(trainer, recipe, data, tokenizer, pad_id_of(tokenizer), World())
        record = evaluate_rollouts(rollouts, data, step)
    finally:
        trainer.close()
    record["eval_rows"] = len(data)
    return record


__all__ = ["Source", "evaluate_source", "generate_text", "load_generator", "read_prompts", "source_of"]
