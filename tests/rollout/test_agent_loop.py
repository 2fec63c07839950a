"""The multi-turn agent loop: token alignment, callbacks, tool errors, limits, concurrency, and a real run on the
tiny model whose behaviour log-probs must match the trainer's."""

import os
import socket
import threading
import time

import pytest
import torch

torch.set_num_threads(1)

from megatron_tsync.rollout.agent_loop import (  # noqa: E402
    AgentConfig,
    AgentLoop,
    FunctionTools,
    ToolStep,
    Trajectory,
)
from megatron_tsync.model.tokenizer import TokenizerCodec, tag_token_id  # noqa: E402
from megatron_tsync.rollout.engine import Completion, SamplingConfig  # noqa: E402




@pytest.fixture(scope="module")
def codec(tiny_dir):
    from tokenizers import Tokenizer

    return TokenizerCodec(Tokenizer.from_file(os.path.join(tiny_dir, "tokenizer.json")))


@pytest.fixture(scope="module")
def ids(codec):
    return {t: tag_token_id(codec, t) for t in ("</tool>", "</s>", "</answer>", "<result>", "</result>")}


def agent_config(ids, **kw):
    sampling = kw.pop("sampling", None) or SamplingConfig(
        max_new_tokens=kw.pop("max_new_tokens", 64),
        stop_token_ids=(ids["</s>"], ids["</answer>"]),
        tool_token_ids=(ids["</tool>"],),
        seed=kw.pop("seed", 0),
    )
    return AgentConfig(sampling=sampling, **kw)


class ScriptedEngine:
    """Plays back scripts: turn k of the trajectory whose prompt starts with token P returns ``scripts[P][k]``
    (cut at the first stop/tool token or at max_new_tokens); log-prob of generated token i is -(i+1)/100."""

    def __init__(self, codec, scripts, result_close_id, fail=False):
        self.codec, self.scripts, self.close, self.fail = codec, scripts, result_close_id, fail
        self.calls: list[int] = []
        self.version = 3

    @property
    def policy_version(self):
        return self.version

    def update_weights(self, state_dict, version):
        self.version = version

    def generate(self, prompts, sampling, n=1, *, seeds=None):
        self.calls.append(len(prompts))
        if self.fail:
            raise RuntimeError("engine exploded")
        out = []
        for p in prompts:
            script = self.scripts[p[0]]
            text = script[min(p.count(self.close), len(script) - 1)]
            toks, reason = self.codec.encode(text), "length"
            for i, t in enumerate(toks):
                if t in sampling.tool_token_ids or t in sampling.stop_token_ids:
                    toks, reason = toks[: i + 1], "tool" if t in sampling.tool_token_ids else "stop"
                    break
            if len(toks) > sampling.max_new_tokens:
                toks, reason = toks[: sampling.max_new_tokens], "length"
            lp = [-(i + 1) / 100 for i in range(len(toks))]
            out.append([Completion(toks, lp, reason, policy_version=self.version)] * n)
        return out


def check_alignment(traj: Trajectory, max_total: int):
    """The Trajectory invariants: masks, spans, log-probs, result spans cover everything exactly once."""
    n = len(traj.token_ids)
    assert len(traj.loss_mask) == len(traj.logprobs) == n <= max_total
    assert traj.loss_mask[: traj.prompt_len] == [0] * traj.prompt_len
    covered = [0] * n
    pos = traj.prompt_len
    results = {rec.turn: rec.result_span for rec in traj.tool_calls}
    for k, (s, e) in enumerate(traj.turn_spans):
        assert s == pos and e > s, (k, s, e, pos)
        assert traj.loss_mask[s:e] == [1] * (e - s)
        covered[s:e] = [1] * (e - s)
        pos = e
        if k in results:
            rs, re_ = results[k]
            assert rs == pos and traj.loss_mask[rs:re_] == [0] * (re_ - rs)
            assert traj.logprobs[rs:re_] == [0.0] * (re_ - rs)
            covered[rs:re_] = [2] * (re_ - rs)
            pos = re_
    assert pos == n, "tokens outside the prompt, turns and results"
    assert covered[traj.prompt_len :].count(0) == 0
    assert all(lp == 0.0 for lp, m in zip(traj.logprobs, traj.loss_mask) if m == 0)
    assert sum(traj.loss_mask) == sum(e - s for s, e in traj.turn_spans)


