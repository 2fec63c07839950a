"""τ²-bench domains as RL tasks (``rollout/envs/tau2_env.py``; needs the optional ``tau2`` extra).

``--task megatron_tsync.runtime.tau2_tasks:NAME`` with NAME one of

- ``mock``: τ²'s mock domain in τ²'s solo mode (no user: the ticket is in the system prompt, ``done`` ends it);
- ``mock-scripted``, ``airline-scripted``, ``retail-scripted``: a scripted user (tests, smoke runs): the opening is
  the task's reason for the call and what the user knows, every later reply is ``###STOP###``;
- ``airline``, ``retail``, ``mock-llm``: τ²'s LLM user simulator (``UserSimulator``, litellm) on a second model:
  ``TSYNC_TAU2_USER_LLM`` (litellm model name, e.g. ``openai/Qwen3-8B`` for an OpenAI-compatible server) and
  ``TSYNC_TAU2_USER_API_BASE`` (e.g. ``http://usernode:8000/v1``, this project's endpoint or vLLM's);
  ``TSYNC_TAU2_USER_TEMPERATURE`` (default 0);
- ``telecom``: τ²'s telecom domain in solo mode (the agent also has the user's device tools);
- ``airline-retail`` (LLM user), ``airline-retail-scripted``: both domains' tasks in one pool (the GPU recipe).

``TSYNC_TAU2_TOOL_FORMAT`` picks the tool format ("tag" default, "qwen" for Qwen models). Splits are τ²'s own
``split_tasks.json``: our ``train`` is τ²'s ``train``, ``eval`` is τ²'s ``test`` (mock has only ``base``: both
splits are its 9 tasks, so its held-out evaluation is not held out). Solo mode keeps the tasks τ²'s
``LLMSoloAgent.check_valid_task`` accepts. Group ``g`` of step ``k`` draws ``pool[mix(seed, split, k, g) mod n]``.

The opening (the user's first message, after τ²'s greeting) is part of the prompt, which the group's trajectories
share: a scripted opening is fixed; an LLM user's opening is generated once per (split, task, step, group) in this
process by τ²'s own user simulator (temperature 0 by default) and cached; the rest of each conversation is per
trajectory. The reward is τ²'s evaluator's: binary 0/1.

Tasks that reward doing nothing are left out of both splits: when a split's pool is built, each task is tried with
the do-nothing conversation (``tau2_env.do_nothing_turns``: no tool call, one closing message; solo: ``done``) under
τ²'s evaluator, with a scripted or solo user whatever the task's user is (no model is called); a task it scores
1.0 (the gold changes nothing and communicates nothing) teaches nothing and makes held-out success meaningless.
``keep_trivial_tasks`` (``--tau2-keep-trivial-tasks``) keeps them. The check runs once per process and (domain,
τ² split, solo) (:func:`trivial_tasks`), and one ``[tsync]`` line per split names the counts per domain.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from typing import Any

from megatron_tsync.algorithms.streamability import RewardSpec
from megatron_tsync.runtime.tasks import TaskInstance, _mix, register_task

__all__ = ["Tau2RLTask", "trivial_tasks"]

_SPLITS = {"train": 0, "eval": 1}
_TAU2_SPLIT = {"train": "train", "eval": "test"}


@dataclasses.dataclass(frozen=True)
class Tau2RLTask:
    """A τ² domain as a task (see the module docstring)."""

    domain: str = "mock"
    user_mode: str = "solo"
    tool_format: str = "tag"
    user_llm: str | None = None
    user_llm_args: dict = dataclasses.field(default_factory=dict)
    verifier: str = "tau2"
    verifier_kwargs: dict = dataclasses.field(default_factory=dict)
    name: str = "mock"
    keep_trivial_tasks: bool = False
    """Keep the tasks a do-nothing conversation solves (:func:`trivial_tasks`); default: left out of both splits."""

    def __post_init__(self):
        if self.verifier != "tau2":
            raise ValueError(f"task {self.name}: the reward is τ²'s own evaluator: --verifier must be 'tau2', got "
                             f"{self.verifier!r}")
        if self.tool_format not in ("tag", "qwen"):
            raise ValueError(f"tool_format must be 'tag' or 'qwen', got {self.tool_format!r}")
        if self.user_mode == "llm" and not self.user_llm:
            raise ValueError(f"task {self.name}: τ²'s LLM user simulator needs TSYNC_TAU2_USER_LLM (a litellm model "
                             "name, e.g. openai/Qwen3-8B) and TSYNC_TAU2_USER_API_BASE (its OpenAI-compatible URL)")
        object.__setattr__(self, "_cache", {})

    @property
    def reward_spec(self) -> RewardSpec:
        return RewardSpec.binary(0.0, 1.0)

    @property
    def tool_stop_text(self) -> str:
        from megatron_tsync.rollout.envs.tool_format import get_tool_format

        return get_tool_format(self.tool_format).stop_text

    def user_config(self):
        from megatron_tsync.rollout.envs.tau2_env import Tau2UserConfig

        return Tau2UserConfig(mode=self.user_mode, llm=self.user_llm, llm_args=dict(self.user_llm_args) or None)

    def make_environment(self, sandbox=None, *, delay_fn=None) -> Any:
        """τ²'s tools run in this process on the episode's in-memory database (no sandbox: ``tau2_env``'s
        docstring says why); ``delay_fn`` is not applied."""
        from megatron_tsync.rollout.envs.tau2_env import Tau2Env

        if "env" not in self._cache:
            self._cache["env"] = Tau2Env(user=self.user_config(), tool_format=self.tool_format)
        return self._cache["env"]

    @property
    def domains(self) -> tuple[str, ...]:
        return tuple(self.domain.split("+"))

    def pool(self, split: str) -> list[tuple[str, Any]]:
        """(domain, τ² task) of ``split`` (ours: "train" / "eval"), the domains in order, each in τ²'s file order,
        without the tasks a do-nothing conversation solves unless ``keep_trivial_tasks``."""
        if split not in _SPLITS:
            raise ValueError(f"split must be one of {sorted(_SPLITS)}, got {split!r}")
        key = ("pool", split)
        if key not in self._cache:
            env = self.make_environment()
            solo = self.user_mode == "solo"
            pool, excluded, t0 = [], {}, time.perf_counter()
            for domain in self.domains:
                tau2_split = "base" if domain == "mock" else _TAU2_SPLIT[split]
                tasks = env.ns.registry.get_tasks_loader(domain)(tau2_split)
                if solo:
                    tasks = [t for t in tasks if env.ns.llm_agent.LLMSoloAgent.check_valid_task(t)]
                if not self.keep_trivial_tasks:
                    trivial = trivial_tasks(domain, tau2_split, solo=solo,
                                            env=None if self.user_mode == "llm" else env)
                    excluded[domain] = (sum(t.id in trivial for t in tasks), len(tasks))
                    tasks = [t for t in tasks if t.id not in trivial]
                pool += [(domain, t) for t in tasks]
            _report(self.name, split, excluded, time.perf_counter() - t0, self.keep_trivial_tasks)
            if not pool and excluded:
                raise ValueError(f"task {self.name}: a do-nothing conversation solves every τ² task of split "
                                 f"{split!r} (τ²'s evaluator scores it 1.0: {_counts(excluded)}), so nothing is left "
                                 "to learn or measure; pass --tau2-keep-trivial-tasks to use them anyway")
            if not pool:
                raise ValueError(f"task {self.name}: no τ² tasks in split {split!r}")
            self._cache[key] = pool
        return self._cache[key]

    def tasks(self, split: str) -> list:
        """τ²'s tasks of ``split`` (one domain)."""
        if len(self.domains) != 1:
            raise ValueError(f"task {self.name} has several domains: use pool()")
        return [t for _, t in self.pool(split)]

    def opening(self, domain: str, task, key: tuple) -> str | None:
        """The user's words before the agent's first turn (``Tau2Env.opening``): fixed for a scripted user; an LLM
        user's are generated once per ``key`` (split, task, step, group) and cached."""
        if self.user_mode == "solo":
            return None
        key = ("opening", domain, task.id) if self.user_mode == "scripted" else ("opening", domain, *key)
        if key not in self._cache:
            self._cache[key] = self.make_environment().opening(domain, task)
        return self._cache[key]

    def instance(self, task, split: str, step: int = 0, group: int = 0, domain: str | None = None) -> TaskInstance:
        from megatron_tsync.rollout.envs.tau2_env import Tau2Task

        domain = domain or self.domains[0]
        t = Tau2Task(domain, task, self.opening(domain, task, (split, task.id, step, group)))
        return TaskInstance(self.make_environment().prompt(t), None, {"env_task": t, "task_id": f"{domain}/{task.id}",
                                                                     "step": step, "group": group, "split": split})

    def sample_prompts(self, step: int, num_groups: int, seed: int, *, split: str = "train") -> list[TaskInstance]:
        pool = self.pool(split)
        out = []
        for g in range(num_groups):
            domain, task = pool[_mix(seed, _SPLITS[split], step, g) % len(pool)]
            out.append(self.instance(task, split, step, g, domain))
        return out

    def demonstration_segments(self, inst: TaskInstance) -> list[tuple[str, bool]]:
        """The gold actions (then ``respond`` with the information to communicate; solo: ``done``) with τ²'s
        observations, as a scripted user's episode produces them."""
        import asyncio

        from megatron_tsync.rollout.envs.tau2_env import gold_turns

        env = self.make_environment()
        turns = gold_turns(inst.meta["env_task"].task, solo=self.user_mode == "solo")

        async def run():
            ep = await env.start(inst.meta["env_task"])
            segs = [(ep.prompt, False)]
            for name, args in turns:
                text = env.format.render_call(name, args)
                obs = await ep.step(text)
                segs += [(text, True), (obs.text, False)]
                if obs.done:
                    break
            return segs

        return asyncio.run(run())

    def demonstration(self, inst: TaskInstance) -> str:
        return "".join(text for text, _ in self.demonstration_segments(inst))


