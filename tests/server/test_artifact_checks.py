"""Promise: the artifact is checked at start. A corrupted or tampered file, a missing file,
or a graph whose inputs do not match gets a clear error naming the file and a non-zero
exit (2, no traceback); the server never loads pickles."""

import hashlib
import json
import pickle
import re
import shutil
import subprocess
import textwrap
from pathlib import Path

import grpc
import pytest

from attnserve.artifact import MANIFEST, MEMORY_MODEL, TOKENIZER
from tests.harness import ATTNSERVE, REPO
from tests.server.reliability import embed_ids, serve, stub

EMBED_GRAPH = "encoder_opt.onnx"  # the graph served (optimised, fp32)
ATTN_GRAPH = "encoder_attn.onnx"


def copy(artifact: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(artifact, tmp_path / "artifact"))


def rehash(directory: Path, name: str) -> None:
    """Tamper consistently: the manifest vouches for the new bytes."""
    manifest = json.loads((directory / MANIFEST).read_text())
    manifest["files"][name] = hashlib.sha256((directory / name).read_bytes()).hexdigest()
    (directory / MANIFEST).write_text(json.dumps(manifest))


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def edit_graph(path: Path, change) -> None:
    import onnx

    graph = onnx.load(str(path))
    change(graph.graph, onnx)
    onnx.save(graph, str(path))


def rename_mask(graph, onnx) -> None:
    graph.input[1].name = "mask"
    for node in graph.node:
        node.input[:] = ["mask" if x == "attention_mask" else x for x in node.input]


def add_input(graph, onnx) -> None:
    graph.input.append(onnx.helper.make_tensor_value_info(
        "token_type_ids", onnx.TensorProto.INT64, ["batch", "seq"]))


def float_ids(graph, onnx) -> None:
    """A graph that loads and runs, but wants float ids: cast at its door."""
    graph.input[0].type.tensor_type.elem_type = onnx.TensorProto.FLOAT
    graph.input[0].name = "input_ids"
    for node in graph.node:
        node.input[:] = ["ids_int" if x == "input_ids" else x for x in node.input]
    graph.node.insert(0, onnx.helper.make_node("Cast", ["input_ids"], ["ids_int"],
                                               to=onnx.TensorProto.INT64))


def drop_attention_output(graph, onnx) -> None:
    del graph.output[-1]


def corrupt(directory: Path, case: str) -> tuple[str, str]:
    """Break the artifact one way; returns (the file the error must name, a phrase of why)."""
    if case == "flipped byte in the served graph":
        flip_byte(directory / EMBED_GRAPH)
        return EMBED_GRAPH, "does not match the manifest"
    if case == "flipped byte in the tokenizer":
        flip_byte(directory / TOKENIZER)
        return TOKENIZER, "does not match the manifest"
    if case == "wrong hash in the manifest":
        manifest = json.loads((directory / MANIFEST).read_text())
        manifest["files"][ATTN_GRAPH] = "0" * 64
        (directory / MANIFEST).write_text(json.dumps(manifest))
        return ATTN_GRAPH, "does not match the manifest"
    if case == "missing graph":
        (directory / ATTN_GRAPH).unlink()
        return ATTN_GRAPH, "missing"
    if case == "missing manifest":
        (directory / MANIFEST).unlink()
        return MANIFEST, "missing"
    if case == "manifest not json":
        (directory / MANIFEST).write_text("{ not json")
        return MANIFEST, "not a valid manifest"
    if case == "manifest without a file's hash":
        manifest = json.loads((directory / MANIFEST).read_text())
        del manifest["files"][TOKENIZER]
        (directory / MANIFEST).write_text(json.dumps(manifest))
        return MANIFEST, f"no sha256 for {TOKENIZER}"
    if case == "not an onnx graph (rehashed)":
        (directory / EMBED_GRAPH).write_bytes(b"\x08\x07garbage" * 64)
        rehash(directory, EMBED_GRAPH)
        return EMBED_GRAPH, "cannot load this graph"
    if case == "not a tokenizer (rehashed)":
        (directory / TOKENIZER).write_text('{"version": "1.0", "model": 7}')
        rehash(directory, TOKENIZER)
        return TOKENIZER, "not a valid tokenizer"
    if case == "embedding ranges of another size":
        manifest = json.loads((directory / MANIFEST).read_text())
        manifest["embedding_ranges"]["ranges"]["pooled_mean"][1].pop()
        (directory / MANIFEST).write_text(json.dumps(manifest))
        return MANIFEST, "embedding_ranges 'pooled_mean' is not a pooled output's [[min], [max]]"
    if case == "memory model not json":
        (directory / MEMORY_MODEL).write_text("{")
        return MEMORY_MODEL, "not a valid memory model"
    graph_cases = {
        "graph input renamed (rehashed)": (EMBED_GRAPH, rename_mask, "graph inputs"),
        "graph with an extra input (rehashed)": (EMBED_GRAPH, add_input, "graph inputs"),
        "graph input of the wrong type (rehashed)": (EMBED_GRAPH, float_ids, "tensor(int64)"),
        "attention graph lacks an output (rehashed)": (ATTN_GRAPH, drop_attention_output,
                                                       "lacks outputs"),
    }
    name, change, why = graph_cases[case]
    edit_graph(directory / name, change)
    rehash(directory, name)
    return name, why


