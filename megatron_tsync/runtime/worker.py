"""A rollout worker process: engine + agent loop + sandboxed tools + verifier, streaming events to the learner.

For every step ``k`` the worker waits for learner weights of a version the learner accepts for step ``k``
(``transport.versions.VersionWindow``: exactly ``k``, or ``k − max_staleness … k`` in async mode; signed hand-off:
files, or a broadcast from the trainer's rank 0 with ``--weight-sync broadcast``), loads them into its engine in
place, rolls out its share of the step's groups (group ``g`` belongs to worker ``g mod rollout.num_workers``), scores
each trajectory the moment it finishes and sends a signed ``TrajectoryEvent`` stamped with the policy version that
produced it (a trajectory whose rollout or verifier failed is sent too, with status "error" and the task's lowest
reward). Nothing waits for the group or the batch. With ``WorkerSpec.stream_turns`` each finished turn is also sent
as a ``TurnEvent``. With ``--harness-cmd`` / ``--harness-fn`` the user's own agent drives each episode through the
OpenAI-compatible endpoint instead of the agent loop (``runtime/harness.py``).

Supervision (``runtime/supervision.py``): from its first line of ``main`` the worker writes a heartbeat
(``run_dir/hb/worker{w}.json``: step, events sent) and watches the trainer's (it exits when the trainer's is stale
for ``rollout.heartbeat_timeout_s``, names another run, or says the trainer closed: then with 0, even mid-step); a
worker started by the trainer also dies with it (``PR_SET_PDEATHSIG``). Its events are signed with the run's key
(``WorkerSpec.run_id``). After its own share of a step, and while it waits for the next weights, it rolls out the
trajectories the fleet re-dispatched to it (``run_dir/assign/``: a dead worker's, same step, same policy version).

Run as ``python -m megatron_tsync.runtime.worker SPEC.json`` (the learner's fleet launcher does this, or srun).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import os
import sys
import time

import numpy as np

from megatron_tsync.config import RLConfig, RolloutConfig
from megatron_tsync.runtime import supervision as sv
from megatron_tsync.transport.ids import group_ids, parse_traj_id, traj_id
from megatron_tsync.transport.versions import VersionWindow

log = logging.getLogger("megatron_tsync.worker")


WEIGHT_WAIT_S = 3600.0
"""How long a worker waits for the weights of a version (and to join the broadcast group) before it gives up."""
WEIGHT_SYNC_OP_TIMEOUT_S = 600.0
"""Broadcast weight sync: bound of each collective, and of the trainer's wait for ready workers."""
SPEC_FORMAT = "tsync-worker-spec-v1"


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """What a rollout worker process is started with: ``run_dir/worker{w}.json``, written by the learner's fleet.

    The run's configuration travels as its typed sections, ``rl`` and ``rollout`` of the ``TrainConfig``
    (serialised with their ``to_dict`` / ``from_dict``); the other fields are facts of this run or this worker that
    the configuration does not hold. No field has a default: ``runtime.fleet.open_fleet`` states every one.
    """

    rl: RLConfig
    """Group size, groups per step, steps, turn / token limits, staleness, seed."""
    rollout: RolloutConfig
    """Engine (and its tensor-parallel size), task, verifier, sampling, latency simulation, weight sync."""
    engine_dtype: str
    """vLLM weights / activations: "bfloat16" when the trainer trains in bf16 (``precision.bf16``), else "float32"."""
    stream_turns: bool
    """Send a ``TurnEvent`` the moment each turn is complete (``rl.algorithm`` opd with ``--rl-mode stream-turn``)."""
    model_dir: str
    """HF folder: architecture + tokenizer (weights come from the hand-off)."""
    start_step: int
    """The first step to roll out (a resumed run starts later than 0)."""
    worker_id: int
    """This worker: it rolls out group ``g`` of a step when ``g mod rollout.num_workers == worker_id``."""
    endpoint: str
    """ZeroMQ endpoint of the learner's event receiver."""
    secret_file: str
    """The run's shared HMAC key."""
    run_id: str
    """This run's id (``transport.secret.new_run_id``, one per trainer process): events are signed with
    ``secret.run_key(key, run_id)``, so a worker of an earlier run sharing the secret file is rejected (wrong_run)."""
    weights_dir: str
    """Where ``rollout.weight_sync`` "file" publishes each version."""
    weight_sync_addr: str
    """``rollout.weight_sync`` "broadcast": HOST:PORT of the store the trainer hosts; this worker is rank
    ``1 + worker_id`` of a group of ``1 + rollout.num_workers`` (``transport/weight_broadcast.py``). "" otherwise."""
    weight_sync_backend: str
    """"gloo" (CPU tensors) or "nccl" (vLLM engines on GPUs next to a CUDA trainer; not run on a GPU yet)."""
    record_routing: bool
    """``--moe-router-replay``: the engine records each position's experts and the events carry them."""
    reward_spec: dict
    """The run's reward spec (``learner.reward_spec``: ``--reward-kind/--reward-range``, default the verifier's) as
    ``{"kind", "lo", "hi"}``: a harness's own reward is checked against it (:meth:`run_reward_spec`), not against the
    task's verifier, which may declare less (a binary verifier under ``--reward-kind bounded``)."""

    def run_reward_spec(self):
        from megatron_tsync.algorithms.streamability import RewardSpec

        return RewardSpec(**self.reward_spec)

    def to_json(self, path: str) -> None:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data.update(format=SPEC_FORMAT, rl=self.rl.to_dict(), rollout=self.rollout.to_dict())
        with open(path, "w") as f:
            json.dump(data, f, indent=1)

    @classmethod
    def from_json(cls, path: str) -> "WorkerSpec":
        with open(path) as f:
            data = json.load(f)
        if data.pop("format", None) != SPEC_FORMAT:
            raise ValueError(f"{path} is not a {SPEC_FORMAT} worker spec (written by another version of "
                             "megatron_tsync?)")
        names = {f.name for f in dataclasses.fields(cls)}
        if set(data) != names:
            raise ValueError(f"{path}: missing {sorted(names - set(data))}, unknown {sorted(set(data) - names)}")
        data.update(rl=RLConfig.from_dict(data["rl"]), rollout=RolloutConfig.from_dict(data["rollout"]))
        return cls(**data)


