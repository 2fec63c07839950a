"""float64, one process: KL to a live reference model (``training/reference.py``), streamed == sync (≤ 1e-12).

The reference is a real megatron model scored by the learner on arrival (forward-only through megatron's schedule):
``--ref-model DIR`` (a Hugging Face folder through the builder/conversion path) or a frozen copy of the policy.
``--kl-mode loss`` with k1, k2, k3 and ``--kl-mode reward`` in stream-trajectory and stream-group against sync;
controls: β > 0 changes the gradient; the live reference gives what recorded reference log-probs computed
independently (a plain forward, no schedule) give; ``--kl-mode reward`` equals training without KL on rewards
r − β·Σ_t w_t kl_t computed here with the estimators written out (not ``algorithms.kl``); a frozen copy of the policy
has KL exactly 0 at θ0.
"""

import copy
import json
import os
import sys

import pytest
import torch

from megatron_tsync.algorithms.streamability import RewardSpec
from megatron_tsync.model.builder import PrecisionConfig, build_model
from megatron_tsync.model.hf_conversion import megatron_to_hf, save_hf_dir
from megatron_tsync.model.logprobs import token_logprobs
from megatron_tsync.streaming.ready_queue import ListSource
from megatron_tsync.training.learner import Learner, LearnerConfig, shape_for
from megatron_tsync.training.optimizer import OptimConfig, build_optimizer, wrap_ddp
from megatron_tsync.training.reference import KL_SUM, ReferenceModel
from megatron_tsync.training.stream_fb import LossConfig

from ._launch import torchrun
from .stream_cases import TINY, arrival_order, make_samples, spec_for
from .test_streaming_exactness import gradient, rel

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "_workers"))
import reference_worker as RW  # noqa: E402

TOL = 1e-12
F64 = PrecisionConfig(params_dtype=torch.float64)


@pytest.fixture(scope="module")
def policy64(megatron_single):
    ddp = wrap_ddp(build_model(TINY, F64, seed=0))
    return ddp, build_optimizer(ddp, OptimConfig(optimizer="sgd", lr=0.0, clip_grad=0))


@pytest.fixture(scope="module")
def ref_dir(megatron_single, tmp_path_factory):
    """A different tiny model (seed 1) as a Hugging Face folder: what ``--ref-model DIR`` reads."""
    d = str(tmp_path_factory.mktemp("ref_model"))
    m = build_model(TINY, F64, seed=1)
    save_hf_dir(d, {k: v.float() for k, v in megatron_to_hf(m).items()}, TINY)
    return d


@pytest.fixture(scope="module")
def reference(ref_dir, policy64):
    return ReferenceModel.from_hf_dir(ref_dir, F64, policy=policy64[0])


def fresh(samples):
    return [copy.deepcopy(s) for s in samples]


def run_modes(policy, reference, seed, **kw):
    """{mode: (gradient, result, samples)} for sync and two streaming modes on fresh copies of one batch."""
    base = make_samples(seed, reward_kind="binary")
    out = {}
    for mode, order_seed in (("sync", None), ("stream-trajectory", 3), ("stream-group", 4)):
        s = fresh(base)
        order = s if order_seed is None else arrival_order(s, order_seed)
        g, res = gradient(policy, mode, s, order, reference, **kw)
        out[mode] = (g, res, s)
    return out


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
@pytest.mark.parametrize("strategy", ["second-backward", "defer"])
def test_kl_loss_live_reference_stream_equals_sync(policy64, reference, kind, strategy):
    kw = dict(estimator="grpo", reward_spec=spec_for("binary"), aux_strategy=strategy,
              loss=LossConfig(kl_mode="loss", kl_coef=0.1, kl_kind=kind))
    runs = run_modes(policy64, reference, 31, **kw)
    g_sync = runs["sync"][0]
    for mode in ("stream-trajectory", "stream-group"):
        g, res, samples = runs[mode]
        assert rel(g, g_sync) < TOL, (mode, rel(g, g_sync))
        assert all(s.ref_logp is not None for s in samples)  # scored by the live reference
    key = "second_backward" if strategy == "second-backward" else "deferred"
    assert runs["stream-trajectory"][1].planner_stats[key] > 0
    g0, _ = gradient(policy64, "sync", *(2 * [fresh(make_samples(31, reward_kind="binary"))]), reference,
                     estimator="grpo", reward_spec=spec_for("binary"))
    assert rel(g_sync, g0) > 1e-3, "control: β > 0 must change the gradient"


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_reward_live_reference_stream_equals_sync(policy64, reference, kind):
    kw = dict(estimator="grpo", reward_spec=spec_for("binary"), loss=LossConfig(kl_mode="reward", kl_coef=0.05,
                                                                                  kl_kind=kind))
    runs = run_modes(policy64, reference, 37, **kw)
    g_sync, res_sync, s_sync = runs["sync"]
    for mode in ("stream-trajectory", "stream-group"):
        g, res, samples = runs[mode]
        assert rel(g, g_sync) < TOL, (mode, rel(g, g_sync))
        assert {s.traj_id: s.meta[KL_SUM] for s in samples} == {s.traj_id: s.meta[KL_SUM] for s in s_sync}
    assert runs["stream-trajectory"][1].planner_stats["bucketed"] > 0
    assert all(s.meta[KL_SUM] != 0.0 for s in s_sync)
    g0, _ = gradient(policy64, "sync", *(2 * [fresh(make_samples(37, reward_kind="binary"))]),
                     estimator="grpo", reward_spec=spec_for("binary"))
    assert rel(g_sync, g0) > 1e-4, "control: β > 0 must change the gradient"


