"""Shared fixtures: real artifacts, each exported once for the same inputs
(tests/artifact_cache.py keeps them between sessions), and real servers started as
`attnserve serve` subprocesses on loopback ports (through tests/harness.py, the one
harness the benchmarks use too)."""

import os
from pathlib import Path

import pytest

from attnserve.server.host import with_malloc_tunables
from attnserve.server.memory import alloc_hook
from tests import harness
from tests.artifact_cache import exported
from tests.families import (
    make_bge_m3,
    make_checkpoint,
    make_multi_vector,
    make_reranker,
    make_sentence_transformer,
    make_sparse_encoder,
)
from tests.harness import ServerProcess, make_tiny_checkpoint

# Its artifact's graphs are each written with their weights in an external data file (the
# threshold lowered to nothing), as a graph past 2 GB is: the export, the optimiser, the
# quantizer, the checks and the server all go through that path on a tiny model.
EXTERNAL_DATA_FAMILY = "qwen3"


def pytest_addoption(parser):
    parser.addoption("--server-workers", default=None, metavar="N",
                     help="start every test server with --workers N (the promises that cross from "
                          "the engine to the front ends are marked `workers`)")


def pytest_configure(config):
    config.addinivalue_line("markers", "workers: a promise that crosses from the engine to the front "
                            "ends, also run against servers with --workers 2")
    workers = config.getoption("--server-workers")
    if workers:
        harness.SERVE_FLAGS[:] = ["--workers", workers]
    # Each server starts as `attnserve serve` leaves itself once it has started again with
    # the allocation hook and glibc's tunables (server/memory/alloc_hook.py), without the
    # first start, which costs about 0.2 s a server; tests/server/test_alloc_hook.py starts
    # servers that start themselves again.
    if alloc_hook.LIBRARY.is_file():
        harness.SERVE_ENV.update(LD_PRELOAD=str(alloc_hook.LIBRARY),
                                 GLIBC_TUNABLES=with_malloc_tunables(os.environ)["GLIBC_TUNABLES"])


def export(out: Path, checkpoint: Path | None = None, *extra: str) -> Path:
    """`attnserve export` into `out`, with the command's own flags, or a copy of what it
    made before from the same inputs (tests/artifact_cache.py). In this process: a
    process of its own would import torch again, seconds an export on a tiny model
    (tests/test_cli.py runs the command itself)."""
    from attnserve.cli import build_parser

    def run(directory: Path) -> None:
        argv = ["export", "--out", str(directory), *extra]
        if checkpoint is not None:
            argv += ["--from", str(checkpoint)]
        args = build_parser()[0].parse_args(argv)
        assert args.func(args) == 0, f"attnserve {' '.join(argv)} failed"

    return exported(out, run, checkpoint, "cli", *extra)


def without_module(directory: Path, name: str) -> dict[str, str]:
    """An environment for a subprocess in which `import name` fails as it does where the
    package is not installed: a module of that name, first on PYTHONPATH, raises
    ModuleNotFoundError."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{name}.py").write_text(
        f"raise ModuleNotFoundError(\"No module named '{name}' (hidden by the test)\", "
        f"name={name!r})\n")
    path = os.pathsep.join(filter(None, [str(directory), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-checkpoint"))


@pytest.fixture(scope="session")
def tiny_artifact(tmp_path_factory, tiny_checkpoint) -> Path:
    return export(tmp_path_factory.mktemp("tiny-artifact"), tiny_checkpoint)


@pytest.fixture(scope="session")
def tiny_fp16_artifact(tmp_path_factory, tiny_checkpoint) -> Path:
    """The tiny model with float16 graphs beside the float32 ones (`export --fp16`)."""
    return export(tmp_path_factory.mktemp("tiny-fp16-artifact"), tiny_checkpoint, "--fp16")


@pytest.fixture(scope="session")
def minilm_artifact(tmp_path_factory) -> Path:
    return export(tmp_path_factory.mktemp("minilm-artifact"))


@pytest.fixture(scope="session")
def minilm_server(minilm_artifact):
    with ServerProcess(minilm_artifact) as server:
        yield server


@pytest.fixture(scope="session")
def tiny_server(tiny_artifact):
    with ServerProcess(tiny_artifact) as server:
        yield server


@pytest.fixture(scope="session")
def bert_reranker_checkpoint(tmp_path_factory) -> Path:
    """A random BertForSequenceClassification of one label, MiniLM's tokenizer and vocabulary."""
    return make_reranker("bert", tmp_path_factory.mktemp("bert-reranker-checkpoint"))


@pytest.fixture(scope="session")
def bert_reranker_artifact(tmp_path_factory, bert_reranker_checkpoint) -> Path:
    return export(tmp_path_factory.mktemp("bert-reranker-artifact"), bert_reranker_checkpoint)


@pytest.fixture(scope="session")
def xlmr_reranker_checkpoint(tmp_path_factory) -> Path:
    """A random XLMRobertaForSequenceClassification of one label (the bge-reranker family)."""
    return make_reranker("xlm-roberta", tmp_path_factory.mktemp("xlmr-reranker-checkpoint"))


@pytest.fixture(scope="session")
def xlmr_reranker_artifact(tmp_path_factory, xlmr_reranker_checkpoint) -> Path:
    return export(tmp_path_factory.mktemp("xlmr-reranker-artifact"), xlmr_reranker_checkpoint)


