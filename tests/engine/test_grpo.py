"""GRPO's objective (``engine.grpo``) against TRL 1.16's own ``GRPOTrainer._compute_loss`` on the same tokens'
log-probabilities: the loss, its gradient by each token's log-probability, ``kl`` and the loss type's metrics, for
every ``loss_type`` (grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo), ``beta`` 0 and 0.04, old log-probabilities
given (``num_iterations`` 2) or the policy's own, an asymmetric clip (``epsilon_high``), GSPO's sequence-level
weights, INTELLECT-2's two-sided clip (``delta``) and the highest-entropy tokens alone (``top_entropy_quantile``)."""

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from tiertune.engine.grpo import grpo_loss, high_entropy, metric_names
from tiertune.settings import ObjectiveSettings

COMPLETIONS, LENGTH, MAX_LENGTH, ACCUM = 6, 9, 12, 2


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(COMPLETIONS, LENGTH, generator=g, dtype=torch.float64) * 3
    mask = torch.ones(COMPLETIONS, LENGTH, dtype=torch.long)
    for r, n in enumerate([9, 4, 7, 1, 9, 6]):  # completions of several lengths (one of one token)
        mask[r, n:] = 0
    old = logps + 0.3 * torch.randn(COMPLETIONS, LENGTH, generator=g, dtype=torch.float64)
    ref = logps + 0.5 * torch.randn(COMPLETIONS, LENGTH, generator=g, dtype=torch.float64)
    adv = torch.randn(COMPLETIONS, generator=g, dtype=torch.float64)
    return logps, mask, old, ref, adv


def _trl(logps, mask, old, ref, adv, o, items, entropies=None):
    """TRL's ``_compute_loss`` on a trainer holding only what it reads, its log-probabilities these, its
    settings ``o``'s (an ``ObjectiveSettings``)."""
    from trl import GRPOTrainer

    t = object.__new__(GRPOTrainer)
    t.__dict__.update(
        top_entropy_quantile=o.top_entropy_quantile,
        off_policy_mask_threshold=None,
        importance_sampling_level=o.importance_sampling_level,
        beta=o.beta,
        loss_type=o.loss_type,
        epsilon_low=o.epsilon,
        epsilon_high=o.epsilon if o.epsilon_high is None else o.epsilon_high,
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        current_gradient_accumulation_steps=ACCUM,
        max_completion_length=MAX_LENGTH,
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        args=SimpleNamespace(
            use_bias_correction_kl=o.use_bias_correction_kl,
            delta=o.delta,
            steps_per_generation=ACCUM,
            sapo_temperature_pos=o.sapo_temperature_pos,
            sapo_temperature_neg=o.sapo_temperature_neg,
        ),
        model=SimpleNamespace(training=True),
        accelerator=SimpleNamespace(
            num_processes=1,
            gather=lambda x: x,
            gather_for_metrics=lambda x: x,
            reduce=lambda x, reduction="sum": x,
            pad_across_processes=lambda x, dim=0, pad_index=0: x,
        ),
    )
    entropies = torch.zeros_like(logps) if entropies is None else entropies
    t._get_per_token_logps_and_entropies = lambda *a, **k: (logps, entropies, None)
    inputs = {
        "prompt_ids": torch.zeros(COMPLETIONS, 3, dtype=torch.long),
        "prompt_mask": torch.ones(COMPLETIONS, 3, dtype=torch.long),
        "completion_ids": torch.zeros(COMPLETIONS, LENGTH, dtype=torch.long),
        "completion_mask": mask,
        "advantages": adv,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": torch.tensor(float(items)),
    }
    loss = t._compute_loss(None, inputs)
    return loss, {k: v[-1] for k, v in t._metrics["train"].items()}


def _compare(o, given_old):
    """Ours against TRL's on the same inputs: the loss, its gradient, the metrics; returns TRL's metrics."""
    logps, mask, old, ref, adv = _inputs(seed=3)
    old = old if given_old else None
    items = 2 * int(mask.sum())  # the generation batch's completion tokens (the step's two micro-batches')
    mine_in = logps.clone().requires_grad_()
    theirs_in = logps.clone().requires_grad_()
    entropies = torch.rand(logps.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64) * 4
    selected = None
    if o.top_entropy_quantile < 1.0:
        selected = high_entropy(entropies, mask, o.top_entropy_quantile)
        assert 0 < int(selected.sum()) < int(mask.sum())
    loss, metrics = grpo_loss(mine_in, mask, adv, old, ref, o, ACCUM, items, selected)
    their_loss, their_metrics = _trl(theirs_in, mask, old, ref, adv, o, items, entropies)
    torch.testing.assert_close(loss, their_loss, rtol=1e-12, atol=0)
    loss.backward()
    their_loss.backward()
    torch.testing.assert_close(mine_in.grad, theirs_in.grad, rtol=1e-12, atol=1e-15)
    assert mine_in.grad.abs().sum() > 0
    names = set(metric_names(o)) - {"entropy"}  # (the head's pass gives it: ``engine.suffix``)
    assert names <= set(their_metrics) and names == set(metrics)
    for name in names:  # (TRL takes the clipped shares in fp32: ``.float()``)
        assert metrics[name] == pytest.approx(their_metrics[name], rel=1e-6, abs=1e-12), name
    return their_metrics