def test_masks_spans_callbacks_and_tool_errors(codec, ids):
    scripts = {
        100: ["Let me add <tool>add: 2 3</tool> trailing", "<answer>5</answer>"],
        101: ["<tool>boom: x</tool>", "<tool>nosuch: 1</tool>", "no call here </tool>", "done</s>"],
        102: ["<answer>7</answer>"],
    }

    def add(args):
        time.sleep(0.3)  # slow tool: the other trajectories must not wait for it
        return str(sum(int(x) for x in args.split()))

    def boom(args):
        raise RuntimeError("tool crashed on purpose")

    engine = ScriptedEngine(codec, scripts, ids["</result>"])
    events = []
    loop = AgentLoop(
        engine, codec, agent_config(ids, max_turns=6, max_total_tokens=400),
        tools=FunctionTools({"add": add, "boom": boom}),
        on_turn=lambda t, k: events.append(("turn", t.index, k, len(t.token_ids), t.finish_reason)),
        on_finish=lambda t: events.append(("finish", t.index, t.finish_reason)),
    )
    prompts = [[100, 40, 41], [101, 42], [102, 43, 44, 45]]
    trajs = loop.run(prompts)
    for t in trajs:
        check_alignment(t, 400)
        assert t.finish_reason == "stop" and t.policy_version == 3 and set(t.turn_versions) == {3}
    t0, t1, t2 = trajs
    # traj 0: turn 0 ends at </tool> (the trailing text is never generated), result "5", then the answer
    turn0 = codec.encode("Let me add <tool>add: 2 3</tool>")
    s, e = t0.turn_spans[0]
    assert t0.token_ids[s:e] == turn0 and t0.logprobs[s:e] == [-(i + 1) / 100 for i in range(len(turn0))]
    rs, re_ = t0.tool_calls[0].result_span
    assert codec.decode(t0.token_ids[rs:re_]) == "<result>5</result>"
    assert t0.tool_calls[0].ok and t0.tool_calls[0].name == "add" and t0.tool_calls[0].args == "2 3"
    assert codec.decode(t0.token_ids[t0.turn_spans[1][0] :]) == "<answer>5</answer>"
    assert t0.token_ids[-1] == ids["</answer>"]
    # traj 1: a crashing tool, an unknown tool and a missing call are recorded; the loop goes on to the stop
    assert t1.num_turns == 4 and [c.ok for c in t1.tool_calls] == [False, False, False]
    assert "RuntimeError: tool crashed on purpose" in t1.tool_calls[0].error
    assert "unknown tool 'nosuch'" in t1.tool_calls[1].error
    assert "no complete" in t1.tool_calls[2].error
    text = codec.decode(t1.token_ids)
    assert "error: RuntimeError" in text and text.endswith("done</s>")
    assert t2.num_turns == 1 and t2.tool_calls == []
    # callbacks: per trajectory turns in order, then finish; fired as they happen (traj 2 is done before the slow
    # tool of traj 0 returns), each on_turn sees the trajectory with that turn (and its result) appended
    for t in trajs:
        mine = [ev for ev in events if ev[1] == t.index]
        assert [ev[0] for ev in mine] == ["turn"] * t.num_turns + ["finish"]
        assert [ev[2] for ev in mine[:-1]] == list(range(t.num_turns))
        assert mine[-2][4] == "stop" and mine[-1][2] == "stop"
    assert events.index(("finish", 2, "stop")) < events.index(next(ev for ev in events if ev[:3] == ("turn", 0, 0)))
    assert events[[ev[:3] for ev in events].index(("turn", 0, 0))][3] == t0.tool_calls[0].result_span[1]
    # batching: all three first turns went to the engine together
    assert engine.calls[0] == 3 and sum(engine.calls) == sum(t.num_turns for t in trajs)


