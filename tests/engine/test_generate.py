"""Batched decoding over a streamed model (``StreamedTrainer.generate``, ``engine.generate``): greedy decoding of
a model whose weights are on disk is transformers' ``generate`` token for token (several architectures, a
batch with left padding, a row stopping at its EOS token), a layer's weights are read once per decoded token for
the whole batch, and sampling with a seed is the same run after run."""

import itertools

import pytest
import torch

from tiertune.engine import EngineConfig, StreamedTrainer
from tiertune.offload.store import StoreConfig

PROMPTS = [[5, 17, 42, 9, 3, 77], [8, 1], [100, 23, 5, 61]]


def _trainer(path, disk_dir, name, budget="1MiB", **config):
    store = StoreConfig.resolve(
        device_budget=budget, host_budget=budget, disk_path=str(disk_dir / name), chunk_size="256KiB"
    )
    base = dict(dtype=torch.float32, params="disk", method="frozen", max_steps=1)
    return StreamedTrainer(str(path), store, EngineConfig(**{**base, **config}))


def _theirs(model, prompts, new, eos=None):
    """transformers' greedy ``generate`` on the left-padded batch; each row's new tokens, up to its EOS."""
    rows, longest = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros((rows, longest), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, longest - len(p) :], mask[r, longest - len(p) :] = torch.tensor(p), 1
    model.generation_config.pad_token_id = 0
    out = model.eval().generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=new,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0,
    )[:, longest:]
    got = []
    for row in out.tolist():
        cut = row.index(eos) + 1 if eos is not None and eos in row else len(row)
        got.append(row[:cut])
    return got


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt_neox", "gemma"])
def test_greedy_decoding_is_transformers_generate(tiny_model_dir, disk_dir, family):
    path, model = tiny_model_dir(family, layers=3)
    theirs = _theirs(model, PROMPTS, 12)
    trainer = _trainer(path, disk_dir, family)
    try:
        assert trainer.generate(PROMPTS, max_new_tokens=12) == theirs
    finally:
        trainer.close()


def test_a_row_stops_at_its_eos_and_the_weights_are_read_at_most_once_a_token(tiny_model_dir, disk_dir):
    path, model = tiny_model_dir("gpt_neox", layers=3)  # (its random weights draw varied tokens)
    free = _theirs(model, PROMPTS, 10)
    # a token some row draws first after a few others: that row stops there, the others go on (unless they draw it)
    row, at = next((r, k) for r, g in enumerate(free) for k in range(1, len(g)) if g[k] not in g[:k])
    eos = free[row][at]
    theirs = _theirs(model, PROMPTS, 10, eos=eos)
    trainer = _trainer(path, disk_dir, "eos", budget="320KiB")  # room for the layer in use, not all three
    try:
        before = trainer.store_stats().bytes_moved.get("disk->host", 0)
        got = trainer.generate(PROMPTS, max_new_tokens=10, eos_token_id=eos)
        read = trainer.store_stats().bytes_moved.get("disk->host", 0) - before
        layers = sum(trainer.chunk_sizes()["layer_weights"])
    finally:
        trainer.close()
    assert got == theirs and got[row][-1] == eos and len(got[row]) == at + 1
    passes = max(len(g) for g in got)  # a pass a decoded token, the prompt's first
    assert layers <= read <= layers * passes * 1.05, (read, layers, passes)


def test_a_host_budget_that_holds_most_layers_keeps_them_between_passes(tiny_model_dir, disk_dir):
    """A decoding is a repeating pass (``ChunkStore.repeating``): the first pass recorded, the next ones replayed,
    eviction keeping what the next pass needs soonest. 16 layers of 132 KiB through a host budget of 1.56 MiB:
    each later pass reads at most 60% of the layers' bytes from the disk (a pass with no trace to go by, LRU,
    read them all each time), every pass copies them to the compute device at most once, and the tokens are
    the greedy ones; the training steps' trace is back after it."""
    path, model = tiny_model_dir("gpt_neox", layers=16)
    theirs = _theirs(model, PROMPTS, 8)
    store = StoreConfig.resolve(
        device_budget="600KiB", host_budget="1600KiB", disk_path=str(disk_dir / "keep"), chunk_size="256KiB"
    )
    trainer = StreamedTrainer(
        str(path), store, EngineConfig(dtype=torch.float32, params="disk", method="frozen", max_steps=1)
    )
    marks = []
    mark = trainer.store.mark_step

    def counted():
        moved = trainer.store_stats().bytes_moved
        marks.append((moved.get("disk->host", 0), moved.get("host->device", 0)))
        mark()

    trainer.store.mark_step = counted
    try:
        trace = trainer.store.scheduler
        got = trainer.generate(PROMPTS, max_new_tokens=8)
        assert trainer.store.scheduler is trace
        layers = sum(trainer.chunk_sizes()["layer_weights"])
    finally:
        trainer.close()
    assert got == theirs and len(marks) == 8
    passes = [(b[0] - a[0], b[1] - a[1]) for a, b in itertools.pairwise(marks)]
    for read, copied in passes[1:]:  # after the first replayed pass
        assert read <= 0.6 * layers and copied <= layers * 1.05, (passes, layers)


