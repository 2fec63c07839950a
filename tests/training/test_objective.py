"""The logged loss is the objective's true value: the same in sync, stream-group and stream-trajectory for the same
batch (float64 ≤ 1e-12), and equal to an independent reference (plain forward, the estimator's batch advantages,
the reference policy loss and ``algorithms.aggregate``). Control: the surrogate sum that used to be ``train/loss``
depends on the mode and the arrival order.

Cases: ratio 1 (trainer π_old) and ratio ≠ 1 (engine π_old, PPO asymmetric + dual clip, TIS), every aggregation,
estimators with per-group and batch statistics, KL (loss) and entropy terms, two minibatches.
"""

import zlib

import pytest
import torch

from megatron_tsync.algorithms import aggregate, get_advantage_estimator
from megatron_tsync.algorithms.kl import kl_penalty
from megatron_tsync.algorithms.policy_loss import PolicyLossConfig, policy_loss
from megatron_tsync.model.builder import PrecisionConfig, build_model
from megatron_tsync.model.logprobs import model_logits, vocab_parallel_entropy, vocab_parallel_logprobs
from megatron_tsync.streaming.ready_queue import ListSource
from megatron_tsync.training.learner import Learner, LearnerConfig, shape_for
from megatron_tsync.training.optimizer import OptimConfig, build_optimizer, wrap_ddp
from megatron_tsync.training.stream_fb import LossConfig

from .stream_cases import TINY, arrival_order, make_samples, spec_for

TOL = 1e-12
PPO_DUAL_TIS = PolicyLossConfig(clip_low=0.2, clip_high=0.28, dual_clip=3.0, tis_cap=2.0)
CASES = {
    "grpo-token-mean": dict(estimator="grpo", reward="bounded", loss={}),
    "dr_grpo-sum-norm": dict(estimator="dr_grpo", reward="continuous",
                             loss={"aggregation": "seq-mean-token-sum-norm"}),
    "rloo-seq-sum": dict(estimator="rloo", reward="binary", loss={"aggregation": "seq-mean-token-sum"}),
    "batch-std-seq-sum": dict(estimator="grpo_batch_std", reward="bounded", loss={"aggregation": "seq-mean-token-sum"}),
    # seq-mean-token-mean at ratio 1 is exactly 0 (Σ_i A_i = 0 in every group): tested at ratio ≠ 1
    "engine-ratio-dual-tis-seq-mean": dict(estimator="grpo", reward="bounded", loss={
        "old_logprobs": "engine", "policy": PPO_DUAL_TIS, "aggregation": "seq-mean-token-mean"}),
    "kl-entropy": dict(estimator="grpo", reward="binary",
                       loss={"kl_mode": "loss", "kl_coef": 0.1, "kl_kind": "k3", "entropy_coef": 0.01}),
    "two-minibatches": dict(estimator="grpo", reward="bounded", loss={}, num_minibatches=2),
}


@pytest.fixture(scope="module")
def model64(megatron_single):
    m = build_model(TINY, PrecisionConfig(params_dtype=torch.float64), seed=0)
    ddp = wrap_ddp(m)
    return ddp, build_optimizer(ddp, OptimConfig(optimizer="sgd", lr=0.0, clip_grad=0))  # θ stays θ0


def _config(case, mode):
    extra = {"num_minibatches": case["num_minibatches"]} if "num_minibatches" in case else {}
    return LearnerConfig(mode=mode, estimator=case["estimator"], reward_spec=spec_for(case["reward"]),
                         loss=LossConfig(**case["loss"]), **extra)


def _run(model64, case, mode, samples, order):
    ddp, opt = model64
    sizes, shape = shape_for(samples)
    return Learner(ddp, opt, _config(case, mode)).train_step(ListSource(order), sizes, shape)


