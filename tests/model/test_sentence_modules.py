"""sentence-transformers' modules as model/sentence_modules.py reads them from modules.json:
Dense layers equal to sentence-transformers' own (residual, activation, both weight
formats it writes), and every module list that would make a served vector something
else than the model's refused, naming the file and the module."""

import json
import shutil

import pytest
import torch

from attnserve.model import CheckpointError
from attnserve.model.sentence_modules import MODULES, dense_layers, read_module_list
from tests.families import make_sentence_transformer


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    """DistilBERT saved by sentence-transformers: Transformer, cls Pooling, a Tanh Dense
    (its weights in pytorch_model.bin)."""
    return make_sentence_transformer("distilbert", tmp_path_factory.mktemp("st") / "distilbert")


@pytest.fixture
def checkpoint(tmp_path, original):
    return shutil.copytree(original, tmp_path / "checkpoint")


def edit_modules(checkpoint, edit) -> None:
    path = checkpoint / MODULES
    entries = json.loads(path.read_text())
    edit(entries)
    path.write_text(json.dumps(entries))


def test_the_module_list_of_a_saved_model(original):
    modules = read_module_list(original)
    assert modules.pooling_config == original / "1_Pooling" / "config.json"
    assert modules.dense == (original / "2_Dense",) and not modules.normalize
    assert (original / "2_Dense" / "pytorch_model.bin").is_file()


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("sizes", [(32, 24), (32, 32)])
def test_dense_layers_equal_sentence_transformers(tmp_path, residual, sizes):
    """Saved by sentence-transformers, safetensors, with or without the residual (projected
    where the sizes differ), and with a bias and an activation."""
    from sentence_transformers.sentence_transformer.modules import Dense

    torch.manual_seed(0)
    theirs = Dense(*sizes, activation_function=torch.nn.GELU(), use_residual=residual).eval()
    (tmp_path / "2_Dense").mkdir()
    theirs.save(str(tmp_path / "2_Dense"))
    (tmp_path / MODULES).write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"},
        {"idx": 3, "name": "3", "path": "3_Dropout", "type": "sentence_transformers.models.Dropout"},
        {"idx": 4, "name": "4", "path": "4_Normalize",
         "type": "sentence_transformers.models.Normalize"}]))
    modules = read_module_list(tmp_path)
    assert modules.normalize
    ours = dense_layers(modules, sizes[0])
    vectors = torch.randn(5, sizes[0])
    with torch.no_grad():
        want = theirs({"sentence_embedding": vectors})["sentence_embedding"]
        assert torch.allclose(ours(vectors), want, atol=1e-6)


def _replace(position, **fields):
    def edit(entries):
        entries[position].update(fields)
    return edit


@pytest.mark.parametrize("edit, message", [
    (_replace(2, type="sentence_transformers.models.LayerNorm"),
     "module 2 'sentence_transformers.models.LayerNorm' is not one attnserve exports"),
    (_replace(1, type="my_package.Pooling"), "module 1 'my_package.Pooling' is not one attnserve "
                                              "exports"),
    (_replace(0, path="0_Transformer"), "the Transformer lives in '0_Transformer'"),
    (lambda entries: entries.insert(2, {"idx": 2, "name": "n", "path": "n_Normalize",
                                        "type": "sentence_transformers.models.Normalize"}),
     "module 2 (Dense) comes after Normalize"),
    (lambda entries: entries.pop(1), "modules ['Transformer', 'Dense']; attnserve exports a "
                                     "Transformer, then one Pooling"),
])
def test_a_module_list_served_otherwise_is_refused(checkpoint, edit, message):
    edit_modules(checkpoint, edit)
    with pytest.raises(CheckpointError) as refused:
        read_module_list(checkpoint)
    assert str(refused.value).startswith(f"{checkpoint / MODULES}: {message}"), refused.value


@pytest.mark.parametrize("fields, message", [
    ({"module_input_name": "token_embeddings"},
     "module_input_name 'token_embeddings'; attnserve exports Dense layers on the pooled vector "
     "('sentence_embedding')"),
    ({"in_features": 16}, "in_features 16 and out_features 24; the vector coming in has 32"),
    ({"activation_function": "my_package.Swish"},
     "activation_function 'my_package.Swish' is not a torch.nn module"),
])
def test_a_dense_config_that_does_not_hold_is_refused(checkpoint, fields, message):
    config = checkpoint / "2_Dense" / "config.json"
    config.write_text(json.dumps(json.loads(config.read_text()) | fields))
    with pytest.raises(CheckpointError) as refused:
        dense_layers(read_module_list(checkpoint), 32)
    assert str(refused.value) == f"{config}: {message}"


def test_dense_weights_that_do_not_fit_are_refused_naming_the_tensor(checkpoint):
    weights = checkpoint / "2_Dense" / "pytorch_model.bin"
    tensors = torch.load(weights, weights_only=True)
    torch.save(tensors | {"linear.weight": tensors["linear.weight"][:, :8]}, weights)
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin: tensor linear\.weight has "
                                              r"shape \(24, 8\), the config says \(24, 32\)"):
        dense_layers(read_module_list(checkpoint), 32)
    torch.save({"linear.weight": tensors["linear.weight"]}, weights)
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin: missing tensor linear\.bias"):
        dense_layers(read_module_list(checkpoint), 32)
    weights.unlink()
    with pytest.raises(CheckpointError, match=r"2_Dense: a Dense module needs model\.safetensors "
                                              r"or pytorch_model\.bin"):
        dense_layers(read_module_list(checkpoint), 32)


def test_normalizing_the_token_states_is_refused(checkpoint):
    edit_modules(checkpoint, lambda entries: entries.append(
        {"idx": 3, "name": "3", "path": "3_Normalize",
         "type": "sentence_transformers.models.Normalize"}))
    (checkpoint / "3_Normalize").mkdir()
    config = checkpoint / "3_Normalize" / "config.json"
    config.write_text(json.dumps({"module_input_name": "token_embeddings"}))
    with pytest.raises(CheckpointError) as refused:
        read_module_list(checkpoint)
    assert str(refused.value).startswith(f"{config}: module_input_name 'token_embeddings'")
