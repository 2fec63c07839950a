"""runtime/speculation.Drafter without a model: what it plans to draft for a step (each first turn's key and cap;
``--speculative-draft-tokens`` caps it), when it offers a job, and when it stands aside."""

import types

from megatron_tsync.rollout.engine import derive_seed
from megatron_tsync.runtime.speculation import Drafter, step_seed


def _worker(budget: int, version: int = 4):
    rl = types.SimpleNamespace(seed=7, group_size=2, groups_per_step=2, train_iters=10)
    spec = types.SimpleNamespace(rl=rl, start_step=0, worker_id=0,
                                 rollout=types.SimpleNamespace(speculative_draft_tokens=budget))
    inst = [types.SimpleNamespace(prompt_text="ab"), types.SimpleNamespace(prompt_text="abcd")]
    return types.SimpleNamespace(
        spec=spec, codec=types.SimpleNamespace(encode=lambda text: [ord(c) for c in text]),
        task=types.SimpleNamespace(sample_prompts=lambda step, n, seed: inst),
        config=types.SimpleNamespace(sampling=types.SimpleNamespace(max_new_tokens=32), max_total_tokens=20),
        step_items=lambda: [(0, 0), (0, 1), (1, 0), (1, 1)], engine=types.SimpleNamespace(policy_version=version))


def test_plan_keys_caps_and_the_draft_budget():
    d = Drafter(_worker(0), make_engine=None)
    assert d.job(5) is not None and d.step == 5
    keys = [derive_seed(step_seed(7, 5), g * 2 + i, 0) for g, i in [(0, 0), (0, 1), (1, 0), (1, 1)]]
    assert list(d.todo) == keys  # the first turn's seed of each trajectory, as the agent loop derives it
    assert [c for _, c in d.todo.values()] == [18, 18, 16, 16]  # min(max_new_tokens, max_total_tokens - prompt)
    d = Drafter(_worker(5), make_engine=None)
    d.job(5)
    assert [c for _, c in d.todo.values()] == [5, 5, 5, 5]  # --speculative-draft-tokens 5


def test_no_job_for_other_weights_the_first_or_past_the_last_step():
    assert Drafter(_worker(0, version=3), make_engine=None).job(5) is None  # the engine holds θ_3, not θ_4
    assert Drafter(_worker(0, version=-1), make_engine=None).job(0) is None  # nothing before the start step
    assert Drafter(_worker(0, version=9), make_engine=None).job(10) is None  # no step 10 of 10
