"""reasoning-gym as a task source (``runtime/reasoning_gym_task.py``, verifier ``reasoning_gym``), no model:

- the reward is reasoning-gym's own ``score_answer`` on the final ``<answer>``: the right answer scores what the
  dataset gives it (1), a wrong one what the dataset says (chain_sum: partial credit when the oracle is a substring,
  else 0), no answer or one forged inside a tool ``<result>`` what ``score_answer(None)`` gives;
- train and held-out questions are disjoint by content, deterministic, and group ``g`` does not depend on the group
  count; the demonstration's calculator call, run by the real sandboxed tool, returns the answer it then gives;
- bad names, configs and verifiers are refused with a clear error; the declared reward spec is bounded [0, 1].
"""

import asyncio

import pytest

pytest.importorskip("reasoning_gym")

NAME = "reasoning-gym:chain_sum:min_terms=2,max_terms=3,max_digits=2"


@pytest.fixture(scope="module")
def task():
    from megatron_tsync.runtime.tasks import get_task

    return get_task(NAME, verifier="reasoning_gym")


@pytest.fixture(scope="module")
def verifier(task):
    from megatron_tsync.rollout.verifiers import get_verifier

    v = get_verifier(task.verifier, **task.verifier_kwargs)
    yield v
    v.close()  # its sandbox's fork server


def _score(verifier, text, inst):
    return asyncio.run(verifier.evaluate(text, inst.verifier_task())).reward


def _scores(verifier, pairs):
    """Rewards of (text, inst) pairs, scored together (the sandboxed scorer batches answers that arrive together)."""
    async def together():
        return await asyncio.gather(*(verifier.evaluate(text, inst.verifier_task()) for text, inst in pairs))

    return [s.reward for s in asyncio.run(together())]


def test_rewards_are_reasoning_gyms_own_score(task, verifier):
    import reasoning_gym

    own = reasoning_gym.create_dataset("chain_sum", min_terms=2, max_terms=3, max_digits=2, size=1, seed=5)
    insts = task.sample_prompts(0, 8, 1234)
    pairs, want = [], []
    for inst in insts:
        entry, oracle = inst.meta["entry"], inst.answer
        assert entry["answer"] == oracle and inst.prompt_text == f"<s>Q: {entry['question']} "
        cases = {oracle: 1.0, oracle + "7": None, str(int(oracle) + 1000): None, "x": None}
        for answer, fixed in cases.items():
            pairs.append((f"<tool>calculator: 1+1</tool><result>2</result><answer> {answer} </answer>", inst))
            want.append(own.score_answer(answer, entry) if fixed is None else fixed)
            assert fixed is None or own.score_answer(answer, entry) == fixed
        forged = f"<tool>python: print(1)</tool><result><answer>{oracle}</answer></result>"
        pairs += [(f"<answer>{oracle}</answer>", inst), ("no answer", inst), (forged, inst)]
        want += [1.0, own.score_answer(None, entry), 0.0]  # tool output cannot answer
        assert own.score_answer(None, entry) == 0.0
    assert _scores(verifier, pairs) == want
    from megatron_tsync.rollout.verifiers import get_verifier

    # no dataset named: the entry's source_dataset, its default config (the same sandbox: one warm fork server)
    bare = get_verifier("reasoning_gym", sandbox=verifier.scorer.sandbox)
    partial = _scores(verifier, [(f"<answer>{i.answer}7</answer>", i) for i in insts])
    assert _scores(bare, [(f"<answer>{i.answer}7</answer>", i) for i in insts]) == partial
    # chain_sum's partial credit for a wrong answer that contains the oracle: len(oracle) / len(answer)
    assert all(0.0 < p < 1.0 for p in partial)
    assert partial == [len(i.answer) / (len(i.answer) + 1) for i in insts]


def test_splits_are_disjoint_by_content_and_deterministic(task):
    train = [i for k in range(6) for i in task.sample_prompts(k, 32, 1234)]
    held = task.sample_prompts(0, 128, 1234, split="eval")
    assert {i.meta["split"] for i in train} == {"train"} and {i.meta["split"] for i in held} == {"eval"}
    q_train = {i.meta["entry"]["question"] for i in train}
    q_held = {i.meta["entry"]["question"] for i in held}
    assert len(q_held) > 100 and len(q_train) > 150  # many distinct questions, none of them shared
    assert not q_train & q_held
    assert [i.prompt_text for i in task.sample_prompts(3, 5, 1234)] == [i.prompt_text for i in train[96:101]]
    assert [i.prompt_text for i in task.sample_prompts(0, 4, 99)] != [i.prompt_text for i in train[:4]]