def _make_engine(spec: WorkerSpec):
    if spec.rollout.engine == "vllm":
        from megatron_tsync.rollout.vllm_engine import VLLMEngine

        # context = the trainer's --seq-length; tensor-parallel size = --rollout-tensor-parallel-size (the GPUs
        # slurm/launch_node.sh gives each worker); TP > 1 runs vLLM's engine core in its own processes (not run on
        # GPUs here)
        tp = spec.rollout.engine_tensor_parallel_size
        extra = {} if tp == 1 else {"tensor_parallel_size": tp, "in_process": False}
        if spec.rollout.max_num_seqs:
            extra["max_num_seqs"] = spec.rollout.max_num_seqs
        if spec.rollout.frontier_first:
            extra["scheduling_policy"] = "priority"
        return VLLMEngine.from_hf_dir(spec.model_dir, seed=spec.rl.seed, dtype=spec.engine_dtype,
                                      max_model_len=spec.rl.seq_length, record_routing=spec.record_routing, **extra)
    from megatron_tsync.rollout.embedded_engine import EmbeddedEngine
    from megatron_tsync.model.parallel import initialize_parallel

    # the embedded engine is a megatron model of its own: a private single-process group (gloo, TP=1, an in-process
    # store: no port), whatever launcher variables the worker inherited
    for k in list(os.environ):
        if k in ("RANK", "WORLD_SIZE", "LOCAL_RANK") or k.startswith("TORCHELASTIC_"):
            os.environ.pop(k)
    initialize_parallel(1, 1, seed=spec.rl.seed)

    return EmbeddedEngine.from_hf_dir(spec.model_dir, record_routing=spec.record_routing)


def sampling_config(rollout: RolloutConfig, rl: RLConfig, tokenizer, tool_stop: str = "</tool>") -> "SamplingConfig":
    """The engine's sampling parameters: the config's (``SamplingConfig.from_config``) plus the agent's stop tokens
    (EOS and ``</answer>``) and tool token (`tool_stop`: the task's ``tool_stop_text``, e.g. Qwen's
    ``</tool_call>``; default ``</tool>``) in this tokenizer."""
    from megatron_tsync.rollout.engine import SamplingConfig

    ids = tokenizer.convert_tokens_to_ids
    return SamplingConfig.from_config(
        rollout, rl,
        stop_token_ids=tuple(i for i in (tokenizer.eos_token_id, ids("</answer>")) if i is not None),
        tool_token_ids=(ids(tool_stop),),
    )


