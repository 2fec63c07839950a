"""τ² domains as RL tasks (runtime/tau2_tasks.py): τ²'s own train/test split files, clear errors for a wrong
verifier or a missing user model, the tasks a do-nothing conversation solves left out (``--tau2-keep-trivial-tasks``
keeps them), and a 3-step live training run on the mock domain (τ²'s solo mode) in
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
# τ² 26.3's tasks whose do-nothing conversation (no tool call, one closing message) its evaluator scores 1.0: the
# gold changes nothing and communicates nothing (docs/tau2.md lists them with the reason). Keys: (domain, τ² split).
DO_NOTHING_SOLVED = {
    ("mock", "base"): {"create_task_1_nl_eval"},
    ("airline", "train"): {"0", "1", "4", "5", "10", "28", "34", "36", "41", "43", "46", "47", "49"},
    ("airline", "test"): {"6", "13", "26", "31", "45", "48"},
    ("retail", "train"): {"10", "25", "50", "57", "105"},
    ("retail", "test"): {"12", "65"},
}


@pytest.mark.parametrize("domain,sizes", [("airline", (30, 20)), ("retail", (74, 40))])
def test_splits_are_tau2s_split_files(domain, sizes):
    from tau2.utils.utils import DATA_DIR

    task = get_task(NAME + domain + "-scripted", verifier="tau2", keep_trivial_tasks=True)
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
    task = get_task(NAME + "airline-retail-scripted", verifier="tau2", keep_trivial_tasks=True)
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
    assert "[tsync] τ² mock train: excluded 0 tasks a do-nothing conversation solves" in out  # the start-up check
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


# ------------------------------------------------------------------------------------------ do-nothing tasks
def _do_nothing(rl_task, task_id: str, split: str = "train"):
    """The environment's episode (the training path: prompt, parsed turn, τ²'s evaluator) of the do-nothing
    conversation, and τ²'s own ``run_task`` replaying it: (our verdict, τ²'s SimulationRun)."""
    import asyncio

    from megatron_tsync.rollout.envs.tau2_env import do_nothing_turns
    from tests.rollout.envs.test_tau2_env import _tau2_run_task

    env, solo = rl_task.make_environment(), rl_task.user_mode == "solo"
    task = next(t for t in rl_task.tasks(split) if t.id == task_id)
    inst = rl_task.instance(task, split)
    turns = do_nothing_turns(solo)

    async def episode():
        ep = await env.start(inst.meta["env_task"])
        obs = [await ep.step(text) for text in env.render_turns(turns)]
        assert obs[-1].done  # the conversation closed (the scripted user's ###STOP###), not cut by the agent loop
        return await ep.finish()

    return asyncio.run(episode()), _tau2_run_task(rl_task, task, turns, inst.meta["env_task"].opening)


def test_do_nothing_solvable_mock_task_is_excluded_from_both_splits(capsys, monkeypatch):
    """mock (scripted user): 1 of 9 tasks is solved by doing nothing; it is in neither split's pool and one line
    per split says so; ``keep_trivial_tasks`` keeps it. Solo mode: none of its 6 tasks is."""
    import megatron_tsync.runtime.tau2_tasks as tt
    from megatron_tsync.runtime.tau2_tasks import trivial_tasks

    monkeypatch.setattr(tt, "_REPORTED", set())  # one line per process: this test's lines, whatever ran before

    assert set(trivial_tasks("mock", "base")) == DO_NOTHING_SOLVED[("mock", "base")]
    assert "reward basis DB+COMMUNICATE; 0 gold actions" in trivial_tasks("mock", "base")["create_task_1_nl_eval"]
    task = get_task(NAME + "mock-scripted", verifier="tau2")
    for split in ("train", "eval"):
        ids = [t.id for t in task.tasks(split)]
        assert len(ids) == 8 and "create_task_1_nl_eval" not in ids
        drawn = {i.meta["task_id"] for i in task.sample_prompts(0, 64, seed=0, split=split)}
        assert len(drawn) == 8 and "mock/create_task_1_nl_eval" not in drawn
    out = capsys.readouterr().out
    assert "τ² mock-scripted train: excluded 1 tasks a do-nothing conversation solves" in out and "mock 1/9" in out
    assert "τ² mock-scripted eval: excluded 1" in out
    kept = get_task(NAME + "mock-scripted", verifier="tau2", keep_trivial_tasks=True)
    assert "create_task_1_nl_eval" in [t.id for t in kept.tasks("train")] and len(kept.tasks("eval")) == 9
    assert "kept (--tau2-keep-trivial-tasks" in capsys.readouterr().out
    assert len(get_task(NAME + "mock", verifier="tau2").tasks("train")) == 6  # solo: no task rewards `done` alone


def test_llm_user_tasks_get_the_filter_without_calling_the_user_model(monkeypatch):
    """τ²'s LLM user path: the check runs with the scripted user (no model call: the user's URL refuses)."""
    monkeypatch.setenv("TSYNC_TAU2_USER_LLM", "openai/user-model")
    monkeypatch.setenv("TSYNC_TAU2_USER_API_BASE", "http://127.0.0.1:1/v1")
    task = get_task(NAME + "mock-llm", verifier="tau2")
    assert task.user_mode == "llm" and "create_task_1_nl_eval" not in [t.id for t in task.tasks("train")]
    assert len(task.tasks("eval")) == 8


def test_excluded_task_scores_one_doing_nothing_and_a_normal_task_zero():
    """The excluded task really scores 1.0 with the do-nothing conversation, by the environment's reward and by τ²'s
    own run_task; a normal task (its gold creates a record) scores 0 with it."""
    rl_task = get_task(NAME + "mock-scripted", verifier="tau2", keep_trivial_tasks=True)
    for task_id, want in (("create_task_1_nl_eval", 1.0), ("create_task_1", 0.0)):
        verdict, sim = _do_nothing(rl_task, task_id)
        assert verdict.reward == sim.reward_info.reward == want, (task_id, verdict.reason, sim.reward_info)
        assert "user_stop" in verdict.reason and sim.termination_reason.value == "user_stop"


def test_keep_trivial_tasks_flag_reaches_the_task(monkeypatch):
    """``--tau2-keep-trivial-tasks`` → ``rollout.tau2_keep_trivial_tasks`` → the task the trainer, its pre-flight and
    the workers build (``task_from_config``): 9 mock tasks with it, 8 without; refused for a task that is not τ²'s."""
    from megatron_tsync.arguments import parse_args
    from megatron_tsync.runtime.tasks import task_from_config

    base = ["--task", NAME + "mock-scripted", "--verifier", "tau2"]
    off, on = parse_args(base).rollout, parse_args([*base, "--tau2-keep-trivial-tasks"]).rollout
    assert not off.tau2_keep_trivial_tasks and on.tau2_keep_trivial_tasks
    assert (len(task_from_config(off).tasks("train")), len(task_from_config(on).tasks("train"))) == (8, 9)
    other = parse_args(["--task", "arithmetic-calculator", "--tau2-keep-trivial-tasks"]).rollout
    with pytest.raises(ValueError, match="--tau2-keep-trivial-tasks applies to τ² tasks"):
        task_from_config(other)


