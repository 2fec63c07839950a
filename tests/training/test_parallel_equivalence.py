"""TP=2, PP=2 and DP=2 (gloo, 2 processes) against one process, from the same Hugging Face weights (fp32):
per-token log-probs, the gradient (under HF names, after the DP reduction and normalisation) and the weights
after one Adam step. Tolerances: log-probs 1e-5 absolute, gradient and weights 1e-5 relative (different
reduction orders in float32).

One launch for the module: a 2-process torchrun that runs every selected layout one after the other (the ``runs``
fixture); the one-process reference runs the same worker code in the test process (``megatron_single``: TP=1,
PP=1, world 1), not in a launch of its own."""

import os

import pytest
import torch

from ._launch import item_param, selected_params, torchrun

WORKER = os.path.join(os.path.dirname(__file__), "_workers", "parallel_equiv_worker.py")
LAYOUTS = ["tp2", "pp2", "dp2"]


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory, megatron_single):
    """(model dir, reference, load(layout)): the reference from this process (the worker's ``run`` at world 1);
    every layout the session selected from one 2-process launch (a layout asked for outside that plan gets a launch
    of its own)."""
    import importlib.util

    from megatron_tsync.model.tiny_model import make_tiny_model

    d = tmp_path_factory.mktemp("peq")
    model = str(d / "model")
    make_tiny_model(model, seed=0)
    spec = importlib.util.spec_from_file_location("parallel_equiv_worker", WORKER)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    worker.run(model, megatron_single, str(d / "single.pt"))
    planned = selected_params(request, lambda item: item_param(item, "layout"))
    if planned:
        torchrun(WORKER, ["--model", model, "--out-dir", str(d), "--layouts", *planned], nproc=2)

    def load(layout):
        if not (d / f"{layout}.pt").exists():
            torchrun(WORKER, ["--model", model, "--out-dir", str(d), "--layouts", layout], nproc=2)
        return torch.load(str(d / f"{layout}.pt"))

    return model, torch.load(str(d / "single.pt")), load


def _rel(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    num = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in a) ** 0.5
    den = sum(float(b[k].double().pow(2).sum()) for k in b) ** 0.5
    return num / den


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_matches_single_process(runs, layout):
    _, ref, load = runs
    got = load(layout)
    assert set(got["logprobs"]) == set(ref["logprobs"])
    lp_err = max(float((got["logprobs"][k] - ref["logprobs"][k]).abs().max()) for k in ref["logprobs"])
    g_err, w_err = _rel(got["grads"], ref["grads"]), _rel(got["weights"], ref["weights"])
    print(layout, "logprob max abs", lp_err, "grad rel", g_err, "weights rel", w_err)
    assert lp_err < 1e-5 and g_err < 1e-5 and w_err < 1e-5
