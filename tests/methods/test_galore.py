"""GaLore: parity with galore-torch's optimizers in a plain loop, and the optimizer-state bytes it saves."""

import pytest
import torch
from parity import ACCUM, STEPS, _batches, _config, plain_training
from torch import nn

from tiertune.engine import StreamedTrainer
from tiertune.methods import optim as engine_optim
from tiertune.methods.optim import GaloreSettings
from tiertune.offload.store import StoreConfig

# rank 4: the rank at which every projection of this test's 32-bit runs is well-posed (see WELL_POSED)
GALORE = GaloreSettings(rank=4, update_proj_gap=3, scale=0.25)  # projections refreshed at steps 0, 3, 6, 9

# The smallest relative change of a gradient (|dG|_2 / sigma_1) that could make a refreshed projection jump
# (see _pin_signs) must be this or more. Between the engine and the plain loop, when their matrix products
# summed in different orders, the gradients at refresh steps differed by up to 9.5e-7 so measured: 4x that.
# (The 32-bit runs have 5.2e-6 with clipping, 2.1e-5 without; at rank 8 they had 1.9e-6.)
WELL_POSED = 4e-6


def _pin_signs(proj, right):
    """``proj`` (singular vectors as rows if ``right``, else as columns) with each vector's sign fixed: its
    entry of largest magnitude made positive. Returns it (in its memory layout) and each vector's margin:
    its largest positive entry less the magnitude of its largest negative one.

    LAPACK leaves the sign of a singular vector arbitrary, and flips it under last-bit changes of the matrix
    (a relative 5e-7 of noise flips a fifth of the top-8 vectors of this test's 64 x 96 gradients). GaLore
    keeps its Adam moments across a refresh of the projection, so a flipped vector changes the rest of the
    training: without a convention both runs share, a last-bit difference between the engine's gradients
    and the plain loop's is a 2% difference of the weights. With one, a vector moves by at most
    sqrt(2) |dG| / gap (Wedin's bound; gap: its singular value's distance to its neighbours, the first left
    out included), and its sign holds while that is under half its margin: the projection is then a
    continuous function of the gradient, and the comparison well-posed."""
    vectors = proj.t() if right else proj
    signs = torch.sign(vectors.gather(0, vectors.abs().argmax(0, keepdim=True)))
    vectors = vectors * signs
    return proj * (signs.t() if right else signs), vectors.max(0).values + vectors.min(0).values


def _robustness(grad, margins):
    """The smallest relative change of ``grad`` (|dG|_2 / sigma_1) that may swap two of its top singular
    vectors, exchange one with the first left out, or flip a sign pinned with these ``margins``."""
    s = torch.linalg.svdvals(grad.double())
    r = len(margins)
    inf = s.new_tensor([float("inf")])
    below = s[:r] - torch.cat([s[1 : r + 1], s.new_zeros(max(0, r + 1 - len(s)))])
    above = torch.cat([inf, s[: r - 1] - s[1:r]])
    gaps = torch.minimum(below, above)
    return float((margins.double() * gaps).min() / (2 * 2**0.5 * s[0]))


def _pinned_projections(monkeypatch):
    """Pin the signs of the singular vectors of both GaLores, the engine's and galore-torch's, to one
    convention (see _pin_signs); returns a list that receives the robustness (see _robustness) of each
    projection galore-torch computes, from its gradient."""
    from galore_torch.galore_projector import GaLoreProjector

    robustness = []
    svd = GaLoreProjector.get_orthogonal_matrix
    engine = engine_optim.orthogonal_basis

    def reference(self, grad, rank, type):
        pinned, margins = _pin_signs(svd(self, grad, rank, type), type == "right")
        robustness.append(_robustness(grad, margins))
        return pinned

    def ours(grad, shape, right, method="exact", seed=0):
        return _pin_signs(engine(grad, shape, right, method, seed), right)[0]

    monkeypatch.setattr(GaLoreProjector, "get_orthogonal_matrix", reference)
    monkeypatch.setattr(engine_optim, "orthogonal_basis", ours)
    return robustness


def _targets(model):
    """The decoder layers' linear weights (what ``target_modules: all-linear`` projects)."""
    layers = model.model.layers
    return {
        f"model.layers.{i}.{n}.weight"
        for i, layer in enumerate(layers)
        for n, m in layer.named_modules()
        if isinstance(m, nn.Linear)
    }


