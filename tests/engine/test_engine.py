"""Parity: the streamed engine against a plain PyTorch loop (same data order and hyper-parameters)."""

import importlib.util
import itertools

import pytest
import torch
from parity import ACCUM, STEPS, _batches, _config, fused_adamw, plain_training

from tiertune.engine import StreamedTrainer
from tiertune.offload.store import StoreConfig


def _reference(model, batches, cfg):
    """The plain loop: HF model in memory, torch.optim.AdamW, clip_grad_norm_, transformers' scheduler."""
    model.train()
    opt = fused_adamw(list(model.parameters()), cfg)
    return plain_training(model, opt, list(model.parameters()), cfg, batches)


def _check_parity(path, initial, disk_dir, placement, host_budget="2MiB", **kw):
    """Train STEPS steps with the engine and with the plain loop; assert the same losses and weights.
    ``host_budget``: with states on disk, below them (so every step reads and writes some on disk)."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    reference.config.use_cache = False
    cfg = _config(
        params=placement,
        optimizer_states=placement,
        gradients="host" if placement == "device" else placement,
        **{"redo": "gradients", **kw},  # bit for bit torch's clip-then-step (the twins' redo: its own test)
    )
    batches = _batches(reference.config.vocab_size)
    expected = _reference(reference, batches, cfg)

    # with states on disk the host holds a fraction of them, so every step reads and writes them on disk
    host = host_budget if placement == "disk" else "8MiB"
    store = StoreConfig.resolve(
        device_budget="8MiB", host_budget=host, disk_path=str(disk_dir), chunk_size="1MiB", prefetch_depth=1
    )
    trainer = StreamedTrainer(str(path), store, cfg)
    try:
        losses = [trainer.step(batches[s * ACCUM : (s + 1) * ACCUM]) for s in range(STEPS)]
        weights = trainer.state_dict()
        stats = trainer.store.stats()
        for tier in ("device", "host"):
            assert stats.tiers[tier].peak <= stats.tiers[tier].budget
        if placement == "disk":
            assert stats.bytes_moved["disk->host"] > 0 and stats.bytes_moved["host->disk"] > 0
        assert stats.divergences == 0  # the optimizer worker's accesses stay out of the trace
    finally:
        trainer.close()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0)
    ref = dict(reference.named_parameters())
    assert set(weights) == set(ref)
    diffs = {
        n: float((weights[n] - p.detach()).abs().max() / p.detach().abs().max().clamp_min(1e-12))
        for n, p in ref.items()
    }
    worst = max(diffs.values())
    assert worst <= 1e-5, sorted(diffs.items(), key=lambda kv: -kv[1])[:3]
    moved = [n for n, w in weights.items() if not torch.equal(w, initial.state_dict()[n])]
    assert len(moved) == len(weights)  # every weight was trained
    return trainer


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt_neox"])
@pytest.mark.parametrize("placement", ["device", "host", "disk"])
def test_loss_and_weights_match_a_plain_pytorch_loop(tiny_model_dir, disk_dir, family, placement):
    path, initial = tiny_model_dir(family)
    trainer = _check_parity(path, initial, disk_dir, placement)
    assert trainer.last_grad_norm > 0.5  # clipping was active (max_grad_norm 0.5)


@pytest.mark.parametrize("placement", ["host", "disk"])
@pytest.mark.parametrize(
    "overlap, max_grad_norm, expected",
    [
        # the norm is 2.0-3.2: some steps clip, some do not. A speculative step that clips is redone; a
        # step after a clipped one waits for the norm; the others are confirmed
        ("on", 2.9, {"speculative": 5, "redone": 2, "after_backward": 3}),
        ("on", 0.0, {"speculative": 10, "redone": 0, "after_backward": 0}),  # no clipping: in place
        ("off", 0.5, {"speculative": 0, "redone": 0, "after_backward": 10}),
    ],
)
def test_optimizer_overlap_modes_are_exact(
    tiny_model_dir, disk_dir, placement, overlap, max_grad_norm, expected
):
    path, initial = tiny_model_dir("llama")
    # a step updating in place needs no more than a layer's gradients and states at once: 1 MiB of host
    trainer = _check_parity(
        path, initial, disk_dir, placement, "1MiB", overlap_optimizer=overlap, max_grad_norm=max_grad_norm
    )
    assert trainer.optimizer_counts == expected
    twins = any(s.twins for s in trainer.states)
    assert twins == (overlap == "on" and max_grad_norm > 0)


@pytest.mark.parametrize("max_grad_norm", [2.9, 0.0])
def test_a_hand_off_after_the_next_layer_s_backward_is_exact(tiny_model_dir, disk_dir, max_grad_norm):
    """``handoff_lag: 1`` (a GPU's default): each layer's gradients handed on after the next layer's backward,
    speculative steps confirmed and redone, or in place: the plain loop's losses and weights, as at 0."""
    path, initial = tiny_model_dir("llama")
    trainer = _check_parity(
        path,
        initial,
        disk_dir,
        "host",
        "1MiB",
        overlap_optimizer="on",
        max_grad_norm=max_grad_norm,
        handoff_lag=1,
    )
    assert trainer.handoff_lag == 1
    assert trainer.optimizer_counts["speculative"] >= 5


@pytest.mark.gpu
def test_on_a_gpu_the_late_hand_off_copies_on_its_own_stream_and_changes_nothing(tiny_model_dir, disk_dir):
    """On CUDA a layer's gradients are copied on a stream of their own that waits for the layer's backward
    (``Compute.after``) while the next layer's runs: the losses and weights are lag 0's, bit for bit."""
    path, _ = tiny_model_dir("llama")
    batches = _batches(211)
    runs = {}
    for lag in (0, 1):
        store = StoreConfig.resolve(
            device="cuda", device_budget="8MiB", host_budget="8MiB", disk_path=str(disk_dir / str(lag))
        )
        trainer = StreamedTrainer(str(path), store, _config(max_grad_norm=0.0, handoff_lag=lag))
        try:
            losses = [trainer.step(batches[s * ACCUM : (s + 1) * ACCUM]) for s in range(4)]
            runs[lag] = (losses, trainer.state_dict())
            assert trainer.handoff_lag == lag
        finally:
            trainer.close()
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(runs[0][1][n], w) for n, w in runs[1][1].items())


