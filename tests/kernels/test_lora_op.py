"""The fused LoRA branch: the Triton kernels (``TRITON_INTERPRET=1`` on a CPU, fp32) and the torch fallback
against the reference with the same dropout mask, forward and backward, on shapes that are not powers of two
and ranks below tl.dot's 16; the reference against peft's own ``lora.Linear``; reproducibility under
``torch.manual_seed``; and the bytes saved for backward against peft's module."""

import importlib.util

import pytest
import torch

from tiertune.kernels.ops.lora import (
    LoRABranchTorch,
    LoRABranchTriton,
    draw_seed,
    dropout_keep_mask,
    lora_branch,
    lora_branch_reference,
)

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
BACKENDS = ["torch"] + (["triton"] if HAS_TRITON else [])
FUNCTIONS = {"torch": LoRABranchTorch, "triton": LoRABranchTriton}
SHAPES = [((37, 48), 72, 8), ((37, 100), 130, 4), ((2, 19, 100), 72, 16), ((5, 33), 17, 1)]


def _inputs(x_shape, out_features, rank, seed, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    n_in = x_shape[-1]
    x = torch.randn(*x_shape, generator=g).to(device, dtype).requires_grad_()
    a = (torch.randn(rank, n_in, generator=g) / n_in**0.5).to(device, dtype).requires_grad_()
    b = torch.randn(out_features, rank, generator=g).to(device, dtype).requires_grad_()
    dy = torch.randn(*x_shape[:-1], out_features, generator=g).to(device, dtype)
    return x, a, b, dy


def _run(fn, x, a, b, dy):
    """Output and the gradients of x, A and B."""
    y = fn()
    gx, ga, gb = torch.autograd.grad(y, (x, a, b), dy)
    return y.detach(), gx, ga, gb


def _assert_all_close(got, want, **tol):
    for name, u, v in zip(("out", "grad_x", "grad_a", "grad_b"), got, want):
        torch.testing.assert_close(u, v, **tol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("x_shape", "out_features", "rank"), SHAPES)
@pytest.mark.parametrize("p", [0.0, 0.1])
def test_the_fused_branch_matches_the_reference_with_its_mask(backend, x_shape, out_features, rank, p):
    x, a, b, dy = _inputs(x_shape, out_features, rank, seed=x_shape[-1] + rank)
    keep = dropout_keep_mask(1234, x.shape, p, x.device, backend=backend) if p else None
    want = _run(lambda: lora_branch_reference(x, a, b, 1.5, p, keep), x, a, b, dy)
    got = _run(lambda: FUNCTIONS[backend].apply(x, a, b, 1.5, p, 1234), x, a, b, dy)
    _assert_all_close(got, want, rtol=1e-5, atol=1e-5)
    if p:  # the dropout did something: without the mask the result is different
        plain = lora_branch_reference(x, a, b, 1.5)
        assert not torch.allclose(got[0], plain, rtol=1e-3, atol=1e-3)


@needs_triton
def test_triton_backward_sums_grad_a_over_groups_of_row_blocks(monkeypatch):
    """Few programs: each one takes several row blocks (the last group runs past the tokens)."""
    from tiertune.kernels.ops import _triton_lora

    monkeypatch.setattr(_triton_lora, "MAX_PROGRAMS", 4)
    x, a, b, dy = _inputs((300, 100), 24, 8, seed=4)
    keep = dropout_keep_mask(77, x.shape, 0.1, x.device)
    want = _run(lambda: lora_branch_reference(x, a, b, 1.5, 0.1, keep), x, a, b, dy)
    got = _run(lambda: LoRABranchTriton.apply(x, a, b, 1.5, 0.1, 77), x, a, b, dy)
    _assert_all_close(got, want, rtol=1e-5, atol=2e-4)  # grad_a reaches ~500: sums of 300 terms in fp32


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_drawn_seed_follows_torch_manual_seed_and_backward_draws_the_same_mask(backend):
    x, a, b, dy = _inputs((37, 48), 72, 8, seed=3)
    torch.manual_seed(11)
    seed = draw_seed()
    keep = dropout_keep_mask(seed, x.shape, 0.1, x.device, backend=backend)
    want = _run(lambda: lora_branch_reference(x, a, b, 2.0, 0.1, keep), x, a, b, dy)
    runs = []
    for s in (11, 11, 12):
        torch.manual_seed(s)
        runs.append(_run(lambda: lora_branch(x, a, b, 2.0, p=0.1, backend=backend), x, a, b, dy))
    _assert_all_close(runs[0], want, rtol=1e-5, atol=1e-5)
    for u, v in zip(runs[0], runs[1]):
        assert torch.equal(u, v)
    assert not torch.allclose(runs[0][0], runs[2][0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_keep_mask_keeps_one_minus_p_and_depends_on_the_seed(backend):
    shape = (96, 130)
    keep = dropout_keep_mask(7, shape, 0.25, "cpu", backend=backend)
    assert keep.shape == shape and keep.dtype == torch.bool
    assert abs(keep.float().mean().item() - 0.75) < 0.02
    assert torch.equal(keep, dropout_keep_mask(7, shape, 0.25, "cpu", backend=backend))
    assert not torch.equal(keep, dropout_keep_mask(8, shape, 0.25, "cpu", backend=backend))
    assert dropout_keep_mask(7, shape, 0.0, "cpu", backend=backend).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_without_training_there_is_no_dropout(backend):
    x, a, b, dy = _inputs((37, 48), 72, 8, seed=5)
    want = _run(lambda: lora_branch_reference(x, a, b, 2.0), x, a, b, dy)
    got = _run(lambda: lora_branch(x, a, b, 2.0, p=0.1, training=False, backend=backend), x, a, b, dy)
    _assert_all_close(got, want, rtol=1e-5, atol=1e-5)


def test_an_fp32_adapter_on_bf16_inputs_returns_fp32_and_a_bf16_input_gradient():
    x, a, b, dy = _inputs((37, 48), 72, 8, seed=9)
    x = x.detach().bfloat16().requires_grad_()
    keep = dropout_keep_mask(5, x.shape, 0.1, "cpu", backend="torch")
    want = _run(lambda: lora_branch_reference(x, a, b, 2.0, 0.1, keep), x, a, b, dy)
    got = _run(lambda: LoRABranchTorch.apply(x, a, b, 2.0, 0.1, 5), x, a, b, dy)
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.bfloat16
    _assert_all_close(got, want, rtol=1e-5, atol=1e-5)


def test_bad_arguments_are_refused():
    x, a, b, _ = _inputs((4, 16), 8, 2, seed=0)
    with pytest.raises(ValueError, match="dropout probability"):
        lora_branch(x, a, b, 1.0, p=1.0)
    with pytest.raises(ValueError, match="backend"):
        lora_branch(x, a, b, 1.0, backend="cuda")


def _peft_linear(n_in, n_out, rank, dropout, base_dtype=torch.float32):
    """A peft ``lora.Linear`` (random B, so the branch is not zero) on a frozen base; peft keeps the adapter
    in fp32 on a bf16 base."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("proj", torch.nn.Linear(n_in, n_out, dtype=base_dtype))
    config = LoraConfig(
        r=rank,
        lora_alpha=2 * rank + 3,
        lora_dropout=dropout,
        target_modules=["proj"],
        init_lora_weights=False,
    )
    module = get_peft_model(model, config).base_model.model.proj
    assert module.lora_A["default"].weight.dtype == torch.float32
    return module


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_the_reference_is_what_peft_adds(x_dtype):
    """The output of peft's lora_B times the scaling is the delta its Linear adds to the base output; with a
    bf16 input and an fp32 adapter peft casts the input up, and so does the reference."""
    module = _peft_linear(48, 72, 8, dropout=0.0, base_dtype=x_dtype)
    a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
    scale = module.scaling["default"]
    captured = []
    module.lora_B["default"].register_forward_hook(lambda m, i, o: captured.append(o))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 7, 48, generator=g).to(x_dtype).requires_grad_()
    dy = torch.randn(3, 7, 72, generator=g)
    out = module(x)
    delta = captured[0] * scale
    if x_dtype == torch.float32:
        torch.testing.assert_close(out, module.base_layer(x) + delta)
    want = (delta.detach(), *torch.autograd.grad(delta, (x, a, b), dy))
    got = _run(lambda: lora_branch_reference(x, a, b, scale), x, a, b, dy)
    assert got[0].dtype == delta.dtype == torch.float32
    _assert_all_close(got, want, rtol=1e-6, atol=1e-6)


def _saved_storages(fn, held: torch.Tensor) -> list[int]:
    """Sizes in bytes of the storages autograd keeps for backward while ``fn`` runs, each once, leaving out
    the storage of ``held`` (the layer's input, which the caller keeps anyway)."""
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    storages.pop(held.untyped_storage().data_ptr(), None)
    del out
    return list(storages.values())


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_fused_branch_saves_no_copy_of_the_input(backend):
    """peft keeps dropout's mask and the dropped-out input (each the input's size); the fused branch keeps
    the input itself, which the caller holds anyway, and only rank- and weight-sized tensors besides."""
    module = _peft_linear(96, 80, 8, dropout=0.1).train()
    a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
    scale = module.scaling["default"]
    x = torch.randn(700, 96, requires_grad=True)  # more tokens than features: x outweighs the base weight
    x_bytes = x.numel() * x.element_size()
    peft = _saved_storages(lambda: module(x), held=x)
    fused = _saved_storages(
        lambda: module.base_layer(x) + lora_branch(x, a, b, scale, p=0.1, backend=backend), held=x
    )
    assert sum(fused) + x_bytes <= sum(peft), (fused, peft)
    assert max(fused) < x_bytes and sorted(peft)[-2] >= x_bytes, (fused, peft)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON, reason="needs a CUDA device and triton")
@pytest.mark.parametrize(
    ("x_shape", "out_features", "rank"), [((4, 1000, 4096), 4096, 16), ((3001, 2048), 5632, 8)]
)
@pytest.mark.parametrize("adapter_dtype", [torch.bfloat16, torch.float32])
def test_triton_matches_the_reference_in_bf16_on_a_gpu(x_shape, out_features, rank, adapter_dtype):
    x, a, b, dy = _inputs(x_shape, out_features, rank, seed=0, dtype=torch.bfloat16, device="cuda")
    a = a.detach().to(adapter_dtype).requires_grad_()
    b = (0.02 * b.detach()).to(adapter_dtype).requires_grad_()
    dy = dy.to(adapter_dtype)
    keep = dropout_keep_mask(99, x.shape, 0.1, "cuda")
    want = _run(lambda: lora_branch_reference(x, a, b, 2.0, 0.1, keep), x, a, b, dy)
    got = _run(lambda: LoRABranchTriton.apply(x, a, b, 2.0, 0.1, 99), x, a, b, dy)
    assert got[0].dtype == adapter_dtype and got[1].dtype == torch.bfloat16
    for name, u, v in zip(("out", "grad_x", "grad_a", "grad_b"), got, want):
        err = (u.float() - v.float()).norm() / v.float().norm()
        assert err < 1e-2, (name, err.item())


def test_the_branch_returns_the_dtype_asked_for_and_back_propagates_in_tiles():
    """An fp32 adapter on bf16 inputs of 8,192 tokens, the output asked for in bf16: the reference's output cast
    to bf16 and its gradients; and what forward and backward hold at once stays under three inputs' worth (the
    input's gradient and the output, both bf16, and a tile's fp32 temporaries): casting the whole output's
    gradient to fp32 and multiplying it back would alone hold four."""
    from tiertune.engine.activations import LiveBytes

    x, a, b, dy = _inputs((8192, 256), 256, 8, seed=3)
    x = x.detach().bfloat16().requires_grad_()
    dy = dy.bfloat16()
    want = _run(lambda: lora_branch_reference(x, a, b, 2.0).bfloat16(), x, a, b, dy)
    with LiveBytes() as live:
        got = _run(lambda: lora_branch(x, a, b, 2.0, backend="torch", out_dtype=torch.bfloat16), x, a, b, dy)
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.bfloat16
    _assert_all_close(got, want, rtol=2e-2, atol=2e-2)
    x_bytes = x.numel() * x.element_size()
    assert live.peak < 3 * x_bytes, (live.peak, x_bytes)


@pytest.mark.parametrize("backend", BACKENDS)
def test_autograd_adds_the_base_layers_input_gradient_into_the_branchs(backend, monkeypatch):
    """A LoRA layer's input gradient is the base layer's plus the branch's: the branch makes its own in the
    input's shape (no view of a flat tensor), so backward's engine sums the two into it in place and no third
    input-sized tensor is made (the engine does so only for a tensor it holds the only reference to, no view).
    Triton's interpreter keeps a reference to a kernel's arguments: there only the shape is checked."""
    made = []
    function = FUNCTIONS[backend]
    original = function.backward

    def backward(ctx, grad_out):
        grads = original(ctx, grad_out)
        made.append((grads[0].data_ptr(), grads[0]._is_view()))  # no reference kept: that would stop the sum
        return grads

    monkeypatch.setattr(function, "backward", staticmethod(backward))
    x, a, b, _ = _inputs((2, 37, 48), 48, 8, seed=5)
    base = torch.nn.Linear(48, 48).requires_grad_(False)
    y = base(x) + lora_branch(x, a, b, 2.0, backend=backend)
    (gx,) = torch.autograd.grad(y, [x], torch.ones_like(y))
    assert made[0][1] is False
    if backend == "torch":
        assert made[0][0] == gx.data_ptr()
    want = torch.ones(2, 37, 48) @ (base.weight + 2.0 * b @ a).detach()
    torch.testing.assert_close(gx, want, rtol=1e-5, atol=1e-5)
