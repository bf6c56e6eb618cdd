"""The loader goes by config.json's model_type and architectures, never by tensor names:
checkpoints of families it does not implement are refused, naming what was read and what
is served, even where their tensors would fit. What real checkpoints carry beside the
encoder (a language-model head, RoPE buffers) loads by each family's rules; what a family
does not implement is refused by name."""

import json
import shutil

import pytest
import torch

from attnserve.model import CheckpointError, load_checkpoint
from tests.harness import make_tiny_checkpoint, minilm_dir

SERVED = ("attnserve exports bert, roberta, xlm-roberta, modernbert, mpnet, distilbert, qwen3, "
          "gemma3_text")


def saved(model, directory):
    """`model` as transformers saves it, with a tokenizer beside it (the loader needs one)."""
    model.save_pretrained(directory, safe_serialization=True)
    shutil.copyfile(minilm_dir() / "tokenizer.json", directory / "tokenizer.json")
    return directory


def edit_config(directory, **fields):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    for key, value in fields.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def other_family(kind: str):
    import transformers

    shape = dict(vocab_size=30522, hidden_size=32, num_attention_heads=4)
    if kind == "electra":
        config = transformers.ElectraConfig(embedding_size=32, num_hidden_layers=2,
                                            intermediate_size=64, **shape)
        return transformers.ElectraModel(config)
    config = transformers.DebertaV2Config(num_hidden_layers=2, intermediate_size=64, **shape)
    return transformers.DebertaV2Model(config)


@pytest.mark.parametrize("kind", ["electra", "deberta-v2"])
def test_another_family_is_refused_naming_its_model_type(tmp_path, kind):
    directory = saved(other_family(kind), tmp_path / kind)
    with pytest.raises(CheckpointError) as refused:
        load_checkpoint(directory)
    assert str(refused.value) == (f"{directory / 'config.json'}: model_type {kind!r} is not "
                                  f"served; {SERVED}")


def test_bert_tensors_under_another_model_type_are_refused(tmp_path):
    """Every tensor name is BERT's; config.json says it is not a BERT."""
    directory = make_tiny_checkpoint(tmp_path / "relabelled")
    edit_config(directory, model_type="camembert")
    with pytest.raises(CheckpointError, match=rf"model_type 'camembert' is not served; {SERVED}$"):
        load_checkpoint(directory)
    edit_config(directory, model_type=None)
    with pytest.raises(CheckpointError, match=rf"config\.json: no model_type; {SERVED}$"):
        load_checkpoint(directory)


def test_an_architecture_of_another_family_is_refused(tmp_path):
    directory = make_tiny_checkpoint(tmp_path / "mixed")
    edit_config(directory, architectures=["RobertaModel"])
    with pytest.raises(CheckpointError, match=r"architectures: 'RobertaModel' is not served; for "
                                              r"model_type 'bert' attnserve exports BertModel, "
                                              r"BertForMaskedLM"):
        load_checkpoint(directory)
    # A BERT relabelled RoBERTa would load with RoBERTa's positions: its architecture says no.
    edit_config(directory, model_type="roberta", architectures=["BertModel"])
    with pytest.raises(CheckpointError, match=r"architectures: 'BertModel' is not served; for "
                                              r"model_type 'roberta' attnserve exports RobertaModel, "
                                              r"RobertaForMaskedLM"):
        load_checkpoint(directory)


def test_other_heads_are_refused(tmp_path):
    from transformers import BertConfig, BertForTokenClassification

    config = BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64)
    directory = saved(BertForTokenClassification(config), tmp_path / "tagger")
    with pytest.raises(CheckpointError, match=r"'BertForTokenClassification' is not served"):
        load_checkpoint(directory)


def test_a_masked_lm_loads_its_encoder_and_drops_the_head(tmp_path):
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    config = BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=128)
    hf = BertForMaskedLM(config).eval()
    directory = saved(hf, tmp_path / "mlm")
    ours = load_checkpoint(directory)
    assert ours.pooler is None  # BertForMaskedLM's encoder has no pooler
    ids = torch.randint(0, 30522, (2, 9))
    with torch.no_grad():
        diff = ours(ids).last_hidden_state - hf.bert(ids).last_hidden_state
    assert diff.abs().max() <= 1e-5


