"""Every JSON body of the HTTP doors, requests and answers, declared once as msgspec Structs:
a request is decoded and validated from its bytes in one pass (`decode`), an answer
encoded from them, and /openapi.json's components are generated from them (openapi.py).

Each protocol keeps its peer's rule for a field it does not know (docs/api.md, "Fields a
route does not know"). A fault is refused naming the field in the caller's terms
(`chunking.max_tokens`, `input[2]`), in the door's error shape."""

import functools
import re
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import UNSET, Meta, Raw, Struct, UnsetType

from attnserve.server.engine.requests import Fields, TruncationDirection
from attnserve.server.errors import InvalidArgument, quote

T = TypeVar("T")

Positive = Annotated[int, Meta(ge=1)]
Count = Annotated[int, Meta(ge=0)]
Vector = Annotated[Raw, Meta(extra_json_schema={"oneOf": [
    {"type": "array", "items": {"type": "number"}},
    {"type": "string", "description": "base64 of the vector's little-endian bytes"},
    {"type": "object", "description": "a sparse vector: token ids ascending, their weights",
     "properties": {"indices": {"type": "array", "items": {"type": "integer"}},
                    "values": {"type": "array", "items": {"type": "number"}}}}]})]
"""a vector, written by the door itself (server/http/vectors.py)"""
Sequences = str | list[str | int | list[int]]
"""texts or token ids (`input`, `inputs`, `ids`) as JSON can hold them, checked for one kind of entry,
and for emptiness, where the door reads them (`sequences`)"""
Side = Literal["right", "left", "Right", "Left"]
"""which end a cut keeps: a text's start (right) or its end (left), in TEI's names"""
Nested = Annotated[list, Meta(description="the values, flat (row-major) or nested as `shape`")]
PromptName = Annotated[str | None, Meta(description=(
    "one of the model's prompts, put before each text; omitted or null: its default prompt"))]


# --- OpenAI and Infinity: /v1/embeddings, /embeddings ------------------------------------

class Chunking(Struct, forbid_unknown_fields=True):
    """One vector per chunk of each text (texts only): data then holds one item per chunk."""

    max_tokens: Annotated[int, Meta(ge=1, description=(
        "the most tokens in one chunk, at most the model's positions less its special tokens; "
        "chunks end on word and, where they can, sentence boundaries"))]
    mode: Annotated[Literal["late", "isolated"], Meta(description=(
        "late: the text runs whole in overlapping windows and each chunk pools its tokens' "
        "contextual embeddings; isolated: each chunk runs alone"))] = "late"
    window_overlap: Annotated[int, Meta(ge=0, description=(
        "late only: tokens shared by consecutive windows, at least max_tokens - 1; 0 picks one"))] = 0


class Embeddings(Struct, forbid_unknown_fields=True):
    """OpenAI's embeddings request, with attnserve's fields beside it."""

    input: Annotated[Sequences, Meta(description=(
        "texts, or the model's own token ids (special tokens included)"),
        extra_json_schema={"example": ["attention is all you need"]})]
    model: Annotated[str | None, Meta(
        description="one of GET /v1/models; omitted: the server's default")] = None
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: Annotated[Positive | None, Meta(description=(
        "the model's size, or one of its Matryoshka sizes"))] = None
    user: str | None = None
    truncate: Annotated[bool, Meta(description="cut texts longer than the model's positions "
                                               "instead of refusing them")] = False
    truncation_direction: Side | None = None
    prompt_name: PromptName = None
    chunking: Chunking | None = None
    embedding_types: Annotated[list[Literal["float", "int8", "uint8", "binary", "ubinary", "sparse"]], Meta(
        min_length=1, description="Cohere's: each item carries `embeddings`, one vector per type asked for, "
        "and an empty `embedding`; `sparse` (alone, of a SPLADE model): {indices, values}")] | None = None
    sparse_top_k: Annotated[Positive | None, Meta(description=(
        "with embedding_types [\"sparse\"]: each text's top_k largest weights only"))] = None
    embedding_dtype: Annotated[Literal["float32", "float16"] | None, Meta(description=(
        "float16 halves a base64 float vector (with encoding_format base64 only)"))] = None