def _reference(model, batches, cfg, eight_bit):
    """galore-torch's GaLoreAdamW (or GaLoreAdamW8bit) in the plain loop, weight decay on 2-d tensors."""
    import galore_torch

    params = dict(model.named_parameters())
    targets = _targets(model)
    s = cfg.galore
    galore = dict(rank=s.rank, update_proj_gap=s.update_proj_gap, scale=s.scale, proj_type="std")
    groups = [
        {"params": [params[n] for n in params if n in targets], "weight_decay": cfg.weight_decay, **galore},
        {
            "params": [p for n, p in params.items() if n not in targets and p.dim() >= 2],
            "weight_decay": cfg.weight_decay,
        },
        {"params": [p for p in params.values() if p.dim() < 2], "weight_decay": 0.0},
    ]
    betas = (cfg.adam_beta1, cfg.adam_beta2)
    if eight_bit:
        opt = galore_torch.GaLoreAdamW8bit(groups, lr=cfg.learning_rate, betas=betas, eps=cfg.adam_epsilon)
    else:
        opt = galore_torch.GaLoreAdamW(
            groups, lr=cfg.learning_rate, betas=betas, eps=cfg.adam_epsilon, no_deprecation_warning=True
        )
    return plain_training(model, opt, list(model.parameters()), cfg, batches)


def _train(path, disk_dir, placement, scale=1, **kw):
    """The engine with states placed on ``placement``; budgets ``scale`` times those of the tiny model."""
    kw.setdefault("galore", GALORE)
    cfg = _config(
        method="galore",
        params=placement,
        optimizer_states=placement,
        gradients="host" if placement == "device" else placement,
        **kw,
    )
    host = (2 if placement == "disk" else 8) * scale << 20
    store = StoreConfig.resolve(
        device_budget=8 * scale << 20,
        host_budget=host,
        disk_path=str(disk_dir),
        chunk_size="1MiB",
        prefetch_depth=1,
    )
    trainer = StreamedTrainer(str(path), store, cfg)
    return cfg, trainer


def _llama_7b_like(path, layers):
    """A Llama of hidden 256 and MLP 688 (the 7B model's proportions) with ``layers`` decoder layers, saved
    at ``path``; returns the model."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=512,
        tie_word_embeddings=True,
    )
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def wider_llama(tmp_path_factory):
    """``wider_llama(tied)``: a Llama whose rank-16 low-rank moments all have 4096 elements or more, so
    bitsandbytes keeps them in 8 bits. (Below that size GaLoreAdamW8bit cannot serve as the reference on CPU:
    bitsandbytes' CPU 32-bit kernel does not update a parameter whose data GaLoreAdamW8bit swapped for the
    low-rank buffer, and the projected weights would never change.) Untied embeddings where the weights must
    match to the bit: a tied matrix's gradient sums the head's and the embeddings' parts of each micro-batch,
    which the layer-major step adds in another order than a plain loop (the heads' first,
    ``engine.schedule``), and 8-bit moments turn that last-bit difference into 2e-3 of the weights."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    made: dict[bool, object] = {}

    def make(tied: bool):
        if tied not in made:
            torch.manual_seed(0)
            config = LlamaConfig(
                hidden_size=256,
                intermediate_size=384,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                vocab_size=211,
                tie_word_embeddings=tied,
            )
            path = tmp_path_factory.mktemp("llama-wide")
            AutoModelForCausalLM.from_config(config).save_pretrained(path, max_shard_size="400KB")
            made[tied] = path
        return made[tied]

    return make