def _objective(**settings):
    return ObjectiveSettings(type="grpo", max_completion_length=MAX_LENGTH, epsilon=0.2, **settings)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("given_old", [True, False], ids=["old-given", "old-is-policy"])
@pytest.mark.parametrize("bias_correction", [True, False], ids=["kl-reweighted", "kl-plain"])
def test_the_loss_its_gradient_and_metrics_are_trls(loss_type, beta, given_old, bias_correction):
    o = _objective(loss_type=loss_type, beta=beta, epsilon_high=0.28, use_bias_correction_kl=bias_correction)
    theirs = _compare(o, given_old)
    if given_old:  # the ratios clip somewhere, both ways, at these offsets
        assert theirs["clip_ratio/region_mean"] > 0


@pytest.mark.parametrize(
    "settings",
    [
        {"loss_type": "cispo", "epsilon_high": 5.0},
        {"loss_type": "cispo", "epsilon_high": 1.1, "beta": 0.04},  # a bound the weights cross
        {"loss_type": "sapo"},
        {"loss_type": "sapo", "sapo_temperature_pos": 0.5, "sapo_temperature_neg": 2.0, "beta": 0.04},
        {"loss_type": "luspo", "importance_sampling_level": "sequence"},
        {"loss_type": "grpo", "importance_sampling_level": "sequence", "beta": 0.04},  # GSPO
        {"loss_type": "dapo", "importance_sampling_level": "sequence"},
        {"loss_type": "cispo", "importance_sampling_level": "sequence", "epsilon_high": 1.05},
        {"loss_type": "dapo", "delta": 1.25, "epsilon_high": 0.2},  # INTELLECT-2's two-sided clip
        {"loss_type": "grpo", "delta": 1.3, "beta": 0.04, "importance_sampling_level": "sequence"},
        {"loss_type": "dapo", "top_entropy_quantile": 0.2, "beta": 0.04},  # the 80/20 rule's tokens
        {"loss_type": "grpo", "top_entropy_quantile": 0.5},
    ],
    ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()),
)
@pytest.mark.parametrize("given_old", [True, False], ids=["old-given", "old-is-policy"])
def test_cispo_sapo_luspo_gspo_and_the_two_sided_clip_are_trls(settings, given_old):
    theirs = _compare(_objective(**settings), given_old)
    if given_old and settings.get("epsilon_high") in (1.1, 1.05):  # the bound caps some weights
        assert theirs["cispo_clip_ratio"] > 0


@pytest.mark.parametrize("family", ["llama", "gemma2"])  # gemma2: a logit cap, scored on the logits
def test_the_tempered_loss_scores_softmax_of_the_logits_over_the_temperature(family):
    """GRPO's log-probabilities are of ``softmax(logits / temperature)``, TRL's: ``CausalLMLoss.tempered``
    divides the fused head's inputs (a biased head's bias too) or, with a cap, the capped logits."""
    from tiny import tiny_config
    from transformers import AutoModelForCausalLM

    from tiertune.engine.loss import CausalLMLoss

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family, layers=1)).float().eval()
    if family == "llama":  # a head with a bias, as some architectures have
        head = torch.nn.Linear(64, model.config.vocab_size, bias=True)
        model.set_output_embeddings(head)
    loss = CausalLMLoss(model, fuse=True, backend="torch")
    ids = torch.randint(0, model.config.vocab_size, (2, 7))
    target = ids[:, 1:].clone()
    target[1, :2] = -100
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1].float()
    for temperature in (1.0, 0.7, 1.6):
        expected = torch.nn.functional.cross_entropy(
            (logits / temperature).reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none"
        ).view(target.shape)
        with torch.no_grad(), loss.tempered(temperature):
            got = loss.token_losses(ids, {}, target)
            summed = loss(ids, {}, target)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(summed, expected.sum(), rtol=1e-5, atol=1e-4)
    assert loss.temperature == 1.0  # restored on leaving
    assert loss.fused  # both are in the fused-loss list: the fused path is what ran (gemma2's at 1.0)
