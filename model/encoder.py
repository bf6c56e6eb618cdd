"""A BERT-style encoder (BERT, RoBERTa, XLM-RoBERTa, MPNet, DistilBERT): embeddings, then
post-LN blocks of attention and feed-forward."""

from dataclasses import dataclass

import torch
from torch import nn

from attnserve.model.attention import MultiHeadAttention
from attnserve.model.config import EncoderConfig
from attnserve.model.feed_forward import FeedForward
from attnserve.model.positions import (
    RelativePositionBias,
    RotaryEmbedding,
    positions_after_padding,
    sinusoidal_table,
)


class Embeddings(nn.Module):
    """token + position + token type (where the family has segments), then LayerNorm."""

    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.word = nn.Embedding(config.vocab_size, config.hidden_size)
        self.token_type = (nn.Embedding(config.type_vocab_size, config.hidden_size)
                           if config.type_vocab_size else None)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.position = (nn.Embedding(config.position_table_size, config.hidden_size)
                         if config.positions == "learned" else None)
        # RoPE adds nothing here: it rotates queries and keys inside attention.
        self.register_buffer("sinusoid", sinusoidal_table(config.max_positions, config.hidden_size)
                             if config.positions == "sinusoidal" else None, persistent=False)
        self.after_padding = config.positions_after_padding
        self.pad_token_id = config.pad_token_id

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        x = self.word(input_ids)
        if self.token_type is not None:
            x = x + self.token_type(token_type_ids)
        seq = input_ids.shape[1]
        if self.position is not None and self.after_padding:
            x = x + self.position(positions_after_padding(input_ids, self.pad_token_id))
        elif self.position is not None:
            x = x + self.position.weight[:seq]
        elif self.sinusoid is not None:
            x = x + self.sinusoid[:seq]
        return self.norm(x)


class EncoderBlock(nn.Module):
    """attention → residual → LayerNorm → feed-forward → residual → LayerNorm (post-LN, as BERT)."""

    def __init__(self, config: EncoderConfig, rotary: RotaryEmbedding | None):
        super().__init__()
        self.attention = MultiHeadAttention(config.hidden_size, config.num_heads, rotary,
                                            causal=config.causal)
        self.attention_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.feed_forward = FeedForward(config.hidden_size, config.intermediate_size, config.activation)
        self.output_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor, mask: torch.Tensor,
                score_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        attended, probs = self.attention(x, x, x, mask, score_bias)
        x = self.attention_norm(x + attended)
        x = self.output_norm(x + self.feed_forward(x))
        return x, probs


class Pooler(nn.Module):
    """BERT's pre-training head over the first ([CLS]) token: dense then tanh."""

    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(hidden[:, 0]))


@dataclass
class EncoderOutput:
    last_hidden_state: torch.Tensor
    """(batch, seq, hidden)"""
    attentions: tuple[torch.Tensor, ...] | None
    """one (batch, heads, seq, seq) tensor per layer, when asked for"""
    pooler_output: torch.Tensor | None = None
    """(batch, hidden), when the checkpoint carries BERT's pooler"""


class Encoder(nn.Module):
    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.config = config
        rotary = (RotaryEmbedding(config.head_dim, config.max_positions) if config.positions == "rope"
                  else None)
        self.embeddings = Embeddings(config)
        # One table of relative-position biases, shared by every layer (MPNet).
        self.relative = (RelativePositionBias(config.num_heads, config.relative_attention_buckets)
                         if config.relative_attention_buckets else None)
        self.layers = nn.ModuleList(EncoderBlock(config, rotary) for _ in range(config.num_layers))
        self.pooler = Pooler(config) if config.pooler else None

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, output_attentions: bool = False) -> EncoderOutput:
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        # (batch, seq) of 1 = real token, 0 = padding -> (batch, 1, seq, seq): may query i look
        # at key j? Padding keys never (the causal mask, where set, is attention's).
        batch, seq = attention_mask.shape
        mask = attention_mask[:, None, None, :].expand(batch, 1, seq, seq)
        x = self.embeddings(input_ids, token_type_ids)
        bias = None if self.relative is None else self.relative(seq, input_ids.device)
        attentions = []
        for layer in self.layers:
            x, probs = layer(x, mask, bias)
            attentions.append(probs)
        return EncoderOutput(x, attentions=tuple(attentions) if output_attentions else None,
                             pooler_output=self.pooler(x) if self.pooler is not None else None)
