"""Streamed Σ_i ν_i Σ_t w ℓ / barrier_divisor == aggregate(), and aggregate() == hand loops."""

import pytest
import torch

from megatron_tsync.algorithms import AGGREGATION_MODES, aggregate, barrier_divisor, sequence_weight


def _batch(seed: int, b: int = 7, t: int = 13):
    gen = torch.Generator().manual_seed(seed)
    per_token = torch.randn(b, t, generator=gen, dtype=torch.float64)  # (B, T)
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    mask = (torch.arange(t) < lengths[:, None]).double()  # different lengths
    mask *= (torch.rand(b, t, generator=gen) > 0.25).double()  # holes: tool-output tokens
    mask[0] = 0.0  # a trajectory with no action token at all
    mask[1, 0] = 1.0
    return per_token, mask


def _loop_reference(per_token, mask, mode, l_max):
    """Plain python loops over trajectories, independent of both code paths."""
    rows = [[(float(x), float(m)) for x, m in zip(px, pm)] for px, pm in zip(per_token, mask)]
    b = len(rows)
    sums = [sum(x * m for x, m in row) for row in rows]
    counts = [sum(m for _, m in row) for row in rows]
    if mode == "token-mean":
        return sum(sums) / sum(counts)
    if mode == "seq-mean-token-mean":
        return sum(s / c for s, c in zip(sums, counts) if c > 0) / b
    if mode == "seq-mean-token-sum":
        return sum(sums) / b
    return sum(sums) / (b * l_max)


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_streamed_equals_aggregate(mode, seed):
    per_token, mask = _batch(seed)
    b, l_max = per_token.shape[0], 16  # L_max: the action-token budget, a constant larger than this batch's width
    n_tok = int(mask.sum())
    nu = [sequence_weight(mode, int(mask[i].sum()), num_sequences=b, max_len=l_max) for i in range(b)]
    streamed = sum(nu[i] * float((per_token[i] * mask[i]).sum()) for i in range(b)) / barrier_divisor(mode, n_tok)
    ref = float(aggregate(per_token, mask, mode, global_num_tokens=n_tok, num_sequences=b, max_len=l_max))
    assert streamed == pytest.approx(ref, rel=1e-13, abs=1e-15)
    assert ref == pytest.approx(_loop_reference(per_token, mask, mode, l_max), rel=1e-13, abs=1e-15)


def test_gradient_of_streamed_sum_equals_gradient_of_aggregate():
    per_token, mask = _batch(5)
    x = per_token.clone().requires_grad_()
    for mode in AGGREGATION_MODES:
        (g_ref,) = torch.autograd.grad(aggregate(x ** 2, mask, mode), x)
        div = barrier_divisor(mode, int(mask.sum()))
        streamed = sum(sequence_weight(mode, int(mask[i].sum()), num_sequences=x.shape[0], max_len=x.shape[1])
                       * (x[i] ** 2 * mask[i]).sum() for i in range(x.shape[0]))
        (g,) = torch.autograd.grad(streamed, x)
        torch.testing.assert_close(g / div, g_ref, rtol=1e-13, atol=1e-15)


def test_global_denominators_over_shards():
    """Two "DP ranks" holding halves of the batch: global denominators make the sum of shard losses the batch loss."""
    per_token, mask = _batch(9, b=8)
    n_tok, b = int(mask.sum()), per_token.shape[0]
    for mode in AGGREGATION_MODES:
        full = aggregate(per_token, mask, mode, max_len=20)
        shards = sum(aggregate(per_token[s], mask[s], mode, global_num_tokens=n_tok, num_sequences=b, max_len=20)
                     for s in (slice(0, 3), slice(3, 8)))
        torch.testing.assert_close(shards, full, rtol=1e-13, atol=1e-15)


def test_hand_values():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert float(aggregate(per_token, mask, "token-mean")) == pytest.approx(10 / 4)
    assert float(aggregate(per_token, mask, "seq-mean-token-mean")) == pytest.approx((2.0 + 4.0) / 2)
    assert float(aggregate(per_token, mask, "seq-mean-token-sum")) == pytest.approx((6.0 + 4.0) / 2)
    assert float(aggregate(per_token, mask, "seq-mean-token-sum-norm")) == pytest.approx(10 / (2 * 3))
    assert sequence_weight("token-mean", 3, num_sequences=2) == 1.0
    assert sequence_weight("seq-mean-token-mean", 3, num_sequences=2) == 1 / 6
    assert sequence_weight("seq-mean-token-mean", 0, num_sequences=2) == 0.0
    assert sequence_weight("seq-mean-token-sum", 3, num_sequences=2) == 0.5
    assert sequence_weight("seq-mean-token-sum-norm", 3, num_sequences=2, max_len=8) == 1 / 16
    assert barrier_divisor("token-mean", 4) == 4.0
    assert barrier_divisor("seq-mean-token-mean", 4) == 1.0


def test_validation():
    with pytest.raises(ValueError, match="unknown aggregation mode"):
        sequence_weight("sum", 3, num_sequences=2)
    with pytest.raises(ValueError, match="max_len"):
        sequence_weight("seq-mean-token-sum-norm", 3, num_sequences=2)
    assert sequence_weight("seq-mean-token-sum-norm", 8, num_sequences=2, max_len=8) == 1 / 16  # T_i = L_max
    with pytest.raises(ValueError, match=r"9 action tokens > L_max = 8"):  # L_max must bound every T_i
        sequence_weight("seq-mean-token-sum-norm", 9, num_sequences=2, max_len=8)
    with pytest.raises(ValueError, match="unknown aggregation mode"):
        barrier_divisor("mean", 3)
    with pytest.raises(ValueError):
        aggregate(torch.zeros(2, 3), torch.zeros(2, 4), "token-mean")