@pytest.mark.parametrize("coef", [0.3, 0.97])
def test_a_redo_from_the_twins_is_clip_then_step_without_the_gradients(coef):
    """``adamw_redo``: from the speculation's twins (made with coefficient 1) and the moments before the step,
    the step with coefficient c equals torch's fused AdamW on c x the gradient, to fp32 rounding, for decayed
    and undecayed tensors, at a step whose bias corrections matter."""
    from tiertune.methods.optim import AdamStep, adamw, adamw_redo

    g = torch.Generator().manual_seed(0)
    shapes = {"w": (64, 48), "b": (48,)}
    p = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    m = {n: torch.randn(s, generator=g) * 0.1 for n, s in shapes.items()}
    v = {n: torch.rand(s, generator=g) * 0.01 for n, s in shapes.items()}
    grad = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    hp = AdamStep(1e-2, 0.9, 0.999, 1e-8, 0.1, 3)
    names, c = list(shapes), torch.tensor(coef)

    def copy(d):
        return {k: t.clone() for k, t in d.items()}

    expected = copy(p), copy(m), copy(v)
    adamw(names, expected[0], {n: grad[n] * c for n in names}, expected[1], expected[2], hp, {"w"})
    twins = copy(p), copy(m), copy(v)
    adamw(names, twins[0], grad, twins[1], twins[2], hp, {"w"})  # the speculation: coefficient 1
    adamw_redo(names, (m, v), twins, c, hp)  # neither the gradients nor the weights before the step
    for got, want in zip(twins, expected, strict=True):
        for n in names:
            torch.testing.assert_close(got[n], want[n], rtol=1e-6, atol=1e-7)