def test_limits(codec, ids):
    forever = "<tool>echo: hi</tool>"
    scripts = {
        100: [forever],  # tool calls forever -> max_turns
        101: ["word " * 200],  # never stops -> per-turn length cap
        102: [forever],  # big results -> total token cap
    }
    tools = FunctionTools({"echo": lambda a: a * 50})
    engine = ScriptedEngine(codec, scripts, ids["</result>"])
    cfg = agent_config(ids, max_turns=3, max_total_tokens=90, max_result_tokens=12, max_new_tokens=20)
    finished = []
    trajs = AgentLoop(engine, codec, cfg, tools=tools, on_finish=finished.append).run(
        [[100, 5], [101, 5], [102] + [5] * 60]
    )
    for t in trajs:
        check_alignment(t, 90)
    t0, t1, t2 = trajs
    assert t0.finish_reason == "max_turns" and t0.num_turns == 3 and len(t0.tool_calls) == 2
    for rec in t0.tool_calls:  # results cut to max_result_tokens, still closed
        rs, re_ = rec.result_span
        assert re_ - rs == 12 and t0.token_ids[re_ - 1] == ids["</result>"]
    assert t1.finish_reason == "length" and t1.num_turns == 1 and t1.response_len == 20
    assert t2.finish_reason == "length" and len(t2.token_ids) <= 90
    assert sorted(t.index for t in finished) == [0, 1, 2]


def test_default_registry_tools_run_in_sandbox(codec, ids):
    scripts = {100: ["<tool>calculator: 2+3*4</tool>", "<answer>14</answer>"]}
    engine = ScriptedEngine(codec, scripts, ids["</result>"])
    (t,) = AgentLoop(engine, codec, agent_config(ids)).run([[100, 7]])
    check_alignment(t, 1024)
    assert t.finish_reason == "stop" and t.tool_calls[0].ok and t.tool_calls[0].name == "calculator"
    rs, re_ = t.tool_calls[0].result_span
    assert codec.decode(t.token_ids[rs:re_]) == "<result>14</result>"


def test_engine_failure_ends_trajectories_cleanly(codec, ids):
    engine = ScriptedEngine(codec, {100: ["x"]}, ids["</result>"], fail=True)
    finished = []
    trajs = AgentLoop(engine, codec, agent_config(ids), on_finish=finished.append).run([[100], [100, 1]])
    assert [t.finish_reason for t in trajs] == ["error", "error"]
    assert all("engine exploded" in t.error for t in trajs) and len(finished) == 2


# ------------------------------------------------------------------------------------------------ real engine


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


@pytest.fixture(scope="module")
def real(tiny_dir):
    import torch.distributed as dist

    from megatron_tsync.rollout.embedded_engine import EmbeddedEngine
    from megatron_tsync.model.hf_conversion import load_hf_dir, load_hf_into_model
    from megatron_tsync.model.builder import build_model
    from megatron_tsync.model.parallel import initialize_parallel

    if not dist.is_initialized():
        os.environ["MASTER_PORT"] = _free_port()
    initialize_parallel(1, 1, seed=0)
    arch, state = load_hf_dir(tiny_dir)
    trainer = build_model(arch, seed=1)
    load_hf_into_model(trainer, state)
    trainer.eval()
    return EmbeddedEngine.from_hf_dir(tiny_dir), trainer


def test_real_engine_concurrent_rollouts_match_trainer(real, codec, ids):
    """The tiny random model, made to end turns often (a slice of the vocabulary acts as </tool> or as a stop),
    with a trivial tool of real latency; behaviour log-probs must equal the trainer's on the final sequences."""
    from megatron_tsync.model.logprobs import token_logprobs

    engine, trainer = real
    sampling = SamplingConfig(
        temperature=0.9,
        max_new_tokens=12,
        stop_token_ids=(ids["</s>"], ids["</answer>"]) + tuple(range(300, 312)),
        tool_token_ids=(ids["</tool>"],) + tuple(range(330, 420)),
        seed=7,
    )
    cfg = AgentConfig(sampling=sampling, max_turns=4, max_total_tokens=96, max_result_tokens=16, batch_wait_s=0.05)
    calls = []

    def trivial_tool(turn_text: str) -> ToolStep:  # sync executor: runs on a worker thread
        calls.append(threading.current_thread().name)
        time.sleep(0.01)
        return ToolStep("<result>ok 42</result>", True, "trivial", turn_text[-10:])

    events = []
    loop = AgentLoop(engine, codec, cfg, tools=trivial_tool,
                     on_turn=lambda t, k: events.append((t.index, k)), on_finish=lambda t: events.append((t.index, "end")))
    prompts = [codec.encode(f"Q: {a}+{b}*3 ") for a, b in [(1, 2), (13, 7), (40, 5), (9, 99), (3, 3), (21, 8)]]
    trajs = loop.run(prompts)
    assert sum(t.num_turns for t in trajs) > len(trajs), "expected some multi-turn trajectories"
    assert len(loop.last_batch_sizes) < sum(t.num_turns for t in trajs), "turns were not batched"
    assert calls and all(name != threading.main_thread().name for name in calls)
    worst = 0.0
    for t in trajs:
        check_alignment(t, 96)
        assert t.turn_versions == [0] * t.num_turns and t.policy_version == 0
        assert t.finish_reason in ("stop", "length", "max_turns")
        assert [k for i, k in events if i == t.index] == list(range(t.num_turns)) + ["end"]
        with torch.no_grad():
            ref = token_logprobs(trainer, torch.tensor([t.token_ids]), temperature=0.9)[0]  # (S-1,)
        m = torch.tensor(t.loss_mask[1:], dtype=torch.bool)
        worst = max(worst, (ref[m] - torch.tensor(t.logprobs[1:])[m]).abs().max().item())
    print(f"\nagent loop: turns {[t.num_turns for t in trajs]}, batches {loop.last_batch_sizes}, "
          f"log-prob max |diff| {worst:.2e}")
    assert worst <= 1e-5
    # Per-turn seeds make the rollout reproducible whatever the batching.
    again = AgentLoop(engine, codec, cfg, tools=trivial_tool).run(prompts)
    assert [t.token_ids for t in again] == [t.token_ids for t in trajs]


