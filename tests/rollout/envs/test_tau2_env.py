"""τ²-bench as an environment (rollout/envs/tau2_env.py) on τ²'s own domains, tasks and evaluator, no model:

- replaying a task's gold actions through the environment scores 1.0 by τ²'s evaluator and a wrong action 0.0, for
  every mock task and the first 10 airline and 10 retail train tasks with a database write (scripted user), and the
  first 10 telecom train tasks (solo mode);
- the reward the environment reports equals what τ²'s own ``run_task`` (its orchestrator, user and evaluator, with a
  τ² agent replaying the same messages) returns, and the conversations are the same messages;
- τ²'s solo mode (mock; telecom, whose gold actions are the user's phone fixes, 10 tasks above): gold then ``done``
  scores 1.0; ending without ``done`` scores 0 (τ²: max_steps);
- turns without a usable call are error observations that add no τ² message.

The airline / retail / telecom gold-and-wrong check runs, in CI, the covering subset of those 10 tasks: the fewest of
them, in order, that use every write tool the 10 use and make every kind of last write (telecom: last fix) wrong
(airline 5, retail 3, telecom 5; each episode is ~1 CPU s of τ²'s evaluator). TSYNC_FULL_SWEEPS=1 runs all 10.

Needs the optional tau2 extra (tools/test.sh installs it).
"""

import asyncio
import os

import pytest

pytest.importorskip("tau2", reason="the optional tau2 extra is not installed")

from megatron_tsync.rollout.envs.base import run_scripted  # noqa: E402
from megatron_tsync.rollout.envs.tau2_env import DONE, RESPOND, gold_turns  # noqa: E402
from megatron_tsync.runtime.tasks import get_task  # noqa: E402

NAME = "megatron_tsync.runtime.tau2_tasks:"
# mock's update_task_with_history_and_env_assertions has no gold actions: its criterion is the environment assertion
# "task_2 is completed", whose one solution is this call
NO_GOLD = {"update_task_with_history_and_env_assertions": [("update_task_status",
                                                             {"task_id": "task_2", "status": "completed"})]}
# mock's create_task_1_nl_eval lists neither gold actions nor environment assertions: τ²'s EnvironmentEvaluator then
# returns 1.0 without comparing databases ("No expected actions or env assertions"), and its NL assertions are not
# in its reward basis, so no action can fail it: τ²'s evaluator gives a wrong action 1.0 too
WRONG_STILL_ONE = {"create_task_1_nl_eval"}


@pytest.fixture(scope="module")
def tau2_tasks():
    """Every task of each split (the environment's tests; the do-nothing filter is tests/runtime/test_tau2_tasks.py's)."""
    return {name: get_task(NAME + name, verifier="tau2", keep_trivial_tasks=True) for name in
            ("mock-scripted", "mock", "airline-scripted", "retail-scripted", "telecom")}


def _solution(task, solo=False) -> list[tuple[str, dict]]:
    if task.id in NO_GOLD:
        return NO_GOLD[task.id] + [(RESPOND, {"content": "Done."})]
    return gold_turns(task, solo)


def _writes(rl_task, task) -> list[int]:
    """Indices of the solution's database writes (τ²'s tool types)."""
    env = rl_task.make_environment().reference(rl_task.domain)
    return [i for i, (name, _) in enumerate(_solution(task))
            if env.tools.has_tool(name) and env.tools.tool_type(name).value == "write"]


def _wrong(rl_task, task) -> list[tuple[str, dict]]:
    """The solution with its last write made wrong: mock: a valid write with another value (the other status, a
    wrong title), airline/retail: the first string argument not an existing id (τ² answers with an error, the write
    does not happen); a solution without writes gets an extra mock task. Telecom (solo): the last fix (a toggle on
    the user's phone, without arguments) is left out."""
    if rl_task.user_mode == "solo" and rl_task.domain == "telecom":
        turns = _solution(task, solo=True)
        return turns[:-2] + turns[-1:]
    turns = [(n, dict(a)) for n, a in _solution(task)]
    writes = _writes(rl_task, task)
    if not writes:
        return [("create_task", {"user_id": "user_1", "title": "Wrong task"})] + turns
    name, args = turns[writes[-1]]
    if name == "update_task_status":
        args["status"] = "pending" if args["status"] == "completed" else "completed"
    elif name == "create_task":
        args["title"] += " (wrong)"
    else:
        key = next(k for k, v in args.items() if isinstance(v, str))
        args[key] += "_wrong"
    return turns


