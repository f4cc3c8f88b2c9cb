"""GRPO's rollouts (``objective.type: grpo``, TRL 1.16's ``GRPOTrainer`` names and rules): the stream of a run's
micro-batches made from its prompts by the model being trained.

Every ``num_iterations`` steps a generation batch is sampled: the step's ``per_device_train_batch_size x
gradient_accumulation_steps`` completions on each process (times the steps a generation feeds, TRL's
``steps_per_generation`` or ``generation_batch_size``: ``steps_a_generation``), ``num_generations`` of each of its
prompts (the next prompts of the data, in the run's seeded order, each step's split over the processes), decoded
in one batch by the streamed model
(``StreamedTrainer.generate``: the weights read once per decoded token for all of them, LoRA applied as in
training), each completion from a generator seeded by the run's seed, the generation's number and its own (a
resumed run samples what the uninterrupted one did, a launch of any number of processes what one does). The reward
functions score each completion (TRL's signature: ``prompts``, ``completions``, ``completion_ids``, the data's
other columns as keyword arguments, ``trainer_state``, ``log_extra``, ``log_metric``), the advantages follow
(``engine.grpo.advantages``), and the batch is cut into the step's micro-batches in order: each row its prompt then
its completion (right-padded; the targets are the completion's tokens), with its ``advantages``; a full fine-tune's
KL term has each micro-batch's reference figures scored then (``ref_logps``:
``finetune.reference.ReferenceBeside``, the initial weights beside the policy, once a generation). A generation
trains ``num_iterations`` steps; from its second, each micro-batch carries the ``old_logps`` its first step found
(the policy that sampled it: no pass of the weights beyond the steps' own); a generation that feeds several steps
has them from a pass of the layers over its micro-batches when it is sampled (``old_policy``, TRL's forward at
generation time), and ``dapo``'s normaliser a step's share of its tokens (``items``). The generation's metrics go
in its first micro-batch (``METRICS_KEY``), with TRL's names; a sample of its completions is appended to
``completions.jsonl`` in the run directory."""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import math
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from tiertune.distributed.world import World
from tiertune.engine.grpo import advantages
from tiertune.errors import ConfigError, DataError
from tiertune.files import write_text_atomically
from tiertune.finetune.data import prompt_of
from tiertune.finetune.served import SERVED_KEY
from tiertune.kernels.ops.linear_ce import IGNORE_INDEX

log = logging.getLogger("tiertune.grpo")

METRICS_KEY = "rollout_metrics"
"""The key of a generation's first micro-batch holding its metrics (``reward``, ``rewards/<function>/mean``, ...)."""
SAMPLES_FILE = "completions.jsonl"
"""Where a run appends a sample of each generation's completions (one JSON line each)."""
SAMPLES = 8
"""The completions of a generation written to ``SAMPLES_FILE``."""
KEPT = (
    "input_ids",
    "attention_mask",
    "labels",
    "advantages",
    "num_tokens",
    "logps",
    "old_logps",
    "ref_logps",
    "items",
)
"""What a checkpoint keeps of a generation's micro-batches (``Rollouts.state``)."""
NOT_COLUMNS = ("prompt", "completion", "completion_ids", "input_ids", "labels")
"""A prompt row's fields that are not passed to the reward functions as columns (TRL's, and tiertune's own)."""


@dataclass
class RewardFunctions:
    """The recipe's reward functions (``objective.reward_funcs``), their names (for their metrics) and weights."""

    functions: list[Callable[..., Sequence[float | None]]]
    names: list[str]
    weights: torch.Tensor

    @classmethod
    def load(
        cls, names: Sequence[str], weights: Sequence[float] | None = None, device: torch.device | None = None
    ) -> RewardFunctions:
        """Each ``module:function`` (imported with the directory tiertune runs in on the Python path),
        ``path/to/file.py:function``, or a reward model's directory or hub id (``RewardModel``, on ``device``); a
        ConfigError that names what cannot be found."""
        functions: list[Callable[..., Sequence[float | None]]] = [
            reward_function(name) if ":" in name else RewardModel(name, device or torch.device("cpu"))
            for name in names
        ]
        w = torch.tensor(
            list(weights) if weights is not None else [1.0] * len(functions), dtype=torch.float32
        )
        return cls(
            functions, [getattr(f, "__name__", name) for f, name in zip(functions, names, strict=True)], w
        )


