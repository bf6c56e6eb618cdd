"""Text -> token ids with the artifact's own tokenizer.json (Hugging Face `tokenizers`).

A text never costs more than the tokens the model can take. It is tokenized once, cut
after max_positions + 1 tokens (the post-processor still closes it with [SEP]): one
that comes back that long was longer than the model's positions, so it is refused, or
cut to them keeping the closing special tokens. A long text is tokenized a prefix at a
time: up to a point where nothing that follows can change the tokens before it (before
whitespace; for BERT's pre-tokenizer also before punctuation and CJK characters, which
it always splits off), growing the prefix only while it holds too few tokens to decide.
Tokenized whole, a 4 MiB text takes 6 s and 625 MiB at its peak; its first 4,096
characters take a millisecond. A text with no such point (one 4 MiB word, or
only whitespace) is still tokenized whole, its working memory held first.

All of it goes through `encode_batch`, which lets the interpreter go while it works
(`encode` holds it: 1.27 s for a 2 MiB text), in slices of a few hundred texts, so the
event loop gets the interpreter between them. Each slice's working memory is taken from
the call's memory holds before it runs and given back after; what the call keeps (the
ids, and tokens and offsets when asked for) stays held until the call ends.
"""

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from attnserve.artifact import TOKENIZER, Artifact, ArtifactError
from attnserve.server.memory.ledger import Holds
from attnserve.server.memory.probe import trim_heap

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
# What a call keeps of each text: the ids as an array (the array itself, 8 bytes an id),
# and for Tokenize the tokens and offsets as Python lists (a str and a tuple of two ints a
# token: ~150 bytes).
KEPT_BYTES_PER_TEXT = 256
KEPT_BYTES_PER_ID = 8
KEPT_BYTES_PER_DETAIL = 160
# After tokenizing this much, the heap's freed pages go back to the OS.
TRIM_AFTER_BYTES = 16 << 20

_WHITESPACE_CUT = r"(?<=\S)\s"
# BERT's pre-tokenizer splits off every punctuation character (these are the ASCII ones)
# and its normaliser every CJK ideograph: text before one is tokenized as if it ended
# there.
_BERT_CUT = _WHITESPACE_CUT + (r"|[!-/:-@\[-`{-~]|[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
                               r"\U00020000-\U0002a6df\U0002a700-\U0002ceaf\U0002f800-\U0002fa1f]")
# Where to look for the last cut point before a prefix's end.
CUT_WINDOW = 4096


@dataclass(frozen=True)
class Encoded:
    ids: np.ndarray
    """int64 token ids, special tokens included"""
    tokens: list[str] | None
    """None unless asked for"""
    offsets: list[tuple[int, int]] | None


class TooLong(ValueError):
    def __init__(self, index: int, limit: int):
        self.index = index
        self.reason = (f"more than {limit} tokens, longer than the model's {limit} positions; "
                       "set truncate=true to cut it")
        super().__init__(f"text {index}: {self.reason}")