def reference_objective(model64, case, samples) -> float:
    """Mean over the batch's minibatches of J_j = aggregate(ℓ(A) + β·kl − c·H) on minibatch j, each trajectory
    forwarded on its own, advantages from the estimator's batch formula over the minibatch's groups."""
    ddp, _ = model64
    lc = LossConfig(**case["loss"])
    est = get_advantage_estimator(case["estimator"], eps=1e-6)
    sizes, shape = shape_for(samples)
    m = case.get("num_minibatches", 1)
    mb_of = {g: i % m for i, g in enumerate(sizes)}
    values = []
    for j in range(m):
        groups = [g for g in sizes if mb_of[g] == j]
        batch = [s for g in groups for s in samples if s.group_id == g]
        adv = est.advantages(torch.tensor([s.reward for s in batch], dtype=torch.float64),
                             torch.tensor([groups.index(s.group_id) for s in batch]))
        rows, masks = [], []
        with torch.no_grad():
            for s, a in zip(batch, adv):
                ids = s.token_ids.unsqueeze(0)  # (1, T)
                logits = model_logits(ddp, ids)  # (1, T, V)
                logp = vocab_parallel_logprobs(logits[:, :-1], ids[:, 1:])  # (1, T-1)
                beh = s.behaviour_logp[1:].unsqueeze(0)
                old = beh if lc.old_logprobs == "engine" else logp
                per = policy_loss(logp, old, a.reshape(1), lc.policy, beh)  # (1, T-1)
                if lc.kl_coef:
                    per = per + lc.kl_coef * kl_penalty(logp, s.ref_logp[1:].unsqueeze(0), lc.kl_kind)
                if lc.entropy_coef:
                    per = per - lc.entropy_coef * vocab_parallel_entropy(logits[:, :-1])
                rows.append(per[0])
                masks.append(s.loss_mask[1:].to(torch.float64))
        width = max(r.numel() for r in rows)
        per_token = torch.stack([torch.nn.functional.pad(r, (0, width - r.numel())) for r in rows])  # (B, T)
        mask = torch.stack([torch.nn.functional.pad(r, (0, width - r.numel())) for r in masks])  # (B, T)
        values.append(float(aggregate(per_token, mask, lc.aggregation, num_sequences=len(batch) if m > 1
                                      else shape.num_sequences, max_len=shape.max_len)))
    return sum(values) / m


@pytest.mark.parametrize("name", list(CASES))
def test_true_loss_is_the_same_in_every_mode(model64, name):
    case = CASES[name]
    samples = make_samples(zlib.crc32(name.encode()) % 997, num_groups=4, reward_kind=case["reward"],
                           with_ref="kl_coef" in case["loss"])
    ref = reference_objective(model64, case, samples)
    sync = _run(model64, case, "sync", samples, samples)
    got = {"sync": sync}
    for mode, seed in (("stream-trajectory", 1), ("stream-group", 3)):
        got[f"{mode}/{seed}"] = _run(model64, case, mode, samples, arrival_order(samples, seed))
    scale = max(abs(ref), 1e-300)
    print(name, f"J {ref:.6g}; rel. diff to the reference", {k: f"{abs(r.objective - ref) / scale:.1g}"
                                                         for k, r in got.items()},
          "to sync", {k: f"{abs(r.objective - sync.objective) / scale:.1g}" for k, r in got.items()},
          "; surrogate sum", {k: f"{r.loss_sum:.4g}" for k, r in got.items()})
    assert abs(sync.objective - ref) <= TOL * scale, (sync.objective, ref)
    for k, r in got.items():
        assert abs(r.objective - sync.objective) <= TOL * scale, (k, r.objective, sync.objective)
    # control: the surrogate sum (the old train/loss) moves with the mode / arrival order
    streamed = [r.loss_sum for k, r in got.items() if k.startswith("stream-trajectory")]
    assert any(abs(v - sync.loss_sum) > 1e-6 * max(1.0, abs(sync.loss_sum)) for v in streamed), got


def test_objective_moves_with_the_rewards(model64):
    """Control for the reference comparison: other rewards, another objective (the value is not a constant)."""
    case = CASES["grpo-token-mean"]
    samples = make_samples(5, num_groups=4, reward_kind="bounded")
    a = _run(model64, case, "stream-trajectory", samples, arrival_order(samples, 1)).objective
    for s in samples:
        s.reward = 1.0 - s.reward
    b = _run(model64, case, "stream-trajectory", samples, arrival_order(samples, 1)).objective
    assert abs(a - b) > 1e-6 * max(abs(a), 1e-12)