def _run(rl_task, task, turns):
    env = rl_task.make_environment()
    inst = rl_task.instance(task, "train")
    return asyncio.run(run_scripted(env, inst.meta["env_task"], env.render_turns(turns)))


def _cases(rl_task, limit):
    tasks = rl_task.tasks("train")
    if limit is None:
        return tasks
    if rl_task.domain == "telecom":
        return [t for t in tasks if t.evaluation_criteria.actions][:limit]
    return [t for t in tasks if _writes(rl_task, t)][:limit]


def _kinds(rl_task, task) -> set:
    """What a case exercises: the write tools of its solution and the tool of the write (telecom: the fix) that
    :func:`_wrong` changes."""
    if rl_task.domain == "telecom":
        return {("last", _solution(task, solo=True)[-2][0])}
    turns, writes = _solution(task), _writes(rl_task, task)
    return {("write", turns[i][0]) for i in writes} | {("last", turns[writes[-1]][0])}


def _covering(rl_task, cases):
    """The cases, in order, that add a kind the ones before did not have (all of them with TSYNC_FULL_SWEEPS=1)."""
    if os.environ.get("TSYNC_FULL_SWEEPS", "") not in ("", "0"):
        return cases
    seen, out = set(), []
    for t in cases:
        if not _kinds(rl_task, t) <= seen:
            seen |= _kinds(rl_task, t)
            out.append(t)
    return out


@pytest.mark.parametrize("name,limit", [("mock-scripted", None),
                                        pytest.param("airline-scripted", 10, marks=pytest.mark.slow),  # 5 in CI
                                        pytest.param("retail-scripted", 10, marks=pytest.mark.slow),  # 3 in CI
                                        pytest.param("telecom", 10, marks=pytest.mark.slow)])  # 5 in CI
def test_gold_actions_score_one_and_a_wrong_action_zero(tau2_tasks, name, limit):
    rl_task = tau2_tasks[name]
    solo = rl_task.user_mode == "solo"
    cases = _cases(rl_task, limit)
    assert len(cases) == (9 if limit is None else limit)
    if limit is not None:  # every kind of the `limit` tasks, in CI through the fewest of them
        every = set().union(*(_kinds(rl_task, t) for t in cases))
        cases = _covering(rl_task, cases)
        assert set().union(*(_kinds(rl_task, t) for t in cases)) == every
    for task in cases:
        verdict, obs = _run(rl_task, task, _solution(task, solo))
        assert verdict.reward == 1.0, (task.id, verdict.reason, [o.text[:300] for o in obs])
        assert obs[-1].done and ("agent_stop" if solo else "user_stop") in verdict.reason  # done / user ###STOP###
        verdict, obs = _run(rl_task, task, _wrong(rl_task, task))
        if task.id in WRONG_STILL_ONE:
            assert verdict.reward == 1.0
            continue
        assert verdict.reward == 0.0, (task.id, verdict.reason)
        assert "': 0.0" in verdict.reason.split("breakdown")[1]  # a τ² criterion failed (DB / env assertion)


def _tau2_message(ns, i, name, args, solo):
    """Turn ``i`` as τ²'s own agent would send it (independent of the environment's mapping); made when sent (τ²
    orders a trajectory by the messages' timestamps)."""
    m = ns.message
    if name == RESPOND and not solo:
        return m.AssistantMessage(role="assistant", content=args["content"])
    return m.AssistantMessage(role="assistant", tool_calls=[m.ToolCall(id=f"call_{i}", name=name, arguments=args)])


