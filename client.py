"""A Python client for EncoderService that returns numpy arrays."""

from dataclasses import dataclass, field

import grpc
import numpy as np

from attnserve.server._proto.attnserve.v1 import encoder_pb2 as pb
from attnserve.server._proto.attnserve.v1 import encoder_pb2_grpc as pb_grpc

_NUMPY = {pb.DTYPE_UNSPECIFIED: "<f4", pb.DTYPE_FLOAT32: "<f4", pb.DTYPE_FLOAT16: "<f2",
          pb.DTYPE_INT8: "i1", pb.DTYPE_UINT8: "u1", pb.DTYPE_BINARY: "i1", pb.DTYPE_UBINARY: "u1"}
POOLING = {"default": pb.POOLING_UNSPECIFIED, "mean": pb.POOLING_MEAN, "cls": pb.POOLING_CLS,
           "none": pb.POOLING_NONE, "lasttoken": pb.POOLING_LAST_TOKEN}
EMBEDDING_TYPES = {"float": pb.EMBEDDING_TYPE_FLOAT, "int8": pb.EMBEDDING_TYPE_INT8,
                   "uint8": pb.EMBEDDING_TYPE_UINT8, "binary": pb.EMBEDDING_TYPE_BINARY,
                   "ubinary": pb.EMBEDDING_TYPE_UBINARY}
TRUNCATION_DIRECTIONS = {"right": pb.TRUNCATION_DIRECTION_RIGHT, "left": pb.TRUNCATION_DIRECTION_LEFT}


def to_numpy(tensor: pb.Tensor) -> np.ndarray | None:
    if not tensor.shape and not tensor.data:
        return None
    return np.frombuffer(tensor.data, dtype=_NUMPY[tensor.dtype]).reshape(tuple(tensor.shape))


@dataclass
class Chunk:
    start: int
    """the chunk's first code point in its text (a Python str index)"""
    end: int
    """exclusive: the chunk is text[start:end]"""
    num_tokens: int
    pooled: np.ndarray


@dataclass
class RerankResult:
    index: int
    """the text's place in the request"""
    score: float
    text: str | None
    """with return_texts"""


@dataclass
class LabelScore:
    id: int
    """the label's id in the classifier's config"""
    label: str
    score: float


@dataclass
class SparseEmbedding:
    """A text's non-zero weights by token id, ids ascending."""

    indices: np.ndarray
    """uint32 token ids"""
    values: np.ndarray
    """float32, in the order of `indices`"""


@dataclass
class EmbeddingResult:
    pooled: np.ndarray | None
    token_embeddings: np.ndarray | None
    attentions: np.ndarray | None
    token_ids: list[int]
    num_tokens: int = 0
    chunks: list[Chunk] = field(default_factory=list)
    """with chunking, in text order"""
    multi_vector: np.ndarray | None = None
    """with multi_vector: [vectors, dim]"""
    sparse: SparseEmbedding | None = None
    """with sparse"""


def _sparse(vector: pb.SparseVector) -> SparseEmbedding:
    return SparseEmbedding(np.asarray(vector.indices, dtype=np.uint32),
                           np.asarray(vector.values, dtype=np.float32))


