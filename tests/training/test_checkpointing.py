"""Checkpoints: a run saves at step k, continues to k+n (the uninterrupted reference) and is SIGKILLed; a new
process resumes from the checkpoint; its steps k+1..k+n must be bitwise equal (losses and every parameter,
torch.equal) to the reference. Adam, fp32, clip_grad 1, weight decay,
data drawn from the restored RNG streams. DP=2 with the distributed optimizer: one first run saves the same step
in both shardings (two checkpoints), one resume launch resumes from each in turn."""

import importlib.util
import os
import signal

import pytest
import torch

from megatron_tsync.training import checkpointing as ck

from ._launch import item_param, selected_params

_spec = importlib.util.spec_from_file_location(
    "conv_common", os.path.join(os.path.dirname(__file__), "_workers", "conv_common.py"))
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)

WORKER = os.path.join(common.WORKERS, "ckpt_resume_worker.py")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from megatron_tsync.model.tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("tiny") / "llama"), family="llama", seed=3)


def _first_and_resume(hf_dir, tmp_path, nproc, extra, shardings=None):
    """The first run (saves at step 3, one checkpoint per sharding, then SIGKILLed) and one resume launch that
    resumes from each checkpoint in turn; checks what both launches must do. Returns {sharding: (ckpt, out)}."""
    names = shardings or [None]
    ckpts = [str(tmp_path / ("ckpt" if s is None else f"ckpt-{s}")) for s in names]
    outs = [str(tmp_path / ("res" if s is None else f"res-{s}")) for s in names]
    base = [WORKER, "--hf", hf_dir, "--save-step", "3", "--extra-steps", "3"] + extra
    save = ["--ckpt", *ckpts] + (["--optim-sharding", *shardings] if shardings else [])
    rc, log, t_first = common.run_isolated(base + ["--mode", "first", *save, "--out", str(tmp_path / "full")],
                                           nproc=nproc)
    assert rc != 0, "the first run must die by SIGKILL"
    if nproc == 1:
        assert rc == -signal.SIGKILL, log[-4000:]
    for r in range(nproc):
        assert os.path.exists(tmp_path / f"full.rank{r}"), log[-4000:]
    for ckpt in ckpts:
        assert ck.latest_step(ckpt) == 3
        assert not any(n.endswith(".tmp") for n in os.listdir(ckpt))
    rc, log, t_res = common.run_isolated(base + ["--mode", "resume", "--ckpt", *ckpts, "--out", *outs], nproc=nproc)
    assert rc == 0, log[-4000:]
    print(f"wall s: first {t_first:.1f} resume {t_res:.1f} ({len(ckpts)} checkpoint(s))")
    return dict(zip(names, outs))


def _same_as_uninterrupted(tmp_path, nproc, res):
    for r in range(nproc):
        a = torch.load(str(tmp_path / f"full.rank{r}"))
        b = torch.load(f"{res}.rank{r}")
        assert len(a["losses"]) == len(b["losses"]) == 3
        for x, y in zip(a["losses"], b["losses"]):
            assert torch.equal(x, y), (a["losses"], b["losses"])
        assert sorted(a["params"]) == sorted(b["params"])
        for k in a["params"]:
            assert torch.equal(a["params"][k], b["params"][k]), k
    print(f"losses {[float(x) for x in a['losses']]}")


def _resume_case(hf_dir, tmp_path, nproc, extra):
    _same_as_uninterrupted(tmp_path, nproc, _first_and_resume(hf_dir, tmp_path, nproc, extra)[None])


def test_resume_is_bitwise_single_process(hf_dir, tmp_path):
    _resume_case(hf_dir, tmp_path, 1, [])


@pytest.mark.slow
def test_resume_is_bitwise_tp2(hf_dir, tmp_path):
    _resume_case(hf_dir, tmp_path, 2, ["--tp", "2"])


SHARDINGS = ["dp_reshardable", "fully_reshardable"]


@pytest.fixture(scope="module")
def dp2_dist_opt(request, hf_dir, tmp_path_factory):
    """DP=2 with the distributed optimizer: one first run saving a checkpoint in every selected sharding, one
    resume launch for all of them."""
    tmp = tmp_path_factory.mktemp("dp2_dist_opt")
    shardings = selected_params(request, lambda item: item_param(item, "sharding")) or SHARDINGS
    return tmp, _first_and_resume(hf_dir, tmp, 2, ["--dist-opt"], shardings)


@pytest.mark.slow
@pytest.mark.parametrize("sharding", SHARDINGS)
def test_resume_is_bitwise_dp2_distributed_optimizer(dp2_dist_opt, sharding):
    tmp, res = dp2_dist_opt
    _same_as_uninterrupted(tmp, 2, res[sharding])


def test_latest_step_and_meta(tmp_path):
    assert ck.latest_step(str(tmp_path)) is None
    (tmp_path / ck.TRACKER).write_text("12\n")
    assert ck.latest_step(str(tmp_path)) == 12
    assert ck.iter_dir("/x", 12) == "/x/iter_0000012"
