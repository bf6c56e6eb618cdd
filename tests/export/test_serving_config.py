"""What export reads beside a checkpoint's weights (export/serving.py): sentence-transformers'
pooling in its current and older forms, its prompts, Matryoshka sizes from config.json or
--matryoshka-dims; what it refuses, by file; and the manifest that carries them, read
back by the server (an older manifest without them too)."""

import json
import shutil
import subprocess

import pytest

from attnserve.artifact import MANIFEST, ArtifactError, load_artifact
from attnserve.export.serving import ServingConfigError, read_serving
from tests.conftest import export
from tests.harness import ATTNSERVE, REPO

HIDDEN = 32


def checkpoint(tmp_path, pooling: dict | None = None, st: dict | None = None,
               config: dict | None = None):
    if pooling is not None:
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    if st is not None:
        (tmp_path / "config_sentence_transformers.json").write_text(json.dumps(st))
    (tmp_path / "config.json").write_text(json.dumps(config or {}))
    return tmp_path


@pytest.mark.parametrize("pooling, expected", [
    (None, ("mean", True)),
    ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}, ("cls", True)),
    ({"pooling_mode_mean_tokens": True}, ("mean", True)),
    ({"embedding_dimension": 32, "pooling_mode": "cls", "include_prompt": False}, ("cls", False)),
    ({"pooling_mode": ["mean"], "include_prompt": True}, ("mean", True)),
])
def test_pooling_in_every_form_sentence_transformers_writes(tmp_path, pooling, expected):
    serving = read_serving(checkpoint(tmp_path, pooling), HIDDEN)
    assert (serving.pooling, serving.include_prompt) == expected


def test_prompts_and_sizes_are_read(tmp_path):
    serving = read_serving(checkpoint(
        tmp_path, st={"prompts": {"query": "query: ", "document": ""}, "default_prompt_name": "query"},
        config={"matryoshka_dimensions": [8, 32, 16, 8]}), HIDDEN)
    assert serving.prompts == {"query": "query: ", "document": ""}
    assert serving.default_prompt_name == "query"
    assert serving.matryoshka_dims == [32, 16, 8]
    assert read_serving(tmp_path, HIDDEN, [4, 16]).matryoshka_dims == [16, 4]


@pytest.mark.parametrize("files, dims, message", [
    (dict(pooling={"pooling_mode": "max"}), None,
     "1_Pooling/config.json: pooling_mode 'max' is not served; attnserve pools mean, cls or "
     "lasttoken"),
    (dict(pooling={"pooling_mode": "mean", "include_prompt": "no"}), None,
     "1_Pooling/config.json: include_prompt 'no', expected true or false"),
    (dict(st={"prompts": {"query": 3}}), None,
     "config_sentence_transformers.json: prompts must map names to texts"),
    (dict(st={"prompts": {"query": "q: "}, "default_prompt_name": "passage"}), None,
     "config_sentence_transformers.json: default_prompt_name 'passage' is not one of the "
     "prompts ['query']"),
    (dict(config={"matryoshka_dimensions": [16, 64]}), None,
     "config.json: matryoshka_dimensions: Matryoshka sizes [16, 64]; expected sizes from 1 to "
     "the vectors' size, 32"),
    (dict(), [0], "--matryoshka-dims: Matryoshka sizes [0]; expected sizes from 1 to the "
                  "vectors' size, 32"),
])
def test_what_cannot_be_served_is_refused_by_file(tmp_path, files, dims, message):
    with pytest.raises(ServingConfigError) as err:
        read_serving(checkpoint(tmp_path, **files), HIDDEN, dims)
    assert str(err.value).endswith(message), err.value


def test_export_refuses_sizes_past_the_hidden_size(tmp_path, tiny_checkpoint):
    out = tmp_path / "out"
    done = subprocess.run([*ATTNSERVE, "export", "--from", str(tiny_checkpoint), "--out", str(out),
                           "--matryoshka-dims", "16,64"], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 2
    assert done.stderr.strip() == ("attnserve export: --matryoshka-dims: Matryoshka sizes "
                                   "[16, 64]; expected sizes from 1 to the vectors' size, 32")
    assert not (out / MANIFEST).exists()


def test_the_manifest_carries_them(tmp_path, tiny_checkpoint):
    source = tmp_path / "checkpoint"
    shutil.copytree(tiny_checkpoint, source)
    checkpoint(source, {"pooling_mode": "cls", "include_prompt": False},
               {"prompts": {"query": "query: "}, "default_prompt_name": "query"},
               json.loads((tiny_checkpoint / "config.json").read_text()) | {
                   "matryoshka_dimensions": [16]})
    manifest = load_artifact(export(tmp_path / "out", source, "--matryoshka-dims", "16,8")).manifest
    assert (manifest.default_pooling, manifest.include_prompt) == ("cls", False)
    assert manifest.prompts == {"query": "query: "} and manifest.default_prompt_name == "query"
    assert manifest.matryoshka_dims == [16, 8]


def _edited(tiny_artifact, target, edit):
    shutil.copytree(tiny_artifact, target)
    data = json.loads((target / MANIFEST).read_text())
    edit(data)
    (target / MANIFEST).write_text(json.dumps(data))
    return target


def test_an_older_manifest_has_no_prompts_and_no_sizes(tmp_path, tiny_artifact):
    def as_format_3(data):
        data["format_version"] = 3
        for name in ("prompts", "default_prompt_name", "include_prompt", "matryoshka_dims",
                     "embedding_ranges"):
            del data[name]

    manifest = load_artifact(_edited(tiny_artifact, tmp_path / "v3", as_format_3)).manifest
    assert (manifest.prompts, manifest.default_prompt_name) == ({}, None)
    assert manifest.include_prompt and manifest.matryoshka_dims == []


@pytest.mark.parametrize("fields, message", [
    ({"prompts": {"q": "q: "}, "default_prompt_name": "p"},
     "default_prompt_name 'p' is not one of the prompts ['q']"),
    ({"prompts": ["q: "]}, "prompts must map names to texts"),
    ({"matryoshka_dims": [64]}, "matryoshka_dims [64] must be sizes from 1 to the vectors' "
                                "size, 32"),
])
def test_a_manifest_whose_prompts_or_sizes_do_not_hold_is_refused(tmp_path, tiny_artifact,
                                                                   fields, message):
    target = _edited(tiny_artifact, tmp_path / "bad", lambda data: data.update(fields))
    with pytest.raises(ArtifactError) as err:
        load_artifact(target)
    assert str(err.value) == f"{target / MANIFEST}: {message}"
