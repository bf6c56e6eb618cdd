"""Random checkpoints at the sizes users serve, for the speed benchmarks: random weights
cost the time real ones do. Each is saved as sentence-transformers saves a model, so the
benchmarks' reference (`SentenceTransformer.encode`) loads the same directory.

- bert-base: BERT-base's shape (12 layers, hidden 768, 12 heads, feed-forward 3072, 512
  positions), MiniLM's tokenizer and modules (mean pooling, Normalize);
- qwen3-0.6b: Qwen3-Embedding-0.6B's shape (28 layers, hidden 1024, 16 query and 8
  key/value heads of 128, feed-forward 3072, vocabulary 151669, 32768 positions, tied
  embeddings) and modules (last-token pooling, Normalize, its query instruction), with a
  small byte-level tokenizer that appends <|endoftext|> and pads on the left as Qwen3's does.

`python -m bench families` makes them (QUICK: each shape's family at a tiny size, for a run
that only proves the command works).
"""

import shutil
from pathlib import Path

SHAPES = {
    "bert-base": ("bert", dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                               intermediate_size=3072, max_position_embeddings=512,
                               initializer_range=0.02)),
    "qwen3-0.6b": ("qwen3", dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                                 num_key_value_heads=8, head_dim=128, intermediate_size=3072,
                                 vocab_size=151669, max_position_embeddings=32768,
                                 initializer_range=0.02)),
}
QUICK = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
"""what --quick puts over each shape (a decoder keeps its grouping: 4 query heads over 2)"""
_QUICK_DECODER = dict(num_key_value_heads=2, head_dim=16)


def make(shape: str, directory: Path, quick: bool = False) -> Path:
    """The random checkpoint of `shape` (one of SHAPES) in `directory`, replacing it;
    `quick`: at QUICK's size."""
    from tests.families import make_sentence_transformer

    family, config = SHAPES[shape]
    if quick:
        config = config | QUICK | (_QUICK_DECODER if "num_key_value_heads" in config else {})
    shutil.rmtree(directory, ignore_errors=True)
    return make_sentence_transformer(family, directory, **config)
