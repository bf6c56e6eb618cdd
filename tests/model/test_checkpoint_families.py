"""The loader goes by config.json's model_type and architectures, never by tensor names:
checkpoints of families it does not implement are refused, naming what was read and what
is served, even where their tensors would fit."""

import json
import shutil

import pytest
import torch

from attnserve.model import CheckpointError, load_checkpoint
from tests.harness import make_tiny_checkpoint, minilm_dir

SERVED = "attnserve exports bert, roberta, xlm-roberta, modernbert"


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
    if kind == "distilbert":
        config = transformers.DistilBertConfig(dim=32, n_layers=2, n_heads=4, hidden_dim=64)
        return transformers.DistilBertModel(config)
    if kind == "electra":
        config = transformers.ElectraConfig(embedding_size=32, num_hidden_layers=2,
                                            intermediate_size=64, **shape)
        return transformers.ElectraModel(config)
    config = transformers.DebertaV2Config(num_hidden_layers=2, intermediate_size=64, **shape)
    return transformers.DebertaV2Model(config)


@pytest.mark.parametrize("kind", ["distilbert", "electra", "deberta-v2"])
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
