"""Checkpoints: a run saves at step k, continues to k+n (the uninterrupted reference) and is SIGKILLed; a new
process resumes from the checkpoint; its steps k+1..k+n must be bitwise equal (losses and every parameter,
torch.equal) to the reference. Adam, fp32, clip_grad 1, weight decay,
data drawn from the restored RNG streams."""

import importlib.util
import os
import signal

import pytest
import torch

from megatron_tsync.training import checkpointing as ck

_spec = importlib.util.spec_from_file_location(
    "conv_common", os.path.join(os.path.dirname(__file__), "_workers", "conv_common.py"))
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)

WORKER = os.path.join(common.WORKERS, "ckpt_resume_worker.py")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from megatron_tsync.model.tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("tiny") / "llama"), family="llama", seed=3)


def _resume_case(hf_dir, tmp_path, nproc, extra):
    ckpt = str(tmp_path / "ckpt")
    base = [WORKER, "--hf", hf_dir, "--ckpt", ckpt, "--save-step", "3", "--extra-steps", "3"] + extra
    rc, log, t_first = common.run_isolated(base + ["--mode", "first", "--out", str(tmp_path / "full")], nproc=nproc)
    assert rc != 0, "the first run must die by SIGKILL"
    if nproc == 1:
        assert rc == -signal.SIGKILL, log[-4000:]
    for r in range(nproc):
        assert os.path.exists(tmp_path / f"full.rank{r}"), log[-4000:]
    assert ck.latest_step(ckpt) == 3
    assert not any(n.endswith(".tmp") for n in os.listdir(ckpt))
    rc, log, t_res = common.run_isolated(base + ["--mode", "resume", "--out", str(tmp_path / "res")], nproc=nproc)
    assert rc == 0, log[-4000:]
    for r in range(nproc):
        a = torch.load(str(tmp_path / f"full.rank{r}"))
        b = torch.load(str(tmp_path / f"res.rank{r}"))
        assert len(a["losses"]) == len(b["losses"]) == 3
        for x, y in zip(a["losses"], b["losses"]):
            assert torch.equal(x, y), (a["losses"], b["losses"])
        assert sorted(a["params"]) == sorted(b["params"])
        for k in a["params"]:
            assert torch.equal(a["params"][k], b["params"][k]), k
    print(f"losses {[float(x) for x in a['losses']]}; wall s: first {t_first:.1f} resume {t_res:.1f}")


def test_resume_is_bitwise_single_process(hf_dir, tmp_path):
    _resume_case(hf_dir, tmp_path, 1, [])


def test_resume_is_bitwise_tp2(hf_dir, tmp_path):
    _resume_case(hf_dir, tmp_path, 2, ["--tp", "2"])


@pytest.mark.parametrize("sharding", ["dp_reshardable", "fully_reshardable"])
def test_resume_is_bitwise_dp2_distributed_optimizer(hf_dir, tmp_path, sharding):
    _resume_case(hf_dir, tmp_path, 2, ["--dist-opt", "--optim-sharding", sharding])


def test_latest_step_and_meta(tmp_path):
    assert ck.latest_step(str(tmp_path)) is None
    (tmp_path / ck.TRACKER).write_text("12\n")
    assert ck.latest_step(str(tmp_path)) == 12
    assert ck.iter_dir("/x", 12) == "/x/iter_0000012"