def test_a_redo_from_the_twins_lets_each_gradient_go_once_its_update_read_it(tiny_model_dir, disk_dir):
    """With the twins' redo a speculative step's gradients are dropped as their updates read them: the
    gradients, homed on disk, are never written there and take host memory only while their layer's update is
    in flight, so the host's peak is below the kept-gradients redo's by most of the gradient bytes (steps that
    speculate and are confirmed: max_grad_norm above every norm). With steps that clip (max_grad_norm 2.9:
    some are redone from the twins), the weights follow the plain loop (rel 1e-5; Llama has no parameter whose
    gradient is rounding noise)."""
    from transformers import AutoModelForCausalLM

    path, _ = tiny_model_dir("llama", layers=8, shard="200KB")
    peaks, grads = {}, 0
    for redo, max_grad_norm in (("twins", 100.0), ("gradients", 100.0), ("twins", 2.9)):
        reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        reference.config.use_cache = False
        cfg = _config(
            params="host",
            optimizer_states="host",
            gradients="disk",
            redo=redo,
            overlap_optimizer="on",
            max_grad_norm=max_grad_norm,
        )
        batches = _batches(reference.config.vocab_size)
        expected = _reference(reference, batches, cfg)
        store = StoreConfig.resolve(
            device_budget="8MiB",
            host_budget="16MiB",
            disk_path=str(disk_dir / f"{redo}-{max_grad_norm}"),
            chunk_size="1MiB",
        )
        trainer = StreamedTrainer(str(path), store, cfg)
        try:
            losses = [trainer.step(batches[s * ACCUM : (s + 1) * ACCUM]) for s in range(STEPS)]
            weights = trainer.state_dict()
            stats = trainer.store.stats()
            grads = trainer.state_bytes()["gradients"]
            counts = dict(trainer.optimizer_counts)
        finally:
            trainer.close()
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0)
        for n, p in reference.named_parameters():
            assert float((weights[n] - p.detach()).abs().max() / p.detach().abs().max()) <= 1e-5, n
        assert stats.bytes_moved.get("host->disk", 0) == 0  # no gradient written to disk
        if max_grad_norm > 10:
            assert counts == {"speculative": STEPS, "redone": 0, "after_backward": 0}
            peaks[redo] = stats.tiers["host"].peak
        else:
            assert counts["redone"] >= 1, counts
    assert peaks["twins"] <= peaks["gradients"] - grads // 2, (peaks, grads)