@pytest.mark.parametrize(
    "placement,optim,max_grad_norm",
    [
        ("device", "adamw_torch", 0.5),
        ("host", "adamw_torch", 0.5),
        ("disk", "adamw_torch", 0.5),
        ("host", "adamw_torch", 0.0),
        ("host", "adamw_bnb_8bit", 0.5),
        ("disk", "adamw_bnb_8bit", 0.0),
    ],
)
def test_galore_matches_galore_torch(
    tiny_model_dir, wider_llama, disk_dir, monkeypatch, placement, optim, max_grad_norm
):
    """10 steps of gradient accumulation, warmup and cosine, weight decay and clipping (every step with
    max_grad_norm 0.5, so the speculative steps are redone), projections refreshed every 3 steps, the signs
    of the singular vectors pinned on both sides (see _pin_signs).

    The 32-bit runs are checked to be well-posed: every projection galore-torch computes stays put under
    last-bit changes of its gradient, so rounding differences stay rounding differences. The 8-bit runs
    cannot be: rounding the moments to 8 bits is discontinuous too (1e-7 of relative noise in the engine's
    gradients, with the projections shared, moves their weights by 2.4e-3), so they match only because the
    engine computes bit for bit what galore-torch does (see test_the_update_is_galore_torch_bit_for_bit).
    With clipping, though, the engine projects before the coefficient c is known (during backward, on the
    device) and scales the low-rank gradient: c (G Pᵀ) where galore-torch has (c G) Pᵀ, one rounding apart,
    which the 8-bit moments turn into 1.7e-3 of the weights after 10 steps (measured): that case compares
    the losses as tightly and the weights within 5e-3."""
    from transformers import AutoModelForCausalLM

    eight_bit = optim == "adamw_bnb_8bit"
    monkeypatch.setattr(
        torch.cuda, "synchronize", lambda *a, **k: None
    )  # GaLoreAdamW8bit calls it, even on CPU
    robustness = _pinned_projections(monkeypatch)
    path = wider_llama(tied=max_grad_norm > 0) if eight_bit else tiny_model_dir("llama")[0]
    settings = GaloreSettings(rank=16, update_proj_gap=3, scale=0.25) if eight_bit else GALORE
    cfg, trainer = _train(
        path,
        disk_dir,
        placement,
        8 if eight_bit else 1,
        optim=optim,
        max_grad_norm=max_grad_norm,
        galore=settings,
    )
    batches = _batches(211)
    try:
        losses = [trainer.step(batches[s * ACCUM : (s + 1) * ACCUM]) for s in range(STEPS)]
        weights = trainer.state_dict()
        assert trainer.store.stats().divergences == 0
    finally:
        trainer.close()
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    reference.config.use_cache = False
    expected = _reference(reference, batches, cfg, eight_bit)
    assert len(robustness) == 4 * len(_targets(reference))  # refreshed at steps 0, 3, 6 and 9
    if not eight_bit:
        assert min(robustness) >= WELL_POSED, sorted(robustness)[:5]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-4, atol=0)
    worst = max(
        float((weights[n] - p.detach()).abs().max() / p.detach().abs().max())
        for n, p in reference.named_parameters()
    )
    assert worst <= (5e-3 if eight_bit and max_grad_norm > 0 else 1e-4)


@pytest.mark.parametrize("eight_bit", [False, True])
@pytest.mark.parametrize("shape", [(512, 256), (256, 512)])  # right singular vectors, left ones
def test_the_update_is_galore_torch_bit_for_bit(monkeypatch, shape, eight_bit):
    """The same gradients through the engine's GaLore projection and update, its projection kept in a
    row-major chunk buffer, and through galore-torch's optimizer: the same weights to the bit, over three refreshes. (The
    products see the projection in the column-major layout galore-torch keeps it in, so BLAS sums them in
    the same order: with the row-major buffer as it is, G Pᵀ differs in the last bits at rank 8. The
    low-rank moments have 4096 elements, so bitsandbytes keeps them in 8 bits.)"""
    import galore_torch

    from tiertune.methods.optim import AdamStep, GaLore

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)  # GaLoreAdamW8bit calls it on CPU
    gen = torch.Generator().manual_seed(0)
    linear = nn.Linear(shape[1], shape[0], bias=False)
    weight = torch.randn(shape, generator=gen) * 0.02
    grads = [torch.randn(shape, generator=gen) for _ in range(7)]
    lr, betas, eps, decay = 3e-3, (0.9, 0.999), 1e-6, 0.1

    galore = GaLore(GaloreSettings(rank=8, update_proj_gap=3, scale=0.25), [linear], {id(linear): "proj"})
    entries = [("proj.weight", shape, torch.float32)]
    m, v = (
        {n: torch.zeros(s, dtype=d) for n, s, d in galore.moment_entries(entries, eight_bit)} for _ in "mv"
    )
    proj = {n: torch.zeros(s, dtype=d) for n, s, d in galore.projection_entries(entries)}
    ours = {"proj.weight": weight.clone()}
    for step, g in enumerate(grads, 1):
        hp = AdamStep(lr, *betas, eps, decay, step)
        low = galore.project(g.clone(), proj["proj.weight"], galore.refreshes(step))
        galore.update(["proj.weight"], ours, {"proj.weight": low}, m, v, proj, hp, eight_bit)

    param = nn.Parameter(weight.clone())
    group = {"params": [param], "rank": 8, "update_proj_gap": 3, "scale": 0.25, "proj_type": "std"}
    if eight_bit:
        opt = galore_torch.GaLoreAdamW8bit([group], lr=lr, betas=betas, eps=eps, weight_decay=decay)
    else:
        opt = galore_torch.GaLoreAdamW(
            [group], lr=lr, betas=betas, eps=eps, weight_decay=decay, no_deprecation_warning=True
        )
    for g in grads:
        param.grad = g.clone()
        opt.step()
    assert torch.equal(ours["proj.weight"], param.detach())