def test_idle_work_runs_only_while_no_trajectory_needs_the_engine(codec, ids):
    """``idle_work`` jobs run on the engine thread while every trajectory is in a (slow) tool call, and yield within
    their interrupt as soon as one needs the engine; the trajectories are the same as without idle work."""
    scripts = {100: ["<tool>slow: 1</tool>", "<answer>1</answer>"], 101: ["<tool>slow: 2</tool>", "<answer>2</answer>"]}

    def slow(args):
        time.sleep(0.3)
        return args

    ran, yielded, busy, engines = [], [], [], []

    def job(interrupt):
        ran.append(time.monotonic())
        busy.append(len(engines[-1].calls))
        while not interrupt():
            time.sleep(0.005)
        yielded.append(time.monotonic())

    def run(idle):
        engines.append(ScriptedEngine(codec, scripts, ids["</result>"]))
        loop = AgentLoop(engines[-1], codec, agent_config(ids, max_turns=3, max_total_tokens=400),
                         tools=FunctionTools({"slow": slow}), idle_work=idle)
        return [t.token_ids for t in loop.run([[100, 40], [101, 41]])]

    plain = run(None)
    assert run(lambda: job if len(ran) < 3 else None) == plain
    # the first job started once both trajectories were in their tool call, and yielded when their second turn came
    assert ran and busy[0] == 1 and len(yielded) == len(ran) and yielded[0] - ran[0] > 0.2


def test_frontier_first_serves_earlier_groups_first_under_a_cap(real, codec, ids):
    """``max_num_seqs`` caps what one engine call takes; ``frontier_first`` takes the earliest groups' requests
    (metadata ``priority``) among those waiting, where arrival order (the default) takes the first to ask. Same
    trajectories either way (per-request seeds)."""
    engine, _ = real
    sampling = SamplingConfig(max_new_tokens=6, stop_token_ids=(ids["</s>"], ids["</answer>"]),
                              tool_token_ids=(ids["</tool>"],), seed=3)
    prompts = [codec.encode(f"Q: {a}+{a} ") for a in range(6)]
    meta = [{"priority": 2 - i // 2} for i in range(6)]  # groups 2, 2, 1, 1, 0, 0 in prompt (= arrival) order
    runs = {}
    for frontier in (True, False):
        cfg = AgentConfig(sampling=sampling, max_turns=1, max_total_tokens=64, max_num_seqs=2, frontier_first=frontier)
        loop = AgentLoop(engine, codec, cfg)
        runs[frontier] = ([t.token_ids for t in loop.run(prompts, metadata=meta)], loop.last_served)
    assert runs[True][1] == [[0, 0], [1, 1], [2, 2]]
    assert runs[False][1] == [[2, 2], [1, 1], [0, 0]]
    assert runs[True][0] == runs[False][0]
    with pytest.raises(ValueError, match="max_num_seqs"):
        AgentConfig(sampling=sampling, max_num_seqs=-1)
