"""The shared optimizer-step barrier (``training.barrier.barrier_step``), float64, one process.

On a real megatron DDP + optimizer: the hook sees the accumulated gradient divided by the explicit divisor (and the
divisor really is applied: the control with divisor 1 differs), the SGD update uses that gradient, the grad-norm is
its norm (to float32, megatron's grad-norm precision), and the buffers are zero afterwards.
"""

import torch

from megatron_tsync.model.builder import PrecisionConfig, build_model
from megatron_tsync.training.barrier import BarrierResult, barrier_step
from megatron_tsync.training.optimizer import OptimConfig, build_optimizer, grad_buffers, wrap_ddp

from .stream_cases import TINY

LR = 0.1


def _accumulated(seed: int = 0):
    """A fresh float64 DDP model whose grad buffers hold one backward of a random linear function of its logits."""
    ddp = wrap_ddp(build_model(TINY, PrecisionConfig(params_dtype=torch.float64), seed=0))
    opt = build_optimizer(ddp, OptimConfig(optimizer="sgd", lr=LR, clip_grad=0))
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, TINY.vocab_size, (1, 12), generator=g)
    logits = ddp(ids, torch.arange(12).unsqueeze(0), None)  # (1, 12, V)
    w = torch.randn(logits.shape, generator=g, dtype=logits.dtype)
    ddp.zero_grad_buffer()
    (logits * w).sum().backward()
    return ddp, opt


def _step(divisor: float):
    ddp, opt = _accumulated()
    params = list(ddp.parameters())
    raw = [p.main_grad.clone() for p in params]
    before = [p.detach().clone() for p in params]
    seen = []
    res = barrier_step(ddp, opt, divisor, lambda d: seen.append([p.main_grad.clone() for p in d.parameters()]))
    return ddp, params, raw, before, seen, res


def test_barrier_divides_hooks_steps_and_zeroes(megatron_single):
    ddp, params, raw, before, seen, res = _step(4.0)
    assert isinstance(res, BarrierResult) and res.update_ok and res.start_s <= res.end_s
    assert len(seen) == 1  # the hook ran once, between the division and the step
    hooked = seen[0]
    assert sum(float(r.abs().sum()) for r in raw) > 0
    for r, h in zip(raw, hooked):
        assert torch.equal(h, r * 0.25)  # divided by the explicit divisor (a power of two: exact)
    norm = torch.cat([h.reshape(-1) for h in hooked]).norm().item()
    assert abs(res.grad_norm - norm) <= 1e-6 * norm  # the optimizer's norm (megatron computes it in float32)
    for p, b, h in zip(params, before, hooked):
        torch.testing.assert_close(p.detach(), b - LR * h, rtol=1e-15, atol=1e-15)  # SGD step with that gradient
    assert all(float(t.abs().sum()) == 0.0 for t in grad_buffers(ddp))  # zeroed for the next accumulation


def test_barrier_divisor_is_applied(megatron_single):
    """Control: divisor 1 leaves the gradient undivided, so its norm is 4× the divisor-4 norm."""
    *_, res4 = _step(4.0)
    _, _, raw, _, seen, res1 = _step(1.0)
    for r, h in zip(raw, seen[0]):
        assert torch.equal(h, r)
    assert abs(res1.grad_norm - 4.0 * res4.grad_norm) <= 1e-12 * res1.grad_norm
    ddp, opt = _accumulated()
    assert barrier_step(ddp, opt, 2.0).update_ok  # no hook


def test_a_non_finite_gradient_or_loss_skips_the_step(megatron_single):
    """One NaN (or inf) in the reduced gradient, or a non-finite loss reported by the caller: no optimizer step (θ
    bitwise unchanged), the buffers zeroed, ``skipped``; megatron-core's own step would have applied it (it returns
    update_successful=True with a NaN grad-norm without a loss scaler: the control)."""
    for poison, loss_finite in ((float("nan"), True), (float("inf"), True), (None, False)):
        ddp, opt = _accumulated()
        params = list(ddp.parameters())
        before = [p.detach().clone() for p in params]
        if poison is not None:
            params[3].main_grad.view(-1)[5] = poison
        res = barrier_step(ddp, opt, 2.0, loss_finite=loss_finite)
        assert res.skipped and not res.update_ok and res.grad_norm is None, (poison, loss_finite)
        assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))
        assert all(float(t.abs().sum()) == 0.0 for t in grad_buffers(ddp))
    ddp, opt = _accumulated()  # control: megatron's optimizer alone applies the NaN
    next(iter(ddp.parameters())).main_grad.view(-1)[0] = float("nan")
    ok, gnorm, _ = opt.step()
    assert ok and gnorm != gnorm and not all(torch.isfinite(p).all() for p in ddp.parameters())
