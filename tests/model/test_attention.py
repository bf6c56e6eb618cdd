"""Attention's defining properties (shapes, rows of weights summing to one, weights in
[0, 1]), then masks, batch invariance and cross-attention."""

import pytest
import torch

from attnserve.model import Encoder, EncoderConfig
from attnserve.model.attention import MultiHeadAttention
from attnserve.model.positions import RotaryEmbedding


@pytest.mark.parametrize("heads", [1, 2])
def test_shapes_rows_sum_to_one_and_weights_in_unit_range(heads):
    torch.manual_seed(0)
    x = torch.randn(2, 4, 8)  # batch 2, seq_len 4, d_model 8
    out, probs = MultiHeadAttention(8, heads)(x, x, x)
    assert out.shape == (2, 4, 8)
    assert probs.shape == (2, heads, 4, 4)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, heads, 4), atol=1e-6, rtol=0)
    assert probs.min() >= 0 and probs.max() <= 1


def test_q_k_v_are_three_distinct_parameters():
    attention = MultiHeadAttention(8, 2)
    weights = [attention.w_q.weight, attention.w_k.weight, attention.w_v.weight]
    assert len({w.data_ptr() for w in weights}) == 3
    assert not torch.equal(weights[0], weights[1]) and not torch.equal(weights[1], weights[2])


def test_padding_mask_gives_exactly_zero_weight():
    torch.manual_seed(0)
    x = torch.randn(1, 5, 8)
    mask = torch.tensor([1, 1, 1, 0, 0])[None, None, None, :]
    _, probs = MultiHeadAttention(8, 2)(x, x, x, mask)
    assert torch.all(probs[..., 3:] == 0)
    torch.testing.assert_close(probs.sum(-1), torch.ones(1, 2, 5), atol=1e-6, rtol=0)


def test_causal_mask_gives_exactly_zero_weight_to_the_future():
    config = EncoderConfig(vocab_size=50, hidden_size=16, num_layers=1, num_heads=2,
                           intermediate_size=32, max_positions=16, causal=True)
    torch.manual_seed(0)
    out = Encoder(config).eval()(torch.randint(0, 50, (2, 6)), output_attentions=True)
    future = torch.triu(torch.ones(6, 6, dtype=torch.bool), diagonal=1)
    assert torch.all(out.attentions[0][..., future] == 0)
    assert torch.all(out.attentions[0][..., ~future] > 0)


@pytest.mark.parametrize("positions", ["learned", "sinusoidal", "rope"])
def test_padding_and_longer_neighbours_do_not_change_a_sequence(positions):
    config = EncoderConfig(vocab_size=100, hidden_size=32, num_layers=2, num_heads=4,
                           intermediate_size=64, max_positions=64, positions=positions)
    torch.manual_seed(0)
    encoder = Encoder(config).eval()
    short = torch.randint(1, 100, (1, 5))
    alone = encoder(short).last_hidden_state
    batch = torch.zeros(3, 20, dtype=torch.long)
    mask = torch.zeros(3, 20, dtype=torch.long)
    batch[0, :5], mask[0, :5] = short, 1
    batch[1:], mask[1:] = torch.randint(1, 100, (2, 20)), 1
    with torch.no_grad():
        together = encoder(batch, mask).last_hidden_state
    assert (together[0, :5] - alone[0]).abs().max() <= 1e-5


def test_cross_attention_with_a_different_key_length():
    torch.manual_seed(0)
    query, memory = torch.randn(2, 3, 8), torch.randn(2, 7, 8)
    out, probs = MultiHeadAttention(8, 2)(query, memory, memory)
    assert out.shape == (2, 3, 8) and probs.shape == (2, 2, 3, 7)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 2, 3), atol=1e-6, rtol=0)


@pytest.mark.parametrize("pairs", ["interleaved", "halves"])
def test_rope_scores_depend_only_on_relative_position(pairs):
    rotary = RotaryEmbedding(head_dim=8, max_positions=32, pairs=pairs)
    torch.manual_seed(0)
    q, k = torch.randn(8), torch.randn(8)
    # The same q and k placed at every position: q_i·k_j must depend on i - j only.
    rq = rotary(q.expand(1, 1, 32, 8))[0, 0]
    rk = rotary(k.expand(1, 1, 32, 8))[0, 0]
    scores = rq @ rk.T
    torch.testing.assert_close(scores[3, 1], scores[10, 8], atol=1e-5, rtol=0)
    assert not torch.allclose(scores[3, 1], scores[3, 2])
