"""Where a long text is cut into chunks, and the model windows its chunks are embedded in.

Chunks. A cut falls before a token, at one of five levels: inside a character (between
the byte-level tokens of one), inside a word (between word pieces), before a piece of a
word the pre-tokenizer splits off (punctuation in "don't"), at a word boundary
(whitespace between the tokens, or a character of a script written without spaces: CJK
ideographs and punctuation, kana, whether the pre-tokenizer splits each off as a word,
as BERT's does, or not, as metaspace and byte-level ones do not), or at a sentence
boundary (sentence-final punctuation and closing quotes, then whitespace and no
lowercase letter, or CJK sentence-final punctuation; a blank line). Each chunk takes as
many tokens as it may (`max_tokens`) and ends at the last cut within reach of the
highest level there is: a run of whole sentences where they fit, else whole words, else
word pieces, else byte-level tokens of whole characters. Between
chunks lies only whitespace: chunk i is the text from its first token's start to the
next chunk's, whitespace stripped at both ends (the first begins at the text's first
non-whitespace character, the last ends at its last).

Windows (late chunking): docs/api.md#long-documents-chunking; which window a chunk's
vector comes from: `best_windows`.

Everything here is numpy over the tokens, or one regular expression over the text that
never backtracks across a run: a 1 MiB text is cut in well under a second.
"""

import re
from dataclasses import dataclass

import numpy as np

from attnserve.server.engine.tokenize import TextTokens

INSIDE_CHARACTER, INSIDE_WORD, WORD_PIECE, WORD, SENTENCE = 0, 1, 2, 3, 4
# Characters of scripts written without spaces between words: every one is a word boundary.
SPACELESS = ((0x3000, 0x30FF),  # CJK symbols and punctuation, hiragana, katakana
             (0x3400, 0x4DBF), (0x4E00, 0x9FFF), (0xF900, 0xFAFF),  # CJK ideographs
             (0xFF00, 0xFFEF),  # full-width forms (，！？)
             (0x20000, 0x2A6DF), (0x2A700, 0x2CEAF), (0x2F800, 0x2FA1F))
# A sentence ends after a run of terminators and closing quotes: in Latin script where
# whitespace and then no lowercase letter follow ("e.g. the" goes on), in CJK at once; a
# blank line ends one too. Each run is matched from its first character only (the
# look-behinds), with possessive quantifiers, so the search stays linear in the text.
SENTENCE_END = re.compile(
    r"(?<![.!?…])[.!?…]++[\"'”’)\]»]*+(?=\s++[^a-z\s])"
    r"|(?<![。！？])[。！？]++[”’」』）]*+"
    r"|\n[^\S\n]*+\n")
CONTEXT_TOKENS = 64
"""the context on both sides of a chunk the default window overlap aims for"""


def _spaceless(code_points: np.ndarray) -> np.ndarray:
    found = np.zeros(code_points.shape, dtype=bool)
    for low, high in SPACELESS:
        found |= (code_points >= low) & (code_points <= high)
    return found


def cut_levels(text: str, tokens: TextTokens) -> np.ndarray:
    """int8 [n + 1]: the level of a cut before token i (0 and n, the text's edges, are SENTENCE)."""
    n = len(tokens.ids)
    levels = np.zeros(n + 1, dtype=np.int8)
    levels[[0, n]] = SENTENCE
    if n < 2:
        return levels
    starts, ends = tokens.starts, tokens.ends
    code_points = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")
    last = len(code_points) - 1
    after_gap = starts[1:] > ends[:-1]
    # Byte-level tokens of one character each cover all of it: the next starts before
    # the previous ends. A token of whitespace alone (byte-level 'Ġ' before '中') covers
    # nothing (tokenize.TextTokens): it goes with what follows it.
    between_characters = (starts[1:] >= ends[:-1]) & (starts[:-1] < ends[:-1])
    spaceless = (_spaceless(code_points[np.minimum(starts[1:], last)])
                 | _spaceless(code_points[np.clip(ends[:-1] - 1, 0, last)]))
    word_start = tokens.word_starts[1:]
    inner = levels[1:n]
    inner[between_characters] = INSIDE_WORD
    inner[word_start] = WORD_PIECE
    inner[(word_start & after_gap) | (spaceless & between_characters)] = WORD
    ends_at = np.fromiter((m.end() for m in SENTENCE_END.finditer(text)), dtype=np.int64)
    after = np.searchsorted(starts, ends_at)  # the first token at or past each end
    after = after[(after > 0) & (after < n)]
    levels[after[levels[after] >= WORD]] = SENTENCE
    return levels


