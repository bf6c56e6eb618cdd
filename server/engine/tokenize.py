"""Text -> token ids with the artifact's own tokenizer.json (Hugging Face `tokenizers`).

A text never costs more than the tokens the model can take. It is tokenized once, cut
after max_positions + 1 tokens (the post-processor still closes it with [SEP] or </s>):
one that comes back that long was longer than the model's positions, so it is refused,
or cut to them keeping the closing special tokens. A long text is tokenized a prefix at a
time: up to a cut point (`cut_points`), where nothing that follows can change the tokens
before it, growing the prefix only while it holds too few tokens to decide. Tokenized
whole, a 4 MiB text takes 6 s and 625 MiB at its peak; its first 4,096 characters take a
millisecond. A text with no cut point (one 4 MiB word, or only whitespace) is still
tokenized whole, its working memory held first. Cut at its start instead, a text is
tokenized a suffix at a time from a cut point near its end, past which the tokens are the
whole text's (docs/api.md#truncation-side).

All of it goes through `encode_batch`, which lets the interpreter go while it works
(`encode` holds it: 1.27 s for a 2 MiB text), in slices of a few hundred texts, so the
event loop gets the interpreter between them. Each slice's working memory is taken from
the call's memory holds before it runs and given back after; what the call keeps (the
ids, and tokens and offsets when asked for) stays held until the call ends.

A reranker's (query, text) pairs (`encode_pairs`) are laid out as the tokenizer's
post-processor lays out a pair ([CLS] query [SEP] text [SEP], <s> query </s></s> text
</s>), the query and texts tokenized without special tokens, a prefix at a time. Chunking
needs a text whole, never truncated, with each token's place in it (`encode_whole`): it is
tokenized a piece at a time, each piece ending at a cut point, its offsets in code
points, each token's start past the space that byte-level and metaspace tokens carry
before their word (Ġword, ▁word).
"""

import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from attnserve.artifact import MANIFEST, SCORERS, TOKENIZER, Artifact, ArtifactError
from attnserve.server.host import TRIM_AFTER_BYTES, trim_heap
from attnserve.server.memory.ledger import Holds

# A slice: at most this many texts, or this many characters to tokenize.
SLICE_TEXTS = 256
SLICE_CHARS = 64 << 10
# The first prefix of a long text, in characters per model position (English runs ~4-5
# characters a token, CJK 1), and how much it grows while too short to decide.
PREFIX_CHARS_PER_POSITION = 8
PREFIX_GROWTH = 4
# Working memory of tokenizing, per character tokenized and per text, measured at its
# worst (one 4 MiB run of "!" tokenized whole: 565 bytes a byte at the peak; the text's
# normalised copy and alignments, the pre-tokenizer's splits, the encodings).
WORK_BYTES_PER_CHAR = 600
WORK_BYTES_PER_TEXT = 4 << 10
# What a call keeps of each text: the ids as an array (the array itself, 8 bytes an id), and for Tokenize the
# tokens and offsets as Python lists (a str and a tuple of two ints a token: ~150 bytes).
KEPT_BYTES_PER_TEXT = 256
KEPT_BYTES_PER_ID = 8
KEPT_BYTES_PER_DETAIL = 160
# A decoded character takes at most this many bytes (UTF-8; a byte-level token's character
# decodes to one byte, or to U+FFFD where the bytes are not UTF-8).
DECODED_BYTES_PER_CHAR = 4
# A whole text is tokenized in pieces of about this many characters; what a call keeps
# of each of its tokens: id, start, end (int64 each) and whether it starts a word.
PIECE_CHARS = 16 << 10
KEPT_BYTES_PER_WHOLE_TOKEN = 32

_WHITESPACE_CUT = r"(?<=\S)\s"
_SPACE_CUT = r"(?<=\S) "
_NO_CUT = r"(?!)"
# BERT's pre-tokenizer splits off every punctuation character (these are the ASCII ones) and its normaliser
# every CJK ideograph: text before one is tokenized as if it ended there.
_BERT_CUT = _WHITESPACE_CUT + (r"|[!-/:-@\[-`{-~]|[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
                               r"\U00020000-\U0002a6df\U0002a700-\U0002ceaf\U0002f800-\U0002fa1f]")