def test_a_filter_that_removes_every_task_fails_clearly(monkeypatch):
    """Every task solved by doing nothing: the pool and the run's pre-flight fail with a message naming the flag."""
    import megatron_tsync.runtime.tau2_tasks as tt
    from megatron_tsync.arguments import parse_args
    from megatron_tsync.runtime import preflight

    ns = tt.Tau2RLTask().make_environment().ns
    monkeypatch.setattr(tt, "trivial_tasks", lambda domain, split, solo=False, env=None: {
        t.id: "test" for t in ns.registry.get_tasks_loader(domain)(split)})
    with pytest.raises(ValueError, match=r"solves every τ² task of split 'train' .*mock 9/9.*--tau2-keep-trivial"):
        get_task(NAME + "mock-scripted", verifier="tau2").pool("train")
    cfg = parse_args(["--task", NAME + "mock-scripted", "--verifier", "tau2"])
    with pytest.raises(preflight.PreflightError, match="cannot read its prompts: .*--tau2-keep-trivial-tasks"):
        preflight._read_prompts(cfg, preflight._check_task(cfg))
    assert len(get_task(NAME + "mock-scripted", verifier="tau2", keep_trivial_tasks=True).tasks("train")) == 9


ALL_SPLITS = os.environ.get("TSYNC_TAU2_ALL_SPLITS") == "1"


