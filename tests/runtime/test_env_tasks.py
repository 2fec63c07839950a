"""The generated suites as RL tasks: deterministic disjoint splits, the hidden_tests verifier is required, and the
demonstration (warm start) is exactly what the environment returns for the known solution."""

import asyncio

import pytest

from megatron_tsync.runtime.tasks import get_task

NAME = "megatron_tsync.runtime.env_tasks:"


@pytest.mark.parametrize("suite", ["swe-lite", "terminal-lite"])
def test_splits_are_deterministic_and_disjoint(suite):
    t = get_task(NAME + suite, verifier="hidden_tests")
    a = [i.meta["task_id"] for i in t.sample_prompts(3, 16, 1234)]
    assert a == [i.meta["task_id"] for i in t.sample_prompts(3, 16, 1234)]
    ev = {i.meta["task_id"] for s in range(5) for i in t.sample_prompts(s, 16, 1234, split="eval")}
    tr = {i.meta["task_id"] for s in range(5) for i in t.sample_prompts(s, 16, 1234)}
    assert ev and tr and not ev & tr
    assert t.reward_spec.binary


def test_refuses_another_verifier():
    with pytest.raises(ValueError, match="--verifier must be 'hidden_tests'"):
        get_task(NAME + "swe-lite", verifier="exact_answer")


@pytest.mark.parametrize("suite,fmt", [("swe-lite", "tag"), ("terminal-lite", "qwen")])
def test_demonstration_is_what_the_environment_returns(suite, fmt):
    from megatron_tsync.rollout.envs.base import run_scripted

    t = get_task(NAME + suite, verifier="hidden_tests", tool_format=fmt)
    inst = t.sample_prompts(0, 1, 7)[0]
    segs = t.demonstration_segments(inst)
    env = t.make_environment()
    assert segs[0][0] == env.prompt(inst.meta["env_task"]) == inst.prompt_text
    actions = [s for s, act in segs if act]
    verdict, obs = asyncio.run(run_scripted(env, inst.meta["env_task"], actions))
    assert [o.text for o in obs] == [s for s, act in segs[1:] if not act]
    assert verdict.reward == 1.0


def test_swe_lite_example_config_parses_and_names_the_suite():
    import os

    from megatron_tsync.arguments import parse_args

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cfg = parse_args(["--config", os.path.join(root, "examples", "swe_lite", "config.yaml")], world_size=1)
    assert cfg.learner.mode == "stream-trajectory" and cfg.rollout.engine == "embedded"
    task = get_task(cfg.rollout.task, verifier=cfg.rollout.verifier)
    assert task.name == "swe-lite" and cfg.learner.reward_spec.kind == "binary"


@pytest.mark.parametrize("fmt,stop", [("tag", "</tool>"), ("qwen", "</tool_call>")])
def test_the_worker_stops_tool_turns_at_the_formats_token(fmt, stop):
    from megatron_tsync.runtime import worker as W
    from tests.runtime.test_worker_spec import _spec

    class Tok:
        eos_token_id = 1
        _ids = {"</answer>": 8, "</tool>": 4, "</tool_call>": 9}

        def convert_tokens_to_ids(self, t):
            return self._ids[t]

    task = get_task(NAME + "swe-lite", verifier="hidden_tests", tool_format=fmt)
    assert task.tool_stop_text == stop
    assert W.sampling_config(_spec().rollout, _spec().rl, Tok(), task.tool_stop_text).tool_token_ids == (Tok._ids[stop],)
    assert W.sampling_config(_spec().rollout, _spec().rl, Tok()).tool_token_ids == (4,)  # control: the default is the tag format's