class RewardModel:
    """A sequence-classification model as a reward function (TRL's ``reward_funcs`` entry that names a model):
    ``AutoModelForSequenceClassification`` with one label, on ``device`` (the run's compute device: held beside
    the streamed model, outside its budgets), scoring each prompt and completion by its first logit, the text
    joined (a conversation through the model's chat template) and tokenized by the model's own tokenizer
    without special tokens, right-padded (its EOS the pad where it has none), as TRL scores them. Its name (the
    metrics') is the path's last part, TRL's."""

    def __init__(self, name: str, device: torch.device) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from tiertune.loading.hub import model_directory

        directory = model_directory(name)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(directory)
            self.model = AutoModelForSequenceClassification.from_pretrained(directory, num_labels=1)
        except (OSError, ValueError, KeyError) as exc:
            raise ConfigError(
                f"objective.reward_funcs: {name!r} is neither module:function nor a reward model (a "
                f"sequence-classification model's directory with its tokenizer): {str(exc).splitlines()[0]}"
            ) from None
        self.model.to(device).eval()
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model.config.get_text_config().pad_token_id = self.tokenizer.pad_token_id
        self.device = device
        self.__name__ = name.rstrip("/").split("/")[-1]

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any) -> list[float]:
        """Each completion's reward: the model's score of its prompt and it."""
        if isinstance(prompts[0], str):
            texts = [p + c for p, c in zip(prompts, completions, strict=True)]
        else:
            texts = [
                self.tokenizer.apply_chat_template(list(p) + list(c), tokenize=False)
                for p, c in zip(prompts, completions, strict=True)
            ]
        inputs = self.tokenizer(
            text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False
        ).to(self.device)
        with torch.inference_mode():
            return self.model(**inputs).logits[:, 0].float().cpu().tolist()