# Where to look for the last cut point before a prefix's end.
CUT_WINDOW = 4096
# The code points Python counts as whitespace (str.isspace): none lies past U+3000.
_SPACES = np.array([c for c in range(0x3001) if chr(c).isspace()], dtype=np.uint32)


def cut_points(pre_tokenizer: dict | None) -> re.Pattern:
    """Where a text may be cut with the tokens before the cut the same as the whole text's, for a
    tokenizer.json's pre-tokenizer: before whitespace (BERT's also before punctuation and CJK characters,
    which it always splits off); before a space only for a metaspace pre-tokenizer (XLM-RoBERTa's splits at
    spaces and nowhere else: a newline stays inside a word) and for a byte-level one that adds a space before
    a text (which it would add before a piece starting with a newline); none where the pre-tokenizer does not
    split. Others than these split at least at whitespace (Whitespace, WhitespaceSplit, Split on it)."""
    kind = (pre_tokenizer or {}).get("type")
    if kind == "BertPreTokenizer":
        return re.compile(_BERT_CUT)
    if kind == "Metaspace":
        return re.compile(_SPACE_CUT if pre_tokenizer.get("split", True) else _NO_CUT)
    if kind == "ByteLevel":
        if not pre_tokenizer.get("use_regex", True):
            return re.compile(_NO_CUT)
        return re.compile(_SPACE_CUT if pre_tokenizer.get("add_prefix_space") else _WHITESPACE_CUT)
    return re.compile(_WHITESPACE_CUT)


@dataclass(frozen=True)
class Encoded:
    ids: np.ndarray
    """int64 token ids, special tokens included"""
    tokens: list[str] | None
    """None unless asked for"""
    offsets: list[tuple[int, int]] | None
    special: list[bool] | None = None
    """with tokens: which are special tokens ([CLS], [SEP], <s>, ...)"""


@dataclass(frozen=True)
class TextTokens:
    """A whole text's tokens, special tokens aside, and where each lies in the text."""

    ids: np.ndarray
    """int64"""
    starts: np.ndarray
    """int64 code point offsets of each token's first character that is not whitespace"""
    ends: np.ndarray
    """int64, exclusive"""
    word_starts: np.ndarray
    """bool: the token begins a word of the pre-tokenizer's (not a piece after ##)"""


@dataclass(frozen=True)
class Prompt:
    """A prompt, as the model reads it before a text."""

    name: str
    text: str
    length: int
    """the tokens at a sequence's start that are the prompt's, the leading special tokens
    included: sentence-transformers' prompt_length (the prompt tokenized alone, less the
    special token that closes it), which pooling leaves out with include_prompt false"""
    ids: np.ndarray
    """int64: the prompt's tokens after the leading special tokens, kept by a text cut at its start"""
    tokens: list[str]
    offsets: list[tuple[int, int]]


class PromptTooLong(ValueError):
    """A prompt that leaves a text no room in the model's positions."""


class TooLong(ValueError):
    def __init__(self, index: int, limit: int, reason: str | None = None):
        """`index`: the text's; -1 for a pair's query."""
        self.index = index
        self.reason = reason or (f"more than {limit} tokens, longer than the model's {limit} "
                                 "positions; set truncate=true to cut it")
        super().__init__(f"text {index}: {self.reason}")


@dataclass(frozen=True)
class PairTemplate:
    """Where a pair's special tokens go, as the tokenizer's post-processor places them:
    head, query, middle, text, tail."""

    head: np.ndarray
    middle: np.ndarray
    tail: np.ndarray
    segments: bool
    """the text's side is token type 1 (the template says so: BERT's)"""

    @property
    def specials(self) -> int:
        return len(self.head) + len(self.middle) + len(self.tail)

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> "PairTemplate | None":
        """None for a tokenizer whose post-processor has no template for pairs."""
        try:
            probe = tokenizer.encode("a", "b")
        except Exception:  # noqa: BLE001 - `tokenizers` raises a bare Exception
            return None
        ids, sides = np.asarray(probe.ids, dtype=np.int64), probe.sequence_ids
        query = [i for i, side in enumerate(sides) if side == 0]
        text = [i for i, side in enumerate(sides) if side == 1]
        return cls(ids[:query[0]], ids[query[-1] + 1:text[0]], ids[text[-1] + 1:],
                   probe.type_ids[text[0]] == 1)


