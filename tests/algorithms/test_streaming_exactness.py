"""End to end on a tiny softmax policy (float64): streaming with the clip rule (§3), the moving origin (§1) and the
per-trajectory normalisers (§2) reproduces the batch gradient; ignoring the rule or guessing the sign does not."""

import random

import pytest
import torch

from megatron_tsync.algorithms import (
    PolicyLossConfig,
    RewardSpec,
    aggregate,
    barrier_divisor,
    decide,
    get_advantage_estimator,
    importance_ratio,
    policy_loss,
    sequence_weight,
    sign_free,
    surrogate,
)

V, D, T_MAX = 11, 6, 14


def make_batch(seed: int, num_groups: int, group_size: int, reward_kind: str):
    gen = torch.Generator().manual_seed(seed)
    n = num_groups * group_size
    feats = torch.randn(n, T_MAX, D, generator=gen, dtype=torch.float64)  # (N, T, D)
    actions = torch.randint(0, V, (n, T_MAX), generator=gen)  # (N, T)
    lengths = torch.randint(4, T_MAX + 1, (n,), generator=gen)
    mask = (torch.arange(T_MAX) < lengths[:, None]).double()  # (N, T) padding
    mask = mask * (torch.rand(n, T_MAX, generator=gen) > 0.2).double()  # tool tokens carry no loss
    if reward_kind == "binary":
        rewards = torch.randint(0, 2, (n,), generator=gen).double()
    else:
        rewards = torch.rand(n, generator=gen, dtype=torch.float64)
    ids = torch.arange(num_groups).repeat_interleave(group_size)
    theta = torch.randn(V, D, generator=gen, dtype=torch.float64) * 0.5
    theta_old = theta + 0.15 * torch.randn(V, D, generator=gen, dtype=torch.float64)  # ratios ≠ 1
    return dict(feats=feats, actions=actions, mask=mask, rewards=rewards, ids=ids, theta=theta,
                theta_old=theta_old)


