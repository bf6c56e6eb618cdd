"""Every refusal of a user's input at the command line: `attnserve export`, `serve` and
`memory-profile` run as a user runs them, each refused input one line on stderr naming the
file or flag and the reason, exit status 2, no traceback."""

import json
import shutil
import subprocess

import pytest

from tests.conftest import EXTERNAL_DATA_FAMILY
from tests.families import make_sparse_encoder
from tests.harness import ATTNSERVE, REPO


def refusal(*args: str) -> str:
    """The one line `attnserve *args` refuses with."""
    done = subprocess.run([*ATTNSERVE, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2, (done.returncode, done.stderr[-3000:])
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr[-3000:]
    return lines[0]


def test_export_refuses_a_family_it_does_not_implement(tmp_path, tiny_checkpoint):
    relabelled = shutil.copytree(tiny_checkpoint, tmp_path / "relabelled")
    config = json.loads((relabelled / "config.json").read_text())
    (relabelled / "config.json").write_text(json.dumps(config | {"model_type": "electra"}))
    line = refusal("export", "--from", str(relabelled), "--out", str(tmp_path / "out"))
    assert line.startswith(f"attnserve export: {relabelled / 'config.json'}: model_type 'electra' "
                           "is not served; attnserve exports bert, roberta")
    assert not list((tmp_path / "out").glob("*"))  # refused before any graph is written


def test_export_refuses_float16_graphs_of_a_sparse_encoder(tmp_path):
    """A SPLADE model exports as a sparse encoder (tests/export/test_heads_export.py), whose
    head has no float16 graph yet: refused, rather than exported without one."""
    splade = make_sparse_encoder(tmp_path / "splade")
    line = refusal("export", "--from", str(splade), "--out", str(tmp_path / "out"), "--fp16")
    assert line == (f"attnserve export: --fp16: {splade} is a splade model, whose heads have no "
                    "float16 or int8 graphs yet; export it without")
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_export_refuses_a_missing_checkpoint(tmp_path):
    line = refusal("export", "--from", str(tmp_path / "nowhere"), "--out", str(tmp_path / "out"))
    assert line == (f"attnserve export: {tmp_path / 'nowhere' / 'config.json'}: missing (a "
                    "checkpoint needs config.json, model.safetensors, tokenizer.json)")


def test_export_refuses_a_bad_flag_value(tmp_path):
    line = refusal("export", "--out", str(tmp_path / "out"), "--int8-min-cosine", "2")
    assert line == "attnserve export: argument --int8-min-cosine: 2: a cosine in (0, 1] (see --help)"


@pytest.fixture(scope="module")
def damaged(sentence_artifact, tmp_path_factory):
    """The external-data artifact with one byte of a graph's data file changed."""
    artifact = sentence_artifact(EXTERNAL_DATA_FAMILY)[1]
    copy = shutil.copytree(artifact.directory, tmp_path_factory.mktemp("damaged") / "artifact")
    data = copy / "encoder.onnx.data"
    content = bytearray(data.read_bytes())
    content[-1] ^= 0xFF
    data.write_bytes(bytes(content))
    return copy


def test_serve_refuses_a_damaged_artifact_naming_the_file(damaged):
    line = refusal("serve", "--artifact", str(damaged), "--port", "0", "--metrics-port", "0")
    assert line.startswith(f"attnserve serve: --artifact {damaged}: {damaged / 'encoder.onnx.data'}: "
                           "sha256 ")


def test_serve_refuses_a_bad_flag_value(tiny_artifact):
    line = refusal("serve", "--artifact", str(tiny_artifact), "--port", "many")
    assert line == "attnserve serve: --port: 'many' is not an integer"


def test_memory_profile_refuses_a_damaged_artifact_naming_the_file(damaged):
    line = refusal("memory-profile", "--artifact", str(damaged), "--device", "cpu")
    assert line.startswith(f"attnserve memory-profile: {damaged / 'encoder.onnx.data'}: sha256 ")


def test_memory_profile_refuses_a_bad_flag_value(tiny_artifact):
    line = refusal("memory-profile", "--artifact", str(tiny_artifact), "--seq-lens", "16,long")
    assert line == ("attnserve memory-profile: argument --seq-lens: 16,long: comma-separated "
                    "whole numbers, such as 16,32,64 (see --help)")