def test_an_xlm_roberta_masked_lm_loads_its_encoder(tmp_path):
    """Its tensors under roberta., its head under lm_head. (dropped); no pooler."""
    from transformers import XLMRobertaConfig, XLMRobertaForMaskedLM

    torch.manual_seed(0)
    config = XLMRobertaConfig(vocab_size=300, hidden_size=32, num_hidden_layers=2,
                              num_attention_heads=4, intermediate_size=64,
                              max_position_embeddings=130, type_vocab_size=1)
    hf = XLMRobertaForMaskedLM(config).eval()
    ours = load_checkpoint(saved(hf, tmp_path / "xlmr-mlm"))
    assert ours.pooler is None and ours.config.max_positions == 128
    ids = torch.randint(3, 300, (2, 9))
    with torch.no_grad():
        diff = ours(ids).last_hidden_state - hf.roberta(ids).last_hidden_state
    assert diff.abs().max() <= 1e-5


@pytest.mark.parametrize("family, head", [("mpnet", "MPNetForMaskedLM"),
                                          ("distilbert", "DistilBertForMaskedLM"),
                                          ("qwen3", "Qwen3ForCausalLM"),
                                          ("gemma3_text", "Gemma3ForCausalLM")])
def test_a_language_model_loads_its_encoder_and_drops_the_head(tmp_path, family, head):
    """The head untied from the token embeddings, so its tensors are in the file."""
    import transformers

    from tests.families import make_checkpoint

    config = transformers.AutoConfig.from_pretrained(make_checkpoint(family, tmp_path / "base"))
    config.tie_word_embeddings = False
    torch.manual_seed(0)
    hf = getattr(transformers, head)(config).eval()
    directory = saved(hf, tmp_path / head)
    ours = load_checkpoint(directory)
    ids = torch.randint(3, config.vocab_size, (2, 9))
    with torch.no_grad():
        diff = ours(ids).last_hidden_state - hf.base_model(ids).last_hidden_state
    assert diff.abs().max() <= 1e-5


def test_rope_buffers_saved_with_the_weights_are_checked_and_skipped(tmp_path):
    """Older decoder checkpoints carry RoPE's inverse frequencies per layer: skipped when
    they are what config.json's rope_theta and head_dim give, refused by name when not."""
    from safetensors.torch import load_file, save_file

    from tests.families import make_checkpoint

    directory = make_checkpoint("qwen3", tmp_path / "qwen3")
    reference = load_checkpoint(directory)
    tensors = load_file(directory / "model.safetensors")
    inv_freq = 1.0 / 1_000_000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16)
    for layer in range(2):
        tensors[f"model.layers.{layer}.self_attn.rotary_emb.inv_freq"] = inv_freq.clone()
    save_file(tensors, directory / "model.safetensors")
    ids = torch.randint(3, 400, (1, 12))
    with torch.no_grad():
        assert torch.equal(load_checkpoint(directory)(ids).last_hidden_state,
                           reference(ids).last_hidden_state)
    tensors["model.layers.1.self_attn.rotary_emb.inv_freq"] = inv_freq * 2
    save_file(tensors, directory / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor model\.layers\.1\."
                                              r"self_attn\.rotary_emb\.inv_freq is not the RoPE"):
        load_checkpoint(directory)


@pytest.mark.parametrize("family, fields, message", [
    ("qwen3", {"use_sliding_window": True}, "use_sliding_window true is not supported"),
    ("qwen3", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
     "rope_parameters.rope_type 'yarn' is not supported (default)"),
    ("qwen3", {"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported (silu)"),
    ("gemma3_text", {"use_bidirectional_attention": False},
     "use_bidirectional_attention false: attnserve exports Gemma3 run bidirectionally"),
    ("gemma3_text", {"attn_logit_softcapping": 50.0},
     "attn_logit_softcapping 50.0 is not supported (null)"),
    ("mpnet", {"pad_token_id": 0}, "pad_token_id 0: MPNet numbers its positions after id 1"),
    ("distilbert", {"activation": "silu"}, "activation 'silu' is not supported (gelu, relu)"),
])
def test_what_a_family_does_not_implement_is_refused_by_name(tmp_path, family, fields, message):
    from tests.families import make_checkpoint

    directory = make_checkpoint(family, tmp_path / family)
    edit_config(directory, **fields)
    with pytest.raises(CheckpointError) as refused:
        load_checkpoint(directory)
    assert str(refused.value).startswith(f"{directory / 'config.json'}: {message}"), refused.value