def test_galore_optimizer_states_are_under_0_4_of_adamw(tmp_path, disk_dir):
    """Moments and projections of GaLore (rank 32) against AdamW's moments on the same Llama-shaped model
    (hidden 256, MLP 688, 8 layers: decoder layers hold 96% of the parameters, as in a 7B model)."""
    _llama_7b_like(tmp_path, layers=8)
    store = StoreConfig.resolve(
        device_budget="64MiB", host_budget="256MiB", disk_path=str(disk_dir), chunk_size="1GiB"
    )
    measured = {}
    for method in ("full", "galore"):
        cfg = _config(method=method, galore=GaloreSettings(rank=32), overlap_optimizer=False)
        trainer = StreamedTrainer(str(tmp_path), store, cfg)
        try:
            measured[method] = trainer.state_bytes()
        finally:
            trainer.close()
    adamw = measured["full"]["moments"]
    galore = measured["galore"]["moments"] + measured["galore"]["projections"]
    assert measured["galore"]["weights"] == measured["full"]["weights"]  # every weight is still trained
    assert galore <= 0.4 * adamw, (galore, adamw)


@pytest.mark.parametrize("method", ["full", "galore"])
def test_layerwise_update_never_holds_every_layers_gradients(tiny_model_dir, disk_dir, method):
    """Without clipping and with one micro-batch per step, each layer's update runs during backward as soon
    as its gradients exist, and they are dropped once used: at most a few layers' gradients are ever held
    (in host memory, with their home on disk; nothing is written there), never all 8."""
    path, _ = tiny_model_dir("llama", layers=8)
    cfg = _config(method=method, max_grad_norm=0.0, overlap_optimizer=True, gradients="disk")
    store = StoreConfig.resolve(
        device_budget="8MiB",
        host_budget="16MiB",
        disk_path=str(disk_dir),
        chunk_size="1GiB",
        prefetch_depth=1,
    )
    trainer = StreamedTrainer(str(path), store, cfg)
    grads = [c for s in trainer.states if s.group.kind == "layer" for c in s.grads]
    held = []
    add_grads = trainer.add_grads

    def counting(state, layer_grads, ready=None):
        add_grads(state, layer_grads, ready)
        held.append(sum(1 for c in grads if c.valid))

    trainer.add_grads = counting
    batches = _batches(211)
    try:
        for s in range(3):
            trainer.step([batches[s]])
        written = trainer.store.stats().bytes_moved.get("host->disk", 0)
    finally:
        trainer.close()
    assert len(grads) == 8 and len(held) == 3 * (8 + 2)  # 8 layers, the (tied) embedding, the final norm
    assert max(held) <= 3, held
    assert written == 0


def _gradient_shapes(model, rank):
    """Bytes of one step's gradients as the CPU optimizer receives them: (GaLore's, AdamW's). A projected
    m x n weight sends its low-rank gradient, m x r when m >= n, else r x n; every other tensor its own."""
    targets = _targets(model)
    galore = full = 0
    for name, p in model.named_parameters():
        full += p.numel() * 4
        if name in targets:
            m, n = p.shape
            r = min(rank, m, n)
            galore += (m * r if m >= n else r * n) * 4
        else:
            galore += p.numel() * 4
    return galore, full


@pytest.mark.parametrize("svd", ["exact", "randomized"])
def test_only_low_rank_gradients_reach_the_cpu_optimizer(tmp_path, disk_dir, svd):
    """GaLore projects on the compute device during backward: with one micro-batch per step, the gradients
    handed to the host are the low-rank ones for the projected weights (m/r fewer bytes each), counted by
    the engine, equal to what the shapes say, and a small share of AdamW's on the same model."""
    reference = _llama_7b_like(tmp_path / "model", layers=4)
    rank = 16
    store = StoreConfig.resolve(
        device_budget="64MiB", host_budget="128MiB", disk_path=str(disk_dir), chunk_size="1GiB"
    )
    batches = _batches(512)
    sent = {}
    for method in ("full", "galore"):
        cfg = _config(method=method, galore=GaloreSettings(rank=rank, update_proj_gap=2, svd=svd))
        trainer = StreamedTrainer(str(tmp_path / "model"), store, cfg)
        try:
            losses = [trainer.step([batches[s]]) for s in range(3)]  # refreshed at steps 1 and 3
            sent[method] = trainer.gradient_bytes / 3
            svd_s = trainer.times["galore_svd"]
        finally:
            trainer.close()
        assert all(torch.isfinite(torch.tensor(losses)))
    expected_galore, expected_full = _gradient_shapes(reference, rank)
    assert sent == {"full": expected_full, "galore": expected_galore}
    assert sent["galore"] < 0.25 * sent["full"]
    assert svd_s > 0  # the refreshes ran in backward, where the engine times them


