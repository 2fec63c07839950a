"""terminal-lite: >= 100 distinct tasks by seed over 9 families; the known solution scores 1 and doing nothing 0
(one task per family in the fast tier; in the slow tier a second task of every family, other random data, both
policies in one pass, with the latency figures printed).

TSYNC_FULL_SWEEPS=1 makes the slow-tier sweep run all 100 tasks (200 episodes) instead of CI's 9."""

from __future__ import annotations

import time

import pytest

from megatron_tsync.rollout.envs.terminal_lite import FAMILIES, generate_task, generate_tasks
from tests.rollout.envs.suite_helpers import do_nothing, full_sweeps, known_fix, latency_line, run_policies, run_policy

pytestmark = pytest.mark.timeout(1800)


def test_generates_100_distinct_deterministic_tasks():
    t0 = time.perf_counter()
    tasks = generate_tasks(3, 100)
    rate = len(tasks) / (time.perf_counter() - t0)
    assert len({(repr(sorted(t.files.items())), t.instruction) for t in tasks}) == 100
    assert {t.meta["family"] for t in tasks} == set(FAMILIES)
    assert [t.checks for t in generate_tasks(3, 5)] == [t.checks for t in tasks[:5]]
    assert generate_tasks(4, 1)[0].checks != tasks[0].checks  # control: another seed
    print(f"terminal-lite: {rate:.0f} tasks generated per second")


def test_known_solution_scores_1_and_nothing_scores_0_fast_subset(terminal_env):
    tasks = [generate_task(0, i) for i in range(len(FAMILIES))]
    out = run_policies(terminal_env, tasks, [known_fix, do_nothing])  # both policies in one pass
    good, bad = out[known_fix], out[do_nothing]
    assert [v.reward for _, v, _ in good] == [1.0] * len(tasks), [(t.task_id, v.reason) for t, v, _ in good]
    assert [v.reward for _, v, _ in bad] == [0.0] * len(tasks), [(t.task_id, v.reason) for t, v, _ in bad]


def test_a_script_is_checked_on_hidden_inputs(terminal_env):
    """A script that prints the right answer for the visible sample only fails."""
    task = next(generate_task(0, i) for i in range(9, 40) if generate_task(0, i).meta["family"] == "script-words")
    name = task.instruction.split("`")[1]
    cheat = terminal_env.format.render_call("bash", {"command": f"mkdir -p bin && echo 'echo 4' > {name}"})
    assert run_policy(terminal_env, [task], lambda e, t: [cheat])[0][1].reward == 0.0
    assert run_policy(terminal_env, [task], known_fix)[0][1].reward == 1.0


@pytest.mark.slow
def test_known_solution_scores_1_and_nothing_scores_0_on_every_family(terminal_env):
    # tasks cycle through the families (task i is family i % 9): 9..17 is every family again, after the fast tier's
    tasks = generate_tasks(0, 100) if full_sweeps() else [generate_task(0, i) for i in range(9, 9 + len(FAMILIES))]
    assert {t.meta["family"] for t in tasks} == set(FAMILIES)
    out = run_policies(terminal_env, tasks, [known_fix, do_nothing])
    good, bad = out[known_fix], out[do_nothing]
    assert [t.task_id for t, v, _ in good if v.reward != 1.0] == []
    assert [t.task_id for t, v, _ in bad if v.reward != 0.0] == []
    print(latency_line("terminal-lite known solution", good))
    print(latency_line("terminal-lite do nothing", bad))
