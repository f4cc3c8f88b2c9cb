import shutil

import pytest
import torch
from safetensors import safe_open

from tiertune.errors import ModelError
from tiertune.loading.weights import INDEX, Checkpoint


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt_neox"])
def test_every_tensor_matches_the_safetensors_library(tiny_model_dir, family):
    path, _ = tiny_model_dir(family)
    assert (path / INDEX).exists()  # sharded
    ckpt = Checkpoint(path)
    seen = 0
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
                expected = f.get_tensor(name)
                out = torch.empty_like(expected)
                ckpt.read_into(name, out)
                assert torch.equal(out, expected), name
                as_bf16 = torch.empty(expected.shape, dtype=torch.bfloat16)
                ckpt.read_into(name, as_bf16, scratch=torch.empty(4096, dtype=torch.uint8))  # many slices
                assert torch.equal(as_bf16, expected.to(torch.bfloat16)), name
                seen += 1
    assert seen == len(ckpt.entries) > 10


def test_single_file_checkpoint(tiny_model_dir, tmp_path):
    _, model = tiny_model_dir("llama")
    model.save_pretrained(tmp_path)  # one model.safetensors
    ckpt = Checkpoint(tmp_path)
    w = model.state_dict()["model.layers.1.mlp.up_proj.weight"]
    out = torch.empty_like(w)
    ckpt.read_into("model.layers.1.mlp.up_proj.weight", out)
    assert torch.equal(out, w)


def _copy(path, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(path, dst)
    return dst


def test_errors_name_the_file(tiny_model_dir, tmp_path):
    path, _ = tiny_model_dir("qwen2")
    with pytest.raises(ModelError, match="no safetensors weights"):
        Checkpoint(tmp_path)
    broken = _copy(path, tmp_path)
    shard = sorted(broken.glob("*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ModelError, match=f"{shard.name}.*does not exist"):
        Checkpoint(broken)


def test_truncated_and_corrupt_files_are_detected(tiny_model_dir, tmp_path):
    path, _ = tiny_model_dir("gpt_neox")
    truncated = _copy(path, tmp_path)
    shard = sorted(truncated.glob("*.safetensors"))[0]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 100)
    with pytest.raises(ModelError, match=f"{shard.name} is truncated"):
        Checkpoint(truncated)
    corrupt = tmp_path / "corrupt"
    shutil.copytree(path, corrupt)
    shard = sorted(corrupt.glob("*.safetensors"))[0]
    raw = bytearray(shard.read_bytes())
    raw[8:20] = b"\x00garbage!!\x00\x00"
    shard.write_bytes(bytes(raw))
    with pytest.raises(ModelError, match=f"{shard.name} is corrupt"):
        Checkpoint(corrupt)


def test_shape_mismatch_names_the_tensor(tiny_model_dir):
    path, _ = tiny_model_dir("llama")
    ckpt = Checkpoint(path)
    with pytest.raises(ModelError, match="model.norm.weight.*expects"):
        ckpt.read_into("model.norm.weight", torch.empty(3))


def test_an_integer_tensor_for_a_floating_weight_is_refused(tiny_model_dir, tmp_path):
    """An int32 tensor where the model has a floating-point weight was cast and trained on (its integers as
    weights): a ModelError naming the tensor, its file and dtype."""
    from safetensors.torch import load_file, save_file

    path, _ = tiny_model_dir("llama")
    copy = _copy(path, tmp_path)
    shard = next(f for f in sorted(copy.glob("*.safetensors")) if "model.norm.weight" in load_file(f))
    tensors = load_file(shard)
    shape = tuple(tensors["model.norm.weight"].shape)
    tensors["model.norm.weight"] = torch.arange(shape[0], dtype=torch.int32)
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(
        ModelError, match=rf"'model.norm.weight' in .*{shard.name} is int32, but it is a floating"
    ):
        Checkpoint(copy).read_into("model.norm.weight", torch.empty(shape))
    out = torch.empty(
        shape, dtype=torch.int32
    )  # read as what it is: allowed (quantized bases store integers)
    Checkpoint(copy).read_into("model.norm.weight", out)
    assert out.tolist() == list(range(shape[0]))
