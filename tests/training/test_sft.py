"""The supervised warm start: the loss falls on the tiny model, it is exactly the mean over action tokens (prompt and
tool output masked as in the agent loop), and it is deterministic."""

import os

import pytest
import torch

from megatron_tsync.training.sft import collate, demonstration_tokens, sft_warmup
from megatron_tsync.runtime.tasks import ArithmeticCalculatorTask




@pytest.fixture(scope="module")
def codec(tiny_dir):
    from tokenizers import Tokenizer

    from megatron_tsync.model.tokenizer import TokenizerCodec

    return TokenizerCodec(Tokenizer.from_file(os.path.join(tiny_dir, "tokenizer.json")))


def fresh_learner(tiny_dir, lr=1e-3):
    from megatron_tsync.model.hf_conversion import load_hf_dir, load_hf_into_model
    from megatron_tsync.model.builder import build_model
    from megatron_tsync.training.optimizer import OptimConfig, build_optimizer, wrap_ddp

    arch, state = load_hf_dir(tiny_dir)
    model = build_model(arch, seed=0)
    load_hf_into_model(model, state)
    ddp = wrap_ddp(model)
    return ddp, build_optimizer(ddp, OptimConfig(lr=lr, clip_grad=1.0))


def test_mask_excludes_prompt_and_tool_output(codec):
    task = ArithmeticCalculatorTask()
    inst = task.instance("37+18*4")
    segs = task.demonstration_segments(inst)
    ids, mask = demonstration_tokens(codec, segs)
    kinds = [k for text, a in segs for k in [a] * len(codec.encode(text))]
    assert mask == [int(k) for k in kinds]
    result = codec.encode("<result>109</result>")
    start = next(i for i in range(len(ids)) if ids[i:i + len(result)] == result)
    assert all(m == 0 for m in mask[start:start + len(result)]), "tool output must not carry loss"
    assert codec.decode([t for t, m in zip(ids, mask) if m]) == "<tool>calculator: 37+18*4</tool><answer>109</answer>"
    # Collate: right padding, shifted mask (target t+1 weights position t), padding never trained on.
    short = demonstration_tokens(codec, task.demonstration_segments(task.instance("1+2")))
    x, m = collate([(ids, mask), short], pad_id=2)
    assert x.shape == (2, len(ids)) and m.shape == (2, len(ids) - 1)
    assert m[0].tolist() == [float(v) for v in mask[1:]]
    assert m[1, len(short[0]) - 1:].sum() == 0 and (x[1, len(short[0]):] == 2).all()
    _, m_all = collate([(ids, mask)], pad_id=2, loss_on="all")
    assert m_all.sum() == len(ids) - 1
    with pytest.raises(ValueError):
        collate([(ids, mask)], pad_id=2, loss_on="prompt")


def test_sft_lowers_loss_deterministically_on_action_tokens(megatron_single, tiny_dir, codec):
    from megatron_tsync.model.logprobs import token_logprobs

    task = ArithmeticCalculatorTask()
    ddp, opt = fresh_learner(tiny_dir)
    # The first logged loss is exactly the mean NLL of the action tokens under the initial weights.
    insts = task.sample_prompts(0, 8, seed=5)
    x, m = collate([demonstration_tokens(codec, task.demonstration_segments(i)) for i in insts], pad_id=2)
    with torch.no_grad():
        expect = float(-(token_logprobs(ddp, x) * m).sum() / m.sum())
    losses = sft_warmup(ddp, opt, codec, task, steps=25, batch_size=8, seed=5)
    assert losses[0] == pytest.approx(expect, rel=1e-5)
    assert len(losses) == 25 and all(map(torch.isfinite, torch.tensor(losses)))
    assert sum(losses[-5:]) / 5 < 0.5 * losses[0], losses
    ddp2, opt2 = fresh_learner(tiny_dir)
    again = sft_warmup(ddp2, opt2, codec, task, steps=25, batch_size=8, seed=5)
    assert again == losses, "the warm start is not deterministic"
    # lr override is applied for the warm start only
    before = [g["lr"] for g in opt2.param_groups]
    sft_warmup(ddp2, opt2, codec, task, steps=1, batch_size=2, seed=6, lr=5e-4)
    assert [g["lr"] for g in opt2.param_groups] == before