class TextTokenizer:
    def __init__(self, path: Path, max_positions: int, prompts: dict[str, str] | None = None):
        """`prompts`: name -> text (the artifact's)."""
        # The bundled tokenizer.json pads and truncates to 128 tokens: padding off, and
        # the cut one token past the model's positions, where the server's own rule
        # decides (refuse or truncate) instead of a silent cut.
        self.tokenizer = Tokenizer.from_file(str(path))
        self.tokenizer.no_padding()
        described = json.loads(self.tokenizer.to_str())
        # A post-processor adds nothing to a text without its special tokens but may move
        # offsets, and RoBERTa's trims a space token's differently at a text's start than
        # inside it: a piece's tokens would not lie where the whole text's do.
        self.whole = Tokenizer.from_str(json.dumps(described | {"post_processor": None}))
        """for encode_whole: no truncation, no post-processor"""
        self.whole.no_truncation()
        self.tokenizer.enable_truncation(max_positions + 1)
        self.left = Tokenizer.from_str(json.dumps(described))
        """for a text cut at its start: its last tokens, the special tokens around them"""
        self.left.enable_truncation(max_positions + 1, direction="left")
        self.max_positions = max_positions
        self.first_prefix = PREFIX_CHARS_PER_POSITION * max_positions
        mask = self.tokenizer.encode("a").special_tokens_mask
        # The special tokens the post-processor puts after a text ([SEP], </s>): a cut keeps them.
        self.tail = next((i for i, special in enumerate(reversed(mask)) if not special), len(mask))
        empty = self.tokenizer.encode("")
        self.empty = Encoded(np.asarray(empty.ids, dtype=np.int64), empty.tokens, empty.offsets)
        """an empty text's encoding: the fewest tokens any text has"""
        self.head_ids = self.empty.ids[:len(empty.ids) - self.tail]
        """the special tokens before a text ([CLS], <s>)"""
        self.tail_ids = self.empty.ids[len(empty.ids) - self.tail:]
        """the special tokens after it ([SEP], </s>)"""
        self.cut_points = cut_points(described.get("pre_tokenizer"))
        longest = max(map(len, self.tokenizer.get_vocab(with_added_tokens=True)))
        self.decoded_bytes_per_id = DECODED_BYTES_PER_CHAR * longest + 1
        """the most text one id decodes to: its token's characters, and the space before it"""
        self.pair = PairTemplate.of(self.tokenizer)
        """how a reranker's pairs are laid out; None without a template for pairs"""

        self.prompts = {name: self._prompt(name, text) for name, text in (prompts or {}).items()}
        """name -> Prompt; None for an empty text (sentence-transformers then adds none)"""

    def _prompt(self, name: str, text: str) -> Prompt | None:
        if not text:
            return None
        encoding = self.tokenizer.encode(text)
        if len(encoding) >= self.max_positions:
            raise PromptTooLong(f"prompt {name!r} and the special tokens take {self.max_positions} "
                                "or more of the model's positions, leaving none for a text")
        length = len(encoding) - (1 if self.tail else 0)
        own = slice(len(self.head_ids), length)
        return Prompt(name, text, length, np.asarray(encoding.ids[own], dtype=np.int64),
                      encoding.tokens[own], encoding.offsets[own])

    def encode(self, texts: list[str], truncate: bool, holds: Holds, details: bool = False,
               prompt: Prompt | None = None, left: bool = False,
               special_tokens: bool = True) -> list[Encoded]:
        """Refuses (TooLong) a text longer than the model's positions unless `truncate`, which cuts its end,
        or its start with `left`; `details`: keep the tokens, offsets (into the prompt and the text, as the
        model reads them) and special-token flags too; `prompt`: put before each text; `special_tokens`: close
        each text with the model's special tokens. Takes its memory from `holds`: the working memory while it
        works, what it returns for good."""
        out: list[Encoded] = []
        per_token = KEPT_BYTES_PER_ID + (KEPT_BYTES_PER_DETAIL if details else 0)
        lead = prompt.text if prompt else ""
        tail = self.tail if special_tokens else 0
        for start, end in _slices([min(len(text), self.first_prefix) + len(lead) for text in texts]):
            encodings = self._encode_slice(texts[start:end], holds, lead, special_tokens=special_tokens)
            kept = [self._keep_end(texts[start + i], prompt, holds, details, special_tokens)
                    if left and truncate and len(e) > self.max_positions
                    else self._keep(start + i, e, truncate, details, tail)
                    for i, e in enumerate(encodings)]
            del encodings
            holds.take(sum(KEPT_BYTES_PER_TEXT + per_token * len(k.ids) for k in kept), "token ids")
            out.extend(kept)
        return out

    def _encode_slice(self, texts: list[str], holds: Holds, lead: str = "",
                      limit: int | None = None, special_tokens: bool = True) -> list:
        """Each text's encoding after `lead`, from its shortest prefix that decides it: the
        whole text, or a prefix that already has more tokens than the model's positions.
        With `limit`: without special tokens, more than `limit` tokens deciding."""
        limit, tokenizer = (self.max_positions, self.tokenizer) if limit is None else (limit, self.whole)
        cuts = [self._cut(text, 0, self.first_prefix) for text in texts]
        encodings = self._tokenize([lead + text[:end] for text, (end, _)
                                    in zip(texts, cuts, strict=True)], holds, tokenizer,
                                   special_tokens)
        for i, text in enumerate(texts):
            end, size = cuts[i]
            while end < len(text) and len(encodings[i]) <= limit:
                end, size = self._cut(text, 0, size * PREFIX_GROWTH)
                encodings[i] = self._tokenize([lead + text[:end]], holds, tokenizer, special_tokens)[0]
        return encodings

    def encode_pairs(self, query: str, texts: Sequence[str], truncate: bool, holds: Holds,
                     max_text_tokens: int | None = None,
                     left: bool = False) -> tuple[list[np.ndarray], np.ndarray | None]:
        """Each (query, text) pair's ids, and where each pair's second segment starts (None when the template
        has none). Refuses (TooLong) a query that leaves no room for a text (index -1), and a pair over the
        model's positions unless `truncate`, which cuts its text to fit, keeping its start (its end with
        `left`); `max_text_tokens`: every text cut to at most that (a text it makes fit is not refused)."""
        pair = self.pair
        room = self.max_positions - pair.specials
        (asked,) = self._encode_slice([query], holds, limit=room)
        if len(asked) >= room:
            raise TooLong(-1, self.max_positions, f"{'more than ' if len(asked) > room else ''}"
                          f"{len(asked)} tokens, leaving no room for a text among the model's "
                          f"{self.max_positions} positions (with the pair's {pair.specials} "
                          "special tokens): shorten it (truncate cuts texts, never the query)")
        query_ids = np.asarray(asked.ids, dtype=np.int64)
        head = np.concatenate([pair.head, query_ids, pair.middle])
        budget = room - len(query_ids)
        cap = budget if max_text_tokens is None else min(budget, max_text_tokens)
        pairs: list[np.ndarray] = []
        for start, end in _slices([min(len(text), self.first_prefix) for text in texts]):
            encodings = self._encode_slice(list(texts[start:end]), holds, limit=budget)
            for i, encoding in enumerate(encodings, start):
                ids = encoding.ids
                if len(ids) > budget and cap == budget and not truncate:
                    raise TooLong(i, self.max_positions, (
                        f"with the query, more than {self.max_positions} tokens, longer than the "
                        f"model's {self.max_positions} positions; set truncate=true to cut the "
                        "text"))
                if left and len(ids) > cap:
                    _, suffix = self._from_end(texts[i], cap, holds, self.whole)
                    ids = suffix.ids[len(suffix) - cap:]
                pairs.append(np.concatenate([head, np.asarray(ids[:cap], dtype=np.int64), pair.tail]))
            del encodings
            holds.take(sum(KEPT_BYTES_PER_TEXT + KEPT_BYTES_PER_ID * len(p)
                           for p in pairs[start:]), "token ids")
        segments = np.full(len(pairs), len(head), dtype=np.int64) if pair.segments else None
        return pairs, segments

    def _from_end(self, text: str, count: int, holds: Holds, tokenizer: Tokenizer,
                  special_tokens: bool = True) -> tuple[int, object]:
        """(where its suffix starts, the suffix's encoding): a text tokenized a suffix at a time from a cut
        point near its end, until it has more than `count` tokens or is whole."""
        start, size = self._suffix(text, self.first_prefix)
        (encoding,) = self._tokenize([text[start:]], holds, tokenizer, special_tokens)
        while start > 0 and len(encoding) <= count:
            start, size = self._suffix(text, size * PREFIX_GROWTH)
            (encoding,) = self._tokenize([text[start:]], holds, tokenizer, special_tokens)
        return start, encoding

    def _tokenize(self, texts: list[str], holds: Holds, tokenizer: Tokenizer,
                  special_tokens: bool = True) -> list:
        """With `self.whole`: untruncated, without special tokens."""
        work = WORK_BYTES_PER_TEXT * len(texts) + WORK_BYTES_PER_CHAR * sum(map(len, texts))
        holds.take(work, "tokenizing")
        try:
            return tokenizer.encode_batch(
                texts, add_special_tokens=special_tokens and tokenizer is not self.whole)
        finally:
            holds.give_back(work)
            if work >= TRIM_AFTER_BYTES:
                trim_heap()

    def _cut(self, text: str, start: int, size: int) -> tuple[int, int]:
        """(the last cut point past `start` within `size` characters of it, the size
        looked at); the text's end when the rest is that short. With no cut point near
        the end, it looks further, past the run that has none."""
        while start + size < len(text):
            points = list(self.cut_points.finditer(
                text, max(start + 1, start + size - CUT_WINDOW), start + size))
            if points:
                return points[-1].start(), size
            size *= PREFIX_GROWTH
        return len(text), len(text) - start

    def decode(self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool,
               holds: Holds) -> list[str]:
        """Each sequence of ids (in the vocabulary) as text; the text held first, as the most
        its ids can decode to."""
        holds.take(sum(KEPT_BYTES_PER_TEXT + self.decoded_bytes_per_id * len(ids)
                       for ids in sequences), "decoded text")
        return self.tokenizer.decode_batch(sequences, skip_special_tokens=skip_special_tokens)

    def _suffix(self, text: str, size: int) -> tuple[int, int]:
        """(the first cut point of the last `size` characters, the size looked at); 0 when
        the text is that short. With no cut point near, it looks further back."""
        while size < len(text):
            begin = len(text) - size
            point = self.cut_points.search(text, begin, min(len(text), begin + CUT_WINDOW))
            if point is not None:
                return point.start(), size
            size *= PREFIX_GROWTH
        return 0, len(text)

    def _keep_end(self, text: str, prompt: Prompt | None, holds: Holds, details: bool,
                  special_tokens: bool) -> Encoded:
        """A text too long for the model cut at its start: the leading special tokens, the
        prompt's, the text's last tokens that fit, the closing special tokens."""
        heads, tails = (len(self.head_ids), self.tail) if special_tokens else (0, 0)
        room = self.max_positions - heads - tails - (len(prompt.ids) if prompt else 0)
        start, encoding = self._from_end(text, room + heads + tails, holds, self.left, special_tokens)
        n = len(encoding)
        return _kept(encoding, slice(heads), slice(max(heads, n - tails - room), n - tails),
                     slice(n - tails, n), details, prompt,
                     start + (len(prompt.text) if prompt else 0))

    # --- whole texts, for chunking ------------------------------------------------------

    def encode_whole(self, texts: Sequence[str], holds: Holds) -> list[TextTokens]:
        """Each text's tokens, never truncated, special tokens aside; memory taken from
        `holds` as `encode` takes it."""
        pieces = [(i, start, end) for i, text in enumerate(texts) for start, end in self._pieces(text)]
        parts: list[list[TextTokens]] = [[] for _ in texts]
        for low, high in _slices([end - start for _, start, end in pieces]):
            piece_slice = pieces[low:high]
            encodings = self._tokenize([texts[i][start:end] for i, start, end in piece_slice],
                                       holds, self.whole)
            holds.take(KEPT_BYTES_PER_WHOLE_TOKEN * sum(map(len, encodings)), "tokens")
            for (i, start, end), encoding in zip(piece_slice, encodings, strict=True):
                parts[i].append(_piece_tokens(encoding, texts[i][start:end], start))
            del encodings
        return [_joined(p) for p in parts]

    def _pieces(self, text: str) -> Iterator[tuple[int, int]]:
        start = 0
        while start < len(text):
            end, _ = self._cut(text, start, PIECE_CHARS)
            yield start, end
            start = end

    def _keep(self, index: int, encoding, truncate: bool, details: bool, closing: int) -> Encoded:
        """`closing`: the special tokens that end the encoding, which a cut keeps."""
        if len(encoding) <= self.max_positions:
            return _kept(encoding, slice(0), slice(None), slice(0), details)
        if not truncate:
            raise TooLong(index, self.max_positions)
        return _kept(encoding, slice(0), slice(self.max_positions - closing),
                     slice(len(encoding) - closing, len(encoding)), details)


