"""Triton kernels of the LoRA branch (see ``lora.py``).

The dropout mask is never stored: every kernel draws it again from ``tl.rand(seed, offset)``, where ``offset``
is the element's index in the row-major [tokens, in_features] input, so each element keeps or drops the same
way in the forward, in the backward and in ``keep_mask``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 64  # tokens per tile
BLOCK_K = 64  # in_features per tile
MIN_DOT = 16  # tl.dot wants every dimension >= 16: the rank is padded to this
MAX_PROGRAMS = 1024  # backward: enough to fill a GPU, few enough that the fp32 partials of grad_A stay small


@triton.jit
def _dropped(
    x, rows, cols, n_rows, n_in, stride_x, seed, p, keep_scale, DROPOUT: tl.constexpr, dtype: tl.constexpr
):
    """The [rows x cols] tile of ``dropout(x)``, cast to ``dtype`` (A's) like peft casts x; zero outside."""
    inside = (rows[:, None] < n_rows) & (cols[None, :] < n_in)
    xt = tl.load(x + rows[:, None] * stride_x + cols[None, :], mask=inside, other=0.0).to(dtype)
    if DROPOUT:
        keep = tl.rand(seed, rows[:, None] * n_in + cols[None, :]) >= p
        xt = tl.where(keep, xt * keep_scale, 0.0).to(dtype)
    return xt


@triton.jit(do_not_specialize=["seed"])
def _forward(
    x,
    a,
    h,
    seed,
    n_rows,
    n_in,
    rank,
    stride_x,
    stride_a,
    stride_h,
    p,
    keep_scale,
    DROPOUT: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    R: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    ranks = tl.arange(0, R)
    acc = tl.zeros((BLOCK_M, R), dtype=tl.float32)
    for k in range(0, n_in, BLOCK_K):
        cols = k + tl.arange(0, BLOCK_K)
        xt = _dropped(x, rows, cols, n_rows, n_in, stride_x, seed, p, keep_scale, DROPOUT, a.dtype.element_ty)
        at = tl.load(  # A^T's [cols x ranks] tile; the padded ranks are zero
            a + ranks[None, :] * stride_a + cols[:, None],
            mask=(ranks[None, :] < rank) & (cols[:, None] < n_in),
            other=0.0,
        )
        acc = tl.dot(xt, at, acc, input_precision=PRECISION)
    inside = (rows[:, None] < n_rows) & (ranks[None, :] < rank)
    tl.store(h + rows[:, None] * stride_h + ranks[None, :], acc.to(h.dtype.element_ty), mask=inside)


@triton.jit(do_not_specialize=["seed"])
def _backward(
    x,
    a,
    gh,
    gx,
    ga_partial,
    seed,
    n_rows,
    n_in,
    rank,
    stride_x,
    stride_a,
    stride_gh,
    stride_gx,
    p,
    keep_scale,
    blocks_per,
    DROPOUT: tl.constexpr,
    WANT_X: tl.constexpr,
    WANT_A: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    R: tl.constexpr,
):
    # program (group, column block): ``blocks_per`` row blocks of one column block of x, so x is read once
    # for both gradients; the group's share of grad_A goes to its own partial (summed by the launcher)
    group = tl.program_id(0)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    ranks = tl.arange(0, R)
    dtype = a.dtype.element_ty
    a_tile = tl.load(
        a + ranks[:, None] * stride_a + cols[None, :],
        mask=(ranks[:, None] < rank) & (cols[None, :] < n_in),
        other=0.0,
    )
    ga = tl.zeros((R, BLOCK_N), dtype=tl.float32)
    for i in range(blocks_per):
        rows = (group.to(tl.int64) * blocks_per + i) * BLOCK_M + tl.arange(0, BLOCK_M)
        g = tl.load(
            gh + rows[:, None] * stride_gh + ranks[None, :],
            mask=(rows[:, None] < n_rows) & (ranks[None, :] < rank),
            other=0.0,
        )
        if WANT_X:
            # grad of dropout(x) rounded to A's dtype (what peft's lora_A returns), then the mask
            d = tl.dot(g, a_tile, input_precision=PRECISION).to(dtype)
            if DROPOUT:
                keep = tl.rand(seed, rows[:, None] * n_in + cols[None, :]) >= p
                d = tl.where(keep, d * keep_scale, 0.0)
            inside = (rows[:, None] < n_rows) & (cols[None, :] < n_in)
            tl.store(gx + rows[:, None] * stride_gx + cols[None, :], d.to(gx.dtype.element_ty), mask=inside)
        if WANT_A:
            xt = _dropped(x, rows, cols, n_rows, n_in, stride_x, seed, p, keep_scale, DROPOUT, dtype)
            ga = tl.dot(tl.trans(g), xt, ga, input_precision=PRECISION)
    if WANT_A:
        out = ga_partial + group.to(tl.int64) * R * n_in + ranks[:, None] * n_in + cols[None, :]
        tl.store(out, ga, mask=cols[None, :] < n_in)


@triton.jit(do_not_specialize=["seed"])
def _keep_mask(out, seed, n, p, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out + offs, (tl.rand(seed, offs) >= p).to(tl.int8), mask=offs < n)


def _rank_block(rank: int) -> int:
    return max(MIN_DOT, triton.next_power_of_2(rank))


def _rows_block(rows: int) -> int:
    return min(BLOCK_M, max(MIN_DOT, triton.next_power_of_2(rows)))


def _cols_block(cols: int) -> int:
    return min(BLOCK_K, max(MIN_DOT, triton.next_power_of_2(cols)))


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # fp32 as torch's matmul (no TF32 by default)


def lora_a_forward(x: torch.Tensor, a: torch.Tensor, seed: int, p: float) -> torch.Tensor:
    """``h = dropout(x) @ A^T`` ([tokens, r], A's dtype) for a contiguous 2-D ``x``."""
    rows, n_in = x.shape
    rank = a.shape[0]
    h = torch.empty((rows, rank), dtype=a.dtype, device=x.device)
    if rows == 0:
        return h
    a = a.contiguous()
    block_m = _rows_block(rows)
    _forward[(triton.cdiv(rows, block_m),)](
        x,
        a,
        h,
        seed,
        rows,
        n_in,
        rank,
        x.stride(0),
        a.stride(0),
        h.stride(0),
        p,
        1.0 / (1.0 - p),
        DROPOUT=p > 0,
        PRECISION=_precision(a.dtype),
        BLOCK_M=block_m,
        BLOCK_K=_cols_block(n_in),
        R=_rank_block(rank),
    )
    return h


def lora_a_backward(
    x: torch.Tensor,
    a: torch.Tensor,
    grad_h: torch.Tensor,
    seed: int,
    p: float,
    want_x: bool,
    want_a: bool,
    shape: tuple[int, ...] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``grad_x = mask * (grad_h @ A) / (1 - p)`` (x's dtype; made in ``shape``, the input's before it was
    flattened, when given: not a view, so autograd may add another gradient into it in place) and
    ``grad_A = grad_h^T @ dropout(x)`` (A's)."""
    rows, n_in = x.shape
    rank = a.shape[0]
    whole = torch.empty(shape or x.shape, dtype=x.dtype, device=x.device) if want_x else None
    gx = whole.view(rows, n_in) if whole is not None else None
    if rows == 0 or not (want_x or want_a):
        return whole, torch.zeros_like(a) if want_a else None
    a, grad_h = a.contiguous(), grad_h.to(a.dtype).contiguous()
    block_m, block_n, block_r = _rows_block(rows), _cols_block(n_in), _rank_block(rank)
    row_blocks, col_blocks = triton.cdiv(rows, block_m), triton.cdiv(n_in, block_n)
    groups = min(row_blocks, max(1, MAX_PROGRAMS // col_blocks))
    per = triton.cdiv(row_blocks, groups)
    groups = triton.cdiv(row_blocks, per)
    partial = torch.empty((groups, block_r, n_in), dtype=torch.float32, device=x.device) if want_a else x
    _backward[(groups, col_blocks)](
        x,
        a,
        grad_h,
        gx if want_x else x,
        partial,
        seed,
        rows,
        n_in,
        rank,
        x.stride(0),
        a.stride(0),
        grad_h.stride(0),
        n_in,
        p,
        1.0 / (1.0 - p),
        per,
        DROPOUT=p > 0,
        WANT_X=want_x,
        WANT_A=want_a,
        PRECISION=_precision(a.dtype),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        R=block_r,
    )
    ga = partial[:, :rank].sum(0).to(a.dtype) if want_a else None
    return whole, ga


def keep_mask(seed: int, numel: int, p: float, device: torch.device) -> torch.Tensor:
    """The kernels' keep mask for ``seed``, flat (``numel`` booleans)."""
    out = torch.empty(numel, dtype=torch.int8, device=device)
    block = 1024
    if numel:
        _keep_mask[(triton.cdiv(numel, block),)](out, seed, numel, p, BLOCK=block)
    return out.bool()
