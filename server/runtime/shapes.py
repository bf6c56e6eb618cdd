"""Shape buckets: the bounded set of (batch, seq) shapes batches are padded to.

On CUDA the first run of a (batch, seq) shape costs ~55 ms (later runs of it ~1.2 ms; an
H200 with onnxruntime-gpu 1.31.1), and dynamic batching of mixed lengths makes nearly
every batch a new shape. Padding each batch to a bucket (rows to a power of two, length
to a multiple of `seq_multiple`) bounds the shapes to a few dozen, all of which run once
before the server says SERVING. The rows added are all padding (masked), and their
results are thrown away."""

from dataclasses import dataclass

Shape = tuple[int, int]
"""(batch, seq)"""


@dataclass(frozen=True)
class ShapeBuckets:
    seq_multiple: int
    """lengths round up to a multiple of this (capped at the model's positions)"""
    max_batch_size: int
    """rows round up to a power of two, capped at this"""
    max_positions: int

    def padded(self, batch: int, longest: int) -> Shape:
        rows = max(batch, min(self.max_batch_size, 1 << (batch - 1).bit_length()))
        seq = max(longest, min(self.max_positions, -(-longest // self.seq_multiple) * self.seq_multiple))
        return rows, seq

    def reachable(self, max_batch_tokens: int) -> list[Shape]:
        """Every shape a batch can be padded to: one sequence of any length, or a batch
        whose padded shape stays within `max_batch_tokens` (the batch loop's cap), small
        to large."""
        # Rows depend on the batch only and the length on the longest only.
        rows = sorted({self.padded(batch, 1)[0] for batch in range(1, self.max_batch_size + 1)})
        seqs = sorted({self.padded(1, n)[1] for n in range(1, self.max_positions + 1)})
        shapes = [(r, s) for r in rows for s in seqs if r == 1 or r * s <= max_batch_tokens]
        return sorted(shapes, key=lambda shape: (shape[0] * shape[1], shape))
