"""A cross-encoder: the encoder reads a (query, text) pair as one sequence, and a
classification head turns it into one score per label.

    logits = out(activation(dense(pool(encoder(pair)))))

pool takes the first token's vector ([CLS], <s>), or the mean over the real tokens
(ModernBERT may be trained so), or the last real token's (a causal decoder's, Qwen3,
whose head is `out` alone); BERT's dense layer is its pre-trained pooler. Every token
attends to both sides of the pair, which is what makes it a better ranker than comparing
two separately pooled vectors, and why it must run once per pair.
"""

import torch
from torch import nn

from attnserve.model import pooling
from attnserve.model.config import HeadConfig
from attnserve.model.encoder import Encoder
from attnserve.model.families import AnyEncoder
from attnserve.model.feed_forward import activation


class ClassificationHead(nn.Module):
    def __init__(self, hidden_size: int, config: HeadConfig):
        super().__init__()
        self.config = config
        self.dense = (nn.Linear(hidden_size, hidden_size, bias=config.dense_bias)
                      if config.dense else nn.Identity())
        self.act = activation(config.activation) if config.dense else nn.Identity()
        self.norm = (nn.LayerNorm(hidden_size, eps=config.norm_eps, bias=config.norm_bias)
                     if config.norm else nn.Identity())
        self.out = nn.Linear(hidden_size, len(config.labels), bias=config.out_bias)

    def pool(self, hidden: torch.Tensor, attention_mask: torch.Tensor,
             input_ids: torch.Tensor) -> torch.Tensor:
        """(batch, seq, hidden) -> (batch, hidden)."""
        if self.config.pooling == "cls":
            return pooling.first(hidden)
        if self.config.pooling == "mean":
            return pooling.mean(hidden, attention_mask)
        keep = attention_mask.bool()
        if self.config.pad_token_id is not None:
            keep = keep & (input_ids != self.config.pad_token_id)
        return pooling.last(hidden, keep)

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor,
                input_ids: torch.Tensor) -> torch.Tensor:
        pooled = self.pool(hidden, attention_mask, input_ids)
        return self.out(self.norm(self.act(self.dense(pooled))))


class CrossEncoder(nn.Module):
    def __init__(self, encoder: AnyEncoder, head: HeadConfig):
        super().__init__()
        self.encoder = encoder
        self.config = encoder.config
        self.head = ClassificationHead(encoder.config.hidden_size, head)

    @property
    def uses_token_types(self) -> bool:
        """BERT learned a second segment's embedding (the text's, after the query's); RoBERTa's
        families have one segment only, the others none."""
        return isinstance(self.encoder, Encoder) and self.config.type_vocab_size > 1

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """(batch, seq) pairs -> (batch, labels) logits."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        segments = (token_type_ids,) if isinstance(self.encoder, Encoder) else ()
        out = self.encoder(input_ids, attention_mask, *segments)
        return self.head(out.last_hidden_state, attention_mask, input_ids)
