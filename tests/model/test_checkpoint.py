"""The loader refuses a checkpoint that does not fit, naming the tensor or file."""


import pytest
import torch
from safetensors.torch import load_file, save_file

from attnserve.model import CheckpointError, load_checkpoint
from tests.harness import make_tiny_checkpoint


@pytest.fixture
def checkpoint(tmp_path):
    return make_tiny_checkpoint(tmp_path / "ckpt")


def rewrite(checkpoint, change):
    tensors = load_file(checkpoint / "model.safetensors")
    change(tensors)
    save_file(tensors, checkpoint / "model.safetensors")


def test_tiny_checkpoint_loads_and_matches_hugging_face(checkpoint):
    from transformers import BertModel

    ours = load_checkpoint(checkpoint)
    hf = BertModel.from_pretrained(checkpoint, attn_implementation="eager").eval()
    ids = torch.randint(0, 30522, (2, 9))
    with torch.no_grad():
        diff = ours(ids).last_hidden_state - hf(ids).last_hidden_state
    assert diff.abs().max() <= 1e-5


def test_wrong_shape_is_refused_naming_the_tensor(checkpoint):
    name = "encoder.layer.1.attention.self.key.weight"
    rewrite(checkpoint, lambda t: t.__setitem__(name, torch.zeros(32, 31)))
    with pytest.raises(CheckpointError, match=rf"{name} has shape \(32, 31\)"):
        load_checkpoint(checkpoint)


def test_missing_tensor_is_refused_naming_it(checkpoint):
    rewrite(checkpoint, lambda t: t.pop("encoder.layer.0.output.dense.bias"))
    with pytest.raises(CheckpointError, match=r"missing tensor for layers\.0\.feed_forward\.down\.bias"):
        load_checkpoint(checkpoint)


def test_unknown_tensor_is_refused_naming_it(checkpoint):
    rewrite(checkpoint, lambda t: t.__setitem__("cls.predictions.bias", torch.zeros(3)))
    with pytest.raises(CheckpointError, match=r"cls\.predictions\.bias does not belong"):
        load_checkpoint(checkpoint)


@pytest.mark.parametrize("file", ["config.json", "model.safetensors", "tokenizer.json"])
def test_missing_file_is_refused_naming_it(checkpoint, file):
    (checkpoint / file).unlink()
    with pytest.raises(CheckpointError, match=rf"{file}: missing"):
        load_checkpoint(checkpoint)


def test_default_checkpoint_is_minilm():
    encoder = load_checkpoint()
    c = encoder.config
    assert (c.num_layers, c.num_heads, c.hidden_size, c.max_positions) == (6, 12, 384, 512)