CASES = [
    "flipped byte in the served graph", "flipped byte in the tokenizer",
    "wrong hash in the manifest", "missing graph", "missing manifest", "manifest not json",
    "manifest without a file's hash", "embedding ranges of another size",
    "not an onnx graph (rehashed)",
    "not a tokenizer (rehashed)", "memory model not json", "graph input renamed (rehashed)",
    "graph with an extra input (rehashed)", "graph input of the wrong type (rehashed)",
    "attention graph lacks an output (rehashed)",
]


@pytest.mark.parametrize("case", CASES)
def test_a_bad_artifact_is_refused_at_start_naming_the_file(tiny_artifact, tmp_path, case):
    directory = copy(tiny_artifact, tmp_path)
    name, why = corrupt(directory, case)
    done = subprocess.run([*ATTNSERVE, "serve", "--artifact", str(directory), "--host", "127.0.0.1",
                           "--port", "0", "--metrics-port", "0", "--device", "cpu"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    message = done.stderr
    # One line, naming the flag and the artifact it came from, then the file at fault.
    assert f"attnserve serve: --artifact {directory}: {directory / name}:" in message, \
        message[-2000:]
    assert why in message, message[-2000:]
    assert "Traceback" not in message, message[-2000:]
    assert "event=serving" not in message


HOOK = textwrap.dedent('''
    import os, sys

    _log, _watch = os.environ["AUDIT_LOG"], os.environ["AUDIT_DIR"]

    def _hook(event, args):
        if event == "pickle.find_class" or (
                event == "open" and isinstance(args[0], str) and args[0].startswith(_watch)):
            with open(_log, "a") as out:
                out.write(f"{event} {args[0]!s} {args[1]!s}\\n")

    sys.addaudithook(_hook)
''')


class Boom:
    """Unpickling this creates `marker`: proof a pickle was loaded."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        import os

        return (os.mkdir, (self.marker,))


def test_the_server_never_loads_pickles(tiny_artifact, tmp_path):
    directory = copy(tiny_artifact, tmp_path)
    marker = tmp_path / "unpickled"
    baits = ["model.pkl", "memory_model.pkl", "tokenizer.pkl", "pytorch_model.bin", "weights.pt",
             "embeddings.npy", f"{EMBED_GRAPH}.pkl"]
    for bait in baits:
        (directory / bait).write_bytes(pickle.dumps(Boom(marker)))
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HOOK)
    log = tmp_path / "audit.log"
    log.touch()
    server = serve(directory, env={"PYTHONPATH": f"{hook}:{REPO}", "AUDIT_LOG": str(log),
                                   "AUDIT_DIR": str(directory)})
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub(channel).Embed(embed_ids([[101, 7592, 102]]), timeout=30)
    finally:
        assert server.stop() == 0
    events = log.read_text().splitlines()
    opened = {Path(line.split(" ", 2)[1]).name for line in events if line.startswith("open ")}
    assert opened, "the audit hook saw nothing: is sitecustomize loaded?"
    assert not any(line.startswith("pickle.find_class") for line in events), events
    assert not marker.exists()
    assert not opened & set(baits), opened
    assert all(name.endswith((".json", ".onnx")) for name in opened), opened


def test_no_pickle_loaders_in_the_server_source():
    loaders = re.compile(r"\bimport pickle\b|\bpickle\.|\bnp\.load\(|\bnumpy\.load\(|torch\.load|"
                         r"joblib|\bdill\b|\bshelve\b|allow_pickle|cloudpickle|\bmarshal\b")
    sources = [p for p in (REPO / "server").rglob("*.py") if "_proto" not in p.parts]
    assert sources
    hits = [f"{p.relative_to(REPO)}:{n}" for p in sources
            for n, line in enumerate(p.read_text().splitlines(), 1) if loaders.search(line)]
    assert not hits, hits