def _only_these_tasks(monkeypatch, domain: str, tau2_split: str, ids: set[str]) -> None:
    """τ²'s task loader for ``domain`` / ``tau2_split`` returns only ``ids`` (in file order), and the process's
    do-nothing verdicts are forgotten, so the filter runs again over that subset."""
    import megatron_tsync.runtime.tau2_tasks as tt

    registry = tt.Tau2RLTask().make_environment().ns.registry  # τ² imported the way the trainer imports it
    real = registry.get_tasks_loader

    def loader(name):
        load = real(name)
        if name != domain:
            return load
        return lambda split=None, **kw: [t for t in load(split, **kw) if split != tau2_split or t.id in ids]

    monkeypatch.setattr(registry, "get_tasks_loader", loader)
    monkeypatch.setattr(tt, "_TRIVIAL", {})


@pytest.mark.slow
@pytest.mark.parametrize("domain,split", [
    ("airline", "train"), ("retail", "train"),
    # the test splits: the same check, ~35 CPU s more each; CI runs the train splits (TSYNC_TAU2_ALL_SPLITS=1: all)
    pytest.param("airline", "eval", marks=pytest.mark.skipif(not ALL_SPLITS, reason="TSYNC_TAU2_ALL_SPLITS=1")),
    pytest.param("retail", "eval", marks=pytest.mark.skipif(not ALL_SPLITS, reason="TSYNC_TAU2_ALL_SPLITS=1"))])
def test_do_nothing_solvable_tasks_of_airline_and_retail(domain, split, monkeypatch):
    """airline: 13 of 30 train (6 of 20 test) tasks, retail 5 of 74 (2 of 40): doing nothing scores 1.0 there
    (~1.5 / 0.7 CPU s per task: τ²'s evaluator parses the domain database twice per task); they are left out.
    The filter scores every task of the split, one by one, with the same code; CI runs it over 8 tasks of each train
    split (the first and last 2 solved ones, 4 others: ~10 CPU s instead of 46 each), ``TSYNC_TAU2_ALL_SPLITS=1``
    over every task of all four splits."""
    import megatron_tsync.runtime.tau2_tasks as tt
    from megatron_tsync.runtime.tau2_tasks import trivial_tasks

    tau2_split = {"train": "train", "eval": "test"}[split]
    solved = DO_NOTHING_SOLVED[(domain, tau2_split)]
    if not ALL_SPLITS:
        ids = [t.id for t in tt.Tau2RLTask().make_environment().ns.registry.get_tasks_loader(domain)(tau2_split)]
        order = sorted(solved, key=ids.index)
        keep = set(order[:2] + order[-2:]) | set([i for i in ids if i not in solved][:4])
        _only_these_tasks(monkeypatch, domain, tau2_split, keep)
        solved = solved & keep
    rl_task = get_task(NAME + domain + "-scripted", verifier="tau2")
    full = get_task(NAME + domain + "-scripted", verifier="tau2", keep_trivial_tasks=True)
    assert set(trivial_tasks(domain, tau2_split)) == solved
    assert [t.id for t in rl_task.tasks(split)] == [t.id for t in full.tasks(split) if t.id not in solved]
    keep = next(t.id for t in full.tasks(split) if t.id not in solved)
    for task_id, want in ((min(solved), 1.0), (keep, 0.0)):
        verdict, sim = _do_nothing(full, task_id, split)
        assert verdict.reward == sim.reward_info.reward == want, (task_id, verdict.reason, sim.reward_info)
