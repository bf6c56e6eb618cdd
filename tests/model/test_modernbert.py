"""ModernBERT's parts against transformers' own: the rotary convention, the local window,
the configs the Hub carries in either form, the fused tensors split at load."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from attnserve.model import CheckpointError, load_checkpoint
from attnserve.model.positions import RotaryEmbedding
from tests.families import MODERNBERT_WINDOW, make_checkpoint
from tests.hugging_face import HuggingFace


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint("modernbert", tmp_path_factory.mktemp("modernbert"))


def edited(checkpoint, directory, **fields):
    directory.mkdir()
    for path in checkpoint.iterdir():
        (directory / path.name).write_bytes(path.read_bytes())
    config = json.loads((directory / "config.json").read_text())
    for key, value in fields.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def same_as_transformers(directory, length: int = 60) -> float:
    hf = HuggingFace(directory)
    ids = torch.randint(0, 300, (2, length))
    mask = torch.ones_like(ids)
    mask[1, length // 3:] = 0
    with torch.no_grad():
        got = load_checkpoint(directory)(ids, mask).last_hidden_state
        want = hf.model(input_ids=ids, attention_mask=mask).last_hidden_state
    return float((got - want)[mask.bool()].abs().max())


def test_halves_are_transformers_rotate_half():
    from transformers.models.modernbert.modeling_modernbert import apply_rotary_pos_emb

    torch.manual_seed(0)
    head_dim, seq, base = 16, 40, 160_000.0
    rotary = RotaryEmbedding(head_dim, 64, base, pairs="halves")
    q, k = torch.randn(2, 3, seq, head_dim), torch.randn(2, 3, seq, head_dim)
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.arange(seq, dtype=torch.float32)[None, :, None] * inv_freq
    emb = torch.cat((angles, angles), dim=-1)
    want_q, want_k = apply_rotary_pos_emb(q, k, emb.cos(), emb.sin())
    assert (rotary(q) - want_q).abs().max() <= 1e-6
    assert (rotary(k) - want_k).abs().max() <= 1e-6
    assert (RotaryEmbedding(head_dim, 64, base)(q) - want_q).abs().max() > 0.1


def test_local_layers_see_only_their_window_global_ones_everything(checkpoint):
    encoder = load_checkpoint(checkpoint)
    assert encoder.config.layer_types == ("global", "local", "global")
    ids = torch.randint(0, 300, (1, 50))
    with torch.no_grad():
        maps = encoder(ids, output_attentions=True).attentions
    distance = (torch.arange(50)[:, None] - torch.arange(50)[None, :]).abs()
    outside = distance > MODERNBERT_WINDOW // 2
    assert torch.all(maps[1][..., outside] == 0) and torch.all(maps[1][..., ~outside] > 0)
    assert torch.all(maps[0] > 0) and torch.all(maps[2] > 0)


def test_a_config_in_the_hubs_older_form_reads_the_same(checkpoint, tmp_path):
    """ModernBERT-base's config.json names its layers by global_attn_every_n_layers and its
    bases global_rope_theta and local_rope_theta; transformers reads both forms."""
    directory = edited(checkpoint, tmp_path / "older", layer_types=None, rope_parameters=None,
                       global_attn_every_n_layers=2, global_rope_theta=80_000.0,
                       local_rope_theta=5_000.0)
    config = load_checkpoint(directory).config
    assert config.layer_types == ("global", "local", "global")
    assert (config.global_rope_theta, config.local_rope_theta) == (80_000.0, 5_000.0)
    assert same_as_transformers(directory) <= 1e-5


def test_rope_scaling_is_refused(checkpoint, tmp_path):
    directory = edited(checkpoint, tmp_path / "scaled", rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 160_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
    with pytest.raises(CheckpointError, match=r"rope_parameters\.full_attention\.rope_type "
                                              r"'linear' is not supported"):
        load_checkpoint(directory)


def test_a_masked_lm_loads_its_encoder_and_drops_the_head(checkpoint, tmp_path):
    from transformers import ModernBertConfig, ModernBertForMaskedLM

    torch.manual_seed(1)
    config = ModernBertConfig.from_pretrained(checkpoint)
    hf = ModernBertForMaskedLM(config).eval()
    directory = tmp_path / "mlm"
    hf.save_pretrained(directory, safe_serialization=True)
    (directory / "tokenizer.json").write_bytes((checkpoint / "tokenizer.json").read_bytes())
    ids = torch.randint(0, 300, (1, 40))
    with torch.no_grad():
        got = load_checkpoint(directory)(ids).last_hidden_state
        want = hf.model(input_ids=ids).last_hidden_state
    assert (got - want).abs().max() <= 1e-5


def test_a_fused_tensor_of_the_wrong_shape_is_refused_naming_it(checkpoint, tmp_path):
    directory = edited(checkpoint, tmp_path / "bad")
    tensors = load_file(directory / "model.safetensors")
    tensors["layers.1.attn.Wqkv.weight"] = tensors["layers.1.attn.Wqkv.weight"][:64]
    save_file(tensors, directory / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"tensor layers\.1\.attn\.Wqkv\.weight has shape "
                                              r"\(64, 32\), the model expects \(96, 32\)"):
        load_checkpoint(directory)
