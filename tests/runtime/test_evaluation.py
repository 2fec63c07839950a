"""Held-out evaluation during training (``runtime/evaluation.py``) on a warm-started tiny agent, in-process:

- its success rate equals an independent evaluation of the same weights (``examples/tiny_agent/evaluate.py``'s
  rollout-and-score path: its own agent config, tokenizer object, tool executor and scoring, near-zero temperature
  instead of top-k 1) on the same held-out prompts, and is neither 0 nor 1 (so equality could fail);
- it leaves training untouched: the weights, the train/eval mode and the torch RNG state are the same afterwards,
  and a second evaluation of the same weights gives the same record; after an optimizer step it changes;
- which versions are evaluated (the first, every N, the end; each once), and the log / summary lines.
"""

import glob
import json
import os
import sys

import pytest
import torch

pytestmark = pytest.mark.slow  # every test here needs the warm start (120 SFT steps) or a live run: end-to-end

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
N_PROMPTS = 48


@pytest.fixture(scope="module")
def run(megatron_single, tiny_dir):
    """(cfg, task, ddp, evaluator): the quickstart's config on the tiny model after a short warm start."""
    from megatron_tsync.arguments import parse_args
    from megatron_tsync.model.builder import build_model
    from megatron_tsync.model.hf_conversion import load_hf_dir, load_hf_into_model
    from megatron_tsync.model.tokenizer import TokenizerCodec
    from megatron_tsync.runtime.evaluation import HeldOutEval
    from megatron_tsync.runtime.tasks import get_task
    from megatron_tsync.training.optimizer import wrap_ddp
    from megatron_tsync.training.sft import build_sft_optimizer, sft_warmup
    from transformers import AutoTokenizer

    cfg = parse_args(["--config", os.path.join(ROOT, "examples", "tiny_agent", "config.yaml"), "--model", tiny_dir,
                      "--eval-interval", "4", "--eval-prompts", str(N_PROMPTS), "--train-iters", "10",
                      "--eval-greedy"])  # the quickstart's config evaluates sampled
    task = get_task(cfg.rollout.task, verifier=cfg.rollout.verifier)
    arch, state = load_hf_dir(tiny_dir)
    model = build_model(arch, seed=0)
    load_hf_into_model(model, state)
    ddp = wrap_ddp(model)
    sft_opt, clip = build_sft_optimizer(ddp)
    sft_warmup(ddp, sft_opt, TokenizerCodec(AutoTokenizer.from_pretrained(tiny_dir)), task, 120, batch_size=16,
               seed=3, lr=1e-3, clip_grad=clip)
    ddp.train()
    ev = HeldOutEval(cfg, task, tiny_dir, ddp, first_step=0)
    yield cfg, task, ddp, ev
    ev.close()


def _record(rec):
    return {k: v for k, v in rec.items() if k != "seconds"}


def test_success_equals_an_independent_evaluation_of_the_same_weights(run, tiny_dir):
    from tokenizers import Tokenizer

    from megatron_tsync.model.tokenizer import TokenizerCodec
    from megatron_tsync.rollout.embedded_engine import EmbeddedEngine

    cfg, task, ddp, ev = run
    rec = ev.run(0)
    sys.path.insert(0, os.path.join(ROOT, "examples", "tiny_agent"))
    try:
        import evaluate as independent
    finally:
        sys.path.pop(0)
    codec = TokenizerCodec(Tokenizer.from_file(os.path.join(tiny_dir, "tokenizer.json")))
    insts = task.sample_prompts(0, N_PROMPTS, cfg.rl.seed, split="eval")
    assert [i.prompt_text for i in insts] == [i.prompt_text for i in ev.instances]
    train = {i.prompt_text for i in task.sample_prompts(0, 64, cfg.rl.seed)}
    assert not train & {i.prompt_text for i in insts}  # held out: none of them is a training prompt
    _, rewards, _ = independent.rollout_and_score(EmbeddedEngine(ddp), codec, task, insts, temperature=1e-4)
    ddp.train()
    assert rec["prompts"] == N_PROMPTS and rec["greedy"] and rec["errors"] == 0
    assert rec["success_rate"] == sum(1 for r in rewards if r >= 1.0) / N_PROMPTS
    assert 0.0 < rec["success_rate"] < 1.0, rec  # a result that could have differed
    assert "held-out v0: success" in ev.line(rec) and f"({N_PROMPTS} prompts, greedy" in ev.line(rec)