@pytest.mark.parametrize("loss", [dict(kl_mode="reward", kl_coef=0.05, kl_kind="k3"),
                                  dict(kl_mode="loss", kl_coef=0.1, kl_kind="k2")])
def test_kl_with_minibatches_and_epochs(megatron_single, reference, loss):
    """Two minibatches × two epochs (four SGD steps): KL sums and reference log-probs are fixed on arrival at θ0
    (trajectories landing after the first step are scored under the θ0 snapshot), so the weights after the whole
    step equal sync's in both streaming modes."""
    from megatron_tsync.algorithms.policy_loss import PolicyLossConfig

    base = make_samples(59, num_groups=4, reward_kind="binary")
    weights = {}
    for mode, seed in (("sync", None), ("stream-trajectory", 3), ("stream-group", 4)):
        ddp = wrap_ddp(build_model(TINY, F64, seed=0))
        opt = build_optimizer(ddp, OptimConfig(optimizer="sgd", lr=0.05, clip_grad=0))
        theta0 = torch.cat([p.detach().reshape(-1).clone() for p in ddp.parameters()])
        cfg = LearnerConfig(mode=mode, reward_spec=spec_for("binary"), num_minibatches=2, epochs=2,
                            loss=LossConfig(policy=PolicyLossConfig(), **loss))
        s = fresh(base)
        learner = Learner(ddp, opt, cfg, reference=reference)
        res = learner.train_step(ListSource(s if seed is None else arrival_order(s, seed)), *shape_for(s))
        weights[mode] = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])
        if mode == "stream-trajectory":
            assert res.planner_stats["bucketed"] > 0
            if loss["kl_mode"] == "reward":  # π_θ0 of the KL sum under the θ0 snapshot for late arrivals
                assert learner.theta0.swapped_forwards > 0
    moved = (weights["sync"] - theta0).norm()
    assert moved > 1e-6
    for mode in ("stream-trajectory", "stream-group"):
        assert ((weights[mode] - weights["sync"]).norm() / moved).item() < TOL, mode


def _plain_logp(model, s):
    """(T,) log-probs of a sample's tokens by a plain forward (no schedule), entry 0 = 0."""
    with torch.no_grad():
        lp = token_logprobs(model, s.token_ids.unsqueeze(0))[0]  # (T-1,)
    return torch.cat([lp.new_zeros(1), lp]).double()


def _kl_written_out(lp, ref, kind):
    d = lp - ref
    return {"k1": d, "k2": 0.5 * d * d, "k3": torch.exp(-d) + d - 1.0}[kind]


@pytest.mark.parametrize("kind", ["k1", "k3"])
def test_kl_reward_is_the_shaped_reward(policy64, reference, kind):
    """--kl-mode reward == no KL with r_i − β Σ_t w_t kl_t (π_θ0 and π_ref by a plain forward, estimator written
    out), and the live reference's log-probs equal the plain forward's (--kl-mode loss with recorded ref_logp)."""
    beta = 0.05
    samples = make_samples(41, reward_kind="binary")
    live, live_res = gradient(policy64, "stream-trajectory", *(2 * [fresh(samples)]), reference, estimator="grpo",
                              reward_spec=spec_for("binary"), loss=LossConfig(kl_mode="reward", kl_coef=beta,
                                                                              kl_kind=kind))
    shaped = fresh(samples)
    policy_gpt, ref_gpt = policy64[0].module, reference.model
    for s in shaped:
        lp, ref = _plain_logp(policy_gpt, s), _plain_logp(ref_gpt, s)
        s.reward = s.reward - beta * float((_kl_written_out(lp, ref, kind) * s.loss_mask)[1:].sum())
    g, _ = gradient(policy64, "sync", shaped, shaped, estimator="grpo", reward_spec=RewardSpec.continuous())
    assert rel(live, g) < TOL
    # loss mode: live reference vs recorded reference log-probs from the plain forward
    recorded = fresh(samples)
    for s in recorded:
        s.ref_logp = _plain_logp(ref_gpt, s)
    kw = dict(estimator="grpo", reward_spec=spec_for("binary"), loss=LossConfig(kl_mode="loss", kl_coef=0.1,
                                                                                  kl_kind=kind))
    g_live, _ = gradient(policy64, "sync", *(2 * [fresh(samples)]), reference, **kw)
    g_rec, _ = gradient(policy64, "sync", recorded, recorded, None, **kw)
    assert rel(g_live, g_rec) < TOL


