"""Fused linear + cross-entropy against the unfused reference: forward and backward, odd shapes and
vocabularies, ignored targets, both reductions, soft-capped logits, the torch and the Triton backends (the
Triton one under ``TRITON_INTERPRET=1`` on a CPU, in fp32: the interpreter's bf16 arithmetic is wrong); and
its peak memory."""

import importlib.util
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from tiertune.kernels.ops.linear_ce import linear_cross_entropy, linear_cross_entropy_reference

BACKENDS = ["torch"] + (["triton"] if importlib.util.find_spec("triton") else [])


@pytest.mark.parametrize(
    ("tokens", "hidden", "vocab", "chunk"),
    [(37, 16, 101, 8), (128, 64, 1000, 128), (250, 48, 32003, 64), (5, 8, 7, 1)],
)
@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_the_unfused_loss_and_gradients(tokens, hidden, vocab, chunk, reduction, with_bias, backend):
    g = torch.Generator().manual_seed(tokens + vocab)
    x = torch.randn(tokens, hidden, generator=g, requires_grad=True)
    w = (torch.randn(vocab, hidden, generator=g) * 0.1).requires_grad_()
    b = (torch.randn(vocab, generator=g) * 0.1).requires_grad_() if with_bias else None
    target = torch.randint(0, vocab, (tokens,), generator=g)
    target[torch.rand(tokens, generator=g) < 0.3] = -100  # ignored tokens (padding, prompts)
    upstream = 0.37  # a loss scaled before backward, as the engine divides by the step's tokens
    ours = linear_cross_entropy(x, w, target, b, reduction=reduction, chunk_tokens=chunk, backend=backend)
    (ours * upstream).backward()
    mine = [x.grad.clone(), w.grad.clone()] + ([b.grad.clone()] if with_bias else [])
    for t in [x, w] + ([b] if with_bias else []):
        t.grad = None
    ref = linear_cross_entropy_reference(x, w, target, b, reduction=reduction)
    (ref * upstream).backward()
    theirs = [x.grad, w.grad] + ([b.grad] if with_bias else [])
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    for a, r in zip(mine, theirs, strict=True):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("softcap", [30.0, 2.0])  # Gemma 2's cap, and one that flattens most logits
@pytest.mark.parametrize(("tokens", "hidden", "vocab", "chunk"), [(37, 16, 101, 8), (70, 32, 5003, 24)])
@pytest.mark.parametrize(("reduction", "with_bias"), [("sum", False), ("mean", True)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_soft_capped_logits_match_the_unfused_loss_and_gradients(
    tokens, hidden, vocab, chunk, reduction, with_bias, softcap, backend
):
    """``softcap``: the loss of ``softcap * tanh(logits / softcap)``, computed unfused by autograd through
    ``torch.tanh``; the loss alone (under no_grad) too. Logits of several units, so both caps change them."""
    g = torch.Generator().manual_seed(tokens + vocab)
    x = torch.randn(tokens, hidden, generator=g, requires_grad=True)
    w = (torch.randn(vocab, hidden, generator=g) * 0.5).requires_grad_()
    b = torch.randn(vocab, generator=g).requires_grad_() if with_bias else None
    target = torch.randint(0, vocab, (tokens,), generator=g)
    target[torch.rand(tokens, generator=g) < 0.3] = -100
    params = [x, w] + ([b] if with_bias else [])

    logits = torch.nn.functional.linear(x, w, b)
    capped = softcap * torch.tanh(logits / softcap)
    ref = torch.nn.functional.cross_entropy(capped, target, ignore_index=-100, reduction=reduction)
    (ref * 0.37).backward()
    theirs = [p.grad.clone() for p in params]
    uncapped = torch.nn.functional.cross_entropy(logits, target, ignore_index=-100, reduction=reduction)
    assert not torch.allclose(ref, uncapped, rtol=1e-3)  # the cap does change the loss
    for p in params:
        p.grad = None

    ours = linear_cross_entropy(
        x, w, target, b, reduction=reduction, chunk_tokens=chunk, backend=backend, softcap=softcap
    )
    (ours * 0.37).backward()
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    for p, r in zip(params, theirs, strict=True):
        torch.testing.assert_close(p.grad, r, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        alone = linear_cross_entropy(
            x, w, target, b, reduction=reduction, chunk_tokens=chunk, backend=backend, softcap=softcap
        )
        oracle = linear_cross_entropy_reference(x, w, target, b, reduction=reduction, softcap=softcap)
    torch.testing.assert_close(alone, ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(oracle, ref.detach(), rtol=1e-6, atol=1e-6)


def test_a_frozen_head_gets_no_gradient_and_x_does():
    x = torch.randn(20, 8, requires_grad=True)
    w = torch.randn(50, 8)
    target = torch.randint(0, 50, (20,))
    linear_cross_entropy(x, w, target, chunk_tokens=7).backward()
    assert x.grad is not None and w.grad is None


PEAK = """
import json, sys, torch
from tiertune.kernels.ops.linear_ce import linear_cross_entropy, linear_cross_entropy_reference
torch.manual_seed(0)
tokens, hidden, vocab = 4096, 256, 32000
x = torch.randn(tokens, hidden, requires_grad=True)
w = (torch.randn(vocab, hidden) * 0.02).requires_grad_()
target = torch.randint(0, vocab, (tokens,))
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1])
fn = linear_cross_entropy if sys.argv[1] == "fused" else linear_cross_entropy_reference
fn(x[:8], w, target[:8]).backward()  # warm up: the allocator's and the kernels' one-time memory
x.grad = w.grad = None
base = status("VmRSS:")
open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
fn(x, w, target).backward()
print(json.dumps({"peak_kib": status("VmHWM:") - base}))
"""


@pytest.mark.slow
def test_the_torch_fallback_peaks_at_under_a_quarter_of_the_unfused_loss():
    """Vocabulary 32k x 4k tokens, hidden 256, on the CPU, each in a fresh process: how far the peak RSS
    (reset just before the call) rises above the RSS with the inputs in memory; it includes the gradients of
    x and the weight, which both variants produce."""
    peaks = {}
    for kind in ("fused", "unfused"):
        out = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(PEAK), kind], capture_output=True, text=True, check=True
        )
        peaks[kind] = json.loads(out.stdout.strip().splitlines()[-1])["peak_kib"]
    print(peaks)
    assert peaks["fused"] <= peaks["unfused"] / 4, peaks


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,hidden,vocab", [(4096, 4096, 128256), (1000, 2048, 32003)])
def test_triton_matches_torch_in_bf16_on_a_gpu(tokens, hidden, vocab):
    """Both backends on the tensor cores (bf16 products into fp32 logits) against the fp32 oracle on the same
    (bf16-valued) inputs: the loss to fp32's rounding, the gradients to the rounding of the logits' gradient to
    bf16 (relative norms)."""
    from tiertune.kernels.ops.linear_ce import linear_cross_entropy_reference, mixed_matmul

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    w = (torch.randn(vocab, hidden, device="cuda", generator=g) * 0.02).bfloat16().requires_grad_()
    target = torch.randint(0, vocab, (tokens,), device="cuda", generator=g)
    assert mixed_matmul(x, w)
    x32, w32 = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    loss = linear_cross_entropy_reference(x32, w32, target)
    loss.backward()
    oracle = (loss.detach(), x32.grad, w32.grad)
    for backend in ("torch", "triton"):
        loss = linear_cross_entropy(x, w, target, backend=backend)
        loss.backward()
        ours = (loss.detach(), x.grad, w.grad)
        torch.testing.assert_close(ours[0].float(), oracle[0], rtol=1e-4, atol=0)
        for name, a, b in zip(("x", "w"), ours[1:], oracle[1:], strict=True):
            assert a.dtype == torch.bfloat16
            rel = float((a.float() - b).norm() / b.norm())
            assert rel < 1e-2, (backend, name, rel)
        x.grad = w.grad = None


def test_under_no_grad_only_the_loss_is_computed():
    """Evaluation: the same loss, without computing the gradients (whose head-sized buffer and matmuls are
    most of the op's cost): the ops run are recorded, the weight's gradient accumulation must be absent."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.add(str(func))
            return func(*args, **(kwargs or {}))

    x = torch.randn(30, 8, requires_grad=True)
    w = torch.randn(77, 8, requires_grad=True)
    target = torch.randint(0, 77, (30,))
    with torch.no_grad(), Record() as evaluating:
        loss = linear_cross_entropy(x, w, target, chunk_tokens=7, backend="torch")
    assert loss.grad_fn is None
    torch.testing.assert_close(loss, linear_cross_entropy_reference(x, w, target).detach())
    with Record() as training:
        linear_cross_entropy(x, w, target, chunk_tokens=7, backend="torch")
    assert "aten.addmm_.default" in training.ops and "aten.addmm_.default" not in evaluating.ops


@pytest.mark.parametrize("with_bias", [False, True])
def test_a_bf16_head_is_upcast_a_slice_at_a_time(monkeypatch, with_bias):
    """A head in bf16 (a tied 256k x 12k embedding is 12.6 GB in fp32): the logits are still computed in fp32,
    from one slice of at most SLICE_BYTES of the head upcast at a time, never the whole head, and loss and
    gradients equal the unfused fp32 computation on the same bf16 values."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from tiertune.kernels.ops import linear_ce

    tokens, hidden, vocab = 37, 16, 1001
    monkeypatch.setattr(linear_ce, "SLICE_BYTES", 100 * hidden * 4)  # 100 rows: 11 slices, the last short
    g = torch.Generator().manual_seed(3)
    x = torch.randn(tokens, hidden, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * 0.1).bfloat16().requires_grad_()
    b = (torch.randn(vocab, generator=g) * 0.1).bfloat16().requires_grad_() if with_bias else None
    target = torch.randint(0, vocab, (tokens,), generator=g)
    target[:5] = -100

    class Upcasts(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            source = args[0] if func is torch.ops.aten._to_copy.default else None
            # an fp32 copy of rows of the head (x has only `tokens` rows)
            if (
                source is not None
                and source.dim() == 2
                and source.shape[0] > tokens
                and out.dtype == torch.float32
            ):
                Upcasts.largest = max(Upcasts.largest, out.numel())
            return out

    with Upcasts():
        ours = linear_cross_entropy(x, w, target, b, chunk_tokens=16, backend="torch")
    ours.backward()
    assert 0 < Upcasts.largest <= 100 * hidden  # slices of the head were upcast, never more than one slice
    mine = [x.grad.clone(), w.grad.clone()] + ([b.grad.clone()] if with_bias else [])
    x32 = x.detach().float().requires_grad_()
    w32 = w.detach().float().requires_grad_()
    b32 = b.detach().float().requires_grad_() if with_bias else None
    ref = linear_cross_entropy_reference(x32, w32, target, b32)
    ref.backward()
    theirs = [x32.grad, w32.grad] + ([b32.grad] if with_bias else [])
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    for a, r in zip(mine, theirs, strict=True):  # the gradients are returned in the inputs' bf16
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), r.to(torch.bfloat16).float(), rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("chunk", [None, 5])
@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("with_bias", [False, True])
def test_each_tokens_entropy_comes_with_its_cross_entropy(chunk, softcap, with_bias):
    """GRPO's ``entropy``: each token's ``-sum p log p`` of the (capped) logits beside its cross-entropy, from
    the same chunks, against the unfused softmax; 0 where the target is ignored."""
    from tiertune.kernels.ops.linear_ce import token_cross_entropy, token_cross_entropy_and_entropy

    torch.manual_seed(0)
    x, weight = torch.randn(13, 16, dtype=torch.float64), torch.randn(40, 16, dtype=torch.float64)
    bias = torch.randn(40, dtype=torch.float64) if with_bias else None
    target = torch.randint(0, 40, (13,))
    target[[2, 7]] = -100
    losses, entropies = token_cross_entropy_and_entropy(
        x, weight, target, bias, chunk_tokens=chunk, softcap=softcap
    )
    logits = x @ weight.t() + (bias if bias is not None else 0)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    logp = torch.log_softmax(logits, -1)
    valid = target != -100
    expected = -(logp.exp() * logp).sum(-1) * valid
    torch.testing.assert_close(entropies, expected.float(), rtol=1e-5, atol=1e-6)
    assert (entropies[~valid] == 0).all() and (entropies[valid] > 0).all()
    torch.testing.assert_close(losses, token_cross_entropy(x, weight, target, bias, softcap=softcap))
