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