_TRIVIAL: dict[tuple[str, str, bool], dict[str, str]] = {}
_TRIVIAL_LOCK = threading.Lock()
_REPORTED: set[tuple[str, str, bool]] = set()


def trivial_tasks(domain: str, tau2_split: str, *, solo: bool = False, env=None) -> dict[str, str]:
    """{task id: reason} of the tasks of τ²'s ``domain`` / ``tau2_split`` ("train", "test", "base") whose
    do-nothing conversation (``tau2_env.do_nothing_reward``) τ²'s evaluator scores 1.0 (the reward's top), with
    the scripted user (``solo``: τ²'s solo mode, on the tasks its solo agent accepts). No model is called. Computed
    once per process per (domain, split, solo). ``env``: a ``Tau2Env`` of that user to run it in (its reference
    databases reused); None: a scripted / solo one made for the check."""
    from megatron_tsync.rollout.envs.tau2_env import Tau2Env, Tau2UserConfig, do_nothing_reward

    key = (domain, tau2_split, solo)
    with _TRIVIAL_LOCK:
        if key not in _TRIVIAL:
            mode = "solo" if solo else "scripted"
            if env is None or env.user.mode != mode:
                env = Tau2Env(user=Tau2UserConfig(mode=mode))
            tasks = env.ns.registry.get_tasks_loader(domain)(tau2_split)
            if solo:
                tasks = [t for t in tasks if env.ns.llm_agent.LLMSoloAgent.check_valid_task(t)]
            out = {}
            for task in tasks:
                reward, why = do_nothing_reward(env, domain, task)
                if reward >= 1.0:
                    out[task.id] = (f"do-nothing conversation scores {reward:g} ({why}); "
                                    f"{_criteria(task, env.reference(domain))}")
            _TRIVIAL[key] = out
        return dict(_TRIVIAL[key])