def reward_function(name: str) -> Callable[..., Sequence[float | None]]:
    """The callable ``module:function`` or ``path/file.py:function`` names (a ConfigError where it is not one)."""
    where, _, attr = name.rpartition(":")
    if not where or not attr:
        raise ConfigError(f"objective.reward_funcs: {name!r} is not module:function or path/file.py:function")
    try:
        if where.endswith(".py"):
            path = Path(where).expanduser().resolve()
            if not path.is_file():
                raise ConfigError(f"objective.reward_funcs: {name!r}: no file {path}")
            spec = importlib.util.spec_from_file_location(f"tiertune_rewards_{path.stem}", path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            here = str(Path.cwd())
            if here not in sys.path:
                sys.path.insert(0, here)
            module = importlib.import_module(where)
    except ConfigError:
        raise
    except Exception as exc:  # the user's module: whatever it raises on import
        raise ConfigError(
            f"objective.reward_funcs: {name!r}: importing {where} failed ({type(exc).__name__}: {exc})"
        ) from None
    function = getattr(module, attr, None)
    if not callable(function):
        raise ConfigError(f"objective.reward_funcs: {name!r}: {where} has no function {attr!r}")
    return function


@dataclass
class Generation:
    """A generation batch of this process: its prompts (each ``num_generations`` times in a row), their ids, the
    completions' ids, rewards and advantages."""

    rows: list[dict[str, Any]]
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    truncated: list[bool]
    advantages: torch.Tensor
    rewards: torch.Tensor  # [completions, functions]
    completions: list[Any]
    metrics: dict[str, float] = field(default_factory=dict)
    served: list[list[float]] | None = None  # a server's: each completion's first matching tokens'


def steps_a_generation(recipe: Any, ranks: int) -> int:
    """The optimizer steps each generation feeds (TRL's ``steps_per_generation`` micro-batches, or its
    ``generation_batch_size`` completions over the ``ranks``' micro-batches, in whole steps; 1: a generation a
    step, TRL's default); a ConfigError where they are no whole number of steps."""
    o, t = recipe.objective, recipe.training
    accumulated = t.gradient_accumulation_steps
    micro = o.steps_per_generation or accumulated
    if o.generation_batch_size is not None:
        per_micro = t.per_device_train_batch_size * ranks
        if o.generation_batch_size % per_micro:
            raise ConfigError(
                f"objective.generation_batch_size {o.generation_batch_size} must be a multiple of "
                f"per_device_train_batch_size x processes ({per_micro}): each micro-batch's completions whole"
            )
        micro = o.generation_batch_size // per_micro
    if micro % accumulated or micro < accumulated:
        raise ConfigError(
            f"a generation of {micro} micro-batches a process (objective.steps_per_generation or "
            f"generation_batch_size) must feed whole steps of gradient_accumulation_steps {accumulated}: set a "
            "multiple of it"
        )
    return micro // accumulated


def prompt_order(count: int, shuffle: bool, seed: int) -> Iterator[int]:
    """The data's prompt indices epoch after epoch, each epoch in its own seeded order (or in order)."""
    epoch = 0
    while True:
        if shuffle:
            g = torch.Generator().manual_seed(seed + epoch)
            yield from torch.randperm(count, generator=g).tolist()
        else:
            yield from range(count)
        epoch += 1


def generation_seed(seed: int, generation: int, completion: int) -> int:
    """The sampling seed of a run's ``generation``-th batch's ``completion``-th completion, counted over the
    processes (the same on resume, and on any number of processes)."""
    return ((seed * 1_000_003 + generation) * 1_000_033 + completion) % (1 << 62)


class Rollouts:
    """The run's micro-batches made by sampling: ``steps()`` yields each step's micro-batch dicts (the
    ``StreamedTrainer.step`` contract; see the module docstring)."""

    def __init__(
        self,
        trainer: Any,
        recipe: Any,
        data: Any,
        tokenizer: Any,
        pad_id: int,
        world: World,
        samples: Path | None = None,
        rewards: RewardFunctions | None = None,
        sampler: Any = None,
    ) -> None:
        o, t = recipe.objective, recipe.training
        # a full fine-tune's KL term: the initial weights beside it (``ReferenceBeside``, set once the rest is)
        self.reference: Any = None
        self.trainer, self.recipe, self.data, self.tokenizer = trainer, recipe, data, tokenizer
        # who samples: the streamed model, or a served copy (``finetune.served.ServedSampler``, called alike)
        self.sampler = sampler if sampler is not None else trainer.generate
        self.objective, self.world, self.pad_id, self.samples = o, world, pad_id, samples
        self.rewards = rewards or RewardFunctions.load(
            o.reward_funcs or [], o.reward_weights, getattr(trainer, "device", None)
        )
        self.completions = t.per_device_train_batch_size * t.gradient_accumulation_steps  # a step's
        self.spans = steps_a_generation(recipe, world.size)  # the optimizer steps a generation feeds
        self.prompts = (
            self.spans * self.completions // o.num_generations
        )  # this process's prompts a generation
        config = getattr(trainer.model, "generation_config", None)
        eos = getattr(config, "eos_token_id", None)
        if eos is None:
            eos = tokenizer.eos_token_id
        self.eos = {eos} if isinstance(eos, int) else set(eos or ())
        self.tokens_seen = 0
        self.current: tuple[int, list[dict[str, Any]]] | None = None  # the generation being trained
        if o.loss_type == "luspo" and o.importance_sampling_level != "sequence":  # TRL's warnings
            log.warning("objective.loss_type luspo is the paper's with importance_sampling_level: sequence")
        if o.importance_sampling_level == "sequence" and o.loss_type in ("bnpo", "dr_grpo", "dapo", "cispo"):
            log.warning(
                "objective.importance_sampling_level sequence with loss_type %s sums the tokens' terms: each "
                "completion weighs as its length; GSPO's setup is loss_type: grpo",
                o.loss_type,
            )

    def steps(self, first: int = 0, resumed: dict[str, Any] | None = None) -> Iterator[list[dict[str, Any]]]:
        """Each step's micro-batches from step ``first`` (0: the run's start; a resumed run's checkpoint step),
        ``resumed`` the generation in progress its checkpoint holds (``state``): the steps left of it train on
        it as the uninterrupted run did (without it, that generation is sampled again)."""
        o, t = self.objective, self.recipe.training
        order = prompt_order(len(self.data), self.recipe.data.shuffle, t.seed)
        span = self.spans * o.num_iterations  # the steps a generation trains
        generation = first // span
        per_generation = self.prompts * self.world.size
        for _ in range(generation * per_generation):  # the prompts the generations before took
            next(order)
        step = first
        kept = None
        if resumed is not None:
            self.tokens_seen = int(resumed.get("tokens_seen", 0))
            if resumed.get("generation") == generation and first % span:
                kept = resumed["micro"]  # (another generation's: a recipe whose iterations or span changed)
        while True:
            chosen = [next(order) for _ in range(per_generation)]
            mine, places = self.share(chosen)
            if kept is not None:
                micro, kept = kept, None
            else:
                batch = self.generate(mine, generation, step, places)
                micro = self.micro_batches(batch)
                # a served policy is checked by the step it sampled for
                for later in self.step_groups(micro)[1:]:
                    for mb in later:
                        mb.pop(SERVED_KEY, None)
                if self.spans > 1:  # the later steps train a moved policy: the sampling one's figures
                    batch.metrics["old_logps_seconds"] = self.old_policy(micro)
                    # dapo's and cispo's normaliser: the generation's completion tokens over the processes, a
                    # step's share of them (TRL's), not the step's own
                    tokens = sum(int((mb["labels"][:, 1:] != IGNORE_INDEX).sum()) for mb in micro)
                    every = float(self._gathered(torch.tensor([float(tokens)])).sum())
                    for mb in micro:
                        mb["items"] = every / self.spans
                if self.reference is not None:  # scored once: the reference and the completions stay
                    spent = self.reference.seconds
                    for group in self.step_groups(micro):  # a step's micro-batches a pass
                        self.reference.score(group)
                    batch.metrics["reference_seconds"] = round(self.reference.seconds - spent, 4)
                micro[0][METRICS_KEY] = batch.metrics
            self.current = (generation, micro)
            groups = self.step_groups(micro)
            for at in range(step % span, span):
                iteration, part = divmod(at, self.spans)
                step_micro = groups[part]
                if iteration:  # the policy that sampled them: what its first step found
                    for mb in step_micro:
                        # (a run resumed inside the generation sampled it again: its first step is this one)
                        if "old_logps" not in mb and "logps" in mb:
                            mb["old_logps"] = mb["logps"]
                        mb.pop(METRICS_KEY, None)
                yield step_micro
                step += 1
            generation += 1

    def old_policy(self, micro: list[dict[str, Any]]) -> float:
        """Each micro-batch's completion tokens' log-probabilities under the policy that sampled them
        (``old_logps``), in passes of a step's micro-batches without autograd (TRL's forward at generation
        time when a generation feeds several steps); its seconds."""
        from tiertune.engine.grpo import token_logps_head

        began = time.perf_counter()
        head = token_logps_head(self.objective.temperature)
        for group in self.step_groups(micro):
            for mb, logps in zip(group, self.trainer.sequence_logps(group, head), strict=True):
                mb["old_logps"] = logps
        return round(time.perf_counter() - began, 4)

    def step_groups(self, micro: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
        """``micro`` in groups of a step's micro-batches (``gradient_accumulation_steps``; the last may hold
        fewer): what a step trains, and what a pass of the layers without autograd takes."""
        accumulated = self.recipe.training.gradient_accumulation_steps
        return [micro[at : at + accumulated] for at in range(0, len(micro), accumulated)]

    def share(self, chosen: Sequence[int]) -> tuple[list[int], list[int]]:
        """This process's prompts of a generation's (``chosen``, in order) and the place of each of its
        completions among the generation's: each step the generation feeds trains the next of its prompts, split
        over the processes in rank order (TRL's layout), so that a launch of any number of processes trains
        each step on the prompts one process does."""
        per_step = self.prompts // self.spans  # this process's prompts a step
        width = per_step * self.world.size  # a step's prompts, over the processes
        mine: list[int] = []
        places: list[int] = []
        for part in range(self.spans):
            start = part * width + self.world.rank * per_step
            mine += chosen[start : start + per_step]
            first = start * self.objective.num_generations
            places += range(first, first + per_step * self.objective.num_generations)
        return mine, places

    def generate(
        self, indices: Sequence[int], generation: int, step: int, places: Sequence[int] | None = None
    ) -> Generation:
        """This process's completions of the prompts at ``indices`` (each ``num_generations`` times), scored;
        ``places``: each completion's among the generation's (``share``; None: this process's block, in
        order)."""
        o = self.objective
        rows = [self.data.rows[i] for i in indices for _ in range(o.num_generations)]
        if places is None:
            places = range(self.world.rank * len(rows), (self.world.rank + 1) * len(rows))
        # each completion its own generator: the same completions on any number of processes
        seeds = [generation_seed(self.recipe.training.seed, generation, place) for place in places]
        prompt_ids, completion_ids, prompts, completions, truncated = self.sample(rows, seeds)
        extra_metrics: dict[str, list[float]] = {}
        logged: dict[str, list[Any]] = {}
        rewards = self.score(rows, prompts, completions, completion_ids, step, extra_metrics, logged)
        everything = self._gathered(rewards)
        adv, metrics = advantages(
            everything,
            self.rewards.weights,
            o.num_generations,
            o.scale_rewards,
            o.multi_objective_aggregation,
        )
        per_rank = len(rows)
        adv = adv[self.world.rank * per_rank : (self.world.rank + 1) * per_rank]
        metrics = self.named(metrics, extra_metrics)
        metrics.update(self.completion_metrics(prompt_ids, completion_ids, truncated))
        batch = Generation(rows, prompt_ids, completion_ids, truncated, adv, rewards, completions, metrics)
        batch.served = getattr(self.sampler, "served", None)  # a server's log-probabilities, to check
        self.write_samples(batch, prompts, {"step": step + 1}, logged)
        return batch

    def sample(
        self, rows: Sequence[dict[str, Any]], seeds: Sequence[int]
    ) -> tuple[list[list[int]], list[list[int]], list[Any], list[Any], list[bool]]:
        """Each row's prompt completed by the sampler (the row's generator seeded by its of ``seeds``): the
        prompts' ids, the completions' ids, the prompts and completions as the reward functions take them
        (strings, or conversations), and whether each completion was cut at ``max_completion_length``."""
        o = self.objective
        prompt_ids = [list(r["input_ids"]) for r in rows]
        completion_ids = self.sampler(
            prompt_ids,
            o.max_completion_length,
            o.temperature,
            o.top_p,
            o.top_k,
            list(seeds),
            sorted(self.eos),
            self.pad_id,
        )
        texts = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        prompts = [prompt_of(r) for r in rows]
        conversational = not isinstance(prompts[0], str)
        completions: list[Any] = (
            [[{"role": "assistant", "content": text}] for text in texts] if conversational else texts
        )
        # TRL's rule: a completion is truncated unless its last token is an EOS token or the pad token
        ended = self.eos | {self.pad_id}
        truncated = [not ids or ids[-1] not in ended for ids in completion_ids]
        return prompt_ids, completion_ids, prompts, completions, truncated

    def score(
        self,
        rows: list[dict[str, Any]],
        prompts: list[Any],
        completions: list[Any],
        completion_ids: list[list[int]],
        step: int,
        metrics: dict[str, list[float]],
        logged: dict[str, list[Any]],
    ) -> torch.Tensor:
        """Each reward function's reward of each completion ([completions, functions]; NaN where one returned
        None), called as TRL calls them."""
        columns = {k: [r[k] for r in rows] for k in rows[0] if k not in NOT_COLUMNS}
        state = SimpleNamespace(global_step=step, max_steps=self.recipe.training.max_steps)
        out = torch.zeros(len(rows), len(self.rewards.functions))
        for i, (function, name) in enumerate(zip(self.rewards.functions, self.rewards.names, strict=True)):
            try:
                given = function(
                    prompts=prompts,
                    completions=completions,
                    completion_ids=completion_ids,
                    trainer_state=state,
                    log_extra=lambda column, values: logged.setdefault(column, []).extend(values),
                    log_metric=lambda metric, value: metrics.setdefault(metric, []).append(float(value)),
                    **columns,
                )
            except Exception as exc:  # the user's function
                raise DataError(f"the reward function {name} raised {type(exc).__name__}: {exc}") from exc
            given = list(given)
            if len(given) != len(rows):
                raise DataError(
                    f"the reward function {name} returned {len(given)} rewards for {len(rows)} completions: "
                    "return one per completion (None where it does not apply)"
                )
            out[:, i] = torch.tensor([math.nan if r is None else float(r) for r in given])
        return out

    def named(self, metrics: dict[str, float], logged: dict[str, list[float]]) -> dict[str, float]:
        """``advantages``' metrics with each reward function's by its name (TRL's ``rewards/<name>/mean``), and
        the mean of each metric the functions logged (``log_metric``)."""
        out = dict(metrics)
        for i, name in enumerate(self.rewards.names):
            out[f"rewards/{name}/mean"] = out.pop(f"rewards/{i}/mean")
            out[f"rewards/{name}/std"] = out.pop(f"rewards/{i}/std")
        for name, values in logged.items():
            out[name] = sum(values) / len(values)
        return out

    def _gathered(self, values: torch.Tensor) -> torch.Tensor:
        """The generation's ``values`` (a row a completion) of every process, in rank order (this process's
        alone: one process)."""
        if self.world.size == 1:
            return values
        import torch.distributed as dist

        parts: list[Any] = [None] * self.world.size
        dist.all_gather_object(parts, values)
        return torch.cat(parts)

    def completion_metrics(
        self,
        prompt_ids: list[list[int]],
        completion_ids: list[list[int]],
        truncated: list[bool],
        trained: bool = True,
    ) -> dict[str, float]:
        """TRL's ``completions/...`` metrics and ``num_tokens`` (every process's completions, as TRL gathers
        them); not ``trained`` (an evaluation's, the same on every process): of these completions alone, the
        tokens seen not counted."""
        mine = torch.tensor(
            [
                [len(c), float(t), len(p) + len(c)]
                for p, c, t in zip(prompt_ids, completion_ids, truncated, strict=True)
            ],
            dtype=torch.float64,
        )
        every = self._gathered(mine) if trained else mine
        lengths, clipped = every[:, 0].float(), every[:, 1].bool()
        done = lengths[~clipped]
        done = done if len(done) else torch.zeros(1)
        counted = {}
        if trained:
            self.tokens_seen += int(every[:, 2].sum())
            counted["num_tokens"] = float(self.tokens_seen)
        return {
            **counted,
            "completions/mean_length": float(lengths.mean()),
            "completions/min_length": float(lengths.min()),
            "completions/max_length": float(lengths.max()),
            "completions/clipped_ratio": float(clipped.float().mean()),
            "completions/mean_terminated_length": float(done.mean()),
            "completions/min_terminated_length": float(done.min()),
            "completions/max_terminated_length": float(done.max()),
        }

    def micro_batches(self, batch: Generation) -> list[dict[str, Any]]:
        """The generation's rows cut into the step's micro-batches, in order (the module docstring)."""
        size = self.recipe.training.per_device_train_batch_size
        masked = self.objective.mask_truncated_completions
        out = []
        for start in range(0, len(batch.rows), size):
            rows = range(start, min(start + size, len(batch.rows)))  # (an evaluation's last: fewer)
            seqs = [batch.prompt_ids[r] + batch.completion_ids[r] for r in rows]
            width = max(len(s) for s in seqs)
            ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
            for k, r in enumerate(rows):
                p, c = len(batch.prompt_ids[r]), len(batch.completion_ids[r])
                ids[k, : p + c] = torch.tensor(seqs[k], dtype=torch.long)
                mask[k, : p + c] = 1
                if not (masked and batch.truncated[r]):
                    labels[k, p : p + c] = torch.tensor(batch.completion_ids[r], dtype=torch.long)
            out.append(
                {
                    "input_ids": ids,
                    "attention_mask": mask,
                    "labels": labels,
                    "advantages": batch.advantages[start : start + len(rows)].clone(),
                    "num_tokens": int(mask.sum()),
                }
            )
            if batch.served is not None:
                out[-1][SERVED_KEY] = [(len(batch.prompt_ids[r]), batch.served[r]) for r in rows]
        return out

    def state(self, next_step: int) -> dict[str, Any]:
        """What a checkpoint written before step ``next_step`` keeps of the rollouts: the tokens seen and, when
        that step trains the generation in progress again, its number and micro-batches (their tokens,
        advantages and the old policy's log-probabilities)."""
        out: dict[str, Any] = {"tokens_seen": self.tokens_seen}
        if next_step % (self.spans * self.objective.num_iterations) and self.current is not None:
            generation, micro = self.current
            out["generation"] = generation
            out["micro"] = [{k: v for k, v in mb.items() if k in KEPT} for mb in micro]
        return out

    def after_step(self, micro: Sequence[dict[str, Any]]) -> dict[str, float]:
        """After a step on ``micro``: a served sampler's check of its log-probabilities (its metrics)."""
        check = getattr(self.sampler, "check", None)
        return check(micro) if check is not None else {}

    def close(self) -> None:
        """End a served sampler's server; free the reference's store."""
        close = getattr(self.sampler, "close", None)
        try:
            if close is not None:
                close()
        finally:
            if self.reference is not None:
                self.reference.close()
                self.reference = None

    def keep_samples(self, last_step: int) -> None:
        """``SAMPLES_FILE`` cut to the generations of steps up to ``last_step`` (a resumed run writes the later
        ones again), by a temporary file renamed over it."""
        if self.samples is None or not self.samples.is_file():
            return
        lines = self.samples.read_text().splitlines(keepends=True)
        kept = [line for line in lines if line.strip() and json.loads(line).get("step", 0) <= last_step]
        write_text_atomically(self.samples, "".join(kept))

    def write_samples(
        self, batch: Generation, prompts: list[Any], label: dict[str, Any], logged: dict[str, list[Any]]
    ) -> None:
        """A sample of the generation's completions appended to ``SAMPLES_FILE`` (the main process's), each line
        with ``label`` (``step``: the step it trains, or an evaluation's after it, with ``eval``)."""
        if self.samples is None or not self.world.is_main:
            return
        with open(self.samples, "a") as f:
            for r in range(min(SAMPLES, len(batch.rows))):
                line = {
                    **label,
                    "prompt": prompts[r],
                    "completion": batch.completions[r],
                    "advantage": float(batch.advantages[r]),
                    "rewards": {
                        name: None if math.isnan(float(v)) else float(v)
                        for name, v in zip(self.rewards.names, batch.rewards[r].tolist(), strict=True)
                    },
                    **{k: v[r] for k, v in logged.items() if r < len(v)},
                }
                f.write(json.dumps(line, default=str) + "\n")


__all__ = [
    "METRICS_KEY",
    "SAMPLES_FILE",
    "Generation",
    "RewardFunctions",
    "Rollouts",
    "generation_seed",
    "prompt_order",
    "reward_function",
    "steps_a_generation",
]
