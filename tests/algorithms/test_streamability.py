"""``decide`` never streams with a wrong sign (brute force over the outstanding rewards), defers only when it must,
and a guessing rule would be caught by the same checker."""

import itertools
import random
from fractions import Fraction

import pytest
import torch

from megatron_tsync.algorithms import (
    PolicyLossConfig,
    RewardSpec,
    StreamDecision,
    decide,
    describe_config,
    get_advantage_estimator,
)

SPECS = [RewardSpec.binary(0.0, 1.0), RewardSpec.binary(-1.0, 2.5), RewardSpec.bounded(0.0, 1.0),
         RewardSpec.bounded(-3.0, 5.0)]
ESTIMATORS = ["grpo", "grpo_unbiased", "dr_grpo", "rloo"]


def _draw(rng: random.Random, spec: RewardSpec) -> float:
    if spec.kind == "binary":
        return rng.choice([spec.lo, spec.hi])
    return rng.choice([spec.lo, spec.hi, round(rng.uniform(spec.lo, spec.hi), 2), rng.uniform(spec.lo, spec.hi)])


def _completions(rng: random.Random, spec: RewardSpec, u: int, samples: int = 20):
    """All corner completions {lo, hi}^u (the group mean is linear in them, so corners attain its extremes) plus,
    for bounded rewards, random interior completions."""
    yield from itertools.product([spec.lo, spec.hi], repeat=u)
    if spec.kind == "bounded":
        for _ in range(samples):
            yield tuple(rng.uniform(spec.lo, spec.hi) for _ in range(u))


def _exact_sign(rewards: list[float], i: int) -> int:
    """sign(G·r_i − Σ r) in exact rational arithmetic = sign(A_i) for every estimator (α > 0)."""
    s = len(rewards) * Fraction(rewards[i]) - sum(Fraction(r) for r in rewards)
    return (s > 0) - (s < 0)


def _check_rule(rule, spec: RewardSpec, seed: int, trials: int = 200) -> dict:
    """Return counts; raise AssertionError on the first decision whose sign some completion contradicts."""
    rng = random.Random(seed)
    counts = {"stream": 0, "defer": 0}
    for _ in range(trials):
        g = rng.randint(2, 6)
        known = [_draw(rng, spec) for _ in range(rng.randint(1, g))]
        i = rng.randrange(len(known))
        d = rule(reward=known[i], known=known, g=g, spec=spec)
        counts["stream" if d.stream else "defer"] += 1
        signs = set()
        for n, rest in enumerate(_completions(rng, spec, g - len(known))):
            full = known + list(rest)
            signs.add(_exact_sign(full, i))
            if d.stream:
                assert d.adv_sign * _exact_sign(full, i) >= 0, (known, i, rest, d)
            if d.stream and n < 4:  # the estimators' own advantages agree (up to rounding of a zero advantage)
                adv = get_advantage_estimator(ESTIMATORS[n]).advantages(
                    torch.tensor(full, dtype=torch.float64), torch.zeros(len(full), dtype=torch.long))[i]
                assert d.adv_sign * float(adv) >= -1e-9, (known, i, rest, d, float(adv))
        if not d.stream:  # deferral was necessary: both strict signs are reachable
            assert {1, -1} <= signs, (known, i, signs)
    return counts


def _decide(reward, known, g, spec):
    return decide(ratio_in_band=False, reward=reward, known_rewards=known, group_size=g, spec=spec,
                  loss_kind="ppo_clip")


@pytest.mark.parametrize("spec_index", range(len(SPECS)))
def test_decide_sound_and_complete(spec_index):
    spec = SPECS[spec_index]
    counts = _check_rule(_decide, spec, seed=spec_index)
    if spec.kind == "binary":  # r = max ⇒ A ≥ 0 and r = min ⇒ A ≤ 0: binary rewards never need to wait
        assert counts["defer"] == 0, counts
    else:
        assert counts["stream"] > 20 and counts["defer"] > 20, counts


def _guess_from_running_mean(reward, known, g, spec):
    m = sum(known) / len(known)
    return StreamDecision(True, 1 if reward >= m else -1, "guess")


