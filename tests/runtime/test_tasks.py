"""The task registry and the arithmetic-calculator task: determinism, split disjointness, and demonstrations that
agree with the sandboxed calculator, the verifier and the agent loop's token layout."""

import asyncio
import os
import random

import pytest

from megatron_tsync.runtime.tasks import (
    ArithmeticCalculatorTask, Task, available_tasks, evaluate_expression, get_task,
)




@pytest.fixture(scope="session")
def codec(tiny_dir):
    from tokenizers import Tokenizer

    from megatron_tsync.model.tokenizer import TokenizerCodec

    return TokenizerCodec(Tokenizer.from_file(os.path.join(tiny_dir, "tokenizer.json")))


class ScriptedEngine:
    """Plays the task's demonstration: the first turn is the tool call, the turn after a ``<result>`` the answer.
    Every generated token gets log-prob -0.1. Implements the ``RolloutEngine`` protocol."""

    def __init__(self, codec, task, instances):
        self.policy_version = 0
        self.result_id = codec.encode("<result>")[0]
        self.scripts = {}
        for inst in instances:
            segs = task.demonstration_segments(inst)
            prompt = tuple(codec.encode(segs[0][0]))
            self.scripts[prompt] = [codec.encode(t) for t, is_action in segs if is_action]

    def generate(self, prompts, sampling, n=1, *, seeds=None):
        from megatron_tsync.rollout.engine import Completion

        out = []
        for p in prompts:
            key = next(k for k in self.scripts if tuple(p[: len(k)]) == k)
            turn = 1 if self.result_id in p[len(key):] else 0
            toks = self.scripts[key][turn][: sampling.max_new_tokens]
            reason = "tool" if toks[-1] in sampling.tool_token_ids else "stop"
            out.append([Completion(list(toks), [-0.1] * len(toks), reason, None, self.policy_version)] * n)
        return out

    def update_weights(self, state_dict, version):
        self.policy_version = version


def test_registry_and_protocol():
    assert "arithmetic-calculator" in available_tasks()
    task = get_task("arithmetic-calculator", max_operands=2, max_value=9)
    assert isinstance(task, Task) and task.max_value == 9
    assert task.reward_spec.kind == "binary"
    assert get_task("arithmetic-calculator", verifier="answer_with_format").reward_spec.kind == "bounded"
    with pytest.raises(KeyError, match="unknown task 'nope'; available: .*reasoning-gym:NAME"):
        get_task("nope")
    for bad in ({"min_operands": 0}, {"min_operands": 3, "max_operands": 2}, {"ops": "/"}, {"verifier": "x"}):
        with pytest.raises(ValueError):
            get_task("arithmetic-calculator", **bad)


def test_sample_prompts_deterministic_and_split_disjoint():
    task = ArithmeticCalculatorTask()
    a = task.sample_prompts(3, 16, seed=7)
    assert a == task.sample_prompts(3, 16, seed=7)
    assert a != task.sample_prompts(3, 16, seed=8) and a != task.sample_prompts(4, 16, seed=7)
    assert task.sample_prompts(3, 4, seed=7) == a[:4], "group g must not depend on num_groups"
    train = {i.meta["expression"] for s in range(20) for i in task.sample_prompts(s, 32, seed=0)}
    held = {i.meta["expression"] for i in task.sample_prompts(0, 300, seed=0, split="eval")}
    assert not train & held, "train and eval prompts overlap"
    for inst in a:
        expr = inst.meta["expression"]
        n = sum(expr.count(o) for o in "+-*") + 1
        assert 2 <= n <= 3 and inst.prompt_text == f"<s>Q: {expr} "
        assert all(0 <= int(x) <= 99 for x in expr.replace("+", " ").replace("-", " ").replace("*", " ").split())


def test_difficulty_knobs():
    task = ArithmeticCalculatorTask(min_operands=4, max_operands=4, max_value=5, ops="*")
    for inst in task.sample_prompts(0, 20, seed=1):
        nums = inst.meta["expression"].split("*")
        assert len(nums) == 4 and all(0 <= int(x) <= 5 for x in nums)


def test_evaluate_expression_matches_python():
    rng = random.Random(0)
    task = ArithmeticCalculatorTask(max_operands=5)
    for _ in range(500):
        expr = task._expression(rng)
        assert evaluate_expression(expr) == eval(expr)  # noqa: S307 - digits and + - * only
    with pytest.raises(ValueError):
        evaluate_expression("1+")


