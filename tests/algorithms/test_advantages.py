"""Advantage estimators: batch reference vs affine coefficients vs hand / stdlib values."""

import math
import statistics
import zlib

import pytest
import torch

from megatron_tsync.algorithms import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    AffineCoefficients,
    get_advantage_estimator,
    group_mean,
    register_advantage_estimator,
)

NAMES = ["grpo", "grpo_unbiased", "dr_grpo", "rloo", "grpo_batch_std"]
EPS = 1e-6


def _random_batch(gen: torch.Generator, sizes: list[int], kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewards (N,) float64 and non-contiguous, shuffled group ids (N,) for groups of the given sizes."""
    rewards, ids = [], []
    for g, size in enumerate(sizes):
        if kind == "binary":
            r = torch.randint(0, 2, (size,), generator=gen).double()
        elif kind == "constant":
            r = torch.full((size,), 0.7, dtype=torch.float64)
        else:
            r = torch.randn(size, generator=gen, dtype=torch.float64) * 3 + 1
        rewards.append(r)
        ids.append(torch.full((size,), 10 * g + 3, dtype=torch.long))
    rewards, ids = torch.cat(rewards), torch.cat(ids)
    perm = torch.randperm(rewards.numel(), generator=gen)
    return rewards[perm], ids[perm]


def _affine_from_coefficients(est: AdvantageEstimator, rewards: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(rewards)
    for gid in ids.unique():
        sel = ids == gid
        coeffs = est.coefficients(rewards[sel], batch_rewards=rewards if est.needs_batch_rewards else None)
        out[sel] = coeffs.alpha * rewards[sel] + coeffs.beta
    return out


def test_registry_contents():
    assert set(NAMES) <= set(ADVANTAGE_ESTIMATORS)
    for name in NAMES:
        est = get_advantage_estimator(name)
        assert est.name == name
        assert est.needs_batch_rewards == (name == "grpo_batch_std")
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        get_advantage_estimator("ppo_gae")
    with pytest.raises(ValueError, match="already registered"):
        register_advantage_estimator("grpo")(type("Dup", (AdvantageEstimator,), {}))
    assert get_advantage_estimator("grpo", eps=1e-3).eps == 1e-3


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("kind", ["normal", "binary", "constant"])
def test_advantages_equal_affine_coefficients(name, kind):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{name}/{kind}".encode()))
    est = get_advantage_estimator(name)
    for _ in range(5):
        sizes = [2] + torch.randint(2, 9, (6,), generator=gen).tolist()
        rewards, ids = _random_batch(gen, sizes, kind)
        ref = est.advantages(rewards, ids)
        affine = _affine_from_coefficients(est, rewards, ids)
        assert ref.dtype == torch.float64 and ref.shape == rewards.shape
        # α can be 1/ε = 1e6 on zero-variance groups: the tolerance scales with |α·r|.
        scale = max(1.0, float((affine.abs() + rewards.abs()).max()))
        alpha_max = 1.0 / EPS if kind != "normal" else 10.0
        torch.testing.assert_close(ref, affine, rtol=0, atol=1e-12 * scale * alpha_max)


def test_hand_computed_values():
    r = torch.tensor([1.0, 2.0, 3.0, 6.0], dtype=torch.float64)  # mean 3, deviations (-2, -1, 0, 3), Σdev² = 14
    ids = torch.zeros(4, dtype=torch.long)
    dev = torch.tensor([-2.0, -1.0, 0.0, 3.0], dtype=torch.float64)
    expected = {
        "grpo": dev / (math.sqrt(14 / 4) + EPS),
        "grpo_unbiased": dev / (math.sqrt(14 / 3) + EPS),
        "dr_grpo": dev,
        "rloo": torch.tensor([1 - 11 / 3, 2 - 10 / 3, 3 - 9 / 3, 6 - 6 / 3], dtype=torch.float64),
        "grpo_batch_std": dev / (math.sqrt(14 / 3) + EPS),  # one group: batch std == unbiased group std
    }
    for name, exp in expected.items():
        est = get_advantage_estimator(name)
        torch.testing.assert_close(est.advantages(r, ids), exp, rtol=1e-14, atol=1e-14)
        torch.testing.assert_close(_affine_from_coefficients(est, r, ids), exp, rtol=1e-14, atol=1e-14)


def test_stdlib_reference_two_groups():
    a, b = [0.3, 1.9, -0.4, 2.2, 0.0], [5.0, 1.0, 4.0]
    rewards = torch.tensor(a + b, dtype=torch.float64)
    ids = torch.tensor([7] * 5 + [2] * 3)
    expected = {
        "grpo": [(x - statistics.fmean(g)) / (statistics.pstdev(g) + EPS) for g in (a, b) for x in g],
        "grpo_unbiased": [(x - statistics.fmean(g)) / (statistics.stdev(g) + EPS) for g in (a, b) for x in g],
        "dr_grpo": [x - statistics.fmean(g) for g in (a, b) for x in g],
        "rloo": [x - statistics.fmean(g[:i] + g[i + 1:]) for g in (a, b) for i, x in enumerate(g)],
        "grpo_batch_std": [(x - statistics.fmean(g)) / (statistics.stdev(a + b) + EPS) for g in (a, b) for x in g],
    }
    for name, exp in expected.items():
        got = get_advantage_estimator(name).advantages(rewards, ids)
        torch.testing.assert_close(got, torch.tensor(exp, dtype=torch.float64), rtol=1e-12, atol=1e-12)


def test_alpha_known_in_advance():
    assert get_advantage_estimator("dr_grpo").alpha_known_in_advance(5) == 1.0
    assert get_advantage_estimator("rloo").alpha_known_in_advance(5) == 5 / 4
    for name in ("grpo", "grpo_unbiased", "grpo_batch_std"):
        assert get_advantage_estimator(name).alpha_known_in_advance(5) is None
    # when known in advance it must equal the coefficient computed from rewards
    r = torch.tensor([0.1, 0.9, 0.4, 0.4, 0.3], dtype=torch.float64)
    for name in ("dr_grpo", "rloo"):
        est = get_advantage_estimator(name)
        assert est.coefficients(r).alpha == est.alpha_known_in_advance(5)


def test_singleton_groups():
    r = torch.tensor([0.8, 0.2, 0.6], dtype=torch.float64)
    ids = torch.tensor([0, 1, 1])
    for name in ("grpo", "grpo_unbiased", "dr_grpo", "grpo_batch_std"):
        est = get_advantage_estimator(name)
        adv = est.advantages(r, ids)
        assert adv[0] == 0.0, name
        coeffs = est.coefficients(r[:1], batch_rewards=r)
        assert coeffs.advantage(0.8) == 0.0, name
    rloo = get_advantage_estimator("rloo")
    with pytest.raises(ValueError, match="at least 2"):
        rloo.advantages(r, ids)
    with pytest.raises(ValueError, match="at least 2"):
        rloo.coefficients(r[:1])
    with pytest.raises(ValueError, match="at least 2"):
        rloo.alpha_known_in_advance(1)


def test_zero_variance_group_is_exactly_zero():
    r = torch.full((7,), 0.7, dtype=torch.float64)
    assert group_mean(r) == 0.7  # shifted mean: bit exact
    for name in NAMES:
        est = get_advantage_estimator(name)
        coeffs = est.coefficients(r, batch_rewards=r)
        if name in ("grpo", "grpo_unbiased", "grpo_batch_std"):
            assert coeffs.alpha == pytest.approx(1 / EPS)
        assert coeffs.advantage(0.7) == 0.0
        assert est.close_coefficient(coeffs, 0.7, r) == 0.0


def test_batch_std_needs_batch_rewards():
    est = get_advantage_estimator("grpo_batch_std")
    with pytest.raises(ValueError, match="batch_rewards"):
        est.coefficients(torch.tensor([0.0, 1.0]))


def test_close_coefficient_matches_definition():
    gen = torch.Generator().manual_seed(0)
    r = torch.rand(6, generator=gen, dtype=torch.float64)
    for name in NAMES:
        est = get_advantage_estimator(name)
        coeffs = est.coefficients(r, batch_rewards=r)
        for origin in (0.0, float(r[3]), 2.5):
            assert est.close_coefficient(coeffs, origin, r) == pytest.approx(coeffs.alpha * origin + coeffs.beta,
                                                                              rel=1e-12, abs=1e-12)
    with pytest.raises(ValueError, match="beta == -alpha"):
        get_advantage_estimator("grpo").close_coefficient(AffineCoefficients(1.0, 5.0), 0.0, r)


def test_coefficients_are_python_floats_and_input_agnostic():
    est = get_advantage_estimator("grpo")
    c1 = est.coefficients([0.1, 0.7, 0.3])  # python floats must not be rounded through float32
    c2 = est.coefficients(torch.tensor([0.1, 0.7, 0.3], dtype=torch.float64))
    c3 = est.coefficients(torch.tensor([0.1, 0.7, 0.3], dtype=torch.float32))
    assert isinstance(c1.alpha, float) and isinstance(c1.beta, float)
    assert c1 == c2
    assert c1 != c3
    with pytest.raises(ValueError, match="finite"):
        est.coefficients([0.0, float("nan")])