def logprobs(theta: torch.Tensor, feats: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
    logits = feats @ theta.T  # (..., T, V)
    return torch.log_softmax(logits, -1).gather(-1, actions.unsqueeze(-1)).squeeze(-1)  # (..., T)


def batch_gradient(b, est, cfg, mode):
    theta = b["theta"].clone().requires_grad_()
    logp = logprobs(theta, b["feats"], b["actions"])
    old = logprobs(b["theta_old"], b["feats"], b["actions"])
    adv = est.advantages(b["rewards"], b["ids"])
    loss = aggregate(policy_loss(logp, old, adv, cfg), b["mask"], mode, max_len=T_MAX)
    (g,) = torch.autograd.grad(loss, theta)
    return g


def stream_gradient(b, est, cfg, spec, mode, group_size, seed, rule="exact"):
    """Arrivals in random interleaved order; per trajectory: decide, then backprop the surrogate into the group's
    (P, Q, ρ) or defer; per group at completion: close α·P + c·Q and run the deferred backwards."""
    theta = b["theta"].clone().requires_grad_()
    n = b["rewards"].numel()
    n_tok = int(b["mask"].sum())
    acc = torch.zeros_like(theta)
    groups: dict[int, dict] = {}
    stats = {"stream": 0, "defer": 0}

    def traj_grad(i, per_token_fn):
        logp = logprobs(theta, b["feats"][i], b["actions"][i])[None]  # (1, T)
        old = logprobs(b["theta_old"], b["feats"][i], b["actions"][i])[None]
        nu = sequence_weight(mode, int(b["mask"][i].sum()), num_sequences=n, max_len=T_MAX)
        (g,) = torch.autograd.grad(nu * (per_token_fn(logp, old) * b["mask"][i]).sum(), theta)
        return g

    for i in random.Random(seed).sample(range(n), n):
        gid, r = int(b["ids"][i]), float(b["rewards"][i])
        st = groups.setdefault(gid, dict(P=torch.zeros_like(theta), Q=torch.zeros_like(theta), origin=r,
                                         rewards=[], members=[], deferred=[]))
        st["rewards"].append(r)
        st["members"].append(i)
        with torch.no_grad():
            ratio = importance_ratio(logprobs(theta, b["feats"][i], b["actions"][i]),
                                     logprobs(b["theta_old"], b["feats"][i], b["actions"][i]))
        if rule == "exact":
            d = decide(ratio_in_band=sign_free(ratio, cfg, b["mask"][i]), reward=r, known_rewards=st["rewards"],
                       group_size=group_size, spec=spec, loss_kind=cfg.kind)
            stream, sign = d.stream, (d.adv_sign or 1)
        elif rule == "guess":  # sign from the running mean of the known rewards
            stream, sign = True, (1 if r >= sum(st["rewards"]) / len(st["rewards"]) else -1)
        else:  # "ignore": no clip mask at all
            stream, sign = True, None
        stats["stream" if stream else "defer"] += 1
        if stream:
            st["P"] += (st["origin"] - r) * st["Q"]
            st["origin"] = r
            sur_cfg = cfg if sign is not None else PolicyLossConfig(kind="none")
            st["Q"] += traj_grad(i, lambda lp, old: surrogate(lp, old, sign or 1, sur_cfg))
        else:
            st["deferred"].append(i)
        if len(st["rewards"]) == group_size:  # group complete: close it
            coeffs = est.coefficients(st["rewards"])
            acc += coeffs.alpha * st["P"] + est.close_coefficient(coeffs, st["origin"], st["rewards"]) * st["Q"]
            for j in st["deferred"]:
                a = torch.tensor([coeffs.advantage(float(b["rewards"][j]))], dtype=torch.float64)
                acc += traj_grad(j, lambda lp, old: policy_loss(lp, old, a, cfg))
    return acc / barrier_divisor(mode, n_tok), stats


def rel(x, ref):
    return float((x - ref).norm() / ref.norm())


CFG = PolicyLossConfig(kind="ppo_clip", clip_low=0.2, clip_high=0.28, dual_clip=3.0)


@pytest.mark.parametrize("reward_kind,spec", [("binary", RewardSpec.binary()), ("uniform", RewardSpec.bounded(0, 1)),
                                              ("uniform", RewardSpec.continuous())])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_clip_rule_streaming_is_exact(reward_kind, spec, mode):
    est = get_advantage_estimator("grpo")
    b = make_batch(seed=3, num_groups=4, group_size=6, reward_kind=reward_kind)
    ref = batch_gradient(b, est, CFG, mode)
    got, stats = stream_gradient(b, est, CFG, spec, mode, group_size=6, seed=5)
    assert rel(got, ref) <= 1e-12
    if spec.kind != "binary":
        assert stats["defer"] > 0  # the deferred path is exercised
    assert stats["stream"] > 0


@pytest.mark.parametrize("name", ["grpo_unbiased", "dr_grpo", "rloo"])
def test_other_estimators_and_unclipped_tis(name):
    est = get_advantage_estimator(name)
    b = make_batch(seed=4, num_groups=3, group_size=5, reward_kind="uniform")
    got, _ = stream_gradient(b, est, CFG, RewardSpec.bounded(0, 1), "seq-mean-token-sum", 5, seed=1)
    assert rel(got, batch_gradient(b, est, CFG, "seq-mean-token-sum")) <= 1e-12
    plain = PolicyLossConfig(kind="none")
    got, stats = stream_gradient(b, est, plain, RewardSpec.continuous(), "token-mean", 5, seed=2)
    assert stats["defer"] == 0
    assert rel(got, batch_gradient(b, est, plain, "token-mean")) <= 1e-12


@pytest.mark.parametrize("rule", ["guess", "ignore"])
def test_breaking_the_rule_gives_a_wrong_gradient(rule):
    est = get_advantage_estimator("grpo")
    b = make_batch(seed=3, num_groups=4, group_size=6, reward_kind="uniform")
    ref = batch_gradient(b, est, CFG, "token-mean")
    got, _ = stream_gradient(b, est, CFG, RewardSpec.bounded(0, 1), "token-mean", 6, seed=5, rule=rule)
    assert rel(got, ref) > 1e-2