def test_demonstration_uses_the_real_calculator_and_scores_one(task, verifier):
    from megatron_tsync.rollout.sandbox import Sandbox
    from megatron_tsync.rollout.tools import execute_tool_call, parse_tool_call

    sandbox = Sandbox()
    try:
        for inst in task.sample_prompts(1, 4, 1234):
            seg = task.demonstration_segments(inst)
            assert [a for _, a in seg] == [False, True, False, True] and seg[0][0] == inst.prompt_text
            res = execute_tool_call(parse_tool_call(seg[1][0]), sandbox)
            assert res.ok and res.stdout.strip() == inst.answer == seg[2][0][len("<result>"):-len("</result>")]
            assert _score(verifier, task.demonstration(inst)[len(inst.prompt_text):], inst) == 1.0
    finally:
        sandbox.close()
    # a dataset without an expression: the answer alone
    from megatron_tsync.runtime.tasks import get_task

    gcd = get_task("reasoning-gym:gcd", verifier="reasoning_gym")
    inst = gcd.sample_prompts(0, 1, 0)[0]
    assert gcd.demonstration_segments(inst)[1:] == [(f"<answer>{inst.answer}</answer>", True)]


@pytest.mark.parametrize("name,verifier,expect", [
    ("reasoning-gym:no_such_dataset", "reasoning_gym", "reasoning-gym has no dataset 'no_such_dataset'"),
    ("reasoning-gym:", "reasoning_gym", "name a dataset"),
    ("reasoning-gym:chain_sum:max_terms", "reasoning_gym", "is not key=value"),
    ("reasoning-gym:chain_sum:min_terms=5,max_terms=2", "reasoning_gym", "max_terms must be >= min_terms"),
    ("reasoning-gym:chain_sum:no_field=1", "reasoning_gym", "no_field"),
    ("reasoning-gym:chain_sum", "exact_answer", "--verifier must be 'reasoning_gym'"),
])
def test_bad_names_and_verifiers_are_refused(name, verifier, expect):
    from megatron_tsync.runtime.tasks import get_task

    with pytest.raises(ValueError) as e:
        get_task(name, verifier=verifier)
    assert expect in str(e.value)


def test_declared_reward_spec_is_bounded(task):
    from megatron_tsync.config.rewards import declared_reward_spec

    spec = declared_reward_spec("reasoning_gym")
    assert (spec.kind, spec.lo, spec.hi) == ("bounded", 0.0, 1.0)
    assert (task.reward_spec.kind, task.reward_spec.lo, task.reward_spec.hi) == ("bounded", 0.0, 1.0)


def test_example_recipe_parses_and_passes_the_task_check():
    """examples/reasoning_gym/config.yaml: the task and verifier it names build, and the learner is told bounded
    rewards (what the verifier declares), not the binary default."""
    import os

    from megatron_tsync.arguments import parse_args
    from megatron_tsync.runtime.preflight import _check_task

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cfg = parse_args(["--config", os.path.join(root, "examples", "reasoning_gym", "config.yaml")])
    task = _check_task(cfg)
    assert task.dataset == "chain_sum" and task.config == {"min_terms": 2, "max_terms": 3, "max_digits": 2}
    spec = cfg.learner.reward_spec
    assert (spec.kind, spec.lo, spec.hi) == ("bounded", 0.0, 1.0)
    assert cfg.logging.eval_interval > 0


def test_without_reasoning_gym_installed_preflight_says_how_to_install(monkeypatch):
    import sys

    from megatron_tsync.arguments import parse_args
    from megatron_tsync.runtime import reasoning_gym_task
    from megatron_tsync.runtime.preflight import PreflightError, _check_task

    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import reasoning_gym raises ImportError
    monkeypatch.setattr(reasoning_gym_task, "_CACHE", {})
    cfg = parse_args(["--task", "reasoning-gym:chain_sum", "--verifier", "reasoning_gym"])
    with pytest.raises(PreflightError) as e:
        _check_task(cfg)
    assert "reasoning-gym is not installed" in str(e.value) and "pip install 'megatron_tsync[reasoning-gym]'" in str(
        e.value)
