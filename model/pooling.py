"""One vector per sequence from its tokens' hidden states, (batch, seq, hidden) ->
(batch, hidden), as sentence-transformers' Pooling computes it:

- mean: the average over the tokens the mask keeps (a row of padding only pools to zeros);
- cls: the first token's ([CLS], <s>);
- lasttoken: the last real token's, whichever side the batch is padded on: what a causal
  decoder (Qwen3) has read the whole sequence by.

Written without Shape or Expand nodes (a one-hot weighting picks the last token), so the
exported graph keeps every node on the device (a CUDA graph needs that).
"""

import torch


def mean(hidden: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    weights = keep.unsqueeze(-1).to(hidden.dtype)
    return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)


def first(hidden: torch.Tensor) -> torch.Tensor:
    return hidden[:, 0]


def last(hidden: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The last token `keep` (batch, seq) marks: the one whose running count of kept tokens
    reaches the row's total, left padding or right."""
    kept = keep.to(hidden.dtype)
    count = kept.cumsum(dim=1)
    is_last = kept * (count == count[:, -1:]).to(hidden.dtype)
    return (hidden * is_last.unsqueeze(-1)).sum(dim=1)


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, how: str) -> torch.Tensor:
    if how == "mean":
        return mean(hidden, attention_mask)
    if how == "cls":
        return first(hidden)
    if how == "lasttoken":
        return last(hidden, attention_mask)
    raise ValueError(f"unknown pooling {how!r} (mean, cls, lasttoken)")


def normalize(vectors: torch.Tensor) -> torch.Tensor:
    """Each vector (the last axis) at unit L2 length, as torch.nn.functional.normalize makes
    it (the norm clamped at 1e-12), written out so the graph has no Expand node."""
    return vectors / vectors.norm(p=2, dim=-1, keepdim=True).clamp(min=1e-12)