def _tau2_run_task(rl_task, task, turns, opening):
    """τ²'s run_task with τ² agent / user classes that replay ``turns`` and the scripted user's lines."""
    from tau2.run import run_task

    ns = rl_task.make_environment().ns
    solo = rl_task.user_mode == "solo"
    script = list(enumerate(turns))
    base = ns.llm_agent.LLMSoloAgent if solo else ns.llm_agent.LLMAgent

    class Replay(base):
        def generate_next_message(self, message, state):
            i, (name, args) = script.pop(0)
            msg = _tau2_message(ns, i, name, args, solo)
            if solo:
                msg = self._check_if_stop_toolcall(msg)
            return msg, state

    class Scripted(ns.user_simulator.UserSimulator):
        lines = [opening]

        def generate_next_message(self, message, state):
            text = self.lines.pop(0) if self.lines else "###STOP###"
            return ns.message.UserMessage(role="user", content=text), state

    reg = ns.registry
    reg._agents.pop("tsync_replay", None), reg._users.pop("tsync_scripted", None)
    reg.register_agent(Replay, "tsync_replay")
    reg.register_user(ns.user_simulator.DummyUser if solo else Scripted, "tsync_scripted")
    return run_task(rl_task.domain, task, agent="tsync_replay", user="tsync_scripted", max_steps=200)


def _same(ours, theirs):
    def key(msg):
        calls = [(c.name, c.arguments, c.requestor) for c in (getattr(msg, "tool_calls", None) or [])]
        return msg.role, msg.content, calls, getattr(msg, "error", None)

    assert [key(m) for m in ours] == [key(m) for m in theirs]


@pytest.mark.parametrize("name,index", [("mock-scripted", 0), ("mock-scripted", 5),
                                        pytest.param("airline-scripted", 0, marks=pytest.mark.slow),  # ~24 s
                                        pytest.param("retail-scripted", 0, marks=pytest.mark.slow),
                                        ("mock", 0), ("telecom", 0)])
def test_reward_equals_tau2s_own_run_and_evaluation(tau2_tasks, name, index):
    rl_task = tau2_tasks[name]
    env = rl_task.make_environment()
    task = _cases(rl_task, None if name.startswith("mock") else 1)[index]
    wrong = _wrong(rl_task, task)
    solo = rl_task.user_mode == "solo"
    inst = rl_task.instance(task, "train")
    silent = _solution(task)[:-1] + [(RESPOND, {"content": "Done."})]  # the information is not communicated
    rewards = []
    for turns in (_solution(task, solo), wrong) + (() if solo else (silent,)):
        if solo:
            turns = [t for t in turns if t[0] != RESPOND and t[0] != DONE] + [(DONE, {})]

        async def episode():
            ep = await env.start(inst.meta["env_task"])
            for text in env.render_turns(turns):
                if (await ep.step(text)).done:
                    break
            return ep, await ep.finish()

        ep, verdict = asyncio.run(episode())
        sim = _tau2_run_task(rl_task, task, turns, inst.meta["env_task"].opening)
        assert verdict.reward == sim.reward_info.reward, (task.id, turns, verdict.reason, sim.reward_info)
        assert ep.simulation().termination_reason == sim.termination_reason
        _same(ep.orch.get_trajectory(), sim.messages)
        rewards.append(verdict.reward)
    assert rewards[:2] == [1.0, 0.0]  # the comparison sees both outcomes


def test_solo_mode(tau2_tasks):
    rl_task = tau2_tasks["mock"]
    tasks = rl_task.tasks("train")
    assert {t.id for t in tasks} == {"create_task_1", "create_task_1_with_env_assertions", "update_task_1",
                                     "update_task_with_initialization_data", "update_task_with_initialization_actions",
                                     "impossible_task_1"}  # τ²'s LLMSoloAgent.check_valid_task
    inst = rl_task.instance(tasks[0], "train")
    assert "<ticket>" in inst.prompt_text and "- done:" in inst.prompt_text and RESPOND not in inst.prompt_text
    solved = [t for t in tasks if not t.evaluation_criteria.communicate_info]  # no user to communicate with
    assert len(solved) == 5
    for task in solved:
        turns = gold_turns(task, solo=True)
        assert turns[-1] == (DONE, {})
        verdict, obs = _run(rl_task, task, turns)
        assert verdict.reward == 1.0 and obs[-1].done and "agent_stop" in verdict.reason, (task.id, verdict.reason)
        verdict, obs = _run(rl_task, task, turns[:-1])  # the agent loop ends it: no stop
        assert verdict.reward == 0.0 and "max_steps" in verdict.reason


