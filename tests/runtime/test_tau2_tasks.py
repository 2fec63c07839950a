"""τ² domains as RL tasks (runtime/tau2_tasks.py): τ²'s own train/test split files, clear errors for a wrong
verifier or a missing user model, and a 3-step live training run on the mock domain (τ²'s solo mode) in
``stream-trajectory`` mode with the tiny model: every trajectory is scored by τ²'s evaluator (status ok), none is
rejected, and the held-out evaluation runs τ² episodes as well. The tiny model does not solve τ² tasks (rewards 0): the run shows the plumbing, not learning.

Needs the optional tau2 extra (tools/test.sh installs it).
"""

import json
import os

import pytest

pytest.importorskip("tau2", reason="the optional tau2 extra is not installed")

from megatron_tsync.runtime.tasks import get_task  # noqa: E402

NAME = "megatron_tsync.runtime.tau2_tasks:"


@pytest.mark.parametrize("domain,sizes", [("airline", (30, 20)), ("retail", (74, 40))])
def test_splits_are_tau2s_split_files(domain, sizes):
    from tau2.utils.utils import DATA_DIR

    task = get_task(NAME + domain + "-scripted", verifier="tau2")
    with open(os.path.join(DATA_DIR, "tau2", "domains", domain, "split_tasks.json")) as f:
        split = json.load(f)
    train, test = [t.id for t in task.tasks("train")], [t.id for t in task.tasks("eval")]
    assert (len(train), len(test)) == sizes and not set(train) & set(test)
    assert set(train) == set(split["train"]) and set(test) == set(split["test"])
    a, b = task.sample_prompts(3, 4, seed=7, split="eval"), task.sample_prompts(3, 4, seed=7, split="eval")
    assert [i.prompt_text for i in a] == [i.prompt_text for i in b]
    assert {i.meta["env_task"].task_id for i in a} <= set(test)
    assert {i.meta["task_id"].split("/")[0] for i in a} == {domain}
    assert all(i.prompt_text.endswith(f"user: {i.meta['env_task'].opening}\n") for i in a)


@pytest.mark.slow  # loads two τ² domains' data
def test_airline_retail_pool_is_both_train_splits():
    task = get_task(NAME + "airline-retail-scripted", verifier="tau2")
    pool = task.pool("train")
    assert [d for d, _ in pool] == ["airline"] * 30 + ["retail"] * 74
    insts = task.sample_prompts(0, 16, seed=1)
    assert {i.meta["env_task"].domain for i in insts} == {"airline", "retail"}  # one step draws from both
    with pytest.raises(ValueError, match="several domains"):
        task.tasks("train")


def test_clear_errors(monkeypatch):
    with pytest.raises(ValueError, match="--verifier must be 'tau2'"):
        get_task(NAME + "mock", verifier="exact_answer")
    monkeypatch.delenv("TSYNC_TAU2_USER_LLM", raising=False)
    with pytest.raises(ValueError, match="TSYNC_TAU2_USER_LLM"):
        get_task(NAME + "airline", verifier="tau2")
    monkeypatch.setenv("TSYNC_TAU2_USER_LLM", "openai/user-model")
    monkeypatch.setenv("TSYNC_TAU2_USER_API_BASE", "http://127.0.0.1:1/v1")
    task = get_task(NAME + "airline", verifier="tau2")
    assert task.user_llm == "openai/user-model"
    assert task.user_llm_args == {"temperature": 0.0, "api_base": "http://127.0.0.1:1/v1", "api_key": "EMPTY"}
    with pytest.raises(ValueError, match="split must be one of"):
        task.tasks("test")


@pytest.mark.slow
def test_three_step_stream_trajectory_run_on_mock(tiny_dir, tmp_path):
    from tests.runtime.test_train_e2e import _train

    dump = tmp_path / "dump"
    out = _train(["--model", tiny_dir, "--task", NAME + "mock", "--verifier", "tau2", "--group-size", "2",
                  "--global-batch-size", "4", "--rollout-workers", "1", "--max-turns", "2", "--max-new-tokens", "16",
                  "--seq-length", "3072", "--lr", "1e-4", "--rl-mode", "stream-trajectory", "--train-iters", "3",
                  "--no-progress", "--dump-rollouts", str(dump), "--eval-interval", "3", "--eval-prompts", "2"],
                 tmp_path, timeout=600)
    assert "summary: mode stream-trajectory, 3 steps" in out
    assert "held-out v0: success" in out and "held-out v3: success" in out  # τ² episodes in the trainer too
    steps = [ln for ln in out.splitlines() if "] step " in ln]
    assert len(steps) == 3 and all("rejected 0" in ln for ln in steps)
    trace = [json.loads(ln) for ln in open(tmp_path / "runs" / "tsync" / "rollout_plane" / "latency_trace" /
                                          "worker0.jsonl")]
    assert len(trace) == 12 and all(r["status"] == "ok" and r["verify_s"] > 0 for r in trace)  # τ²'s evaluator
    for step in range(3):
        meta = json.loads((dump / f"step_{step:07d}" / "rollouts.json").read_text())
        assert len(meta["trajectories"]) == 4 and all(t["reward"] in (0.0, 1.0) for t in meta["trajectories"])


def test_demonstration_is_the_gold_replay():
    """The supervised warm start's transcript: the prompt, then the gold turns (actions) with τ²'s observations."""
    from megatron_tsync.rollout.envs.tau2_env import gold_turns

    for name in ("mock-scripted", "mock"):
        task = get_task(NAME + name, verifier="tau2")
        inst = task.sample_prompts(0, 1, seed=3)[0]
        segs = task.demonstration_segments(inst)
        assert segs[0] == (inst.prompt_text, False) and [a for _, a in segs[1:]] == [True, False] * (len(segs) // 2)
        turns = gold_turns(inst.meta["env_task"].task, solo=name == "mock")
        assert [t for t, a in segs if a] == task.make_environment().render_turns(turns)
        assert segs[-1][0].startswith("<result>")
