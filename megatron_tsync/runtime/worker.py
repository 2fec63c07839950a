"""A rollout worker process: engine + agent loop + sandboxed tools + verifier, streaming events to the learner.

For every step ``k`` the worker waits for learner weights of a version the learner accepts for step ``k``
(``transport.versions.VersionWindow``: exactly ``k``, or ``k − max_staleness … k`` in async mode; signed hand-off:
files, or a broadcast from the trainer's rank 0 with ``--weight-sync broadcast``), loads them into its engine in
place, rolls out its share of the step's groups (group ``g`` belongs to worker ``g mod rollout.num_workers``), scores
each trajectory the moment it finishes and sends a signed ``TrajectoryEvent`` stamped with the policy version that
produced it (a trajectory whose rollout or verifier failed is sent too, with status "error" and the task's lowest
reward). Nothing waits for the group or the batch. With ``WorkerSpec.stream_turns`` each finished turn is also sent
as a ``TurnEvent``.

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
from megatron_tsync.transport.ids import group_ids, traj_id
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
    weights_dir: str
    """Where ``rollout.weight_sync`` "file" publishes each version."""
    weight_sync_addr: str
    """``rollout.weight_sync`` "broadcast": HOST:PORT of the store the trainer hosts; this worker is rank
    ``1 + worker_id`` of a group of ``1 + rollout.num_workers`` (``transport/weight_broadcast.py``). "" otherwise."""
    weight_sync_backend: str
    """"gloo" (CPU tensors) or "nccl" (vLLM engines on GPUs next to a CUDA trainer; not run on a GPU yet)."""

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
        return VLLMEngine.from_hf_dir(spec.model_dir, seed=spec.rl.seed, dtype=spec.engine_dtype,
                                      max_model_len=spec.rl.seq_length, **extra)
    import socket

    from megatron_tsync.rollout.embedded_engine import EmbeddedEngine
    from megatron_tsync.model.parallel import initialize_parallel

    # the embedded engine is a megatron model of its own: a private single-process group (gloo, TP=1)
    for k in list(os.environ):
        if k in ("RANK", "WORLD_SIZE", "LOCAL_RANK") or k.startswith("TORCHELASTIC_"):
            os.environ.pop(k)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    initialize_parallel(1, 1, seed=spec.rl.seed)

    return EmbeddedEngine.from_hf_dir(spec.model_dir)


def sampling_config(spec: WorkerSpec, tokenizer) -> "SamplingConfig":
    """The engine's sampling parameters: the config's (``SamplingConfig.from_config``) plus the agent's stop tokens
    (EOS and ``</answer>``) and tool token (``</tool>``) in this tokenizer."""
    from megatron_tsync.rollout.engine import SamplingConfig

    ids = tokenizer.convert_tokens_to_ids
    return SamplingConfig.from_config(
        spec.rollout, spec.rl,
        stop_token_ids=tuple(i for i in (tokenizer.eos_token_id, ids("</answer>")) if i is not None),
        tool_token_ids=(ids("</tool>"),),
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
    def __init__(self, spec: WorkerSpec):
        from transformers import AutoTokenizer

        from megatron_tsync.rollout.agent_loop import AgentConfig, AgentLoop, RegistryTools
        from megatron_tsync.model.tokenizer import TokenizerCodec
        from megatron_tsync.rollout.sandbox import Sandbox, SandboxConfig
        from megatron_tsync.rollout.verifiers import get_verifier
        from megatron_tsync.runtime.tasks import get_task
        from megatron_tsync.transport import EventSender, WeightSubscriber, load_secret

        self.spec = spec
        self.key = load_secret(path=spec.secret_file)
        self.sender = EventSender(spec.endpoint, self.key, f"worker{spec.worker_id}")
        broadcast = spec.rollout.weight_sync == "broadcast"
        self.weights = None if broadcast else WeightSubscriber(spec.weights_dir, self.key)
        self.engine = _make_engine(spec)
        self.broadcast = _join_weight_sync(spec, self.engine, self.key) if broadcast else None
        tok = AutoTokenizer.from_pretrained(spec.model_dir)
        self.codec = TokenizerCodec(tok)
        self.task = get_task(spec.rollout.task, verifier=spec.rollout.verifier)
        self.verifier = get_verifier(self.task.verifier, **self.task.verifier_kwargs)
        self.config = AgentConfig(sampling=sampling_config(spec, tok), max_turns=spec.rl.max_turns,
                                  max_total_tokens=spec.rl.seq_length)
        self.step_holder = [spec.start_step]
        sandbox = Sandbox(SandboxConfig(wall_timeout_s=spec.rollout.sandbox_timeout_s))
        self.tools = RegistryTools(sandbox, delay_fn=_delay_fn(spec, self.step_holder))
        self.AgentLoop = AgentLoop
        self.sent = 0

    # ---------------------------------------------------------------------------------------------
    def run(self) -> None:
        spec = self.spec
        for step in range(spec.start_step, spec.rl.train_iters):
            if spec.rollout.weight_sync == "broadcast":
                self._receive_broadcast(step)
            else:
                window = VersionWindow(step, spec.rl.max_staleness)  # what the learner will accept for this step
                version, state = self.weights.wait_for(window.oldest, timeout_s=WEIGHT_WAIT_S)
                if version not in window:
                    raise RuntimeError(f"worker {spec.worker_id}: step {step} needs weights {window}, got v{version}")
                if version != self.engine.policy_version or step == spec.start_step:
                    self.engine.update_weights(state, version)
            self.step_holder[0] = step
            asyncio.run(self._run_step(step))
            self.sender.flush(timeout_s=600)
        self.sender.close(flush_timeout_s=60)

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

    async def _run_step(self, step: int) -> None:
        spec = self.spec
        insts = self.task.sample_prompts(step, spec.rl.groups_per_step, spec.rl.seed)
        gids = group_ids(step, spec.rl.groups_per_step)
        prompts, meta = [], []
        for g, inst in enumerate(insts):
            if g % spec.rollout.num_workers != spec.worker_id:
                continue
            ids = self.codec.encode(inst.prompt_text)
            for i in range(spec.rl.group_size):
                prompts.append(ids)
                meta.append({"group": g, "index": i, "group_id": gids[g], "inst": inst})
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
            self.sender.send(TurnEvent(
                traj_id=traj_id(m["group_id"], m["index"]), group_id=m["group_id"],
                policy_version=traj.policy_version if traj.policy_version >= 0 else step, turn=turn, start=start,
                end=end, token_ids=np.asarray(traj.token_ids[:end], dtype=np.int32), loss_mask=mask,
                logprobs=np.asarray(traj.logprobs[:end], dtype=np.float32) * mask), timeout_s=600)

        loop = self.AgentLoop(self.engine, self.codec, self.config, tools=self.tools, on_finish=on_finish,
                              on_turn=on_turn if spec.stream_turns else None)
        # seed per step so that resumed runs sample the same trajectories
        loop.config = dataclasses.replace(
            self.config, sampling=dataclasses.replace(self.config.sampling, seed=spec.rl.seed * 100003 + step)
        )
        await loop.run_async(prompts, metadata=meta)
        await asyncio.gather(*pending)

    async def _score_and_send(self, traj, step: int, t0: float) -> None:
        from megatron_tsync.transport import TrajectoryEvent

        m = traj.metadata
        inst = m["inst"]
        text = self.codec.decode(traj.token_ids[traj.prompt_len :])
        floor = float(self.task.reward_spec.lo)
        if traj.error:
            reward, status, err = floor, "error", traj.error[:1000]
        else:
            try:  # a failing verifier or a non-finite score must not lose the trajectory: it counts as an error
                score = await self.verifier.evaluate(text, inst.verifier_task())
                reward, status, err = float(score.reward), "ok", ""
                if not math.isfinite(reward):
                    reward, status, err = floor, "error", f"verifier returned a non-finite reward {score.reward!r}"
            except Exception as e:
                reward, status, err = floor, "error", f"verifier failed: {type(e).__name__}: {e}"[:1000]
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
                  "turns": traj.num_turns},
        )
        self.sender.send(ev, timeout_s=600)
        self.sent += 1


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m megatron_tsync.runtime.worker SPEC.json", file=sys.stderr)
        return 2
    logging.basicConfig(level=os.environ.get("TSYNC_LOG", "WARNING"), format="[worker %(asctime)s] %(message)s")
    import signal

    # SLURM's pre-timeout USR1 goes to the whole step: it is the trainer's cue to save; the trainer stops us
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    deadline = time.time() + float(os.environ.get("TSYNC_SPEC_WAIT", "1800"))
    while not os.path.exists(argv[0]):  # started by srun beside the trainer: the trainer writes the spec
        if time.time() > deadline:
            print(f"worker spec {argv[0]} did not appear (is the trainer running with --rollout-launch external "
                  f"and this --rollout-dir?)", file=sys.stderr)
            return 2
        time.sleep(1.0)
    spec = WorkerSpec.from_json(argv[0])
    RolloutWorker(spec).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