def test_sampling_with_a_seed_is_reproducible(tiny_model_dir, disk_dir):
    path, _ = tiny_model_dir("llama", layers=3)
    trainer = _trainer(path, disk_dir, "sample")
    try:
        kw = dict(max_new_tokens=16, temperature=0.8, top_p=0.9, top_k=50)
        first = trainer.generate(PROMPTS, seed=7, **kw)
        again = trainer.generate(PROMPTS, seed=7, **kw)
        other = trainer.generate(PROMPTS, seed=8, **kw)
    finally:
        trainer.close()
    assert first == again and first != other


def test_the_kv_cache_goes_to_host_memory_only_where_the_gpu_is_short(monkeypatch):
    """``kv_on_host``'s rule: on a CUDA device, the cache at its longest and a pass's working memory against
    ``KV_SHARE`` of what is free (the allocator's unused cache counted free, a per-process cap respected); on
    the CPU, never."""
    from types import SimpleNamespace

    from tiertune.engine import generate as gen

    config = SimpleNamespace(
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=64, hidden_size=512,
        intermediate_size=1024, vocab_size=1000,
    )  # fmt: skip
    per_row = gen.kv_bytes(config, 96, 2) + gen.pass_bytes(config, 64, 2)
    assert (
        gen.kv_bytes(config, 96, 2) == 4 * 96 * 2 * 2 * 64 * 2
    )  # layers x tokens x (k, v) x heads x dim x 2 B
    assert not gen.kv_on_host(torch.device("cpu"), config, 10_000, 64, 32, 2)
    free = 100 * per_row
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, 10 * free))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 0)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 1.0, raising=False)
    cuda = torch.device("cuda")
    assert not gen.kv_on_host(cuda, config, 90, 64, 32, 2)  # 90 rows: 90% of the free memory
    assert gen.kv_on_host(cuda, config, 91, 64, 32, 2)
    # a cap of 5% of the GPU: what the process may still allocate is the room
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 0.05, raising=False)
    assert gen.kv_on_host(cuda, config, 46, 64, 32, 2) and not gen.kv_on_host(cuda, config, 45, 64, 32, 2)


@pytest.mark.gpu
def test_on_a_gpu_a_kv_cache_in_host_memory_decodes_the_same_tokens(tiny_model_dir, disk_dir, monkeypatch):
    """Forced to host memory (``KV_SHARE`` 0), the KV cache (transformers' offloaded cache, a layer back on the
    GPU for its visit) gives the greedy tokens of the cache kept on the GPU, and of transformers' generate."""
    from tiertune.engine import generate as gen

    path, model = tiny_model_dir("llama", layers=3)
    theirs = _theirs(model, PROMPTS, 12)
    got = {}
    for share in (gen.KV_SHARE, 0.0):
        monkeypatch.setattr(gen, "KV_SHARE", share)
        store = StoreConfig.resolve(
            device="cuda", device_budget="1MiB", host_budget="1MiB", disk_path=str(disk_dir / str(share))
        )
        trainer = StreamedTrainer(
            str(path), store, EngineConfig(dtype=torch.float32, params="disk", method="frozen", max_steps=1)
        )
        try:
            got[share] = trainer.generate(PROMPTS, max_new_tokens=12)
        finally:
            trainer.close()
    assert got[0.0] == got[gen.KV_SHARE] == theirs


def test_decoding_is_without_dropout(tmp_path, disk_dir):
    """A model that trains with dropout (attention dropout 0.5 here) decodes without it: the decoder layers,
    held out of the module tree by the streamed engine, follow the model's ``eval()`` (they kept training mode
    and dropped half the attention weights)."""
    from transformers import AutoModelForCausalLM

    from tests.tiny import tiny_config

    config = tiny_config("llama", 3)
    config.attention_dropout = 0.5
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path / "model")
    theirs = _theirs(model, PROMPTS, 12)
    trainer = _trainer(tmp_path / "model", disk_dir, "dropout")
    try:
        assert trainer.generate(PROMPTS, max_new_tokens=12) == theirs
        assert all(layer.layer.training for layer in trainer.parts.layers)  # back to training mode after
    finally:
        trainer.close()