def chunk_bounds(levels: np.ndarray, max_tokens: int) -> np.ndarray:
    """int64 token positions 0 = b0 < b1 < … < bk = n: chunk i is tokens [b_i, b_{i+1})."""
    n = len(levels) - 1
    # Per level, highest first, the positions where a cut may fall at it or above.
    allowed = [np.flatnonzero(levels >= level) for level in (SENTENCE, WORD, WORD_PIECE, INSIDE_WORD)]
    bounds, start = [0], 0
    while start < n:
        reach = start + max_tokens
        if reach >= n:
            bounds.append(n)
            break
        cut = reach  # inside one character of more than max_tokens byte-level tokens
        for positions in allowed:
            last = int(positions[np.searchsorted(positions, reach, side="right") - 1])
            if last > start:
                cut = last
                break
        bounds.append(cut)
        start = cut
    return np.asarray(bounds, dtype=np.int64)


def chunk_spans(text: str, tokens: TextTokens, bounds: np.ndarray) -> np.ndarray:
    """int64 [chunks, 2]: each chunk's start and end in the text, in code points."""
    if len(bounds) < 2:
        return np.zeros((0, 2), dtype=np.int64)
    cuts = tokens.starts[bounds[1:-1]].tolist()
    starts = [len(text) - len(text.lstrip()), *cuts]
    ends = [start + len(text[start:end].rstrip())
            for start, end in zip(starts, [*cuts, len(text)], strict=True)]
    return np.column_stack([np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64)])


@dataclass(frozen=True)
class Chunks:
    bounds: np.ndarray
    """token positions, as chunk_bounds"""
    spans: np.ndarray
    """as chunk_spans"""

    @property
    def count(self) -> int:
        return len(self.bounds) - 1

    @property
    def token_counts(self) -> np.ndarray:
        return np.diff(self.bounds)


def cut(text: str, tokens: TextTokens, max_tokens: int) -> Chunks:
    bounds = chunk_bounds(cut_levels(text, tokens), max_tokens)
    return Chunks(bounds, chunk_spans(text, tokens, bounds))


# --- windows ---------------------------------------------------------------------------


def default_overlap(max_tokens: int, width: int) -> int:
    """CONTEXT_TOKENS on both sides of every chunk, at most half a window (the windows then cost at most twice
    the text), and never under max_tokens - 1 (every chunk lies whole in a window)."""
    return max(max_tokens - 1, min(max_tokens - 1 + 2 * CONTEXT_TOKENS, width // 2))


def windows(n: int, width: int, overlap: int) -> tuple[np.ndarray, np.ndarray]:
    """(starts, ends): the token ranges of the windows over n tokens, in order."""
    if n <= width:
        return np.zeros(1, dtype=np.int64), np.full(1, n, dtype=np.int64)
    stride = width - overlap
    starts = np.arange(1 + -(-(n - width) // stride), dtype=np.int64) * stride
    return starts, np.minimum(starts + width, n)


def best_windows(bounds: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """int64 [chunks]: the window each chunk is pooled from, the one that holds it whole
    with the most context on both sides: the largest min(left, right), then the largest
    left + right, then the earliest. Every chunk must lie whole in some window."""
    first, last = bounds[:-1], bounds[1:]
    if not len(first):
        return np.zeros(0, dtype=np.int64)
    lowest = np.searchsorted(ends, last)  # the first window reaching past the chunk
    highest = np.searchsorted(starts, first, side="right") - 1  # the last starting before it
    if np.any(lowest > highest):
        raise ValueError("a chunk lies whole in no window: the overlap is too small")
    best = lowest.copy()
    best_key = np.full(len(first), -1, dtype=np.int64)
    width = int((ends - starts).max())
    for step in range(int((highest - lowest).max()) + 1):
        k = np.minimum(lowest + step, highest)
        left, right = first - starts[k], ends[k] - last
        key = np.minimum(left, right) * (2 * width + 1) + left + right
        better = (lowest + step <= highest) & (key > best_key)
        best[better], best_key[better] = k[better], key[better]
    return best