def _kept(encoding, head: slice, own: slice, tail: slice, details: bool,
          prompt: Prompt | None = None, shift: int = 0) -> Encoded:
    """The `head` of an encoding (its leading special tokens), the prompt's tokens, its
    `own` (offsets moved by `shift`, into the prompt and the text) and its `tail`."""
    ids, lead = encoding.ids, prompt.ids.tolist() if prompt else []
    ids = np.asarray(ids[head] + lead + ids[own] + ids[tail], dtype=np.int64)
    if not details:
        return Encoded(ids, None, None)
    tokens, offsets, mask = encoding.tokens, encoding.offsets, encoding.special_tokens_mask
    offsets_own = [(a + shift, b + shift) for a, b in offsets[own]] if shift else offsets[own]
    return Encoded(ids, tokens[head] + (prompt.tokens if prompt else []) + tokens[own] + tokens[tail],
                   offsets[head] + (prompt.offsets if prompt else []) + offsets_own + offsets[tail],
                   [bool(m) for m in mask[head]] + [False] * len(lead)
                   + [bool(m) for m in mask[own] + mask[tail]])


def _slices(sizes: list[int]) -> Iterator[tuple[int, int]]:
    """Consecutive ranges of texts (or pieces) of these sizes to tokenize, each at most
    SLICE_TEXTS of them or about SLICE_CHARS characters."""
    start, chars = 0, 0
    for i, size in enumerate(sizes):
        chars += size
        if i + 1 - start >= SLICE_TEXTS or chars >= SLICE_CHARS:
            yield start, i + 1
            start, chars = i + 1, 0
    if start < len(sizes):
        yield start, len(sizes)


