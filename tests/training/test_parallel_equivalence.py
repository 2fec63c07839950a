"""TP=2, PP=2 and DP=2 (gloo, 2 processes) against one process, from the same Hugging Face weights (fp32):
per-token log-probs, the gradient (under HF names, after the DP reduction and normalisation) and the weights
after one Adam step. Tolerances: log-probs 1e-5 absolute, gradient and weights 1e-5 relative (different
reduction orders in float32)."""

import os

import pytest
import torch

from ._launch import torchrun

WORKER = os.path.join(os.path.dirname(__file__), "_workers", "parallel_equiv_worker.py")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    from megatron_tsync.model.tiny_model import make_tiny_model

    d = tmp_path_factory.mktemp("peq")
    model = str(d / "model")
    make_tiny_model(model, seed=0)
    out = str(d / "ref.pt")
    torchrun(WORKER, ["--model", model, "--out", out], nproc=1)
    return model, torch.load(out)


def _rel(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    num = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in a) ** 0.5
    den = sum(float(b[k].double().pow(2).sum()) for k in b) ** 0.5
    return num / den


@pytest.mark.parametrize("layout", [["--tp", "2"], ["--pp", "2"], []], ids=["tp2", "pp2", "dp2"])
def test_layout_matches_single_process(reference, layout, tmp_path):
    model, ref = reference
    out = str(tmp_path / "r.pt")
    torchrun(WORKER, ["--model", model, "--out", out, *layout], nproc=2)
    got = torch.load(out)
    assert set(got["logprobs"]) == set(ref["logprobs"])
    lp_err = max(float((got["logprobs"][k] - ref["logprobs"][k]).abs().max()) for k in ref["logprobs"])
    g_err, w_err = _rel(got["grads"], ref["grads"]), _rel(got["weights"], ref["weights"])
    print(layout, "logprob max abs", lp_err, "grad rel", g_err, "weights rel", w_err)
    assert lp_err < 1e-5 and g_err < 1e-5 and w_err < 1e-5
