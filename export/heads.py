"""What a checkpoint returns beyond its encoder's hidden states, as its files say, read
before its weights are: SPLADE's sparse vector (sentence-transformers' SparseEncoder),
bge-m3's lexical weights and token vectors (FlagEmbedding's files), a multi-vector
(ColBERT) model's token vectors (PyLate's or sentence-transformers' MultiVectorEncoder),
read as sentence-transformers reads them; docs/api.md ("Sparse encoders, bge-m3 and
classifiers") says which files tell each. Anything else is a dense embedder
(model/sentence_modules.py).

A module or file this package does not run is refused by name: a sparse or multi-vector
model exported as a dense embedder would serve vectors that are not the model's.
"""

import string
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer

from attnserve.artifact import TOKENIZER, LexicalHead, MultiVectorHead, MultiVectorInput, SparseHead
from attnserve.export.onnx_graphs import Heads
from attnserve.export.serving import ST_CONFIG, TRANSFORMER_CONFIG, read_json
from attnserve.model import AnyEncoder, CheckpointError, CrossEncoder, load_checkpoint
from attnserve.model.masked_lm import MaskedLanguageModel
from attnserve.model.multi_vector import TokenVectors
from attnserve.model.sentence_modules import MODULES, TOKEN_EMBEDDINGS, dense_stack, module_types
from attnserve.model.sparse import SPLADE_ACTIVATIONS, SPLADE_POOLINGS, LexicalWeights, SpladeHead

# The embedders whose heads take the place of pooled vectors.
NOT_DENSE = ("splade", "multi_vector")
M3_SPARSE, M3_COLBERT = "sparse_linear.pt", "colbert_linear.pt"
# The special tokens whose lexical weights bge-m3 leaves out.
M3_DROPPED_TOKENS = ("cls_token", "eos_token", "pad_token", "unk_token")
# sentence-transformers' SPLADE modules, by class name (every version's module path).
_SPLADE_TRANSFORMERS = ("Transformer", "MLMTransformer")
_SPLADE_POOLING = "SpladePooling"


def read_splade(checkpoint: Path) -> SparseHead | None:
    """The checkpoint's SPLADE pooling when its modules.json lists SpladePooling (None when
    it does not); refused unless the list is the masked-LM Transformer, then SpladePooling."""
    path = checkpoint / MODULES
    if not path.is_file():
        return None
    modules = module_types(path)
    classes = [kind.rpartition(".")[2] for _, kind, _ in modules]
    if _SPLADE_POOLING not in classes and "MLMTransformer" not in classes:
        return None
    if len(modules) != 2 or classes[0] not in _SPLADE_TRANSFORMERS or classes[1] != _SPLADE_POOLING:
        raise CheckpointError(f"{path}: modules {[kind for _, kind, _ in modules]}; attnserve "
                              "exports a SPLADE model as a masked-LM Transformer, then SpladePooling")
    if modules[0][2]:
        raise CheckpointError(f"{path}: the Transformer lives in {modules[0][2]!r}; attnserve "
                              "exports one whose config.json and weights are the checkpoint's own")
    task_path = checkpoint / TRANSFORMER_CONFIG
    task = read_json(task_path, CheckpointError).get("transformer_task")
    if classes[0] == "Transformer" and task != "fill-mask":
        raise CheckpointError(f"{task_path}: transformer_task {task!r}; SpladePooling reads the "
                              "masked-LM head's scores (\"fill-mask\")")
    config_path = checkpoint / modules[1][2] / "config.json"
    config = read_json(config_path, CheckpointError)
    pooling = config.get("pooling_strategy", "max")
    activation = config.get("activation_function", "relu")
    if pooling not in SPLADE_POOLINGS or activation not in SPLADE_ACTIVATIONS:
        raise CheckpointError(f"{config_path}: pooling_strategy {pooling!r} and "
                              f"activation_function {activation!r}; attnserve exports "
                              f"{' or '.join(SPLADE_POOLINGS)} and {' or '.join(SPLADE_ACTIVATIONS)}")
    st_path = checkpoint / ST_CONFIG
    top_k = read_json(st_path, CheckpointError).get("max_active_dims")
    if top_k is not None and not (type(top_k) is int and top_k > 0):
        raise CheckpointError(f"{st_path}: max_active_dims {top_k!r}, expected a whole number from 1")
    return SparseHead(pooling, activation, top_k)