def _join_weight_sync(spec: WorkerSpec, engine, key: bytes):
    """Joins the trainer's weight-sync group as rank ``1 + worker_id``. vLLM receives inside its own worker process
    (worker extension; returns None); any other engine gets a subscriber here and loads CPU tensors."""
    host, _, port = spec.weight_sync_addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"worker {spec.worker_id}: weight_sync broadcast needs weight_sync_addr HOST:PORT, got "
                         f"{spec.weight_sync_addr!r}")
    kw = dict(backend=spec.weight_sync_backend, connect_timeout_s=WEIGHT_WAIT_S, op_timeout_s=WEIGHT_SYNC_OP_TIMEOUT_S)
    rank, world = 1 + spec.worker_id, 1 + spec.rollout.num_workers
    if hasattr(engine, "join_weight_broadcast"):
        engine.join_weight_broadcast(host, int(port), rank, world, secret_file=spec.secret_file, **kw)
        return None
    from megatron_tsync.transport.weight_broadcast import BroadcastWeightSubscriber, WeightSyncGroup

    group = WeightSyncGroup.join(host, int(port), rank, world, **kw)
    return BroadcastWeightSubscriber(group, key)


def _delay_fn(spec: WorkerSpec, step_holder: list):
    if spec.rollout.latency_profile in ("none", "", None):
        return None
    from megatron_tsync.runtime.latency import load_profile

    profile = load_profile(spec.rollout.latency_profile, scale=spec.rollout.latency_scale)

    def fn(traj, turn):
        m = traj.metadata  # fresh group factors every step: a pure function of (seed, step, group, traj, turn)
        return profile.for_step(step_holder[0]).sample(m["group"], m["index"], turn)

    return fn


