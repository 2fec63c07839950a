"""tools/bench_learner.py: the plain PyTorch GRPO learner it times computes the project's gradient (an independent
implementation: transformers' Llama with SDPA, the loss written out by hand), and the tool reports every row."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import bench_learner  # noqa: E402


@pytest.mark.slow
def test_tiny_run_reports_rows_and_equal_gradients(megatron_single, tmp_path):
    out = bench_learner.main(["--repeats", "1", "--profiles", "quickstart", "--single", "--json",
                              str(tmp_path / "b.json")])
    names = [r["learner"] for r in out["batch"]]
    assert names == ["tsync sync", "tsync sync, unpacked", "torch padded", "torch padded, unsorted"]
    (ours,) = [r for r in out["batch"] if r["learner"] == "tsync sync"]
    assert ours["grad_rel_diff_vs_torch"] < 1e-5, ours  # fp32: the two learners compute one gradient
    assert all(r["step_s"] > 0 and r["tokens"] > 64 * 40 for r in out["batch"])
    assert (tmp_path / "b.json").exists()


def test_torch_baseline_gradient_is_sensitive(megatron_single):
    """Control: the comparison can fail — flipping one reward changes the baseline's gradient far beyond 1e-5."""
    import torch

    from megatron_tsync.model.builder import ModelArch, build_model

    model = build_model(ModelArch(**bench_learner.ARCH), seed=0)
    hf = bench_learner._hf_model(model, ModelArch(**bench_learner.ARCH))
    S = bench_learner._samples(40, 80, seed=3, groups=2, G=4)
    bench_learner.torch_grpo_step(hf, S, 4096)
    g0 = bench_learner._hf_grads(hf)
    hf.zero_grad(set_to_none=True)
    S[0].reward = 1.0 - S[0].reward
    bench_learner.torch_grpo_step(hf, S, 4096)
    assert bench_learner._rel_diff(bench_learner._hf_grads(hf), g0) > 1e-3
    hf.zero_grad(set_to_none=True)
    S[0].reward = 1.0 - S[0].reward
    bench_learner.torch_grpo_step(hf, S, 64, sort=False)  # microbatching does not change it
    assert bench_learner._rel_diff(bench_learner._hf_grads(hf), g0) < 1e-5
    assert torch.isfinite(torch.cat([v.flatten() for v in g0.values()])).all()