def test_demonstration_agrees_with_sandboxed_calculator_and_verifier():
    from megatron_tsync.rollout.sandbox import Sandbox
    from megatron_tsync.rollout.tools import calculator, format_tool_result, parse_tool_call
    from megatron_tsync.rollout.verifiers import get_verifier

    task = ArithmeticCalculatorTask()
    insts = task.sample_prompts(0, 3, seed=3) + [task.instance("3-50*2")]  # a negative answer too
    sandbox = Sandbox()
    exact, shaped = get_verifier("exact_answer"), get_verifier("answer_with_format")
    for inst in insts:
        segs = task.demonstration_segments(inst)
        assert [a for _, a in segs] == [False, True, False, True]
        call = parse_tool_call(segs[1][0])
        assert call.name == "calculator" and call.args == inst.meta["expression"]
        res = calculator(call.args, sandbox)
        assert res.ok, res
        assert int(res.stdout) == inst.answer
        assert format_tool_result(res) == segs[2][0], "the demonstration's <result> is what the environment appends"
        demo = task.demonstration(inst)
        assert demo == inst.prompt_text + f"<tool>calculator: {call.args}</tool><result>{inst.answer}</result>" \
                                          f"<answer>{inst.answer}</answer>"
        assert asyncio.run(exact.score(demo, inst.verifier_task())) == 1.0
        assert asyncio.run(shaped.score(demo, inst.verifier_task())) == pytest.approx(1.0)
        wrong = demo.replace(f"<answer>{inst.answer}<", f"<answer>{inst.answer + 1}<")
        assert asyncio.run(exact.score(wrong, inst.verifier_task())) == 0.0


def test_demonstration_tokens_equal_agent_loop_trajectory(codec):
    """Segment-wise tokenisation (what SFT trains on) == the tokens and loss mask of an agent-loop rollout that
    generates the demonstration's actions with the real sandboxed calculator."""
    from megatron_tsync.rollout.agent_loop import AgentConfig, AgentLoop
    from megatron_tsync.model.tokenizer import tag_token_id
    from megatron_tsync.rollout.engine import SamplingConfig
    from megatron_tsync.training.sft import demonstration_tokens

    task = ArithmeticCalculatorTask()
    insts = task.sample_prompts(0, 4, seed=11)
    sampling = SamplingConfig(max_new_tokens=32, stop_token_ids=(tag_token_id(codec, "</answer>"),),
                              tool_token_ids=(tag_token_id(codec, "</tool>"),), seed=0)
    loop = AgentLoop(ScriptedEngine(codec, task, insts), codec, AgentConfig(sampling=sampling, max_total_tokens=128))
    trajs = loop.run([codec.encode(i.prompt_text) for i in insts])
    for inst, t in zip(insts, trajs):
        ids, mask = demonstration_tokens(codec, task.demonstration_segments(inst))
        assert t.finish_reason == "stop" and t.tool_calls[0].ok
        assert t.token_ids == ids
        assert t.loss_mask == mask
        assert codec.decode(ids) == task.demonstration(inst)


# ------------------------------------------------------------------------------------------------------ JSONL files
GOOD = '{"id": "p1", "prompt": "Write f", "tests": ["assert f() == 1"]}'


@pytest.mark.parametrize("lines, where, words", [
    ([GOOD, '{"id": "p2", "prompt": "x", "tests": ["1"]'], 2, "not valid JSON"),  # a truncated line
    ([GOOD, "", "[1, 2]"], 3, "expected a JSON object, got list"),
    ([GOOD, "garbage"], 2, "not valid JSON (Expecting value at column 1)"),
    ([GOOD, '{"id": "p3"}'], 2, "a problem needs 'id', 'prompt' and 'tests'"),
])
def test_a_broken_jsonl_task_line_names_file_and_line(tmp_path, lines, where, words):
    """Through the recipes' JSONL task (``examples/jsonl_tasks.py``, read with ``runtime.tasks.read_jsonl``).
    Control: the good line alone loads."""
    path = tmp_path / "tasks.jsonl"
    task = get_task("examples.jsonl_tasks:swe-jsonl", path=str(path), heldout_mod=1000)
    path.write_text(GOOD + "\n")
    assert [r["id"] for r in task.records("train")] == ["p1"]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError) as e:
        task.records("train")
    assert f"{path}:{where}: " in str(e.value) and words in str(e.value), str(e.value)


def test_read_jsonl_names_a_missing_or_non_utf8_file(tmp_path):
    from megatron_tsync.runtime.tasks import read_jsonl

    with pytest.raises(FileNotFoundError, match=f"{tmp_path / 'nope.jsonl'}: no such task file"):
        list(read_jsonl(str(tmp_path / "nope.jsonl")))
    (tmp_path / "bin.jsonl").write_bytes(GOOD.encode() + b"\n\xff\xfe\n")
    with pytest.raises(ValueError, match=f"{tmp_path / 'bin.jsonl'}:2: not UTF-8"):
        list(read_jsonl(str(tmp_path / "bin.jsonl")))
    (tmp_path / "ok.jsonl").write_text(f"\n{GOOD}\n\n")
    assert [n for n, _ in read_jsonl(str(tmp_path / "ok.jsonl"))] == [2]
