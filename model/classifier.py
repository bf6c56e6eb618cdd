"""A cross-encoder: the encoder reads a (query, text) pair as one sequence, and a
classification head turns it into one score per label.

    logits = out(activation(dense(pool(encoder(pair)))))

pool takes the first token's vector ([CLS], <s>), or the mean over the real tokens
(ModernBERT may be trained so); BERT's dense layer is its pre-trained pooler. Every token
attends to both sides of the pair, which is what makes it a better ranker than comparing
two separately pooled vectors, and why it must run once per pair.
"""

import torch
from torch import nn

from attnserve.model.config import HeadConfig
from attnserve.model.encoder import Encoder
from attnserve.model.modernbert import ModernBertEncoder


class ClassificationHead(nn.Module):
    def __init__(self, hidden_size: int, config: HeadConfig):
        super().__init__()
        self.config = config
        self.dense = nn.Linear(hidden_size, hidden_size, bias=config.dense_bias)
        self.act = nn.Tanh() if config.activation == "tanh" else nn.GELU()
        self.norm = (nn.LayerNorm(hidden_size, eps=config.norm_eps, bias=config.norm_bias)
                     if config.norm else nn.Identity())
        self.out = nn.Linear(hidden_size, len(config.labels))

    def pool(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(batch, seq, hidden) -> (batch, hidden)."""
        if self.config.pooling == "cls":
            return hidden[:, 0]
        weights = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * weights).sum(dim=1) / weights.sum(dim=1)

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.act(self.dense(self.pool(hidden, attention_mask)))))


class CrossEncoder(nn.Module):
    def __init__(self, encoder: Encoder | ModernBertEncoder, head: HeadConfig):
        super().__init__()
        self.encoder = encoder
        self.config = encoder.config
        self.head = ClassificationHead(encoder.config.hidden_size, head)

    @property
    def uses_token_types(self) -> bool:
        """BERT learned a second segment's embedding (the text's, after the query's); RoBERTa's
        families have one segment only, ModernBERT none."""
        return isinstance(self.encoder, Encoder) and self.config.type_vocab_size > 1

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """(batch, seq) pairs -> (batch, labels) logits."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if isinstance(self.encoder, Encoder):
            out = self.encoder(input_ids, attention_mask, token_type_ids)
        else:
            out = self.encoder(input_ids, attention_mask)
        return self.head(out.last_hidden_state, attention_mask)