class RolloutWorker:
    """``run_dir``: the rollout-plane directory (heartbeats, re-dispatch files; default: the weights' parent);
    ``status``: the dict ``main``'s heartbeat reports (step, phase, events sent); ``watch``: the trainer watch."""

    def __init__(self, spec: WorkerSpec, run_dir: str | None = None, status: dict | None = None,
                 watch: "sv.TrainerWatch | None" = None):
        from transformers import AutoTokenizer

        from megatron_tsync.rollout.agent_loop import AgentConfig, AgentLoop, RegistryTools
        from megatron_tsync.model.tokenizer import TokenizerCodec
        from megatron_tsync.rollout.sandbox import Sandbox, SandboxConfig
        from megatron_tsync.rollout.verifiers import get_verifier
        from megatron_tsync.runtime.tasks import task_from_config
        from megatron_tsync.transport import EventSender, WeightSubscriber, load_secret

        from megatron_tsync.transport.secret import run_key

        self.spec = spec
        self.key = load_secret(path=spec.secret_file)
        self.sender = EventSender(spec.endpoint, self.key, f"worker{spec.worker_id}", run_id=spec.run_id)
        self.run_dir = run_dir or os.path.dirname(os.path.abspath(spec.weights_dir))
        self.run_key = run_key(self.key, spec.run_id)
        self.status = status if status is not None else {}
        self.watch = watch
        self.assign_done: set[str] = set()
        # tests only: seconds between two trajectory events, so that a kill lands mid-step (fault injection) or a
        # job that waits for a signal idles like an agentic one instead of training flat out (SLURM stop tests)
        self.pace_s = float(os.environ.get("TSYNC_FAULT_PACE_S", "0") or 0)
        broadcast = spec.rollout.weight_sync == "broadcast"
        self.weights = None if broadcast else WeightSubscriber(spec.weights_dir, self.key)
        self.engine = _make_engine(spec)
        self.broadcast = _join_weight_sync(spec, self.engine, self.key) if broadcast else None
        tok = AutoTokenizer.from_pretrained(spec.model_dir)
        self.codec = TokenizerCodec(tok)
        self.task = task_from_config(spec.rollout)
        # a task with an environment (runtime.env_tasks, the calculator) owns each trajectory's tools and reward
        has_env = hasattr(self.task, "make_environment")
        self.verifier = None if has_env else get_verifier(self.task.verifier, **self.task.verifier_kwargs)
        self.config = AgentConfig(sampling=sampling_config(spec.rollout, spec.rl, tok, getattr(self.task, "tool_stop_text", "</tool>")),
                                  max_turns=spec.rl.max_turns,
                                  max_total_tokens=spec.rl.seq_length,
                                  max_num_seqs=spec.rollout.max_num_seqs if spec.rollout.engine == "embedded" else 0,
                                  frontier_first=spec.rollout.frontier_first)
        self.step_holder = [spec.start_step]
        sandbox = Sandbox(SandboxConfig(wall_timeout_s=spec.rollout.sandbox_timeout_s))
        self.tools = RegistryTools(sandbox, delay_fn=_delay_fn(spec, self.step_holder))
        self.env = self.task.make_environment(sandbox, delay_fn=self.tools.delay_fn) if has_env else None
        self.AgentLoop = AgentLoop
        self.sent = 0
        self.drafter = None
        if spec.rollout.speculative:  # drafts the next step's first turns while the weights are awaited
            from megatron_tsync.rollout.embedded_engine import EmbeddedEngine
            from megatron_tsync.runtime.speculation import Drafter

            self.drafter = Drafter(self, lambda: EmbeddedEngine.from_hf_dir(spec.model_dir, version=-1))
        from megatron_tsync.rollout.latency_trace import LatencyTrace  # each trajectory's real latencies (JSONL)

        self.trace = LatencyTrace(os.path.join(self.run_dir, "latency_trace", f"worker{spec.worker_id}.jsonl"))
        self.harness = None  # --harness-cmd / --harness-fn: the user's agent drives each episode (runtime/harness.py)
        if spec.rollout.harness_cmd or spec.rollout.harness_fn:
            from megatron_tsync.runtime.harness import HarnessRunner

            self.harness = HarnessRunner(self, score_trajectory)

    # ---------------------------------------------------------------------------------------------
    def run(self) -> None:
        spec = self.spec
        step = spec.start_step
        while step < spec.rl.train_iters:
            self.status.update(step=step, phase="weights")
            if spec.rollout.weight_sync == "broadcast":
                self._receive_broadcast(step)
            else:
                got = self._file_weights(step)
                if got is None:
                    break  # the trainer closed before this step: nothing more to do
                step = got  # a later step when the learner finished this one without this worker
            self.step_holder[0] = step
            self.status.update(phase="rollout", step_sent=0)
            asyncio.run(self._run_step(step))
            self.sender.flush(timeout_s=600)
            self.status.update(phase="idle")
            step += 1
        else:
            self._serve_until_closed(spec.rl.train_iters - 1)
        self.sender.close(flush_timeout_s=60)

    def _closed(self) -> bool:
        return self.watch is not None and self.watch.closed_now()

    def _file_weights(self, step: int) -> int | None:
        """Loads weights the learner accepts for ``step``, serving re-dispatched work of earlier steps meanwhile, and
        returns the step to roll out: ``step``, or a later one when the learner has already published a newer policy
        (it finished ``step`` without this worker: its trajectories were accounted for otherwise, e.g. as failed
        after a content rejection, or re-dispatched); None if the trainer closed first."""
        spec = self.spec
        window = VersionWindow(step, spec.rl.max_staleness)  # what the learner will accept for this step
        deadline = time.monotonic() + WEIGHT_WAIT_S
        while True:
            self._serve_assignments(step - 1)
            latest = self.weights.latest_version()
            if latest is not None and latest >= window.oldest:
                break
            if self._closed():
                return None
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker {spec.worker_id}: no weights >= v{window.oldest} for step {step} in "
                                   f"{WEIGHT_WAIT_S:.0f}s (latest: {latest})")
            if self.drafter is None or not self.drafter.draft_some(step, lambda: self._weights_landed(window)):
                time.sleep(0.05)
        version, state = self.weights.wait_for(window.oldest, timeout_s=WEIGHT_WAIT_S)
        if version not in window:
            if version < window.oldest:
                raise RuntimeError(f"worker {spec.worker_id}: step {step} needs weights {window}, got v{version}")
            if version >= spec.rl.train_iters:
                log.warning("worker %d: the learner finished its last step before this worker rolled out step %d",
                            spec.worker_id, step)
                return None
            log.warning("worker %d: the learner published v%d before this worker rolled out step %d (that step was "
                        "completed without it): skipping to step %d", spec.worker_id, version, step, version)
            step, window = version, VersionWindow(version, spec.rl.max_staleness)
        if self.drafter is not None:
            self.drafter.before_load(step)  # the drafting engine keeps θ_{step-1}; the other one loads θ_step
        if version != self.engine.policy_version or step == spec.start_step:
            self.engine.update_weights(state, version)
        return step

    def _weights_landed(self, window: VersionWindow) -> bool:
        latest = self.weights.latest_version()
        return latest is not None and latest >= window.oldest

    def _serve_until_closed(self, last_step: int) -> None:
        """After the last step: re-dispatched work may still come until the trainer closes (or is gone)."""
        if self.watch is None or self.weights is None:
            return
        while not self._closed():
            self._serve_assignments(last_step)
            time.sleep(0.05)

    def _serve_assignments(self, max_step: int) -> None:
        """Rolls out the trajectories the fleet re-dispatched to this worker (steps <= ``max_step``), each with the
        policy version the assignment names (reloaded from the weight files if the engine has moved on)."""
        if self.weights is None or max_step < self.spec.start_step:
            return
        for a in sv.read_assignments(self.run_dir, self.run_key, run_id=self.spec.run_id,
                                     worker=self.spec.worker_id, done=self.assign_done, max_step=max_step):
            step, version = int(a["step"]), int(a["version"])
            if self.engine.policy_version != version:
                from megatron_tsync.transport.errors import TransportError

                try:
                    self.engine.update_weights(self.weights.load(version), version)
                except (OSError, RuntimeError, ValueError, TransportError) as e:  # gone (kept: the last 2) or bad
                    log.error("worker %d: cannot load v%d for re-dispatched %s: %s", self.spec.worker_id, version,
                              a["traj_ids"], e)
                    continue
            items = [(g, i) for tid in a["traj_ids"] for _, g, i in [parse_traj_id(tid)]]
            log.warning("worker %d: rolling out %d re-dispatched trajectories of step %d (%s)", self.spec.worker_id,
                        len(items), step, a["reason"])
            self.status.update(phase=f"redo s{step}", step_sent=0)
            held, self.step_holder[0] = self.step_holder[0], step
            seed = self.spec.rl.seed * 100003 + step + 1_000_003 * (1 + int(a["n"]))  # a fresh draw, not a replay
            asyncio.run(self._rollout(step, items, seed, {"redo": int(a["n"])}))
            self.step_holder[0] = held
            self.sender.flush(timeout_s=600)
            self.status.update(phase="idle")

    def _receive_broadcast(self, version: int) -> None:
        """Exactly ``version`` (the config refuses async mode with broadcast); any other is rejected and counted by
        the subscriber (an older one is skipped, a newer one raises)."""
        t0 = time.perf_counter()
        if self.broadcast is None:  # vLLM: received and loaded inside vLLM's worker
            stats = self.engine.receive_weight_broadcast(version, timeout_s=WEIGHT_WAIT_S)
        else:
            v, state = self.broadcast.wait_for(version, timeout_s=WEIGHT_WAIT_S)
            self.engine.update_weights(state, v)
            stats = dict(self.broadcast.last_stats, rejected=dict(self.broadcast.rejected))
        log.info("weights v%d by broadcast in %.3fs (%s)", version, time.perf_counter() - t0, stats)

    def step_items(self) -> list[tuple[int, int]]:
        """This worker's share of a step, (group, index) pairs: group ``g`` when ``g mod num_workers == worker_id``."""
        spec = self.spec
        return [(g, i) for g in range(spec.rl.groups_per_step) if g % spec.rollout.num_workers == spec.worker_id
                for i in range(spec.rl.group_size)]

    async def _run_step(self, step: int) -> None:
        from megatron_tsync.runtime.speculation import step_seed

        # seed per step so that resumed runs sample the same trajectories
        await self._rollout(step, self.step_items(), step_seed(self.spec.rl.seed, step), {})

    async def _rollout(self, step: int, items: list[tuple[int, int]], seed: int, extra: dict) -> None:
        """Rolls out trajectory ``i`` of group ``g`` of ``step`` for each ``(g, i)`` of ``items`` (sampling seed
        ``seed``; ``extra`` goes into each event's meta) and sends each the moment it is scored."""
        if self.harness is not None:
            return await self.harness.rollout(step, items, extra)
        spec = self.spec
        insts = self.task.sample_prompts(step, spec.rl.groups_per_step, spec.rl.seed)
        gids = group_ids(step, spec.rl.groups_per_step)
        prompts, meta, encoded = [], [], {}
        for g, i in items:
            if g not in encoded:
                encoded[g] = self.codec.encode(insts[g].prompt_text)
            prompts.append(encoded[g])
            meta.append({"group": g, "index": i, "group_id": gids[g], "inst": insts[g],
                         "seed_index": g * spec.rl.group_size + i,  # sampling: same on any worker
                         "priority": g, **extra})  # frontier-first: the step's earlier groups first
        if self.env is not None:  # one episode (its own workspace) per trajectory; its prompt is the instance's
            for m in meta:
                m["episode"] = await self.env.start(m["inst"].meta.get("env_task", m["inst"]))
        self._pace_lock = asyncio.Lock()
        pending: list[asyncio.Future] = []
        t0 = time.perf_counter()

        def on_finish(traj):
            pending.append(asyncio.ensure_future(self._score_and_send(traj, step, t0)))

        def on_turn(traj, turn):
            from megatron_tsync.transport import TurnEvent

            m = traj.metadata
            start, end = traj.turn_spans[turn]
            mask = np.asarray(traj.loss_mask[:end], dtype=np.uint8)
            mask[:start] = 0
            ev = TurnEvent(
                traj_id=traj_id(m["group_id"], m["index"]), group_id=m["group_id"],
                policy_version=traj.policy_version if traj.policy_version >= 0 else step, turn=turn, start=start,
                end=end, token_ids=np.asarray(traj.token_ids[:end], dtype=np.int32), loss_mask=mask,
                logprobs=np.asarray(traj.logprobs[:end], dtype=np.float32) * mask,
                **_routing_fields(traj, end))
            why = bad_logprobs(ev)
            if why is None:
                self.sender.send(ev, timeout_s=600)
            else:  # not streamed: the trajectory's final event reports it failed (``reported``)
                log.warning("%s turn %d not sent: %s", ev.traj_id, turn, why)

        from megatron_tsync.rollout.envs.base import EnvTools

        tools = self.tools if self.env is None else EnvTools()
        engine = self.engine if self.drafter is None or extra else self.drafter.attach(step)  # redo: no drafts
        if engine is not self.engine:
            from megatron_tsync.rollout.engine import derive_seed

            for m in meta:  # the first turn's seed: what its draft is keyed by
                m["spec_key"] = derive_seed(seed, m["seed_index"], 0)
        idle = None if self.drafter is None or extra else (lambda: self.drafter.job(step + 1))  # draft step + 1
        loop = self.AgentLoop(engine, self.codec, self.config, tools=tools, on_finish=on_finish,
                              on_turn=on_turn if spec.stream_turns else None, idle_work=idle)
        loop.config = dataclasses.replace(self.config, sampling=dataclasses.replace(self.config.sampling, seed=seed))
        await loop.run_async(prompts, metadata=meta)
        await asyncio.gather(*pending)

    async def _score_and_send(self, traj, step: int, t0: float) -> None:
        from megatron_tsync.transport import TrajectoryEvent

        m = traj.metadata
        inst = m["inst"]
        t_verify = time.perf_counter()
        spec = self.task.reward_spec
        reward, status, err = await score_trajectory(traj, self.codec, inst, m.get("episode"), self.verifier,
                                                     float(spec.lo), spec)
        verify_s = time.perf_counter() - t_verify
        mask = np.asarray(traj.loss_mask, dtype=np.uint8)
        lp = np.asarray(traj.logprobs, dtype=np.float32) * mask
        ev = TrajectoryEvent(
            traj_id=traj_id(m["group_id"], m["index"]),
            group_id=m["group_id"],
            group_size=self.spec.rl.group_size,
            policy_version=traj.policy_version if traj.policy_version >= 0 else step,
            token_ids=np.asarray(traj.token_ids, dtype=np.int32),
            prompt_len=traj.prompt_len,
            loss_mask=mask,
            logprobs=lp,
            reward=reward,
            turn_spans=[tuple(s) for s in traj.turn_spans],
            status=status,
            error=err,
            meta={"worker": self.spec.worker_id, "finish": traj.finish_reason or "", "latency_s": time.perf_counter() - t0,
                  "turns": traj.num_turns, **({"redo": m["redo"]} if "redo" in m else {}),
                  **(self.drafter.meta(m.get("spec_key")) if self.drafter is not None else {})},
            **_routing_fields(traj),
        )
        ev = reported(ev, float(spec.lo))
        if self.pace_s > 0:
            async with self._pace_lock:
                await asyncio.sleep(self.pace_s)
        self.sender.send(ev, timeout_s=600)
        from megatron_tsync.rollout.latency_trace import trace_record

        try:  # a by-product: never lose the run over it
            self.trace.append(trace_record(traj, group=m["group_id"], rollout_s=t_verify - t0, verify_s=verify_s,
                                           step=step, worker=self.spec.worker_id, status=status))
        except OSError as e:
            log.warning("latency trace %s not written: %s", self.trace.path, e)
        self.sent += 1
        self.status.update(sent=self.sent, step_sent=self.status.get("step_sent", 0) + 1)


