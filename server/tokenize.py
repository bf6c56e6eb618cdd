"""Text -> token ids with the artifact's own tokenizer.json (Hugging Face `tokenizers`)."""

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer


@dataclass(frozen=True)
class Encoded:
    ids: np.ndarray
    """int64 token ids, special tokens included"""
    tokens: list[str]
    offsets: list[tuple[int, int]]


class TooLong(ValueError):
    def __init__(self, index: int, length: int, limit: int):
        super().__init__(
            f"texts[{index}]: {length} tokens, longer than the model's {limit} positions; "
            "set truncate=true to cut it"
        )


class TextTokenizer:
    def __init__(self, path: Path, max_positions: int):
        # The bundled tokenizer.json pads and truncates to 128 tokens: turn both off and
        # apply the server's own rule, or long inputs are cut without a word.
        self.tokenizer = Tokenizer.from_file(str(path))
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()
        # A second instance cuts at the model's positions while keeping [SEP]; two
        # instances because truncation is tokenizer state and encoding runs on threads.
        self.truncating = Tokenizer.from_file(str(path))
        self.truncating.no_padding()
        self.truncating.enable_truncation(max_positions)
        self.max_positions = max_positions

    def encode(self, texts: list[str], truncate: bool) -> list[Encoded]:
        """Refuses (TooLong) a text longer than the model's positions unless `truncate`."""
        out = []
        for index, encoding in enumerate(self.tokenizer.encode_batch(texts)):
            if len(encoding.ids) > self.max_positions:
                if not truncate:
                    raise TooLong(index, len(encoding.ids), self.max_positions)
                encoding = self.truncating.encode(texts[index])
            out.append(Encoded(np.asarray(encoding.ids, dtype=np.int64), encoding.tokens,
                               encoding.offsets))
        return out