def test_unusable_turns_are_error_observations(tau2_tasks):
    rl_task = tau2_tasks["mock-scripted"]
    env = rl_task.make_environment()
    task = rl_task.tasks("train")[0]
    inst = rl_task.instance(task, "train")
    assert inst.prompt_text.endswith(f"user: {inst.meta['env_task'].opening}\n")

    async def episode():
        ep = await env.start(inst.meta["env_task"])
        n = len(ep.orch.trajectory)
        bad = [await ep.step("no call here"), await ep.step('<tool>respond: {"content": 3}</tool>'),
               await ep.step("<tool>create_task: {not json</tool>")]
        assert len(ep.orch.trajectory) == n  # no τ² message
        unknown = await ep.step('<tool>no_such_tool: {"a": 1}</tool>')  # a τ² tool error: τ² counts it
        return ep, bad, unknown

    ep, bad, unknown = asyncio.run(episode())
    assert all(not o.ok and not o.done and o.text.startswith("<result>error: ") for o in bad)
    assert not unknown.ok and ep.orch.num_errors == 1 and ep.orch.trajectory[-1].error


def test_qwen_tool_format(tau2_tasks):
    """The Qwen format: ChatML prompt (τ²'s system prompt, the tools as JSON schemas, greeting and opening turns,
    an open assistant turn) and a gold replay through ``<tool_call>`` turns scores 1.0."""
    from megatron_tsync.runtime.tau2_tasks import Tau2RLTask

    rl_task = Tau2RLTask(domain="mock", user_mode="scripted", tool_format="qwen", name="mock-scripted")
    task = rl_task.tasks("train")[0]
    inst = rl_task.instance(task, "train")
    p = inst.prompt_text
    assert p.startswith("<|im_start|>system\n<instructions>") and p.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert '{"type": "function", "function": {"name": "respond"' in p and "<|im_start|>user\n" in p
    verdict, obs = _run(rl_task, task, _solution(task))
    assert verdict.reward == 1.0 and obs[0].text.startswith("<|im_end|>\n<|im_start|>user\n<tool_response>")


@pytest.mark.slow
def test_llm_user_served_by_this_projects_endpoint(megatron_single, tiny_dir):
    """User simulator (b): τ²'s own UserSimulator through litellm (τ²'s LLM configuration: model ``openai/NAME``,
    ``api_base``) against this project's OpenAI-compatible endpoint serving the tiny model. The tiny model's words
    are noise; the point is the path: the opening and the user's replies come from the served model."""
    from transformers import AutoTokenizer

    from megatron_tsync.rollout.embedded_engine import EmbeddedEngine
    from megatron_tsync.rollout.engine import SamplingConfig
    from megatron_tsync.rollout.envs.tool_format import escape_output
    from megatron_tsync.rollout.openai_server import ChatServer
    from megatron_tsync.runtime.tau2_tasks import Tau2RLTask

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    eos = tok.eos_token_id
    engine = EmbeddedEngine.from_hf_dir(tiny_dir, detokenize=tok.decode)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=12, stop_token_ids=(eos,), seed=0)
    with ChatServer.from_hf_dir(engine, tiny_dir, sampling=sampling, model_name="tiny") as srv:
        rl_task = Tau2RLTask(domain="mock", user_mode="llm", user_llm="openai/tiny", name="mock-llm",
                             user_llm_args={"api_base": srv.url, "api_key": "EMPTY"})
        inst = rl_task.sample_prompts(0, 1, seed=0)[0]
        opening = inst.meta["env_task"].opening
        assert isinstance(opening, str) and inst.prompt_text.endswith(f"user: {escape_output(opening)}\n")
        assert rl_task.sample_prompts(0, 1, seed=0)[0].prompt_text == inst.prompt_text  # cached per prompt
        env = rl_task.make_environment()

        async def episode():
            ep = await env.start(inst.meta["env_task"])
            obs = await ep.step('<tool>respond: {"content": "Which task should I create?"}</tool>')
            return ep, obs, await ep.finish()

        ep, obs, verdict = asyncio.run(episode())
    said = [m for m in ep.orch.trajectory if m.role == "user"]
    assert said[0].content == opening and len(said) == 2  # the opening, then the served model's reply
    assert obs.ok and obs.text == env.format.render_result(said[1].content)  # markup in it escaped
    assert verdict.reward in (0.0, 1.0) and "tau2 mock/" in verdict.reason  # τ²'s evaluator on the episode
