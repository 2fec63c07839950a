"""The supervised warm start never applies a non-finite step (``training/sft.py``): a weight that makes the loss NaN
ends the warm start with a ``FloatingPointError`` naming the step, and no weight moved (the step used to be applied:
every weight NaN after it)."""

import pytest
import torch

from megatron_tsync.runtime.tasks import ArithmeticCalculatorTask
from megatron_tsync.training.sft import sft_warmup
from tests.training.test_sft import codec, float64_learner  # noqa: F401  (fixture)


def test_a_non_finite_warm_start_step_is_refused_and_not_applied(megatron_single, tiny_dir, codec):  # noqa: F811
    from megatron_tsync.training.optimizer import OptimConfig

    ddp, opt = float64_learner(tiny_dir, OptimConfig(optimizer="sgd", lr=1e-2, clip_grad=0.0))
    params = dict(ddp.named_parameters())
    poisoned = next(n for n in params if "final_layernorm" in n or "final_norm" in n)
    with torch.no_grad():
        params[poisoned].view(-1)[0] = float("nan")
    before = {n: p.detach().clone() for n, p in params.items()}
    with pytest.raises(FloatingPointError, match="supervised warm start step 0: non-finite loss"):
        sft_warmup(ddp, opt, codec, ArithmeticCalculatorTask(), steps=2, batch_size=2, seed=5)
    for n, p in params.items():  # nothing applied: every weight as it was (the poisoned one included)
        assert torch.equal(p.detach().nan_to_num(7.0), before[n].nan_to_num(7.0)), n