def splade_head(checkpoint: Path, splade: SparseHead, model: MaskedLanguageModel) -> SpladeHead:
    """The module that computes the sparse head over `model`'s scores (read_splade's
    SpladePooling, the second module)."""
    config_path = checkpoint / module_types(checkpoint / MODULES)[1][2] / "config.json"
    config = read_json(config_path, CheckpointError)
    size = config.get("embedding_dimension", config.get("word_embedding_dimension"))
    if size is not None and size != model.config.vocab_size:
        raise CheckpointError(f"{config_path}: embedding_dimension {size}, but the masked-LM "
                              f"head scores {model.config.vocab_size} vocabulary entries")
    return SpladeHead(model.head, splade.pooling, splade.activation)


def is_bge_m3(checkpoint: Path) -> bool:
    """Whether the checkpoint carries bge-m3's heads: both files, or it is refused naming
    the missing one (FlagEmbedding would draw both at random then)."""
    present = [(checkpoint / name).is_file() for name in (M3_SPARSE, M3_COLBERT)]
    if any(present) and not all(present):
        missing = M3_COLBERT if present[0] else M3_SPARSE
        raise CheckpointError(f"{checkpoint / missing}: missing; bge-m3's heads are "
                              f"{M3_SPARSE} and {M3_COLBERT}, both")
    return all(present)


def _linear(path: Path, in_features: int, out_features: int | None) -> torch.nn.Linear:
    """A torch.nn.Linear saved as its state dict (weight [out, in], bias [out])."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a damaged file raises whatever its reader does
        raise CheckpointError(f"{path}: cannot be read ({err})") from err
    weight, bias = (state.get(name) if isinstance(state, dict) else None for name in ("weight", "bias"))
    if (not isinstance(weight, torch.Tensor) or not isinstance(bias, torch.Tensor)
            or set(state) != {"weight", "bias"} or weight.dim() != 2
            or weight.shape[1] != in_features or tuple(bias.shape) != (weight.shape[0],)
            or (out_features is not None and weight.shape[0] != out_features)):
        shapes = ({k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}
                  if isinstance(state, dict) else type(state).__name__)
        want = f"[{out_features or 'dim'}, {in_features}]"
        raise CheckpointError(f"{path}: {shapes}; expected a linear layer's weight {want} and its bias")
    linear = torch.nn.Linear(in_features, weight.shape[0])
    linear.load_state_dict({"weight": weight.float(), "bias": bias.float()})
    return linear.eval()


def _special_ids(checkpoint: Path, names: tuple[str, ...]) -> list[int]:
    """The ids of the tokenizer's special tokens `names` (tokenizer_config.json, then
    special_tokens_map.json: a token or {"content": token}), each found in tokenizer.json."""
    tokenizer = Tokenizer.from_file(str(checkpoint / TOKENIZER))
    settings: dict = {}
    for file in ("special_tokens_map.json", "tokenizer_config.json"):
        settings |= {k: v for k, v in read_json(checkpoint / file, CheckpointError).items()
                     if v is not None}
    ids = []
    for name in names:
        token = settings.get(name)
        token = token.get("content") if isinstance(token, dict) else token
        found = tokenizer.token_to_id(token) if isinstance(token, str) else None
        if found is None:
            raise CheckpointError(f"{checkpoint / 'tokenizer_config.json'}: {name} {token!r} is "
                                  f"not a token of {TOKENIZER}")
        ids.append(found)
    return sorted(set(ids))


PYLATE_PREFIX = "pylate."
# PyLate's defaults for what its config_sentence_transformers.json leaves out.
PYLATE_QUERY_LENGTH = 32
PYLATE_SKIPLIST = list(string.punctuation)
_MULTI_VECTOR_SIMILARITIES = {None: "maxsim", "maxsim": "maxsim", "meanmaxsim": "meanmaxsim"}


@dataclass(frozen=True)
class MultiVector:
    """A multi-vector (ColBERT) checkpoint's modules and settings, as PyLate or
    sentence-transformers' MultiVectorEncoder saved them."""

    dense: tuple[Path, ...]
    """the token projection's Dense folders, in order"""
    head: MultiVectorHead
    """dim: 0 until the projection is read"""
    prompts: dict[str, str]
    tokenizer: Tokenizer | None
    """the checkpoint's tokenizer with PyLate's markers made single special tokens, as
    sentence-transformers registers them; None: the checkpoint's own, unchanged"""