def _criteria(task, environment) -> str:
    """What the task's reward checks, in words (why doing nothing passes it); ``environment``: τ²'s, whose tool
    types say which gold actions write."""
    crit = task.evaluation_criteria
    if crit is None:
        return "no evaluation criteria"
    basis = "+".join(str(getattr(b, "value", b)) for b in crit.reward_basis)
    tools = [t for t in (environment.tools, environment.user_tools) if t is not None]
    writes = [a for a in crit.actions or [] if any(
        t.has_tool(a.name) and t.tool_type(a.name).value == "write" for t in tools)]
    return (f"reward basis {basis}; {len(crit.actions or [])} gold actions ({len(writes)} writes), "
            f"{len(crit.env_assertions or [])} env assertions, {len(crit.communicate_info or [])} facts to "
            "communicate")


def _counts(excluded: dict) -> str:
    return ", ".join(f"{d} {n}/{total}" for d, (n, total) in excluded.items())


def _report(name: str, split: str, excluded: dict, seconds: float, kept: bool) -> None:
    """One ``[tsync]`` line per (task, split, setting) and process (rank 0 of a launcher; each rollout worker)."""
    from megatron_tsync.model.launcher import launcher_env

    key = (name, split, kept)
    if key in _REPORTED or launcher_env()[0] != 0:
        return
    _REPORTED.add(key)
    if kept:
        print(f"[tsync] τ² {name} {split}: tasks a do-nothing conversation solves are kept "
              "(--tau2-keep-trivial-tasks; not checked)", flush=True)
        return
    n = sum(k for k, _ in excluded.values())
    print(f"[tsync] τ² {name} {split}: excluded {n} tasks a do-nothing conversation solves (τ²'s evaluator: 1.0): "
          f"{_counts(excluded)}; checked in {seconds:.1f} s; --tau2-keep-trivial-tasks keeps them", flush=True)


