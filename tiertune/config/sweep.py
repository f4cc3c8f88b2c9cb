"""Several recipes over one base, trained in one run (``tiertune train a.yaml b.yaml``, or a recipe's ``sweep:``
section): each recipe one LoRA adapter, the base streamed once a step for all of them (``engine.several``).

A ``sweep:`` maps dotted settings to lists of values; the recipe stands for every combination of them, each in a
directory of its own under ``training.output_dir`` named by its values (``learning_rate=0.0001,r=8``)::

    sweep:
      training.learning_rate: [1e-4, 2e-4, 4e-4]
      method.lora.r: [8, 16]

Overrides on the command line apply to every recipe (one that sets a swept setting is refused). The recipes must
agree on the base and how it is held (``model``, ``offload``, ``kernels``) and train LoRA adapters; each may
differ in its method settings, data, learning rate and schedule, batch and accumulation, seed and output
directory (``shared_base`` says which setting differs where they do not agree)."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tiertune.config.recipe import Recipe, apply_overrides, build, read_raw
from tiertune.errors import ConfigError

if TYPE_CHECKING:
    from tiertune.config.plan import RunPlan
    from tiertune.engine.config import EngineConfig

SHARED = ("model", "offload", "kernels")
"""The sections every recipe of a run over one base holds alike."""


def load_recipes(paths: list[str | Path], overrides: tuple[str, ...] = ()) -> list[Recipe]:
    """Each recipe of ``paths`` (a ``sweep:`` expanded into one a combination), ``overrides`` applied to every
    one; ConfigError when one cannot be read, a sweep is malformed or an override sets a swept setting."""
    out = []
    for path in paths:
        raw = read_raw(path)
        sweep = raw.pop("sweep", None)
        if sweep is None:
            out.append(build(Recipe, apply_overrides(raw, overrides), ""))
            continue
        for label, settings in expand(sweep, f"recipe {path}"):
            overridden = sorted({o.partition("=")[0].strip() for o in overrides} & {k for k, _ in settings})
            if overridden:
                raise ConfigError(
                    f"{', '.join(overridden)} is swept in recipe {path} (sweep:) and set on the command line; "
                    "drop one"
                )
            one = apply_overrides(copy.deepcopy(raw), overrides)
            for key, value in settings:
                _put(one, key.split("."), value)
            recipe = build(Recipe, one, "")
            recipe.training.output_dir = str(Path(recipe.training.output_dir) / label)
            out.append(recipe)
    return out


def expand(sweep: Any, where: str) -> list[tuple[str, list[tuple[str, Any]]]]:
    """A ``sweep:`` section's combinations, each a directory name and its (dotted setting, value) pairs."""
    if not isinstance(sweep, dict) or not sweep:
        raise ConfigError(
            f"{where}: sweep: must map dotted settings to lists of values, e.g. training.learning_rate: [1e-4, 2e-4]"
        )
    for key, values in sweep.items():
        if not isinstance(key, str) or "." not in key:
            raise ConfigError(
                f"{where}: sweep: {key!r} must be a dotted setting such as training.learning_rate"
            )
        if not isinstance(values, list) or not values:
            raise ConfigError(f"{where}: sweep: {key} must be a non-empty list of values, got {values!r}")
    keys = list(sweep)
    out = []
    for combination in itertools.product(*(sweep[k] for k in keys)):
        label = ",".join(f"{k.rsplit('.', 1)[-1]}={_name(v)}" for k, v in zip(keys, combination, strict=True))
        out.append((label, list(zip(keys, combination, strict=True))))
    return out


def shared_base(recipes: list[Recipe]) -> None:
    """Refuse (ConfigError naming the setting and the recipes' values) recipes that cannot share one base's
    stream: another base or way of holding it, a method other than LoRA, the same output directory twice."""
    first = recipes[0]
    for other in recipes[1:]:
        for section in SHARED:
            a, b = _flat(first.to_dict().get(section)), _flat(other.to_dict().get(section))
            for key in sorted(set(a) | set(b)):
                if a.get(key) != b.get(key):
                    setting = f"{section}.{key}" if key else section
                    raise ConfigError(
                        f"{setting} is {a.get(key)!r} in {first.training.output_dir}'s recipe and {b.get(key)!r} in "
                        f"{other.training.output_dir}'s: recipes trained over one base agree on {', '.join(SHARED)}"
                    )
    for recipe in recipes:
        if recipe.method.type != "lora":
            raise ConfigError(
                f"method.type is {recipe.method.type} in {recipe.training.output_dir}'s recipe: several recipes over one "
                "base each train a LoRA adapter (method.type: lora); run a full fine-tune alone"
            )
    seen: dict[str, int] = {}
    for i, recipe in enumerate(recipes):
        out = str(Path(recipe.training.output_dir).absolute())
        if out in seen:
            raise ConfigError(
                f"recipes {seen[out] + 1} and {i + 1} both write training.output_dir {out}: give each its own"
            )
        seen[out] = i


def shared_engine(runs: list[RunPlan], steps: list[int]) -> EngineConfig:
    """The engine of one run over one base for each of ``runs`` (resolved recipes; ``steps``: each one's): the
    first's settings, each adapter's own (``EngineConfig.others``), the largest micro-batch's tokens and every
    adapter's micro-batches a step (a wave holds them all, the base read once a step, unless the first's plan
    cut its step into waves)."""
    first = runs[0].engine
    whole = first.wave_size in (0, first.gradient_accumulation_steps)
    return dataclasses.replace(
        first,
        max_steps=steps[0],
        wave_size=0 if whole else first.wave_size,
        activation_tokens=max(r.engine.activation_tokens for r in runs),
        gradient_accumulation_steps=sum(r.engine.gradient_accumulation_steps for r in runs),
        others=tuple(
            dataclasses.replace(r.engine, max_steps=n) for r, n in zip(runs[1:], steps[1:], strict=True)
        ),
    )


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: value}


def _put(raw: dict, keys: list[str], value: Any) -> None:
    for key in keys[:-1]:
        raw = raw.setdefault(key, {})
        if not isinstance(raw, dict):
            raise ConfigError(f"sweep: {'.'.join(keys)} goes through a setting that is not a section")
    raw[keys[-1]] = value


def _name(value: Any) -> str:
    """A value as a directory name's part."""
    text = value if isinstance(value, str) else repr(value)
    return re.sub(r"[^A-Za-z0-9._+-]", "_", text)


__all__ = ["SHARED", "expand", "load_recipes", "shared_base"]