def test_randomized_svd_finds_the_gradients_subspace():
    """``svd: randomized`` on a gradient of a few hundred tokens (rank <= tokens) plus noise: its rank-r
    projection keeps the gradient's energy the exact one keeps (to 1%), is the same for the same seed,
    orthonormal, and leaves the global random state as it was (dropout does not depend on the choice)."""
    gen = torch.Generator().manual_seed(0)
    m, n, tokens, rank = 384, 256, 48, 16
    grad = torch.randn(m, tokens, generator=gen) @ torch.randn(tokens, n, generator=gen)
    grad += 1e-3 * torch.randn(m, n, generator=gen)
    before = torch.get_rng_state()
    exact = engine_optim.orthogonal_basis(grad, (rank, n), True, "exact")
    fast = engine_optim.orthogonal_basis(grad, (rank, n), True, "randomized", seed=7)
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(fast, engine_optim.orthogonal_basis(grad, (rank, n), True, "randomized", seed=7))
    torch.testing.assert_close(fast @ fast.t(), torch.eye(rank), atol=1e-5, rtol=0)
    kept_exact = torch.linalg.matrix_norm(grad @ exact.t())
    kept_fast = torch.linalg.matrix_norm(grad @ fast.t())
    assert kept_fast >= 0.99 * kept_exact, (kept_fast, kept_exact)
    left = engine_optim.orthogonal_basis(
        grad.t(), (n, rank), False, "randomized", seed=7
    )  # m < n: left vectors
    assert left.shape == (n, rank)
    assert torch.linalg.matrix_norm(left.t() @ grad.t()) >= 0.99 * kept_exact


def test_svd_setting_is_checked():
    from tiertune.errors import ConfigError
    from tiertune.methods.optim import GaLore

    linear = nn.Linear(8, 8)
    with pytest.raises(ConfigError, match="exact or randomized"):
        GaLore(GaloreSettings(svd="fast"), [linear], {id(linear): "proj"})


@pytest.mark.gpu
@pytest.mark.parametrize("svd", ["exact", "randomized"])
def test_galore_projects_on_the_gpu(tmp_path, disk_dir, svd):
    """On a CUDA device the full gradients, the SVDs and the products stay on the GPU: the projections are
    acquired there in backward (bytes host->device), the host receives only low-rank gradients, and in fp32
    with the exact SVD the losses are the CPU run's (to float tolerance: cuSOLVER and LAPACK differ in
    the last bits, and the projections are refreshed at step 1 only)."""
    reference = _llama_7b_like(tmp_path / "model", layers=2)
    batches = _batches(512)
    losses, sent = {}, {}
    for device in ("cpu", "cuda"):
        store = StoreConfig.resolve(
            device=device,
            device_budget="64MiB",
            host_budget="128MiB",
            disk_path=str(disk_dir / device),
            chunk_size="1GiB",
        )
        cfg = _config(method="galore", galore=GaloreSettings(rank=16, update_proj_gap=100, svd=svd))
        trainer = StreamedTrainer(str(tmp_path / "model"), store, cfg)
        try:
            losses[device] = [trainer.step([batches[s]]) for s in range(3)]
            sent[device] = trainer.gradient_bytes / 3
            proj = [c for s in trainer.states for c in s.proj if c is not None]
            if device == "cuda":  # each projection lived on the GPU and crossed to the host (the update's)
                moved = [trainer.store.moved(c) for c in proj]
                assert all(m.get("host->device", 0) + m.get("device->host", 0) > 0 for m in moved), moved
        finally:
            trainer.close()
    assert sent["cuda"] == sent["cpu"] == _gradient_shapes(reference, 16)[0]
    if svd == "exact":
        torch.testing.assert_close(
            torch.tensor(losses["cuda"]), torch.tensor(losses["cpu"]), rtol=1e-4, atol=0
        )
    assert all(torch.isfinite(torch.tensor(losses["cuda"])))