def bad_logprobs(ev) -> str | None:
    """Why the schema refuses the log-probs of an event built from this worker's engine output (``bad_logprob``: NaN,
    > 0, a behaviour log-prob below ``schema.LOGPROB_FLOOR`` — an engine bug the receiver would reject anyway), or
    None. Other schema errors are raised as before."""
    from megatron_tsync.transport import BadLogprobError

    try:
        ev.validate()
    except BadLogprobError as e:
        return str(e)
    return None


def reported(ev, lowest: float):
    """The trajectory event to send: ``ev``, or when :func:`bad_logprobs` refuses it the same trajectory reported
    failed (the task's ``lowest`` reward, log-probs zeroed), so it is accounted in its group instead of killing this
    worker on the sender's schema check."""
    why = bad_logprobs(ev)
    if why is None:
        return ev
    log.warning("trajectory %s: the engine's log-probs are invalid (%s): reported as failed", ev.traj_id, why)
    return dataclasses.replace(ev, logprobs=np.zeros_like(ev.logprobs), reward=lowest, status="error",
                               error=f"bad_logprob: {why}"[:1000])


async def score_trajectory(traj, codec, inst, episode, verifier, floor: float,
                           spec=None) -> tuple[float, str, str]:
    """(reward, status, error) of a finished trajectory: the environment's verdict on its episode (which it closes),
    else ``verifier`` on the completion against ``inst``; both read ``verifiers.verifier_transcript`` (an answer
    counts only in generated text, never in a tool result or a harness's message). A failed rollout, a failing
    verifier, a non-finite score or one the task's declared ``spec`` (``RewardSpec``) does not admit is status
    "error" with reward ``floor`` (the task's lowest): never lost, never a crash (the learner's edge checks it
    again)."""
    if traj.error:
        if episode is not None:
            episode.close()
        return floor, "error", traj.error[:1000]
    from megatron_tsync.rollout.verifiers import verifier_transcript

    text = verifier_transcript(traj.token_ids, traj.loss_mask, traj.prompt_len, codec.decode)  # answers: generated only
    try:
        if episode is not None:
            score = await episode.finish(text)
        else:
            score = await verifier.evaluate(text, inst.verifier_task())
    except Exception as e:  # a reason code first where the verifier gives one (ScorerFailed: "scorer_timeout: ...")
        why = f"{e.reason}: {e.detail}" if isinstance(getattr(e, "reason", None), str) else f"{type(e).__name__}: {e}"
        return floor, "error", f"verifier failed: {why}"[:1000]
    reward = float(score.reward)
    if not math.isfinite(reward):
        return floor, "error", f"verifier returned a non-finite reward {score.reward!r}"
    if spec is not None:
        try:
            spec.check(reward)
        except ValueError as e:
            return floor, "error", f"verifier returned an off-spec reward: {e}"[:1000]
    return reward, "ok", ""