def test_evaluation_leaves_training_untouched_and_follows_the_weights(run):
    cfg, task, ddp, ev = run
    params = [p.detach().clone() for p in ddp.parameters()]
    rng = torch.get_rng_state()
    assert ddp.training
    first = ev.run(1)
    assert ddp.training and torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(a, b) for a, b in zip(params, ddp.parameters()))
    assert _record(ev.run(2)) == {**_record(first), "version": 2}  # same weights, same record
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a large move away from the warm start (an update's effect): the evaluation must see it
        for p in ddp.parameters():
            p.add_(0.2 * p.abs().mean() * torch.randn(p.shape, generator=gen))
    try:
        moved = ev.run(3)
    finally:
        with torch.no_grad():
            for p, p0 in zip(ddp.parameters(), params):
                p.copy_(p0)
    assert _record(moved) != {**_record(first), "version": 3}


def test_versions_evaluated_and_summary(run):
    _, _, _, ev = run
    ev.records = []
    assert ev.summary() == ""
    ev.records = [{"version": 0, "success_rate": 0.25, "prompts": 48, "greedy": True, "seconds": 1.5}]
    assert [v for v in range(12) if ev.due(v)] == [4, 8, 10]  # 0 is done; every 4; the end (--train-iters 10)
    assert ev.summary() == "held-out success 0.25 (v0, 48 prompts, greedy; evaluation 1.5s in all)"
    ev.records.append({"version": 10, "success_rate": 0.5, "prompts": 48, "greedy": True, "seconds": 2.5})
    assert ev.summary() == ("held-out success 0.25 → 0.50 (v0 → v10, 48 prompts, greedy; evaluation 4.0s in all, "
                            "0.40s per training step)")
    assert not ev.due(10) and ev.due(8)


def _train_live(args, cwd):
    import subprocess

    from tests.conftest import free_port

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", MASTER_PORT=str(free_port()))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    p = subprocess.run([sys.executable, "-m", "megatron_tsync.train", *args], cwd=cwd, env=env, capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0, f"train failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    return p.stdout


# stream-trajectory: tests/runtime/test_train_e2e.py; OPD stream-turn: tests/runtime/test_opd_e2e.py (both read the
# eval/* scalars back too). sync runs a reasoning-gym task: its verifier in the real workers and the evaluator.
MODES = {
    "sync": ["--rl-mode", "sync", "--task", "reasoning-gym:chain_sum:max_terms=2,max_digits=1",
             "--verifier", "reasoning_gym"],
    "stream-group": ["--rl-mode", "stream-group"],
    "async": ["--rl-mode", "async", "--max-staleness", "1"],
}


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_live_evaluation_in_every_mode(mode, tiny_dir, tmp_path):
    """A live run of one step in ``mode`` (real workers, sandbox, verifier) evaluates θ_0 and θ_1: the log lines,
    the summary line's held-out score, eval.json, and ``eval/*`` read back from TensorBoard at the versions' steps."""
    if mode == "sync":
        pytest.importorskip("reasoning_gym")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = tmp_path / "tb"
    out = _train_live(["--model", tiny_dir, "--group-size", "2", "--global-batch-size", "4", "--rollout-workers", "1",
                       "--max-turns", "2", "--max-new-tokens", "16", "--seq-length", "128", "--lr", "1e-4",
                       "--train-iters", "1", "--eval-interval", "1", "--eval-prompts", "4", "--no-progress",
                       "--tensorboard-dir", str(tb), *MODES[mode]], tmp_path)
    assert "held-out v0: success" in out and "held-out v1: success" in out, out
    summary = next(line for line in out.splitlines() if "summary: mode" in line)
    assert f"mode {mode}" in summary and "held-out success" in summary and "(v0 → v1, 4 prompts, greedy" in summary
    recs = json.loads((tb / "eval.json").read_text())
    assert [r["version"] for r in recs] == [0, 1] and all(r["prompts"] == 4 for r in recs)
    ea = EventAccumulator(glob.glob(str(tb / "events*"))[0])
    ea.Reload()
    for key, tag in (("success_rate", "eval/success_rate"), ("mean_reward", "eval/mean_reward")):
        got = [(e.step, e.value) for e in ea.Scalars(tag)]
        assert got == [(r["version"], pytest.approx(r[key], abs=1e-6)) for r in recs], (tag, got, recs)