def test_guessing_the_sign_is_caught():
    for spec in SPECS:
        with pytest.raises(AssertionError):
            _check_rule(_guess_from_running_mean, spec, seed=11)


def test_binary_extremes_always_stream():
    spec = RewardSpec.binary(0.0, 1.0)
    for g in range(2, 8):
        for k in range(1, g + 1):
            for known in itertools.product([0.0, 1.0], repeat=k):
                known = list(known)
                for r in known:
                    d = _decide(r, known, g, spec)
                    all_zero_complete = k == g and sum(known) == 0  # A = 0 exactly: +1 by convention
                    assert d.stream and d.adv_sign == (1 if r == 1.0 or all_zero_complete else -1)


def test_decide_rules_0_1_and_continuous():
    common = dict(reward=0.3, known_rewards=[0.3, 0.9], group_size=4)
    d = decide(ratio_in_band=False, spec=RewardSpec.continuous(), loss_kind="none", **common)
    assert d == StreamDecision(True, None, d.reason) and "rule 0" in d.reason
    d = decide(ratio_in_band=True, spec=RewardSpec.continuous(), loss_kind="ppo_clip", **common)
    assert d.stream and d.adv_sign is None and "rule 1" in d.reason
    d = decide(ratio_in_band=False, spec=RewardSpec.continuous(), loss_kind="ppo_clip", **common)
    assert not d.stream and d.adv_sign is None and "rule 3" in d.reason
    # continuous rewards: the last arrival knows its sign
    d = decide(ratio_in_band=False, reward=0.3, known_rewards=[0.3, 0.9, -5.0, 2.0], group_size=4,
               spec=RewardSpec.continuous(), loss_kind="ppo_clip")
    assert d.stream and d.adv_sign == 1  # mean = -0.45
    # A == 0 exactly (all equal, group complete): both masks give a zero gradient
    d = decide(ratio_in_band=False, reward=0.7, known_rewards=[0.7] * 3, group_size=3,
               spec=RewardSpec.bounded(0, 1), loss_kind="ppo_clip")
    assert d.stream


def test_decide_validation():
    ok = dict(ratio_in_band=False, group_size=3, loss_kind="ppo_clip")
    with pytest.raises(ValueError, match="include"):
        decide(reward=1.0, known_rewards=[0.0], spec=RewardSpec.binary(), **ok)
    with pytest.raises(ValueError, match="binary reward"):
        decide(reward=0.5, known_rewards=[0.5], spec=RewardSpec.binary(), **ok)
    with pytest.raises(ValueError, match="bounded reward"):
        decide(reward=1.5, known_rewards=[1.5], spec=RewardSpec.bounded(0, 1), **ok)
    with pytest.raises(ValueError, match="group_size"):
        decide(reward=1.0, known_rewards=[1.0] * 4, spec=RewardSpec.binary(), **ok)
    with pytest.raises(ValueError, match="loss_kind"):
        decide(ratio_in_band=False, group_size=3, loss_kind="gspo", reward=1.0, known_rewards=[1.0],
               spec=RewardSpec.binary())
    with pytest.raises(ValueError):
        RewardSpec(kind="bounded")  # infinite bounds
    with pytest.raises(ValueError):
        RewardSpec.binary(1.0, 1.0)


def test_describe_config():
    ppo = PolicyLossConfig(kind="ppo_clip", clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    s = describe_config(ppo, RewardSpec.binary(), "in_reward", 0.0)
    assert s.startswith("Streaming is exact.") and "[0.8, 1.28]" in s and "binary" in s and "folded" in s
    s = describe_config(PolicyLossConfig(kind="none", tis_cap=2.0), RewardSpec.continuous(), "none", 0.0)
    assert "rule 0" in s and "TIS" in s and "no KL or entropy" in s
    s = describe_config(ppo, RewardSpec.continuous(), "loss", 1e-3, aux_strategy="defer_to_close")
    assert "KL loss and entropy bonus via deferring" in s and "group completes" in s
    with pytest.raises(ValueError, match="must not be dropped"):
        describe_config(ppo, RewardSpec.binary(), "loss", 0.0, aux_strategy=None)
    with pytest.raises(ValueError, match="kl_mode"):
        describe_config(ppo, RewardSpec.binary(), "k3", 0.0)