def test_24_layers_train_with_a_device_budget_of_about_two_layers(tiny_model_dir, disk_dir):
    path, _ = tiny_model_dir("llama", layers=24, shard="200KB")
    cfg = _config(params="disk", optimizer_states="disk", gradients="host", max_steps=3, warmup_steps=0)
    from tiertune.loading.model import build_skeleton, split_model
    from tiertune.offload.chunk import pack_tensors

    def capacity(group):
        return sum(
            lay.capacity
            for lay in pack_tensors([(n, p.shape, p.dtype) for n, p in group.params.items()], 1 << 20)
        )

    groups = split_model(build_skeleton(path)).groups
    layer_bytes = capacity(groups[1])
    pinned = sum(
        capacity(g) for g in groups if g.kind != "layer"
    )  # embed + final norm, bound per micro-batch
    budget = pinned + 2 * layer_bytes  # two layers: the one computing and the one prefetched
    store = StoreConfig.resolve(
        device_budget=budget, host_budget="4MiB", disk_path=str(disk_dir), chunk_size="1MiB", prefetch_depth=1
    )
    trainer = StreamedTrainer(str(path), store, cfg)
    try:
        batch = _batches(211)[:ACCUM]  # the same batch every step: the loss must fall
        losses, reports = [], []
        for _ in range(3):
            losses.append(trainer.step(batch))
            reports.append(trainer.last_report)
        stats = trainer.store.stats()
    finally:
        trainer.close()
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    # each step's report: its own bytes per link (the totals' difference), the totals and peaks of the store
    assert [r.loss for r in reports] == losses
    # (the store's writes started in a step may land after it returns: the totals only grow)
    assert all(n <= stats.bytes_moved[k] for k, n in reports[-1].bytes_moved.items())
    assert all(n <= stats.tiers[t].peak for t, n in reports[-1].peak_bytes.items())
    for before, after in itertools.pairwise(reports):
        assert after.moved == {k: n - before.bytes_moved.get(k, 0) for k, n in after.bytes_moved.items()}
    assert reports[-1].moved["disk->host"] > 0  # every step streams the layers from disk
    record = reports[-1].record(3, 1.0, 10.0)
    assert record["bytes_moved"] == reports[-1].bytes_moved and record["step_seconds"] == reports[-1].seconds
    assert "wire_bytes" not in record  # one process sends nothing
    assert stats.tiers["device"].budget == budget
    assert stats.tiers["device"].peak == budget  # the second layer was prefetched into the last free bytes
    assert stats.tiers["device"].peak <= stats.tiers["device"].budget
    assert stats.tiers["host"].peak <= stats.tiers["host"].budget
    assert stats.divergences == 0  # every step followed the recorded trace


def test_bf16_weights_follow_fp32_master_weights(tiny_model_dir, disk_dir):
    path, _ = tiny_model_dir("qwen2")
    cfg = _config(dtype=torch.bfloat16, params="disk", optimizer_states="disk", max_steps=4, warmup_steps=0)
    store = StoreConfig.resolve(
        device_budget="8MiB", host_budget="2MiB", disk_path=str(disk_dir), chunk_size=1 << 40
    )
    trainer = StreamedTrainer(str(path), store, cfg)
    try:
        batch = _batches(211)[:ACCUM]
        losses = [trainer.step(batch) for _ in range(4)]
        for state in trainer.states:
            assert state.master, "bf16 compute keeps fp32 master weights"
            for weight_chunk, master_chunk in zip(state.weights, state.master):
                weights, master = trainer.store.read(weight_chunk), trainer.store.read(master_chunk)
                for name, w in weights.items():
                    assert w.dtype == torch.bfloat16 and master[name].dtype == torch.float32
                    assert torch.equal(w, master[name].to(torch.bfloat16)), name
    finally:
        trainer.close()
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("placement", ["device", "disk"])
def test_layer_inputs_on_the_host_keep_parity_and_travel_through_the_store(
    tiny_model_dir, disk_dir, placement
):
    path, initial = tiny_model_dir("llama")
    trainer = _check_parity(
        path,
        initial,
        disk_dir,
        placement,
        activations="host",
        activation_tokens=24,
        gradient_accumulation_steps=ACCUM,
    )
    boundaries = trainer.stash.chunks  # each layer's input, and the last layer's output
    assert len(boundaries) == 5 and all(c.home.value == "host" for c in boundaries)
    assert all(c.capacity == ACCUM * 24 * 64 * 4 for c in boundaries)  # a slot per micro-batch of the step
    moved = trainer.store.stats().bytes_moved
    # a step's wave sends each layer's input down once in forward, and backward brings it back once; but the
    # last layer's input, which backward reads first, stays on the device, and the last layer's output is used
    # by the loss there and dropped
    per_pass = sum(c.capacity for c in boundaries[:-2]) * STEPS
    assert moved["device->host"] >= per_pass and moved["host->device"] >= per_pass


def test_a_micro_batch_larger_than_the_activation_chunks_is_a_clear_error(tiny_model_dir, disk_dir):
    from tiertune.errors import ConfigError

    path, _ = tiny_model_dir("llama")
    cfg = _config(activations="host", activation_tokens=8)
    trainer = StreamedTrainer(str(path), StoreConfig.resolve(device_budget="8MiB", host_budget="8MiB"), cfg)
    try:
        with pytest.raises(ConfigError, match="do not fit the activation chunk"):
            trainer.step(_batches(211)[:1])  # 2 x 12 tokens
    finally:
        trainer.close()


