"""Workspace episodes: the workspace persists across turns (an edit in turn 1 is visible in turn 3), two
trajectories never see each other's files, and many episodes leave no workspace, process or uid behind."""

from __future__ import annotations

import asyncio
import os

import pytest

from megatron_tsync.rollout.envs.swe_lite import generate_task
from megatron_tsync.rollout.sandbox import open_workspaces, uids_in_use

pytestmark = pytest.mark.timeout(300)
TASK = generate_task(0, 1)


def call(env, name, **args):
    return env.format.render_call(name, args)


def test_edit_in_turn_1_is_visible_in_turn_3(swe_env):
    async def go():
        ep = await swe_env.start(TASK)
        try:
            o1 = await ep.step(call(swe_env, "edit", path="notes.txt", old_str="", new_str="remember 42\n"))
            o2 = await ep.step(call(swe_env, "bash", command="echo second >> notes.txt"))
            o3 = await ep.step(call(swe_env, "view", path="notes.txt"))
            return o1, o2, o3
        finally:
            ep.close()

    o1, o2, o3 = asyncio.run(go())
    assert o1.ok and o2.ok and "remember 42" in o3.text and "second" in o3.text, (o1, o2, o3)


def test_tools_report_errors_to_the_agent(swe_env):
    async def go():
        ep = await swe_env.start(TASK)
        try:
            return [await ep.step(a) for a in (
                call(swe_env, "edit", path="README.md", old_str="no such text", new_str="x"),
                call(swe_env, "view", path="missing.py"), call(swe_env, "frobnicate"),
                call(swe_env, "bash", command="exit 3"), "just thinking, no call")]
        finally:
            ep.close()

    obs = asyncio.run(go())
    assert [o.ok for o in obs] == [False] * 5
    assert "occurs 0 times" in obs[0].text and "unknown tool" in obs[2].text and "exit code 3" in obs[3].text
    assert "no tool call" in obs[4].text


def test_two_trajectories_never_see_each_others_files(swe_env):
    for what in ("uid", "filesystem"):  # what isolates workspaces; a machine without them says so and skips
        e = swe_env.sandbox.enforcement()[what]
        if not e["enforced"]:
            pytest.skip(f"{what} not enforced on this machine: {e['how']}")
    async def go():
        a, b = await swe_env.start(TASK), await swe_env.start(TASK)
        try:
            await a.step(call(swe_env, "bash", command="echo secret-of-a > secret.txt"))
            own = await a.step(call(swe_env, "bash", command="cat secret.txt"))
            spy = await b.step(call(swe_env, "bash", command=f"cat {a.ws.path}/secret.txt; ls {a.ws.path}; "
                                                             f"cat secret.txt; ls -a {os.path.dirname(a.ws.path)}"))
            assert "secret-of-a" in own.text  # control: the owner reads it
            return a.ws.path, b.ws.path, spy
        finally:
            a.close()
            b.close()

    pa, pb, spy = asyncio.run(go())
    assert pa != pb and "secret-of-a" not in spy.text, spy
    listed = {line.strip() for line in spy.text.replace("</result>", "\n").splitlines()}
    assert os.path.basename(pb) in listed and os.path.basename(pa) not in listed, spy  # a's dir is not even listed
    assert not os.path.exists(pa) and not os.path.exists(pb)


@pytest.mark.slow
def test_1000_episodes_leave_nothing_behind(env_sandbox):
    """1,000 short episodes (8 at a time, each writes a file and runs a process that tries to outlive it): no
    workspace, no uid, no process is left."""
    from megatron_tsync.rollout.envs.workspace_env import WorkspaceEnv, WorkspaceTask

    env = WorkspaceEnv(sandbox=env_sandbox)
    task = WorkspaceTask("leak", "x", files={"a.txt": "a\n"})
    before_ws, before_uids = len(open_workspaces()), set(uids_in_use())

    async def one(sem):
        async with sem:
            ep = await env.start(task)
            try:
                await ep.step(call(env, "bash", command="(sleep 300 &) ; echo x > b.txt"))
                return ep.ws.path
            finally:
                ep.close()

    async def main():
        sem = asyncio.Semaphore(8)
        return await asyncio.gather(*(one(sem) for _ in range(1000)))

    paths = asyncio.run(main())
    assert len(set(paths)) >= 8 and not any(os.path.exists(p) for p in paths)
    assert len(open_workspaces()) == before_ws and set(uids_in_use()) == before_uids
    from tests.rollout.envs.test_verifier import _sandbox_processes

    assert _sandbox_processes() == []


def test_the_generators_source_is_hidden_from_the_agent(swe_env):
    """The template library holds every correct function: the agent's calls see an empty package directory."""
    import megatron_tsync

    if not swe_env.sandbox.enforcement()["filesystem"]["enforced"]:
        pytest.skip("no mount namespace on this machine")
    src = os.path.join(os.path.dirname(megatron_tsync.__file__), "rollout", "envs", "swe_lite_templates.py")
    assert os.path.isfile(src)  # control: it is there on the host

    async def go():
        ep = await swe_env.start(TASK)
        try:
            return await ep.step(call(swe_env, "bash", command=f"cat {src}")), await ep.step(call(swe_env, "view",
                                                                                                  path=src))
        finally:
            ep.close()

    for obs in asyncio.run(go()):
        assert not obs.ok and "correct source" not in obs.text, obs


def test_loaded_tasks_without_a_value_check_or_a_reference_are_refused(swe_env):
    """A loaded task is verifiable only with its reference solution (it pins the expected values) and a value check
    in each FAIL_TO_PASS test; otherwise a clear error, and the episode's verdict says so (reward 0)."""
    from megatron_tsync.rollout.envs.probes import Expect
    from megatron_tsync.rollout.envs.workspace_env import WorkspaceTask, select_expected

    task = WorkspaceTask("t", "fix it", test_files={"tests/test_a.py": "def test_x():\n    assert f()\n"},
                         must_pass=("tests/test_a.py::test_x", "tests/test_a.py::test_y"),
                         need_strong=("tests/test_a.py::test_x",))
    with pytest.raises(ValueError, match="reference solution"):
        swe_env.test_spec(task)
    weak = {"tests/test_a.py::test_x": (Expect("s", pinned=True),), "tests/test_a.py::test_y": (Expect("s", 7),)}
    with pytest.raises(ValueError, match="test_x has no value check"):
        select_expected(task, weak)
    strong = {**weak, "tests/test_a.py::test_x[1]": (Expect("s", pinned=[3]),), "tests/test_b.py::test_z": ()}
    assert set(select_expected(task, strong)) == {"tests/test_a.py::test_x", "tests/test_a.py::test_x[1]",
                                                   "tests/test_a.py::test_y"}
    with pytest.raises(ValueError, match="report no probes"):
        select_expected(WorkspaceTask("t", "x", must_pass=("tests/test_c.py",)), strong)