def test_frozen_copy_has_zero_kl_at_theta0(policy64):
    """The default reference (frozen initial weights) is an exact copy: log π_ref == log π_θ0 bit for bit, so the
    KL sums are exactly 0 and --kl-mode reward changes nothing at the first step (it does once the policy moves)."""
    frozen = ReferenceModel.frozen_copy(policy64[0], F64)
    samples = fresh(make_samples(43, reward_kind="binary"))
    kw = dict(estimator="grpo", reward_spec=spec_for("binary"))
    g, _ = gradient(policy64, "stream-trajectory", samples, samples, frozen,
                    loss=LossConfig(kl_mode="reward", kl_coef=0.5, kl_kind="k1"), **kw)
    assert all(s.meta[KL_SUM] == 0.0 for s in samples)
    g0, _ = gradient(policy64, "stream-trajectory", *(2 * [fresh(samples)]), **kw)
    assert torch.equal(g, g0)


def test_kl_needs_reference_logprobs(policy64):
    samples = fresh(make_samples(47, reward_kind="binary"))
    with pytest.raises(ValueError, match="needs reference log-probs"):
        gradient(policy64, "sync", samples, samples, None, estimator="grpo", reward_spec=spec_for("binary"),
                 loss=LossConfig(kl_mode="reward", kl_coef=0.1))


def test_ref_model_vocab_mismatch(megatron_single, policy64, tmp_path):
    other = TINY.__class__(**{**TINY.__dict__, "vocab_size": 128})
    save_hf_dir(str(tmp_path), {k: v.float() for k, v in megatron_to_hf(build_model(other, F64, seed=2)).items()},
                other)
    with pytest.raises(ValueError, match="vocab_size 128"):
        ReferenceModel.from_hf_dir(str(tmp_path), F64, policy=policy64[0])


# ------------------------------------------------------------------------------------------ TP=2, PP=2, DP=2
WORKER = os.path.join(os.path.dirname(__file__), "_workers", "reference_worker.py")
LAYOUTS = ["tp2", "pp2", "dp2"]


@pytest.fixture(scope="module")
def policy_dir(megatron_single, tmp_path_factory):
    """The policy as a Hugging Face folder: random initialisation differs per pipeline stage, loading does not."""
    d = str(tmp_path_factory.mktemp("policy_model"))
    save_hf_dir(d, {k: v.float() for k, v in megatron_to_hf(build_model(TINY, F64, seed=0)).items()}, TINY)
    return d


@pytest.fixture(scope="module")
def parallel_reports(ref_dir, policy_dir, tmp_path_factory):
    """One torchrun (2 gloo processes) for the three layouts: the reference is built with each layout."""
    out = tmp_path_factory.mktemp("reference_parallel")
    torchrun(WORKER, ["--layouts", *LAYOUTS, "--ref-dir", ref_dir, "--policy-dir", policy_dir, "--out-dir", str(out)])
    return out


def _one_process_hf_grad(policy_dir, reference, name):
    from megatron_tsync.runtime.rollout_io import grads_to_hf

    ddp = wrap_ddp(RW.load_policy(policy_dir))
    opt = build_optimizer(ddp, OptimConfig(optimizer="sgd", lr=0.0, clip_grad=0))
    learner = Learner(ddp, opt, RW.learner_cfg("sync", name), reference=reference)
    got = {}
    learner.grad_hook = lambda d: got.setdefault("hf", grads_to_hf(d))
    samples = make_samples(RW.SEED, reward_kind="binary")
    sizes, shape = shape_for(samples)
    learner.train_step(ListSource(samples), sizes, shape)
    return got["hf"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_parallel_layouts_live_reference(parallel_reports, policy_dir, reference, layout):
    """Streamed == sync ≤ 1e-12 with the reference built at TP=2 / PP=2 (its forward through the pipeline
    schedule) / DP=2 (each replica scores its own trajectories; KL-in-reward sums reduced over the world), and the
    layout's sync gradient equals the one-process gradient (a mis-sharded reference would move the KL term)."""
    from safetensors.torch import load_file

    rep = json.loads((parallel_reports / f"{layout}.json").read_text())
    assert rep["tp"] * rep["pp"] * rep["dp"] == 2
    for row in rep["result"]:
        assert row["stream-trajectory"] < TOL and row["stream-group"] < TOL, row
        assert row["ref_forwards"] > 0, row
        par = load_file(str(parallel_reports / f"{layout}-{row['case']}.safetensors"))
        one = _one_process_hf_grad(policy_dir, reference, row["case"])
        assert set(par) == set(one)
        a = torch.cat([par[k].reshape(-1) for k in sorted(one)])
        b = torch.cat([one[k].reshape(-1) for k in sorted(one)])
        assert rel(a, b) < TOL, (row["case"], rel(a, b))