class TextTokenizer:
    def __init__(self, path: Path, max_positions: int):
        # The bundled tokenizer.json pads and truncates to 128 tokens: padding off, and
        # the cut one token past the model's positions, where the server's own rule
        # decides (refuse or truncate) instead of a silent cut.
        self.tokenizer = Tokenizer.from_file(str(path))
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(max_positions + 1)
        self.max_positions = max_positions
        probe = self.tokenizer.encode("a")
        mask = probe.special_tokens_mask
        # Special tokens the post-processor puts after the text ([SEP]): a cut keeps them.
        self.tail = next((i for i, special in enumerate(reversed(mask)) if not special), len(mask))
        empty = self.tokenizer.encode("")
        self.empty = Encoded(np.asarray(empty.ids, dtype=np.int64), empty.tokens, empty.offsets)
        """an empty text's encoding: the fewest tokens any text has"""
        bert = type(self.tokenizer.pre_tokenizer).__name__ == "BertPreTokenizer"
        self.cut_points = re.compile(_BERT_CUT if bert else _WHITESPACE_CUT)

    def encode(self, texts: list[str], truncate: bool, holds: Holds,
               details: bool = False) -> list[Encoded]:
        """Refuses (TooLong) a text longer than the model's positions unless `truncate`;
        `details`: keep the tokens and offsets too. Takes its memory from `holds`: the
        working memory while it works, what it returns for good."""
        out: list[Encoded] = []
        per_token = KEPT_BYTES_PER_ID + (KEPT_BYTES_PER_DETAIL if details else 0)
        for start, end in self._slices(texts):
            encodings = self._encode_slice(texts[start:end], holds)
            kept = [self._keep(start + i, e, truncate, details) for i, e in enumerate(encodings)]
            del encodings
            holds.take(sum(KEPT_BYTES_PER_TEXT + per_token * len(k.ids) for k in kept), "token ids")
            out.extend(kept)
        return out

    def _first_prefix(self) -> int:
        return PREFIX_CHARS_PER_POSITION * self.max_positions

    def _slices(self, texts: list[str]) -> Iterator[tuple[int, int]]:
        start, chars = 0, 0
        for i, text in enumerate(texts):
            chars += min(len(text), self._first_prefix())
            if i + 1 - start >= SLICE_TEXTS or chars >= SLICE_CHARS:
                yield start, i + 1
                start, chars = i + 1, 0
        if start < len(texts):
            yield start, len(texts)

    def _encode_slice(self, texts: list[str], holds: Holds) -> list:
        """Each text's encoding, from its shortest prefix that decides it: the whole text,
        or a prefix that already has more tokens than the model's positions."""
        sized = [self._prefix(text, self._first_prefix()) for text in texts]
        encodings = self._tokenize([prefix for prefix, _ in sized], holds)
        for i, text in enumerate(texts):
            prefix, size = sized[i]
            while len(prefix) < len(text) and len(encodings[i]) <= self.max_positions:
                prefix, size = self._prefix(text, size * PREFIX_GROWTH)
                encodings[i] = self._tokenize([prefix], holds)[0]
        return encodings

    def _tokenize(self, texts: list[str], holds: Holds) -> list:
        work = WORK_BYTES_PER_TEXT * len(texts) + WORK_BYTES_PER_CHAR * sum(map(len, texts))
        holds.take(work, "tokenizing")
        try:
            return self.tokenizer.encode_batch(texts)
        finally:
            holds.give_back(work)
            if work >= TRIM_AFTER_BYTES:
                trim_heap()

    def _prefix(self, text: str, size: int) -> tuple[str, int]:
        """(text before its last cut point within `size` characters, the size looked
        at); the whole text when it is that short. With no cut point near the end of the
        prefix, it grows past the run that has none."""
        while size < len(text):
            points = list(self.cut_points.finditer(text, max(0, size - CUT_WINDOW), size))
            if points:
                return text[:points[-1].start()], size
            size *= PREFIX_GROWTH
        return text, len(text)

    def _keep(self, index: int, encoding, truncate: bool, details: bool) -> Encoded:
        if len(encoding) <= self.max_positions:
            head, tail = slice(None), slice(0)
        elif not truncate:
            raise TooLong(index, self.max_positions)
        else:
            head = slice(self.max_positions - self.tail)
            tail = slice(len(encoding) - self.tail, len(encoding))
        ids = encoding.ids
        ids = np.asarray(ids[head] + ids[tail], dtype=np.int64)
        if not details:
            return Encoded(ids, None, None)
        tokens, offsets = encoding.tokens, encoding.offsets
        return Encoded(ids, tokens[head] + tokens[tail], offsets[head] + offsets[tail])


def load_tokenizer(artifact: Artifact) -> TextTokenizer:
    try:
        return TextTokenizer(artifact.path(TOKENIZER), artifact.manifest.max_positions)
    except Exception as err:  # noqa: BLE001 - `tokenizers` raises a bare Exception
        raise ArtifactError(f"{artifact.path(TOKENIZER)}: not a valid tokenizer ({err})") from err