def _routing_fields(traj, end: int | None = None) -> dict:
    """The event's router-replay fields: the trajectory's (P, L, k) routing flattened (a turn event's: of its
    prefix's first ``end`` positions at most), and (L, k)."""
    if traj.routing is None:
        return {}
    r = np.ascontiguousarray(traj.routing[:end])
    return {"routing": r.reshape(-1), "routing_shape": (int(r.shape[1]), int(r.shape[2]))}


def shield_from_job_signals() -> None:
    """SIGTERM, SIGUSR1 and SIGINT ignored: SLURM signals every process of a job (time-out, ``scancel``,
    preemption, the pre-timeout USR1) and these are the trainer's cue to save; it stops its workers itself (closed
    heartbeat, then SIGKILL), and a worker still dies with it (``PR_SET_PDEATHSIG``, or the trainer's heartbeat
    going stale for a worker on another node). Children (sandboxed tool calls) inherit it; they are killed with
    SIGKILL."""
    import signal

    for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(s, signal.SIG_IGN)


def main(argv=None) -> int:
    shield_from_job_signals()  # first: a job-wide SIGTERM must not kill a worker before the trainer has saved
    from megatron_tsync.runtime.launch_env import scrub_launcher_env

    scrub_launcher_env(os.environ)  # srun's task rank / count are not this single-process program's
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m megatron_tsync.runtime.worker SPEC.json", file=sys.stderr)
        return 2
    if os.environ.get("TSYNC_PARENT_PID"):  # started by the trainer: die with it
        sv.set_parent_death_signal(int(os.environ["TSYNC_PARENT_PID"]))
    logging.basicConfig(level=os.environ.get("TSYNC_LOG", "WARNING"), format="[worker %(asctime)s] %(message)s")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    deadline = time.time() + float(os.environ.get("TSYNC_SPEC_WAIT", "1800"))
    while not os.path.exists(argv[0]):  # started by srun beside the trainer: the trainer writes the spec
        if time.time() > deadline:
            print(f"worker spec {argv[0]} did not appear (is the trainer running with --rollout-launch external "
                  f"and this --rollout-dir?)", file=sys.stderr)
            return 2
        time.sleep(1.0)
    spec = WorkerSpec.from_json(argv[0])
    from megatron_tsync.runtime.affinity import AffinityError, fmt, setup_worker

    try:  # --rollout-cpus: this process, its threads and its sandboxed tool calls (before any thread starts)
        cpus = setup_worker(spec.rollout, spec.worker_id, started_by_trainer=bool(os.environ.get("TSYNC_PARENT_PID")))
    except AffinityError as e:
        print(f"worker {spec.worker_id}: error: {e}", file=sys.stderr)
        return 2
    import torch

    given = "" if cpus is None else f" (--rollout-cpus {spec.rollout.cpus})"
    print(f"[worker {spec.worker_id}] cpus {fmt(os.sched_getaffinity(0))}{given}, torch threads "
          f"{torch.get_num_threads()}", flush=True)
    run_dir, timeout = os.path.dirname(os.path.abspath(argv[0])), spec.rollout.heartbeat_timeout_s
    status = {"worker": spec.worker_id, "step": spec.start_step, "phase": "start", "sent": 0}
    sv.BeatWriter(os.path.join(run_dir, "hb", f"worker{spec.worker_id}.json"), spec.run_id, sv.beat_interval(timeout),
                  payload=lambda: dict(status)).start()
    watch = sv.TrainerWatch(os.path.join(run_dir, "hb", "trainer.json"), spec.run_id, timeout).start()
    RolloutWorker(spec, run_dir=run_dir, status=status, watch=watch).run()
    # done (events flushed, sender closed): leave now with 0 rather than through the interpreter's teardown of
    # torch, the engine and zmq, which can outlast the trainer's grace and end in its SIGKILL
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