def _pylate_markers(tokenizer: Tokenizer, prefixes: list[str]) -> Tokenizer | None:
    """`tokenizer` with each marker a known token encodes to other pieces (an added "[Q] " a
    lower-casing tokenizer normalises) made a special, unnormalised token; None: no such marker."""
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    marks = []
    for value in prefixes:
        for prefix in (value, *value.split(None, 1)[:1]) if value.split() else ():
            if prefix in vocab:
                if tokenizer.encode(prefix, add_special_tokens=False).tokens != [prefix]:
                    marks.append(AddedToken(prefix, normalized=False, special=True))
                break
    if not marks:
        return None
    tokenizer.add_special_tokens(marks)
    return tokenizer


def read_multi_vector(checkpoint: Path) -> MultiVector | None:
    """The checkpoint's multi-vector settings when it is a PyLate or MultiVectorEncoder save
    (None when it is neither); refused unless its modules are a Transformer, Dense layers on
    the token states and, in a MultiVectorEncoder's, MultiVectorMask and Normalize."""
    path = checkpoint / MODULES
    if not path.is_file():
        return None
    modules = module_types(path)
    types = [kind for _, kind, _ in modules]
    classes = [kind.rpartition(".")[2] for kind in types]
    st_path = checkpoint / ST_CONFIG
    st = read_json(st_path, CheckpointError)
    pylate = any(kind.startswith(PYLATE_PREFIX) for kind in types) or st.get("model_type") == "ColBERT"
    if not pylate and "MultiVectorMask" not in classes and st.get("model_type") != "MultiVectorEncoder":
        return None
    layout = (["Transformer"] + ["Dense"] * (len(classes) - 1) if pylate else
              ["Transformer"] + ["Dense"] * (len(classes) - 3) + ["MultiVectorMask", "Normalize"])
    if classes != layout or len(classes) < 2 or modules[0][2]:
        raise CheckpointError(f"{path}: modules {types}; attnserve exports a multi-vector model "
                              "as its own Transformer, then Dense layers (PyLate's), or then "
                              "Dense layers, MultiVectorMask and Normalize (sentence-transformers')")
    dense = tuple(checkpoint / folder for (_, _, folder), kind in zip(modules, classes, strict=True)
                  if kind == "Dense")
    tokenizer = Tokenizer.from_file(str(checkpoint / TOKENIZER))
    sbc_path = checkpoint / TRANSFORMER_CONFIG
    sbc = read_json(sbc_path, CheckpointError)
    if pylate:
        prefixes = {side: st[key] or "" for side, key in (("query", "query_prefix"),
                                                           ("document", "document_prefix"))
                    if key in st}
        saved = dict(st.get("prompts") or {})
        prompts = saved | {side: prefix + (saved.get(side) or "").removeprefix(prefix)
                           for side, prefix in prefixes.items()}
        marked = _pylate_markers(tokenizer, list(prefixes.values()))
        expansion = ({"strategy": "fixed", "attend": bool(st.get("attend_to_expansion_tokens")),
                      "length": st.get("query_length") or PYLATE_QUERY_LENGTH}
                     if st.get("do_query_expansion", True) else None)
        query_length, document_length = st.get("query_length"), st.get("document_length")
        skiplist = st.get("skiplist_words")
        mask = {"skiplist_words": PYLATE_SKIPLIST if skiplist is None else skiplist}
        similarity = None
    else:
        marked, prompts = None, dict(st.get("prompts") or {})
        expansion = sbc.get("query_expansion")
        query_length, document_length = sbc.get("query_length"), sbc.get("document_length")
        mask_path = checkpoint / modules[-2][2] / "config.json"
        mask = read_json(mask_path, CheckpointError)
        if mask.get("keep_only_token_ids") is not None:
            raise CheckpointError(f"{mask_path}: keep_only_token_ids is set (an image model's "
                                  "allowlist); attnserve exports text models")
        similarity = st.get("similarity_fn_name")
        if similarity not in _MULTI_VECTOR_SIMILARITIES:
            raise CheckpointError(f"{st_path}: similarity_fn_name {similarity!r}; a multi-vector "
                                  "model scores by maxsim or meanmaxsim")
    # Words that are no token are left out, as sentence-transformers leaves them.
    skip_ids = sorted({i for i in map(tokenizer.token_to_id, mask.get("skiplist_words") or ())
                       if i is not None})
    tasks = mask.get("skiplist_tasks") or ["document"]
    tasks = [tasks] if isinstance(tasks, str) else tasks
    expand_to, token_id, attended = None, None, False
    if expansion is not None:
        if expansion.get("strategy") not in ("fixed", "min") or not isinstance(
                expansion.get("length"), int) or expansion["length"] < 1:
            raise CheckpointError(f"{sbc_path}: query_expansion {expansion!r}; attnserve exports "
                                  "strategy fixed or min with a length")
        expand_to, attended = expansion["length"], bool(expansion.get("attend", False))
        token = expansion.get("token")
        token_id = (tokenizer.token_to_id(token) if token is not None
                    else _special_ids(checkpoint, ("mask_token",))[0])
        if token_id is None:
            raise CheckpointError(f"{sbc_path}: query_expansion token {token!r} is not a token")
        if expansion["strategy"] == "fixed":
            query_length = expand_to
    # sentence-transformers cuts a text at its side's length, else at max_seq_length.
    longest = sbc.get("max_seq_length")
    query_length, document_length = query_length or longest, document_length or longest
    query = MultiVectorInput(prompts.get("query", ""), query_length,
                             skip_ids if "query" in tasks else [], expand_to, token_id, attended)
    document = MultiVectorInput(prompts.get("document", ""), document_length,
                                skip_ids if "document" in tasks else [])
    head = MultiVectorHead(dim=0, skip_leading=0, similarity=_MULTI_VECTOR_SIMILARITIES[similarity],
                           query=query, document=document)
    return MultiVector(dense, head, prompts, marked)