def _export_in_process(out: Path, checkpoint: Path, external_data: bool, **flags):
    """`attnserve export` in this process, with every graph's weights in an external data
    file when `external_data`."""
    from attnserve.artifact import load_artifact
    from attnserve.export import graph_files
    from attnserve.export.pipeline import run_export

    def run(directory: Path) -> None:
        with pytest.MonkeyPatch.context() as patch:
            if external_data:
                patch.setattr(graph_files, "EXTERNAL_DATA_BYTES", 0)
            run_export(directory, checkpoint, **flags)

    exported(out, run, checkpoint, f"external_data={external_data}",
             *(f"{k}={v}" for k, v in sorted(flags.items())))
    return load_artifact(out)


# The flags every test of a family's checkpoint exports it with (`family_checkpoint`):
# one export a family, float16 graphs included, kept for every test that serves or checks it.
FAMILY_EXPORT_FLAGS = ("--fp16",)


@pytest.fixture(scope="session")
def family_checkpoint(tmp_path_factory):
    """family -> its random checkpoint (tests/families.py), made once, in a folder named
    after the family (the name its artifact serves under); exported with
    FAMILY_EXPORT_FLAGS, every test of it shares one export."""
    root = tmp_path_factory.mktemp("families")
    made = {}

    def get(family: str) -> Path:
        if family not in made:
            made[family] = make_checkpoint(family, root / family)
        return made[family]

    return get


@pytest.fixture(scope="session")
def sentence_artifact(tmp_path_factory):
    """family -> (its sentence-transformers checkpoint (tests/families.py's
    SENTENCE_MODULES), its artifact), each exported once, when first asked for: with int8
    graphs; Gemma3's with float16 ones too; EXTERNAL_DATA_FAMILY's with external data."""
    made = {}

    def get(family: str):
        if family not in made:
            checkpoint = make_sentence_transformer(family, tmp_path_factory.mktemp("st") / family)
            made[family] = checkpoint, _export_in_process(
                tmp_path_factory.mktemp(f"{family}-artifact"), checkpoint,
                family == EXTERNAL_DATA_FAMILY, int8=True, fp16=family == "gemma3_text")
        return made[family]

    return get


@pytest.fixture(scope="session")
def classifier_artifact(tmp_path_factory):
    """family -> (its random …ForSequenceClassification of one label, its artifact), each
    exported once, when first asked for (Qwen3's with its int8 graph, its weights drawn
    narrower than the others' so that its int8 scores keep to the gate: at
    tests/families.py's RERANKER_INIT they differ by 0.064, at 0.1 by 0.013)."""
    made = {}

    def get(family: str):
        if family not in made:
            int8 = family == "qwen3"
            checkpoint = make_reranker(family, tmp_path_factory.mktemp("classifier") / family,
                                       **({"initializer_range": 0.1} if int8 else {}))
            made[family] = checkpoint, _export_in_process(
                tmp_path_factory.mktemp(f"{family}-reranker"), checkpoint, False, int8=int8)
        return made[family]

    return get


@pytest.fixture(scope="session")
def multi_label_classifier(tmp_path_factory):
    """A random DistilBertForSequenceClassification of three labels, multi-label (a sigmoid
    each), and its artifact (kind classifier)."""
    root = tmp_path_factory.mktemp("multi-label-classifier")
    checkpoint = make_reranker("distilbert", root / "checkpoint", num_labels=3,
                               problem_type="multi_label_classification")
    return checkpoint, _export_in_process(root / "artifact", checkpoint, False)


SPLADES = {  # name -> make_sparse_encoder's arguments
    "distilbert-legacy": dict(family="distilbert"),
    "roberta-sum-log1p": dict(family="roberta", pooling="sum", activation="log1p_relu",
                              legacy=False, max_active_dims=5),
}


@pytest.fixture(scope="session")
def splade_artifact(tmp_path_factory):
    """name (SPLADES) -> (its random SPLADE checkpoint, its exported directory, its
    manifest), each exported once, when first asked for."""
    from attnserve.artifact import read_manifest
    from attnserve.export.pipeline import run_export

    made = {}

    def get(name: str):
        if name not in made:
            root = tmp_path_factory.mktemp(name)
            checkpoint = make_sparse_encoder(root / "st", **SPLADES[name])
            exported(root / "artifact", lambda directory: run_export(directory, checkpoint),
                     checkpoint)
            made[name] = checkpoint, root / "artifact", read_manifest(root / "artifact")
        return made[name]

    return get


@pytest.fixture(scope="session")
def bge_m3(tmp_path_factory):
    """A random bge-m3-shaped checkpoint (tests/families.py's make_bge_m3), its exported
    directory and its manifest: one graph of the dense, lexical and multi-vector heads."""
    from attnserve.artifact import read_manifest
    from attnserve.export.pipeline import run_export

    root = tmp_path_factory.mktemp("bge-m3")
    checkpoint = make_bge_m3(root / "checkpoint")
    exported(root / "artifact", lambda directory: run_export(directory, checkpoint), checkpoint)
    return checkpoint, root / "artifact", read_manifest(root / "artifact")


@pytest.fixture(scope="session")
def multi_vector_artifact(tmp_path_factory):
    """layout ("pylate" or "native": tests/families.py's make_multi_vector) -> (its random
    ColBERT checkpoint, its exported directory, its manifest), each exported once."""
    from attnserve.artifact import read_manifest
    from attnserve.export.pipeline import run_export

    made = {}

    def get(layout: str):
        if layout not in made:
            root = tmp_path_factory.mktemp(f"colbert-{layout}")
            checkpoint = make_multi_vector(root / "checkpoint", layout)
            exported(root / "artifact", lambda directory: run_export(directory, checkpoint),
                     checkpoint)
            made[layout] = checkpoint, root / "artifact", read_manifest(root / "artifact")
        return made[layout]

    return get
