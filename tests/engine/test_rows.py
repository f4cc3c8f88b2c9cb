"""A trained input embedding back-propagated through its wave's rows (``engine.rows``), its update split
around them (``Updater.splits``: background pieces, then the rows), and the worker's background pieces."""

import contextlib
import threading
import time

import pytest
import torch
from test_engine import _check_parity
from torch import nn

from tiertune.engine import update
from tiertune.engine.rows import InputRows, outside_ranges
from tiertune.engine.worker import OptimizerWorker


@pytest.mark.parametrize(
    "rows, index, per_piece",
    [(20, [0, 3, 4, 9, 19], 4), (7, [], 3), (5, [0, 1, 2, 3, 4], 2), (10, [5], 10), (1, [], 1)],
)
def test_the_pieces_cover_every_row_but_the_inside_ones_once(rows, index, per_piece):
    pieces = outside_ranges(rows, index, per_piece)
    covered = [r for piece in pieces for lo, hi in piece for r in range(lo, hi)]
    assert covered == [r for r in range(rows) if r not in index]  # each once, in order
    for piece in pieces:
        assert piece  # no empty piece is listed
        assert max(hi for _, hi in piece) - min(lo for lo, _ in piece) <= per_piece
        assert all(lo < hi for lo, hi in piece)


class _Scaled(nn.Embedding):
    """An embedding that scales its output in its own forward, as Gemma's does."""

    def forward(self, ids):
        return super().forward(ids) * 3.0


class _Binder:
    """The binder's side ``InputRows`` uses: a weight bound as the module's, and put back."""

    def __init__(self, module):
        self.module, self.slots = module, {"w": [type("S", (), {"module": module, "attr": "weight"})()]}
        self.full = module.weight

    def bind(self, views, requires_grad):
        p = nn.Parameter(views["w"], requires_grad=requires_grad)
        self.module._parameters["weight"] = p
        return {"w": p}

    def unbind(self, names):
        self.module._parameters["weight"] = self.full


class _State:
    def __init__(self, module):
        self.group = type("G", (), {"kind": "embed", "params": {"w": module.weight}})()
        self.trainable = True


@pytest.mark.parametrize("padding", [None, 5, 40])
def test_the_rows_backward_is_the_module_s_own_backward(padding):
    """The rows bound as the weight, ids mapped to them: the module's own embeddings (its scaling too), and
    its own dense gradient in those rows, zero elsewhere (the padding row's dropped as ``padding_idx`` says);
    the module as it was after."""
    from tiertune.engine.compute import Compute

    torch.manual_seed(0)
    module = _Scaled(50, 8, padding_idx=padding)
    full = module.weight
    ids = [torch.tensor([[5, 7, 7, 2]]), torch.tensor([[9, 5, 11, 2]])]
    grads = [torch.randn(1, 4, 8) for _ in ids]
    expected = [module(i).detach() for i in ids]
    dense = sum(torch.autograd.grad(module(i), full, g)[0] for i, g in zip(ids, grads, strict=True))
    rows = InputRows.of(module, [_State(module)], _Binder(module), Compute())
    assert rows is not None
    rows.start(ids)
    rows.gather(full)
    with rows.bound():
        assert module.weight.shape == (5, 8)  # the rows alone
        for i, g, want in zip(ids, grads, expected, strict=True):
            out = module(i)
            torch.testing.assert_close(out, want, rtol=0, atol=0)
            out.backward(g)
            rows.harvest()
    assert module.weight is full and module.padding_idx == padding
    got = rows.take()
    assert got.index.tolist() == [2, 5, 7, 9, 11]
    torch.testing.assert_close(got.dense(), dense, rtol=0, atol=0)
    others = [r for r in range(50) if r not in got.index.tolist()]
    assert not dense[others].any()
    if padding == 5:
        assert not got.dense()[5].any()


def test_an_embedding_it_cannot_stand_in_for_keeps_its_own_backward():
    from tiertune.engine.compute import Compute

    module = nn.Embedding(10, 4, max_norm=1.0)  # rewrites its weight in forward
    assert InputRows.of(module, [_State(module)], _Binder(module), Compute()) is None


class _Store:
    """What the worker asks of a store: nothing to prefetch, no other thread it waits for."""

    def prefetch(self, chunks):
        pass

    @contextlib.contextmanager
    def holding(self, holder):
        yield

    def waiting(self, ident):
        return False


class _S:
    def __init__(self, name):
        self.name, self.weights = name, [object()]

    def reads(self, j):
        return []


def test_a_unit_runs_before_the_background_pieces_left_and_the_rest_after_its_own():
    """Background pieces run only when no unit is queued; a unit submitted meanwhile runs next; the rest of a
    split unit (``part``) runs after its state's pieces; ``join`` waits for the pieces too; the pieces count
    towards no limit (``submit`` never waits for them)."""
    ran, started, gate = [], threading.Event(), threading.Event()

    def run_unit(unit, coef, part):
        if part == "first piece":
            started.set()
            gate.wait(5)
        ran.append((unit[0].name, part))
        time.sleep(0.01)

    worker = OptimizerWorker(_Store(), run_unit, {"optimizer_busy": 0.0}, max_pending=1)
    try:
        embed, layer = _S("embed"), _S("layer")
        worker.start_step([])
        worker.submit_background([(embed, 0, "first piece"), (embed, 0, "piece 2"), (embed, 0, "piece 3")])
        assert started.wait(5)  # the worker had nothing else to do
        waited = worker.submit(layer, None, 0)  # max_pending 1: the pieces do not count
        assert waited < 1.0
        gate.set()
        worker.submit(embed, None, 0, part="rest")
        worker.join()
    finally:
        worker.close()
    assert ran[0] == ("embed", "first piece")  # it had started
    assert ran[1] == ("layer", None)  # queued meanwhile: before the pieces left
    assert ran[2:] == [("embed", "piece 2"), ("embed", "piece 3"), ("embed", "rest")]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("max_grad_norm", [2.9, 0.0])
def test_a_split_update_of_the_embedding_is_the_plain_loop_s(
    tiny_model_dir, disk_dir, family, max_grad_norm, monkeypatch
):
    """Tied (Llama) and untied (Qwen2) embeddings, states on the host: speculative steps split the embedding's
    update (pieces outside the rows, then the rows), confirmed, redone from the gradients when they clip, or in
    place without clipping; the losses and weights are the plain loop's (``_check_parity``'s bounds)."""
    parts = {"Outside": 0, "Inside": 0, "Fill": 0}
    real = update.Updater.unit

    def counted(self, state, j, coef, part=None):
        if part is not None:
            parts[type(part).__name__] += 1
        return real(self, state, j, coef, part)

    monkeypatch.setattr(update.Updater, "unit", counted)
    path, initial = tiny_model_dir(family)
    trainer = _check_parity(
        path, initial, disk_dir, "host", "1MiB", overlap_optimizer="on", max_grad_norm=max_grad_norm
    )
    counts = trainer.optimizer_counts
    speculative = counts["speculative"] + counts["redone"]
    assert speculative >= 4  # of STEPS: a step after a clipped one waits for the norm
    assert parts["Inside"] == speculative  # every speculative step split it
    assert parts["Outside"] >= speculative
    if max_grad_norm:
        assert counts["redone"] >= 1 and parts["Fill"] > 0  # twins, filled ahead