class EncoderClient:
    def __init__(self, address: str = "localhost:50051", *, root_certificates: bytes | None = None,
                 private_key: bytes | None = None, certificate_chain: bytes | None = None,
                 max_message_bytes: int = 256 * 1024 * 1024):
        options = [("grpc.max_receive_message_length", max_message_bytes),
                   ("grpc.max_send_message_length", max_message_bytes)]
        if root_certificates is not None:
            creds = grpc.ssl_channel_credentials(root_certificates, private_key, certificate_chain)
            self.channel = grpc.secure_channel(address, creds, options=options)
        else:
            self.channel = grpc.insecure_channel(address, options=options)
        self.stub = pb_grpc.EncoderServiceStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def embed(self, texts: list[str] | None = None, *, token_ids: list[list[int]] | None = None,
              pooling: str = "default", normalize: bool = False, token_embeddings: bool = False,
              attention_layers: list[int] | None = None, attention_heads: list[int] | None = None,
              average_heads: bool = False, float16: bool = False, truncate: bool = False,
              chunk_tokens: int | None = None, isolated: bool = False, window_overlap: int = 0,
              model: str = "", embedding_type: str = "float", prompt_name: str = "",
              dimensions: int = 0, truncation_direction: str = "right", priority: str = "",
              multi_vector: bool = False, sparse: bool = False,
              timeout: float | None = None) -> list[EmbeddingResult]:
        """`model`: one of `list_models()`, "" for the server's default.
        `priority`: the call's class, "interactive" or "bulk" ("" for the default,
        interactive), in every method that runs the model.
        `prompt_name`: one of the model's prompts (`model_info().prompts`) before every
        text; "" for the server's default prompt. `dimensions`: pooled vectors cut to one of
        the model's `matryoshka_dims` (0: whole). `truncation_direction`: "right" keeps a
        truncated text's start, "left" its end.
        `attention_layers=[]` asks for every layer; None asks for no attention maps.
        `chunk_tokens`: one vector per chunk of at most that many tokens (`chunks`), late
        chunking unless `isolated`, windows overlapping by `window_overlap` tokens (0: the
        server's default). `embedding_type`: float, int8, uint8, binary or ubinary, what
        `pooled` (and each chunk's) comes as. `multi_vector`: each text's multi-vector
        (ColBERT) vectors, of a model with that head (a ColBERT model's: `prompt_name`
        "query" or "document"); `sparse`: its sparse vector, of a model with a sparse head;
        both from the same pass as `pooled`."""
        request = pb.EmbedRequest(
            texts=texts or [], token_ids=[pb.TokenIds(ids=ids) for ids in token_ids or []],
            truncate=truncate, pooling=POOLING[pooling], normalize=normalize, model=model,
            return_token_embeddings=token_embeddings, dtype=pb.DTYPE_FLOAT16 if float16 else pb.DTYPE_FLOAT32,
            embedding_type=EMBEDDING_TYPES[embedding_type], prompt_name=prompt_name, dimensions=dimensions,
            truncation_direction=TRUNCATION_DIRECTIONS[truncation_direction],
            priority=priority, return_multi_vector=multi_vector, return_sparse=sparse,
            attention=None if attention_layers is None else pb.AttentionOptions(
                layers=attention_layers, heads=attention_heads or [], average_heads=average_heads),
            chunking=None if chunk_tokens is None else pb.Chunking(
                max_tokens=chunk_tokens, window_overlap=window_overlap,
                mode=pb.CHUNKING_MODE_ISOLATED if isolated else pb.CHUNKING_MODE_LATE))
        return [EmbeddingResult(to_numpy(e.pooled), to_numpy(e.token_embeddings), to_numpy(e.attentions),
                                list(e.token_ids), e.num_tokens,
                                [Chunk(c.start, c.end, c.num_tokens, to_numpy(c.pooled)) for c in e.chunks],
                                to_numpy(e.multi_vector), _sparse(e.sparse) if sparse else None)
                for e in self.stub.Embed(request, timeout=timeout).embeddings]

    def rerank(self, query: str, texts: list[str], *, top_n: int | None = None,
               raw_scores: bool = False, return_texts: bool = False, truncate: bool = False,
               model: str = "", priority: str = "",
               timeout: float | None = None) -> list[RerankResult]:
        """The texts ranked by a reranker's score of each (query, text) pair, highest first;
        `model`: "" for the server's first reranker."""
        response = self.stub.Rerank(pb.RerankRequest(
            model=model, query=query, texts=texts, top_n=top_n, raw_scores=raw_scores,
            return_texts=return_texts, truncate=truncate, priority=priority), timeout=timeout)
        return [RerankResult(r.index, r.score, r.text if return_texts else None) for r in response.results]

    def score(self, query: str, texts: list[str], *, mode: str = "cosine", truncate: bool = False,
              model: str = "", priority: str = "", timeout: float | None = None) -> np.ndarray:
        """float32, one score a text: the cosine of pooled vectors (`mode="cosine"`) or the
        MaxSim of token vectors (`mode="maxsim"`); `model`: "" for the server's first embedder."""
        modes = {"cosine": pb.SCORE_MODE_COSINE, "maxsim": pb.SCORE_MODE_MAXSIM}
        response = self.stub.Score(pb.ScoreRequest(model=model, query=query, texts=texts, mode=modes[mode],
                                                   truncate=truncate, priority=priority), timeout=timeout)
        return np.asarray(response.scores, dtype=np.float32)

    def classify(self, texts: list[str], *, text_pairs: list[str | None] | None = None,
                 raw_scores: bool = False, top_k: int | None = None, truncate: bool = False,
                 truncation_direction: str = "right", model: str = "", priority: str = "",
                 timeout: float | None = None) -> list[list[LabelScore]]:
        """Each text's label scores, highest first, or (text, text_pairs[i])'s where that is
        not None: the classifier's softmax or sigmoid, or its logits with `raw_scores`; the
        `top_k` best labels only when set. `model`: "" for the server's first classifier."""
        pairs = [None] * len(texts) if text_pairs is None else text_pairs
        if len(pairs) != len(texts):
            raise ValueError(f"text_pairs: {len(pairs)} for {len(texts)} texts")
        inputs = [pb.ClassifyInput(text=t, text_pair=p) for t, p in zip(texts, pairs, strict=True)]
        response = self.stub.Classify(pb.ClassifyRequest(
            model=model, inputs=inputs, raw_scores=raw_scores, top_k=top_k, truncate=truncate,
            truncation_direction=TRUNCATION_DIRECTIONS[truncation_direction],
            priority=priority), timeout=timeout)
        return [[LabelScore(s.id, s.label, s.score) for s in c.scores] for c in response.classifications]

    def embed_sparse(self, texts: list[str], *, top_k: int | None = None,
                     truncate: bool = False, truncation_direction: str = "right",
                     prompt_name: str = "", model: str = "", priority: str = "",
                     timeout: float | None = None) -> list[SparseEmbedding]:
        """Each text's sparse vector from a model with a sparse head (SPLADE): its
        non-zero weights by token id, the `top_k` largest only when set (else the
        model's own default). `model`: "" for the server's default."""
        response = self.stub.EmbedSparse(pb.EmbedSparseRequest(
            model=model, texts=texts, truncate=truncate,
            truncation_direction=TRUNCATION_DIRECTIONS[truncation_direction],
            prompt_name=prompt_name, top_k=top_k, priority=priority), timeout=timeout)
        return [_sparse(v) for v in response.vectors]

    def tokenize(self, texts: list[str], truncate: bool = False, model: str = "",
                 prompt_name: str = "", truncation_direction: str = "right") -> list[pb.Tokenization]:
        """With a prompt, the tokens are the prompt's and the text's, and the offsets count
        from the prompt's first character."""
        return list(self.stub.Tokenize(pb.TokenizeRequest(
            texts=texts, truncate=truncate, model=model, prompt_name=prompt_name,
            truncation_direction=TRUNCATION_DIRECTIONS[truncation_direction])).tokenizations)

    def model_info(self, model: str = "") -> pb.GetModelInfoResponse:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(model=model))

    def list_models(self) -> list[pb.GetModelInfoResponse]:
        """Every model the server holds, its default first."""
        return list(self.stub.ListModels(pb.ListModelsRequest()).models)
