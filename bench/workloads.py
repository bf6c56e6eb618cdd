"""The inputs every engine gets, built once per run with a fixed seed.

Texts are made of whole-word vocabulary entries that each tokenize to exactly one token,
so a text of n tokens (with [CLS] and [SEP]) is the same sequence of ids for the raw
session, the server's tokenizer, our PyTorch model and sentence-transformers' tokenizer.
"""

import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

# batch × seq for the fixed-shape rows.
SHAPES = ((1, 16), (1, 128), (1, 512), (32, 16), (32, 128), (32, 512))
QUICK_SHAPES = ((1, 16), (32, 128), (1, 512))
# Mixed lengths: log-normal around a short passage (median 48 tokens, like retrieval
# passages and chat turns), clipped to 8..256, the range sentence-transformers serves.
MIXED_MEDIAN, MIXED_SIGMA, MIXED_MIN, MIXED_MAX = 48, 0.75, 8, 256
# "Batched ideally": sorted by length, then consecutive groups of at most IDEAL_BATCH
# sequences whose padded tokens stay within IDEAL_PADDING × their real tokens, with no
# scheduling cost. (Plain groups of 32 pad the long tail to its longest: on 2 cores that
# ran at 5.3k tokens/s against 8.4k for these.)
IDEAL_BATCH = 32
IDEAL_PADDING = 1.1
ATTENTION_SHAPE = (8, 256)
IDS_1X16 = [101, *range(2000, 2014), 102]
"""one 16-token sequence of token ids, [CLS] … [SEP]: where the request path, not the model, costs"""
# Short texts (queries, titles, chat turns): where the per-request cost shows most.
SHORT_MIN, SHORT_MAX = 8, 32


@dataclass
class Texts:
    texts: list[str]
    ids: list[list[int]]

    @property
    def lengths(self) -> list[int]:
        return [len(i) for i in self.ids]


@dataclass
class Shape:
    name: str
    batch: int
    seq: int
    inputs: Texts


@dataclass
class Workload:
    seed: int
    shapes: list[Shape]
    mixed: Texts
    ideal_batches: list[list[int]]
    """indexes into mixed, each batch sorted by length"""
    attention: Shape
    short: Texts
    """SHORT_MIN..SHORT_MAX tokens, uniform"""
    short_batches: list[list[int]]
    """ideal batches of `short`, as ideal_batches of mixed"""
    mixed_distribution: dict


def shape_name(batch: int, seq: int) -> str:
    return f"{batch}x{seq}"


class TextMaker:
    def __init__(self, tokenizer_path: Path, seed: int):
        self.tokenizer = Tokenizer.from_file(str(tokenizer_path))
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()
        vocab = self.tokenizer.get_vocab()
        # Lower-case alphabetic whole words: each is one WordPiece token on its own.
        words = sorted(w for w in vocab if w.isascii() and w.isalpha() and w.islower()
                       and len(w) >= 3)
        encoded = self.tokenizer.encode_batch(words)
        self.words = [w for w, e in zip(words, encoded, strict=True) if len(e.ids) == 3]
        self.random = random.Random(seed)

    def make(self, lengths: list[int]) -> Texts:
        texts = [" ".join(self.random.choice(self.words) for _ in range(n - 2)) for n in lengths]
        ids = [e.ids for e in self.tokenizer.encode_batch(texts)]
        for n, row in zip(lengths, ids, strict=True):
            if len(row) != n:
                raise RuntimeError(f"a text meant to be {n} tokens tokenized to {len(row)}")
        return Texts(texts, [list(r) for r in ids])


def mixed_lengths(count: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    raw = rng.lognormal(np.log(MIXED_MEDIAN), MIXED_SIGMA, count)
    return [int(x) for x in np.clip(np.rint(raw), MIXED_MIN, MIXED_MAX)]


def ideal_batches(lengths: list[int], size: int = IDEAL_BATCH,
                  padding: float = IDEAL_PADDING) -> list[list[int]]:
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    real = 0
    for i in order:  # ascending: the newcomer is the longest
        if current and (len(current) + 1 > size
                        or (len(current) + 1) * lengths[i] > padding * (real + lengths[i])):
            batches.append(current)
            current, real = [], 0
        current.append(i)
        real += lengths[i]
    if current:
        batches.append(current)
    return batches


def build(tokenizer_path: Path, *, quick: bool, mixed_count: int, seed: int = 0,
          attention_shape: tuple[int, int] = ATTENTION_SHAPE) -> Workload:
    maker = TextMaker(tokenizer_path, seed)
    shapes = [Shape(shape_name(b, s), b, s, maker.make([s] * b))
              for b, s in (QUICK_SHAPES if quick else SHAPES)]
    lengths = mixed_lengths(mixed_count, seed)
    mixed = maker.make(lengths)
    b, s = attention_shape
    attention = Shape(shape_name(b, s), b, s, maker.make([s] * b))
    array = np.asarray(lengths)
    distribution = {
        "kind": f"lognormal(median={MIXED_MEDIAN}, sigma={MIXED_SIGMA}) clipped to "
                f"[{MIXED_MIN}, {MIXED_MAX}]",
        "count": len(lengths), "tokens": int(array.sum()), "mean": float(array.mean()),
        "p10": float(np.percentile(array, 10)), "p50": float(np.percentile(array, 50)),
        "p90": float(np.percentile(array, 90)), "max": int(array.max()),
    }
    short_lengths = [int(n) for n in np.random.default_rng(seed + 1).integers(
        SHORT_MIN, SHORT_MAX + 1, mixed_count * 2)]
    return Workload(seed, shapes, mixed, ideal_batches(lengths), attention,
                    maker.make(short_lengths), ideal_batches(short_lengths), distribution)


def padded_batch(rows: list[list[int]], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask) int64, padded to the longest row, as the server's scheduler pads."""
    longest = max(len(r) for r in rows)
    ids = np.full((len(rows), longest), pad_id, dtype=np.int64)
    mask = np.zeros((len(rows), longest), dtype=np.int64)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = row
        mask[i, :len(row)] = 1
    return ids, mask