# ------------------------------------------------------------------------------------------------ float64


def float64_learner(tiny_dir, oc):
    from megatron_tsync.model.builder import PrecisionConfig, build_model
    from megatron_tsync.model.hf_conversion import load_hf_dir, load_hf_into_model
    from megatron_tsync.training.optimizer import build_optimizer, wrap_ddp

    arch, state = load_hf_dir(tiny_dir)
    model = build_model(arch, PrecisionConfig(params_dtype=torch.float64), seed=0)
    load_hf_into_model(model, state)
    ddp = wrap_ddp(model)
    return ddp, build_optimizer(ddp, oc)


def _flat(ddp):
    return torch.cat([p.detach().reshape(-1).clone() for p in ddp.parameters()])


def test_float64_run_context_warm_start(megatron_single, tiny_dir):
    """``--params-dtype float64`` with the supervised warm start (it used to crash: the warm-start optimizer
    hard-coded clip 1.0, which megatron's float32-only clipping refuses)."""
    import types

    from megatron_tsync.arguments import parse_args
    from megatron_tsync.runtime.context import RunContext

    cfg = parse_args(["--model", tiny_dir, "--params-dtype", "float64", "--optimizer", "sgd", "--clip-grad", "0",
                      "--sft-warmup-steps", "2"])
    ctx = RunContext(cfg, types.SimpleNamespace(stop=False))
    assert ctx.state["sft_done"]
    assert all(p.dtype == torch.float64 for p in ctx.ddp.parameters())


def test_sft_warmup_lr_flag_sets_the_warm_start_step(megatron_single, tiny_dir):
    """``--sft-warmup-lr``: one warm-start Adam step moves every weight by about lr (|m / √v| = 1 at the first
    step), so 1e-2 moves the weights 10x as far as the default 1e-3; the RL optimizer keeps its own lr."""
    import types

    from megatron_tsync.arguments import parse_args
    from megatron_tsync.runtime.context import RunContext

    def moved(*extra):
        ctx = RunContext(parse_args(["--model", tiny_dir, "--sft-warmup-steps", "0", "--lr", "3e-4"]),
                         types.SimpleNamespace(stop=False))
        before = _flat(ctx.ddp)
        ctx = RunContext(parse_args(["--model", tiny_dir, "--sft-warmup-steps", "1", "--lr", "3e-4", *extra]),
                         types.SimpleNamespace(stop=False))
        assert [g["lr"] for g in ctx.opt.param_groups] == [3e-4] * len(ctx.opt.param_groups)
        return (_flat(ctx.ddp) - before).abs().max().item()

    default, big = moved(), moved("--sft-warmup-lr", "1e-2")
    print(f"largest weight change after one warm-start step: lr 1e-3 {default:.3g}, lr 1e-2 {big:.3g}")
    assert 1e-3 * 0.9 <= default <= 1e-3 * 1.1 and 1e-2 * 0.9 <= big <= 1e-2 * 1.1


def test_float64_warm_start_loss_is_float64(megatron_single, tiny_dir, codec):
    """The logged loss (and the backward it comes from) stays in float64: equal to a float64 recomputation to
    1e-14 relative (the loss used to be taken in float32: ~1e-8 off)."""
    from megatron_tsync.model.logprobs import token_logprobs
    from megatron_tsync.training.optimizer import OptimConfig

    task = ArithmeticCalculatorTask()
    ddp, opt = float64_learner(tiny_dir, OptimConfig(optimizer="sgd", lr=0.0, clip_grad=0.0))
    insts = task.sample_prompts(0, 4, seed=5)
    x, m = collate([demonstration_tokens(codec, task.demonstration_segments(i)) for i in insts], pad_id=2)
    with torch.no_grad():
        lp = token_logprobs(ddp, x)  # (B, S-1) float64
        expect = float(-(lp * m.double()).sum() / m.sum())
        f32 = float(-(lp.float() * m).sum() / m.sum())
    assert lp.dtype == torch.float64
    got = sft_warmup(ddp, opt, codec, task, steps=1, batch_size=4, seed=5)[0]
    print(f"float64 warm-start loss rel err {abs(got - expect) / expect:.2g} (float32 loss: "
          f"{abs(f32 - expect) / expect:.2g})")
    assert abs(got - expect) <= 1e-14 * expect
    assert abs(f32 - expect) > 1e-10 * expect  # control: a float32 loss would be visibly off