def _piece_tokens(encoding, piece: str, offset: int) -> TextTokens:
    """A piece's tokens, placed in its text by the piece's `offset`."""
    ids = np.asarray(encoding.ids, dtype=np.int64)
    places = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2)
    words = np.asarray(encoding.word_ids, dtype=np.int64)
    word_starts = np.ones(len(ids), dtype=bool)
    word_starts[1:] = words[1:] != words[:-1]
    starts = _past_spaces(piece, places[:, 0], places[:, 1])
    return TextTokens(ids, starts + offset, places[:, 1] + offset, word_starts)


def _past_spaces(piece: str, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Each token's start moved past the whitespace it begins with, to its end for a
    token of whitespace alone."""
    code_points = np.frombuffer(piece.encode("utf-32-le", "surrogatepass"), dtype="<u4")
    n = len(code_points)
    solid = np.where(np.isin(code_points, _SPACES), n, np.arange(n))
    next_solid = np.append(np.minimum.accumulate(solid[::-1])[::-1], n)
    return np.minimum(next_solid[np.minimum(starts, n)], ends)


def _joined(parts: list[TextTokens]) -> TextTokens:
    if not parts:
        empty = np.zeros(0, dtype=np.int64)
        return TextTokens(empty, empty, empty, np.zeros(0, dtype=bool))
    return TextTokens(*(np.concatenate([getattr(p, name) for p in parts])
                        for name in ("ids", "starts", "ends", "word_starts")))


def load_tokenizer(artifact: Artifact) -> TextTokenizer:
    manifest = artifact.manifest
    try:
        tokenizer = TextTokenizer(artifact.path(TOKENIZER), manifest.max_positions, manifest.prompts)
    except PromptTooLong as err:
        raise ArtifactError(f"{artifact.path(MANIFEST)}: {err}") from err
    except Exception as err:  # noqa: BLE001 - `tokenizers` raises a bare Exception
        raise ArtifactError(f"{artifact.path(TOKENIZER)}: not a valid tokenizer ({err})") from err
    if artifact.manifest.kind in SCORERS and tokenizer.pair is None:
        raise ArtifactError(f"{artifact.path(TOKENIZER)}: no template for pairs, which a "
                            "reranker's or classifier's pairs need")
    return tokenizer