class InfinityEmbeddings(Embeddings, forbid_unknown_fields=False):
    """Infinity's: OpenAI's, with Infinity's ways of saying "not set"."""

    model: Annotated[str | None, Meta(description=(
        "default/not-specified or omitted: the server's default"))] = None
    dimensions: Annotated[Count | None, Meta(description="0: the model's size")] = None
    modality: Literal["text", "image", "audio"] = "text"


class Embedding(Struct):
    object: Literal["embedding"]
    index: int
    embedding: Vector
    embeddings: Annotated[dict[str, Vector], Meta(description=(
        "with embedding_types: each type's vector"))] | UnsetType = UNSET
    input_index: Annotated[int, Meta(description=(
        "with chunking: the input this is a chunk of"))] | UnsetType = UNSET
    start: Annotated[int, Meta(description="with chunking: the chunk's first code point in its "
                                           "input")] | UnsetType = UNSET
    end: Annotated[int, Meta(description="with chunking: its end, exclusive")] | UnsetType = UNSET
    num_tokens: Annotated[int, Meta(description="with chunking: the chunk's tokens")] | UnsetType = UNSET


class Usage(Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(Struct):
    """One vector per input (or, with chunking, per chunk), in order."""

    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: Usage
    id: Annotated[str, Meta(description="Infinity's")] | UnsetType = UNSET
    created: Annotated[int, Meta(description="Infinity's")] | UnsetType = UNSET


class Model(Struct):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    backend: Annotated[str, Meta(description="Infinity's")] | UnsetType = UNSET
    capabilities: list[str] | UnsetType = UNSET
    stats: dict[str, Any] | UnsetType = UNSET


class ModelList(Struct):
    """Every model, the default first."""

    object: Literal["list"]
    data: list[Model]


class Classify(Struct):
    """vLLM's classification request (POST /classify), texts only; like vLLM's, it ignores
    fields it does not know."""

    input: Annotated[str | list[str], Meta(extra_json_schema={"example": ["I like you"]})]
    model: Annotated[str | None, Meta(description="a classifier; omitted: the first")] = None
    truncate_prompt_tokens: Annotated[int | None, Meta(description=(
        "-1: cut texts longer than the model's positions instead of refusing them"))] = None
    truncation_side: Literal["left", "right"] | None = None
    use_activation: Annotated[bool | None, Meta(description=(
        "false: the logits instead of the model's softmax or sigmoid"))] = None
    user: str | None = None
    messages: Annotated[list | None, Meta(description="refused: texts go in `input`")] = None


class ClassifyData(Struct):
    index: int
    label: str
    probs: Annotated[list[float], Meta(description="every label's score, by label id")]
    num_classes: int


class ClassifyUsage(Usage):
    completion_tokens: int = 0
    prompt_tokens_details: None = None


class Classification(Struct):
    id: str
    object: str
    created: int
    model: str
    data: list[ClassifyData]
    usage: ClassifyUsage


class OpenAIErrorDetail(Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIError(Struct):
    error: OpenAIErrorDetail


# --- text-embeddings-inference -------------------------------------------------------------

class TeiEmbedAll(Struct):
    inputs: Annotated[Sequences, Meta(extra_json_schema={"example": "attention is all you need"})]
    truncate: Annotated[bool | None, Meta(description=(
        "cut inputs longer than the model's positions instead of refusing them (auto_truncate "
        "is false)"))] = None
    truncation_direction: Side = "Right"
    prompt_name: PromptName = None


class TeiEmbed(TeiEmbedAll):
    normalize: bool = True
    dimensions: Positive | None = None


class TeiEmbedSparse(TeiEmbedAll):
    top_k: Annotated[Positive | None, Meta(description=(
        "an extension: each text's top_k largest weights only; null: the model's default, or "
        "every non-zero weight"))] = None


class TeiSparseValue(Struct):
    index: int
    value: float


TeiSparseVectors = list[list[TeiSparseValue]]


class TeiTokenize(Struct):
    inputs: Annotated[str | list[str], Meta(extra_json_schema={"example": "attention is all you need"})]
    add_special_tokens: bool = True
    prompt_name: PromptName = None
    truncate: Annotated[bool | None, Meta(description="an extension: cut texts longer than the "
                                                      "model's positions")] = None


class TeiDecode(Struct):
    ids: Annotated[list[int | list[int]], Meta(extra_json_schema={
        "example": [101, 3086, 2003, 2035, 2017, 2342, 102]})]
    skip_special_tokens: bool = True


class TeiRerank(Struct):
    query: str
    texts: list[str]
    truncate: bool | None = None
    truncation_direction: Side = "Right"
    raw_scores: bool = False
    return_text: bool = False
    model: Annotated[str | None, Meta(description="an extension: a reranker; omitted: the first")] = None


class ClassificationParameters(Struct):
    """The Hugging Face Inference API's text-classification parameters (its clients send them
    to a TEI's root): the answer is then nested as that API's, `[[{label, score}]]`."""

    top_k: Annotated[Positive | None, Meta(description="the best top_k labels only")] = None
    function_to_apply: Annotated[Literal["sigmoid", "softmax", "none"] | None, Meta(
        description="what turns the logits into scores; omitted: the model's")] = None


class TeiPredict(Struct):
    inputs: Annotated[str | list[str | list[str]], Meta(description=(
        "a text; a list of one text or of two (one pair); or a list of those, a batch"),
        extra_json_schema={"example": "I like you. I love you"})]
    truncate: bool | None = None
    truncation_direction: Side = "Right"
    raw_scores: Annotated[bool, Meta(description="the logits instead of the model's softmax "
                                                 "or sigmoid")] = False
    model: Annotated[str | None, Meta(description="an extension: a classifier; omitted: the first")] = None
    parameters: ClassificationParameters | None = None


class TeiPrediction(Struct):
    score: float
    label: str


TeiPredictions = list[TeiPrediction | list[TeiPrediction]]


class SimilarityInputs(Struct):
    source_sentence: str
    sentences: list[str]


class SimilarityParameters(Struct):
    truncate: bool | None = None
    truncation_direction: Side = "Right"
    prompt_name: PromptName = None


class TeiSimilarity(Struct):
    inputs: SimilarityInputs
    parameters: SimilarityParameters | None = None
    model: Annotated[str | None, Meta(description="an extension: an embedding model; omitted: "
                                                  "the first")] = None


TeiVectors = list[list[float]]
TeiTokenVectors = list[list[list[float]]]
TeiScores = list[float]
TeiTexts = list[str]


class TeiToken(Struct):
    id: int
    text: str
    special: bool
    start: Annotated[int | None, Meta(description="the token's first byte (UTF-8) in its text; "
                                                  "null for a special token")]
    stop: int | None


class TeiRank(Struct):
    index: int
    score: float
    text: str | UnsetType = UNSET


class TeiEmbedding(Struct):
    pooling: str


class TeiReranker(Struct):
    id2label: dict[str, str]
    label2id: dict[str, int]


class TeiModelType(Struct):
    embedding: TeiEmbedding | UnsetType = UNSET
    reranker: TeiReranker | UnsetType = UNSET
    classifier: TeiReranker | UnsetType = UNSET


class TeiInfo(Struct):
    model_id: str
    model_sha: str | None
    model_dtype: str
    served_model_name: str
    model_type: TeiModelType
    max_concurrent_requests: int
    max_input_length: int
    max_batch_tokens: int
    max_batch_requests: int
    max_client_batch_size: int
    auto_truncate: bool
    tokenization_workers: int
    version: str
    sha: str | None
    docker_label: str | None


class TeiError(Struct):
    error: str
    error_type: Literal["Unhealthy", "Backend", "Overloaded", "Validation", "Tokenizer", "Empty"]


class Health(Struct):
    """Readiness; 503 also carries TEI's error and error_type."""

    status: Literal["serving", "not_serving"]
    error: str | UnsetType = UNSET
    error_type: Literal["Unhealthy"] | UnsetType = UNSET


# --- Cohere and Jina: /v1/rerank, /v2/rerank --------------------------------------------------

class Document(Struct):
    text: str


class CohereRerank(Struct, forbid_unknown_fields=True):
    query: str
    documents: list[str | Document]
    model: Annotated[str | None, Meta(description="a reranker; omitted: the first")] = None
    top_n: int | None = None
    return_documents: bool | None = None
    max_tokens_per_doc: Positive | None = None
    rank_fields: Annotated[list[str] | None, Meta(description="Cohere v1's; not read: a "
                                                              "document's text is ranked")] = None
    max_chunks_per_doc: Annotated[int | None, Meta(description="Cohere v1's; not read")] = None
    truncate: Annotated[bool | None, Meta(description=(
        "an extension: cut a long pair's document, never its query, instead of refusing it"))] = None


class CohereResult(Struct):
    index: int
    relevance_score: float
    document: Document | UnsetType = UNSET


class CohereUsage(Struct):
    total_tokens: int


class CohereRanking(Struct):
    """Highest score first."""

    id: str
    model: str
    results: list[CohereResult]
    usage: CohereUsage


class CohereError(Struct):
    message: str


# --- KServe v2 REST ---------------------------------------------------------------------------

class InputParameters(Struct):
    binary_data_size: Count | None = None


class InputTensor(Struct):
    name: str
    shape: list[Count]
    datatype: str
    parameters: InputParameters | None = None
    data: Nested | None = None


class OutputParameters(Struct):
    binary_data: bool | None = None


class OutputRequest(Struct):
    name: str
    parameters: OutputParameters | None = None


class InferParameters(Struct):
    binary_data_output: bool = False
    timeout: Annotated[Positive | None, Meta(description="the deadline, in microseconds")] = None


class Infer(Struct):
    inputs: list[InputTensor]
    id: str | None = None
    parameters: InferParameters | None = None
    outputs: list[OutputRequest] = []


class OutputTensorParameters(Struct):
    binary_data_size: int


class OutputTensor(Struct):
    name: str
    datatype: str
    shape: list[int]
    parameters: OutputTensorParameters | UnsetType = UNSET
    data: Vector | UnsetType = UNSET


class Inferred(Struct):
    model_name: str
    model_version: str
    outputs: list[OutputTensor]
    id: str | UnsetType = UNSET


class RepositoryIndex(Struct):
    ready: bool = False


class Live(Struct):
    live: bool


class Ready(Struct):
    ready: bool
    name: str | UnsetType = UNSET


class ServerMetadata(Struct):
    name: str
    version: str
    extensions: list[str]


class KServeError(Struct):
    error: str


# --- decoding ------------------------------------------------------------------------------

# What msgspec calls a JSON type, as an error says it.
_TYPES = {"int": "an integer", "str": "a string", "bool": "true or false", "array": "a list",
          "object": "an object", "null": "null", "float": "a number"}
_PATH = re.compile(r" - at `\$(.*)`$")
_NAMED = re.compile(r"`([^`]*)`")


_decoder = functools.cache(msgspec.json.Decoder)


def decode(body: bytes, schema: type[T]) -> T:
    """`body` as `schema`, validated as it is decoded; refused naming the field at fault."""
    try:
        return _decoder(schema).decode(body)
    except msgspec.ValidationError as err:
        raise _refusal(str(err), schema) from None
    except msgspec.DecodeError as err:
        raise InvalidArgument("body", f"not valid JSON ({err})") from None
    except RecursionError:
        raise InvalidArgument("body", "JSON nested past the depth any request needs") from None


def _refusal(message: str, schema: type) -> InvalidArgument:
    """msgspec's message (`Expected `int`, got `str` - at `$.input[0]``) as the field and the
    reason, in the words of every other refusal."""
    found = _PATH.search(message)
    path = found.group(1).lstrip(".") if found else ""
    reason = message[:found.start()] if found else message
    missing = re.match(r"Object (missing required|contains unknown) field `(.*)`$", reason)
    if missing:
        path = f"{path}.{missing.group(2)}" if path else missing.group(2)
        if missing.group(1) == "missing required":
            return InvalidArgument(path, "required")
        parent = _type_at(schema, path.rpartition(".")[0], msgspec.inspect.StructType)
        known = ", ".join(f.encode_name for f in getattr(parent, "fields", ()))
        return InvalidArgument(path[:64], f"unknown field; known: {known}")
    enum = re.match(r"Invalid enum value (.*)$", reason)
    if enum:
        values = getattr(_type_at(schema, path, msgspec.inspect.LiteralType), "values", ())
        return InvalidArgument(path, f"{enum.group(1)}; expected one of {', '.join(map(quote, values))}")
    reason = _NAMED.sub(lambda m: " or ".join(_TYPES.get(t, t) for t in m.group(1).split(" | ")), reason)
    return InvalidArgument(path or "body", reason[0].lower() + reason[1:])


def _type_at(schema: type, path: str, kind: type):
    """msgspec's type info of the field at `path` (`a.b[0].c`), through lists and unions: its
    member of type `kind` where it is a union."""
    inspect = msgspec.inspect
    info = inspect.type_info(schema)
    for token in re.findall(r"[^.\[\]]+", path):
        info = _plain(info, inspect.ListType if token.isdigit() else inspect.StructType)
        if isinstance(info, inspect.ListType):
            info = info.item_type
        elif isinstance(info, inspect.StructType):
            info = next((f.type for f in info.fields if f.encode_name == token), info)
    return _plain(info, kind)


def _plain(info, kind: type):
    """`info` without its metadata, or the member of its union of type `kind`."""
    def bare(t):
        return t.type if isinstance(t, msgspec.inspect.Metadata) else t
    info = bare(info)
    if isinstance(info, msgspec.inspect.UnionType):
        info = next((bare(t) for t in info.types if isinstance(bare(t), kind)), info)
    return info


def direction(side: Side | None) -> TruncationDirection:
    """A body's truncation side, TEI's "Right" and "Left" or lower case; none: right."""
    return TruncationDirection((side or "right").lower())


def sequences(value: Sequences, field: str, empty: type[InvalidArgument] = InvalidArgument,
              ids: bool = True) -> tuple[dict, Fields]:
    """EmbedRequest's texts or token_ids from a field that holds a string, a list of strings,
    a list of token ids or a list of lists of them (texts alone without `ids`), and the
    names of its parts; `empty`: the error for an empty string or list."""
    if isinstance(value, str):
        if not value:
            raise empty(field, "an empty string; send text")
        return {"texts": [value]}, Fields(field, single=True)
    if not value:
        raise empty(field, "an empty list; expected one that is not empty")
    kind = type(value[0])
    if not ids and kind is not str:
        raise InvalidArgument(f"{field}[0]", f"{quote(value[0])}; expected a string")
    for i, entry in enumerate(value):
        if type(entry) is not kind:
            raise InvalidArgument(f"{field}[{i}]", f"{quote(entry)}; expected "
                                  f"{_TYPES.get(kind.__name__, 'a list')}, as {field}[0] is")
        if not entry and kind is not int:  # token id 0 is a token (<s> in RoBERTa's vocabulary)
            raise empty(f"{field}[{i}]", "an empty string; send text" if kind is str else
                        "an empty list; send at least one token id")
    if kind is str:
        return {"texts": value}, Fields(field)
    if kind is int:
        return {"token_ids": [value]}, Fields(field, single=True)
    return {"token_ids": value}, Fields(field)