def test_float64_warm_start_clips_exactly(megatron_single, tiny_dir, codec):
    """float64 gradient-norm clipping of the warm start is megatron's rule, exactly: g · c / (‖g‖ + 1e-6) when that
    factor is < 1. One SGD step (lr 1) with clipping equals the unclipped step scaled by that factor (≤ 1e-12
    relative); the unclipped one gives ‖g‖. Control: the clipped step differs from the unclipped one."""
    from megatron_tsync.training.optimizer import OptimConfig
    from megatron_tsync.training.sft import build_sft_optimizer

    task = ArithmeticCalculatorTask()
    steps = {}
    for clip in (0.0, "clip"):
        ddp, _ = float64_learner(tiny_dir, OptimConfig(optimizer="sgd", lr=1.0, clip_grad=0.0))
        theta0 = _flat(ddp)
        if clip == "clip":
            c = 0.25 * gnorm
            opt, own_clip = build_sft_optimizer(ddp, OptimConfig(optimizer="sgd", lr=1.0, clip_grad=c))
            assert own_clip == c and opt.config.clip_grad == 0.0  # megatron's clipping is float32-only
        else:
            opt, own_clip = build_sft_optimizer(ddp, OptimConfig(optimizer="sgd", lr=1.0, clip_grad=0.0))
        sft_warmup(ddp, opt, codec, task, steps=1, batch_size=4, seed=5, clip_grad=own_clip)
        steps[clip] = _flat(ddp) - theta0
        gnorm = steps[0.0].norm().item()
    coef = c / (gnorm + 1e-6)
    err = ((steps["clip"] - coef * steps[0.0]).norm() / steps["clip"].norm()).item()
    print(f"‖g‖ {gnorm:.4g}, clip {c:.4g}: clipped step vs scaled unclipped step rel err {err:.2g}")
    assert err <= 1e-12
    assert ((steps["clip"] - steps[0.0]).norm() / steps[0.0].norm()).item() > 0.5


def test_sft_optimizer_fp32_keeps_megatron_clipping(megatron_single, tiny_dir):
    from megatron_tsync.training.optimizer import OptimConfig
    from megatron_tsync.training.sft import WARM_START_OPTIM, build_sft_optimizer

    assert (WARM_START_OPTIM.optimizer, WARM_START_OPTIM.lr, WARM_START_OPTIM.clip_grad) == ("adam", 1e-3, 1.0)
    ddp, _ = fresh_learner(tiny_dir)
    opt, own_clip = build_sft_optimizer(ddp, OptimConfig(clip_grad=1.0))
    assert own_clip == 0.0 and opt.config.clip_grad == 1.0
    with pytest.raises(ValueError, match="clip"):  # clipping twice is refused
        sft_warmup(ddp, opt, None, ArithmeticCalculatorTask(), steps=1, batch_size=1, seed=0, clip_grad=1.0)


@pytest.mark.slow
def test_dp2_warm_start_with_the_distributed_optimizer(tiny_dir, tmp_path):
    """DP=2: the warm start's optimizer follows the DDP's reduction. With --use-distributed-optimizer the replicas
    stay identical and equal the all-reduce run's weights (float32 Adam, 3 steps: ≤ 1e-6); control: a plain Adam on
    the reduce-scattered gradients lets the replicas drift apart (it did before, 6e-3 after 3 steps)."""
    from ._launch import torchrun

    out = str(tmp_path / "sft_dp.json")
    worker = os.path.join(os.path.dirname(__file__), "_workers", "sft_dp_worker.py")
    rep = torchrun(worker, [tiny_dir, "--out", out], out_json=out)
    w = torch.load(out + ".pt")
    print(rep, "distributed vs plain", (w["distributed"] - w["plain"]).abs().max().item())
    assert rep["plain"] == 0.0 and rep["distributed"] == 0.0
    assert (w["distributed"] - w["plain"]).abs().max().item() <= 1e-6
    assert rep["control"] > 1e-4