def which_embedder(checkpoint: Path, fp16: bool, int8: bool, matryoshka_dims: list[int] | None
                   ) -> tuple[str, SparseHead | MultiVector | None]:
    """Which embedder the checkpoint is, "dense", "splade", "multi_vector" or "bge-m3" (with
    its SPLADE head or multi-vector settings), refusing flags its heads cannot export with."""
    found = read_splade(checkpoint) or read_multi_vector(checkpoint)
    which = ("splade" if isinstance(found, SparseHead) else "multi_vector" if found
             else "bge-m3" if is_bge_m3(checkpoint) else "dense")
    if which != "dense":
        flags = [flag for flag, on in (("--fp16", fp16), ("--int8", int8)) if on]
        if flags:
            raise CheckpointError(f"{' and '.join(flags)}: {checkpoint} is a {which} model, whose "
                                  "heads have no float16 or int8 graphs yet; export it without")
    if which in NOT_DENSE and matryoshka_dims:
        raise CheckpointError(f"--matryoshka-dims: {checkpoint} is a {which} model, which has no "
                              "dense vectors to cut")
    return which, found


def load_with_heads(checkpoint: Path, which: str, found: SparseHead | MultiVector | None
                    ) -> tuple[AnyEncoder | CrossEncoder, Heads | None, dict]:
    """The checkpoint's model (SPLADE's: the encoder under its masked-LM head), its heads for
    the graphs (multi-vector: its Dense layers on every token's state), their manifest entries."""
    model = load_checkpoint(checkpoint, keep_language_model_head=which == "splade")
    hidden = model.config.hidden_size
    if which == "splade":
        sparse = splade_head(checkpoint, found, model)
        return model.encoder, Heads(pooled=False, sparse=sparse), {"sparse": found}
    if which == "multi_vector":
        projection = dense_stack(found.dense, hidden, TOKEN_EMBEDDINGS)
        return (model, Heads(pooled=False, multi_vector=TokenVectors(projection).eval()),
                {"multi_vector": replace(found.head, dim=projection[-1].linear.out_features)})
    if which == "bge-m3":
        lexical = LexicalWeights(hidden)
        lexical.linear = _linear(checkpoint / M3_SPARSE, hidden, 1)
        projection = _linear(checkpoint / M3_COLBERT, hidden, None)
        return (model, Heads(lexical=lexical.eval(), multi_vector=TokenVectors(projection).eval()),
                {"lexical": LexicalHead(_special_ids(checkpoint, M3_DROPPED_TOKENS)),
                 "multi_vector": MultiVectorHead(dim=projection.out_features, skip_leading=1,
                                                 similarity="meanmaxsim")})
    return model, None, {}