def _env_kwargs(user_mode: str) -> dict:
    kw: dict = {"user_mode": user_mode, "tool_format": os.environ.get("TSYNC_TAU2_TOOL_FORMAT", "tag")}
    if user_mode == "llm":
        kw["user_llm"] = os.environ.get("TSYNC_TAU2_USER_LLM") or None
        args = {"temperature": float(os.environ.get("TSYNC_TAU2_USER_TEMPERATURE", "0"))}
        if os.environ.get("TSYNC_TAU2_USER_API_BASE"):
            args["api_base"] = os.environ["TSYNC_TAU2_USER_API_BASE"]
            args.setdefault("api_key", os.environ.get("TSYNC_TAU2_USER_API_KEY", "EMPTY"))
        kw["user_llm_args"] = args
    return kw


def _register(name: str, domain: str, user_mode: str) -> None:
    @register_task(name)
    def _factory(**kwargs) -> Tau2RLTask:
        return Tau2RLTask(**{"domain": domain, "name": name, **_env_kwargs(user_mode), **kwargs})


for _name, _domain, _mode in (("mock", "mock", "solo"), ("mock-scripted", "mock", "scripted"),
                              ("mock-llm", "mock", "llm"), ("airline", "airline", "llm"),
                              ("airline-scripted", "airline", "scripted"), ("retail", "retail", "llm"),
                              ("retail-scripted", "retail", "scripted"), ("telecom", "telecom", "solo"),
                              ("airline-retail", "airline+retail", "llm"),
                              ("airline-retail-scripted", "airline+retail", "scripted")):
    _register(_name, _domain, _mode)
