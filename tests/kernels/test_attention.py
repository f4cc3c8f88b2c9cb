"""Segment attention (``kernels.ops.attention``): packed and padded rows as causal segments, never a
sequence x sequence mask, equal to transformers' own attention on the positions a loss reads."""

from __future__ import annotations

import copy

import pytest
import torch

from tiertune.kernels.ops.attention import NAME, segment_attention_fits, segments, use_segment_attention


def tiny(model_type: str, **overrides) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(
        vocab_size=101,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        head_dim=16,
        pad_token_id=0,
    )
    kw.update(overrides)
    config = AutoConfig.for_model(model_type, **kw)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def run(model, batch: dict, valid: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    logits = model(**batch, use_cache=False).logits
    weights = torch.linspace(-1, 1, logits.shape[-1])
    (logits * weights * valid[..., None]).sum().backward()
    return (logits * valid[..., None]).detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def packed_positions(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths])[None]


def test_segments_from_positions_and_padding():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 0]])
    assert segments(pos, None, 1, 10) == [[(0, 3), (3, 5), (5, 9), (9, 10)]]
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    assert segments(None, mask, 2, 6) == [[(0, 4)], [(0, 6)]]
    assert segments(None, torch.tensor([[1, 0, 1, 0]]), 1, 4) is None  # a hole: the mask path
    assert segments(None, None, 2, 5) == [[(0, 5)], [(0, 5)]]


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_packed_rows_equal_sdpas_block_diagonal_mask(model_type):
    """Three documents in one row and a row of two (position_ids restarting), fp32: logits and every
    gradient equal transformers' sdpa with its block-diagonal mask."""
    model = tiny(model_type)
    ours = copy.deepcopy(model)
    assert use_segment_attention(ours) is None and ours.config._attn_implementation == NAME
    ids = torch.randint(1, 101, (2, 48), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([packed_positions([20, 5, 23]), packed_positions([31, 17])])
    batch = {"input_ids": ids, "position_ids": pos}
    valid = torch.ones(2, 48)
    a, b = run(ours, batch, valid), run(model, batch, valid)
    torch.testing.assert_close(a[0], b[0], rtol=1e-5, atol=1e-5)
    for name, grad in b[1].items():
        torch.testing.assert_close(a[1][name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_padded_rows_equal_sdpa():
    model = tiny("llama")
    ours = copy.deepcopy(model)
    assert use_segment_attention(ours) is None
    ids = torch.randint(1, 101, (3, 40), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 40, dtype=torch.long)
    mask[0, 31:] = 0
    mask[2, 7:] = 0
    batch = {"input_ids": ids, "attention_mask": mask}
    a, b = run(ours, batch, mask.float()), run(model, batch, mask.float())
    torch.testing.assert_close(a[0], b[0], rtol=1e-5, atol=1e-5)
    # every position, padded ones too (an MoE router sees them)
    with torch.no_grad():
        torch.testing.assert_close(ours(**batch).logits, model(**batch).logits, rtol=1e-5, atol=1e-5)
    for name, grad in b[1].items():
        torch.testing.assert_close(a[1][name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_no_sequence_by_sequence_tensor_for_a_packed_row(monkeypatch):
    """The largest tensor attention sees for a packed 4096-token row is linear in the length (sdpa's mask
    would be 4096 x 4096)."""
    import torch.nn.functional as F

    model = tiny("llama")
    assert use_segment_attention(model) is None
    seen = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        seen.append(attn_mask)
        return real(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    ids = torch.randint(1, 101, (1, 4096))
    with torch.no_grad():
        model(input_ids=ids, position_ids=packed_positions([1000, 3000, 96]))
    assert seen and all(m is None for m in seen)


def test_what_keeps_its_own_attention():
    from transformers import AutoConfig

    gemma2 = AutoConfig.for_model("gemma2")
    assert segment_attention_fits(gemma2) is not None
    mistral = AutoConfig.for_model("mistral", sliding_window=4096)
    assert segment_attention_fits(mistral) == "a sliding attention window"
    assert segment_attention_fits(AutoConfig.for_model("llama")) is None


def test_backward_recomputes_each_call_with_the_forwards_dropout():
    """A packed and right-padded batch with attention dropout: the gradients ``segment_attention`` computes by
    recomputing each SDPA call in backward equal autograd through the same calls, each given the same random
    draws (the random state replayed from forward)."""
    import torch.nn.functional as F

    from tiertune.kernels.ops.attention import _gather, _jobs, segment_attention, segments

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 40, 8, generator=g, requires_grad=True) for _ in range(3))
    positions = torch.cat([torch.arange(15), torch.arange(25)])[None].expand(2, -1)
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, 33:] = 0
    grad = torch.randn(2, 40, 4, 8, generator=g)
    torch.manual_seed(7)
    out, _ = segment_attention(None, q, k, v, mask, dropout=0.3, scaling=None, position_ids=positions)
    ours = torch.autograd.grad(out, (q, k, v), grad)

    torch.manual_seed(7)
    rows = segments(positions, mask, 2, 40)
    expected = q.new_zeros(2, 40, 4, 8)
    for q_at, kv_at, n, causal in _jobs(rows, 40, q.device):
        o = F.scaled_dot_product_attention(
            _gather(q, q_at, n), _gather(k, kv_at, n), _gather(v, kv_at, n), dropout_p=0.3, is_causal=causal
        )
        expected = expected.index_put((q_at[0], q_at[1]), o.transpose(1, 2).reshape(-1, 4, 8))
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    for a, b in zip(ours, torch.autograd.grad(expected, (q, k, v), grad), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert any(x.abs().sum() > 0 for x in ours)


def test_a_packed_rows_gradients_written_over_its_own_queries_keys_and_values_are_the_same():
    """Packed rows, no padding: when q, k and v are intermediates (as in a model) each call's gradients are
    written over the tokens it read; they equal those of the same call on leaves (new tensors, summed)."""
    from tiertune.kernels.ops.attention import segment_attention

    g = torch.Generator().manual_seed(1)
    leaves = [torch.randn(2, 4, 48, 8, generator=g, requires_grad=True) for _ in range(3)]
    positions = torch.cat([torch.arange(20), torch.arange(28)])[None].expand(2, -1)
    grad = torch.randn(2, 48, 4, 8, generator=g)
    held = [x * 1.0 for x in leaves]  # intermediates: the in-place path
    out, _ = segment_attention(None, *held, None, position_ids=positions)
    in_place = torch.autograd.grad(out, leaves, grad)
    assert out.grad_fn.in_place
    # the intermediates now hold their gradients (x * 1.0: the leaves' gradients)
    assert all(torch.equal(x.detach(), gx) for x, gx in zip(held, in_place, strict=True))
    out2, _ = segment_attention(None, *leaves, None, position_ids=positions)
    assert not out2.grad_fn.in_place
    torch.testing.assert_close(out, out2, rtol=0, atol=0)
    for a, b in zip(in_place, torch.autograd.grad(out2, leaves, grad), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (4, 4), (6, 1)])
@pytest.mark.parametrize("held", [False, True])
def test_long_rows_run_a_kv_head_at_a_time_and_equal_sdpa(monkeypatch, heads, kv_heads, held):
    """Rows of one document at least ``_GROUPED_TOKENS`` long with autograd (lowered to 64 here): one SDPA call
    per row and KV head, recomputed in backward; output and gradients equal SDPA's over all heads at once (fp32,
    1e-6), written over q, k and v when they are intermediates (``held``), into new tensors for leaves."""
    import torch.nn.functional as F

    from tiertune.kernels.ops import attention

    monkeypatch.setattr(attention, "_GROUPED_TOKENS", 64)
    g = torch.Generator().manual_seed(2)
    leaves = [torch.randn(2, n, 80, 8, generator=g, requires_grad=True) for n in (heads, kv_heads, kv_heads)]
    grad = torch.randn(2, 80, heads, 8, generator=g)
    inputs = [x * 1.0 for x in leaves] if held else leaves
    out, _ = attention.segment_attention(None, *inputs, None)
    assert type(out.grad_fn).__name__ == "_HeadGroupsBackward" and out.grad_fn.in_place == held
    ours = torch.autograd.grad(out, leaves, grad)
    expected = F.scaled_dot_product_attention(
        *leaves, is_causal=True, enable_gqa=kv_heads != heads
    ).transpose(1, 2)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    for a, b in zip(ours, torch.autograd.grad(expected, leaves, grad), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)

    class Refused:
        @staticmethod
        def apply(*args):
            raise AssertionError("a KV head at a time")

    monkeypatch.setattr(attention, "_HeadGroups", Refused)
    with torch.no_grad():  # forward without backward keeps SDPA's one call, as does a shorter row
        attention.segment_attention(None, *leaves, None)
    attention.segment_attention(None, *(x[:, :, :63] for x in leaves), None)


def test_long_rows_recompute_each_call_with_the_forwards_dropout(monkeypatch):
    """Attention dropout in the KV-head calls: backward's recomputation draws what forward drew (the gradients
    equal autograd through the same calls, made by hand with the same seed)."""
    import torch.nn.functional as F

    from tiertune.kernels.ops import attention

    monkeypatch.setattr(attention, "_GROUPED_TOKENS", 32)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, n, 40, 8, generator=g, requires_grad=True) for n in (4, 2, 2))
    grad = torch.randn(1, 40, 4, 8, generator=g)
    torch.manual_seed(11)
    out, _ = attention.segment_attention(None, q, k, v, None, dropout=0.4)
    ours = torch.autograd.grad(out, (q, k, v), grad)
    torch.manual_seed(11)
    parts = [
        F.scaled_dot_product_attention(
            q[:, 2 * j : 2 * j + 2],
            k[:, j : j + 1],
            v[:, j : j + 1],
            dropout_p=0.4,
            is_causal=True,
            enable_gqa=True,
        )
        for j in range(2)
    ]
    expected = torch.cat(parts, dim=1).transpose(1, 2)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    for a, b in zip(ours, torch.autograd.grad(expected, (q, k, v), grad), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