@pytest.mark.parametrize(
    ("family", "kernels", "norms"),
    [("gemma2", "torch", 9), ("gemma2", "triton", 9), ("gemma3_text", "torch", 13)],
)
def test_gemma_2_and_3_train_with_the_kernels_and_the_soft_capped_fused_loss(
    tiny_model_dir, disk_dir, family, kernels, norms
):
    """Gemma 2 and 3 (soft-capped logits, cap 1 so that it bends these small logits; a fused loss without the
    cap is off by about 1e-3) with their layers patched and the loss fused with the head, against ``kernels:
    none`` (transformers' modules and its own soft-capped logits): the same losses for 3 steps. ``triton``
    runs in Triton's interpreter, in fp32. Norms: 4 a layer and the final one, and Gemma 3's q and k norms."""
    if kernels == "triton" and importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    path, _ = tiny_model_dir(family, layers=2)
    batches = _batches(211)
    losses = {}
    for run in ("none", kernels):
        store = StoreConfig.resolve(device_budget="8MiB", host_budget="8MiB", disk_path=str(disk_dir / run))
        trainer = StreamedTrainer(str(path), store, _config(kernels=run, warmup_steps=0))
        try:
            if run != "none":
                assert trainer.fused_loss
                assert trainer.kernel_counts == {"rms_norm": norms, "glu": 2, "rope": 2}
            losses[run] = [trainer.step(batches[s : s + 1]) for s in range(3)]  # a micro-batch a step
        finally:
            trainer.close()
    torch.testing.assert_close(torch.tensor(losses[kernels]), torch.tensor(losses["none"]), rtol=1e-5, atol=0)


@pytest.mark.parametrize("family", ["cohere", "mixtral", "deepseek_v3"])
def test_the_fused_loss_of_scaled_logits_and_moe_models_is_transformers_loss(
    tiny_model_dir, disk_dir, family
):
    """Cohere's logits are scaled (logit_scale 0.5 here: a fused loss without it is far off), and MoE models'
    causal-LM heads are plain linears: the loss fused with the head gives the losses of ``kernels: none``
    (transformers' own logits) for 3 steps."""
    path, _ = tiny_model_dir(family, layers=2)
    batches = _batches(211)
    losses = {}
    for run in ("none", "torch"):
        store = StoreConfig.resolve(device_budget="8MiB", host_budget="8MiB", disk_path=str(disk_dir / run))
        trainer = StreamedTrainer(str(path), store, _config(kernels=run, warmup_steps=0))
        try:
            assert trainer.fused_loss == (run != "none")
            losses[run] = [trainer.step(batches[s : s + 1]) for s in range(3)]
        finally:
            trainer.close()
    torch.testing.assert_close(torch.tensor(losses["torch"]), torch.tensor(losses["none"]), rtol=1e-5, atol=0)


@pytest.mark.parametrize(
    "family", ["mistral", "qwen3", "gemma", "gemma2", "phi3", "olmo2", "stablelm", "cohere"]
)
def test_more_families_match_a_plain_pytorch_loop(tiny_model_dir, disk_dir, family):
    path, initial = tiny_model_dir(family)
    _check_parity(path, initial, disk_dir, "host")


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_mixture_of_experts_match_a_plain_pytorch_loop(tiny_model_dir, disk_dir, family):
    """MoE checkpoints as transformers 5 saves them (a tensor per expert) stream into the fused expert
    tensors the model uses, and full fine-tuning with weights and states on disk matches the plain loop."""
    path, initial = tiny_model_dir(family)
    _check_parity(path, initial, disk_dir, "disk")


@pytest.mark.parametrize(("placement", "overlap"), [("host", "on"), ("disk", "on"), ("disk", "off")])
def test_8bit_adam_states_match_bitsandbytes_adamw8bit(tiny_model_dir, disk_dir, placement, overlap):
    """``training.optim: adamw_bnb_8bit``: the same kernels as bitsandbytes' AdamW8bit in a plain loop.

    Untied embeddings: a tied matrix's gradient sums the head's and the embeddings' parts of each micro-batch,
    which the layer-major step adds in another order than a plain loop (heads first, ``engine.schedule``); the
    last-bit difference that makes is within fp32 tolerance, but it can move an element of an 8-bit moment
    into the next quantization bucket."""
    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM

    path, _ = tiny_model_dir("qwen2")
    cfg = _config(
        params=placement,
        optimizer_states=placement,
        gradients="host",
        optim="adamw_bnb_8bit",
        overlap_optimizer=overlap,
        max_grad_norm=2.9,
    )
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    reference.config.use_cache = False
    reference.train()
    params = list(reference.parameters())
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    opt = bnb.optim.AdamW8bit(
        groups, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon
    )
    batches = _batches(reference.config.vocab_size)
    expected = plain_training(reference, opt, params, cfg, batches)
    store = StoreConfig.resolve(
        device_budget="8MiB",
        host_budget="2MiB" if placement == "disk" else "8MiB",
        disk_path=str(disk_dir),
        chunk_size="1MiB",
        prefetch_depth=1,
    )
    trainer = StreamedTrainer(str(path), store, cfg)
    try:
        losses = [trainer.step(batches[s * ACCUM : (s + 1) * ACCUM]) for s in range(STEPS)]
        weights = trainer.state_dict()
        moments = [c for s in trainer.states for c in s.exp_avg]
        eight_bit = sum(t.dtype == torch.uint8 for c in moments for t in (x for x in c.tensors))
        counts = dict(trainer.optimizer_counts)
    finally:
        trainer.close()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), rtol=1e-5, atol=1e-6)
    assert eight_bit > 0  # the large tensors' moments really are 8-bit
    if overlap == "on":
        assert counts["redone"] >= 1 and counts["speculative"] >= 1  # both paths of the speculation ran


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt_neox"])
def test_the_fused_loss_trains_like_the_model_own_loss(tiny_model_dir, disk_dir, family):
    """kernels: torch (the loss fused with the head, chunked) against the model's own logits and loss: the
    same loss sequence; the weights agree to rounding (Adam amplifies rounding in gradients that are zero in
    exact arithmetic, such as attention key biases, so those are compared in absolute terms)."""
    path, _ = tiny_model_dir(family)
    batches = _batches(211)
    runs = {}
    for kernels in ("none", "torch"):
        store = StoreConfig.resolve(
            device_budget="8MiB", host_budget="8MiB", disk_path=str(disk_dir / kernels)
        )
        trainer = StreamedTrainer(str(path), store, _config(kernels=kernels))
        try:
            assert trainer.fused_loss == (kernels == "torch")
            losses = [trainer.step(batches[s * ACCUM : (s + 1) * ACCUM]) for s in range(STEPS)]
            runs[kernels] = (losses, trainer.state_dict())
        finally:
            trainer.close()
    torch.testing.assert_close(
        torch.tensor(runs["torch"][0]), torch.tensor(runs["none"][0]), rtol=1e-5, atol=0
    )
    for name, value in runs["none"][1].items():
        torch.testing.assert_close(runs["torch"][1][name], value, rtol=0, atol=1e-4)  # measured: <= 1.3e-5


def test_an_unknown_kernels_value_names_every_choice_a_recipe_takes():
    """A recipe built in Python is checked as one read from YAML: the setting and its choices named."""
    from tiertune.config.recipe import Recipe
    from tiertune.errors import ConfigError

    with pytest.raises(ConfigError, match=r"kernels must be one of auto, torch, triton; got 'fast'"):
        Recipe(kernels="fast")
