"""Learner side of the rollout plane: worker processes, the event receiver, the weight hand-off.

:func:`open_fleet` writes one :class:`~megatron_tsync.runtime.worker.WorkerSpec` per worker (the run's ``rl`` and
``rollout`` config sections plus this run's facts) and builds the :class:`RolloutFleet`, which starts the rollout
workers as separate processes (or, with ``--rollout-launch external``, waits for workers started by srun elsewhere),
publishes the policy weights of each version (signed files, or with ``weight_sync == "broadcast"`` a broadcast to
every worker from a group whose store it hosts), and turns verified ``TrajectoryEvent`` s into
:class:`~megatron_tsync.streaming.ready_queue.Sample` s for the learner through :class:`TransportSource`.

Events of a policy version outside the fleet's :class:`~megatron_tsync.transport.versions.VersionWindow` are
rejected by the receiver and counted (``receiver.rejected``). Failures: whenever a poll comes back empty, a worker
process this fleet started that exited with a non-zero code raises :class:`WorkerDied` with the worker's id, exit
code and the last lines of its log (it does not say which trajectories are lost). A worker that exits with code 0
early, or an external worker that dies (the fleet has no handle on it), is noticed only by the stall timeout: no
event for ``rollout.stall_timeout_s`` seconds raises a ``TimeoutError`` naming the count and a few of the step's
missing trajectory ids.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

from megatron_tsync.runtime.worker import WEIGHT_SYNC_OP_TIMEOUT_S, WEIGHT_WAIT_S, WorkerSpec
from megatron_tsync.streaming.ready_queue import Sample
from megatron_tsync.transport.ids import parse_traj_id, traj_ids
from megatron_tsync.transport.versions import VersionWindow

log = logging.getLogger(__name__)


class WorkerDied(RuntimeError):
    pass


class RolloutFleet:
    def __init__(self, base_spec: WorkerSpec, run_dir: str, *, launch: bool = True, log_dir: str | None = None):
        from megatron_tsync.transport import EventReceiver, load_secret

        self.spec = base_spec
        self.run_dir = run_dir
        self.key = load_secret(path=base_spec.secret_file)
        # the policy versions accepted now: the one owner of that window; the receiver asks it for every frame
        self.versions = VersionWindow(base_spec.start_step, base_spec.rl.max_staleness)
        self.reward_floor = 0.0  # what a failed trajectory counts with (the task's lowest reward; set by open_fleet)
        # async mode: trajectories of a later step that arrived while an earlier one was trained (by step)
        self.early: dict[int, list] = {}
        self.receiver = EventReceiver(bind_address(base_spec.endpoint), self.key,
                                      expected_version_fn=self.versions.accepted)
        self.procs: list[subprocess.Popen] = []
        self.log_dir = log_dir or os.path.join(run_dir, "worker_logs")
        os.makedirs(self.log_dir, exist_ok=True)
        self.weight_publisher = self._start_weight_sync() if base_spec.rollout.weight_sync == "broadcast" else None
        self.spec_paths = self._write_specs(launch)
        if launch:
            self._launch()

    def _start_weight_sync(self):
        """Hosts the weight-sync store (rank 0 of 1 + num_workers) and records its address in the worker spec; the
        group itself forms at the first publish, once every worker has joined."""
        import dataclasses

        from megatron_tsync.transport.weight_broadcast import BroadcastWeightPublisher, WeightSyncGroup

        spec = self.spec
        host, world = weight_sync_host(spec.endpoint), 1 + spec.rollout.num_workers
        group = WeightSyncGroup.host(world, host=host, backend=spec.weight_sync_backend,
                                     op_timeout_s=WEIGHT_SYNC_OP_TIMEOUT_S)
        self.spec = dataclasses.replace(spec, weight_sync_addr=f"{host}:{group.port}")
        return BroadcastWeightPublisher(group, self.key, bucket_bytes=spec.rollout.weight_sync_bucket_mb << 20,
                                        poll_fn=self.check_alive, connect_timeout_s=WEIGHT_WAIT_S)

    def _write_specs(self, local: bool) -> list[str]:
        """``run_dir/worker{w}.json`` for every worker (written atomically: external workers wait for them)."""
        import dataclasses

        paths = []
        for w in range(self.spec.rollout.num_workers):
            # local workers connect to the address actually bound (a tcp port chosen by the OS is resolved)
            endpoint = self.receiver.endpoint if local else self.spec.endpoint
            spec = dataclasses.replace(self.spec, worker_id=w, endpoint=endpoint)
            path = os.path.join(self.run_dir, f"worker{w}.json")
            spec.to_json(path + ".tmp")
            os.replace(path + ".tmp", path)
            paths.append(path)
        return paths

    def _launch(self) -> None:
        env = worker_env()
        for w, path in enumerate(self.spec_paths):
            out = open(os.path.join(self.log_dir, f"worker{w}.log"), "ab")
            self.procs.append(
                subprocess.Popen([sys.executable, "-m", "megatron_tsync.runtime.worker", path], env=env,
                                 stdout=out, stderr=subprocess.STDOUT)
            )

    def publish(self, model_hf_state: dict[str, torch.Tensor], version: int) -> None:
        from megatron_tsync.transport import publish_weights

        if self.weight_publisher is None:
            publish_weights(model_hf_state, self.spec.weights_dir, version, self.key)
        else:
            try:
                self.weight_publisher.publish(model_hf_state, version)
            except (RuntimeError, TimeoutError):
                self.check_alive()  # a dead worker is the likely cause: name it, with its log
                raise
            log.info("weights v%d broadcast: %s", version, self.weight_publisher.last_stats)
        self.versions.advance(version)

    def begin_step(self, step: int) -> None:
        """Accept events of policy versions [step − max_staleness, step] from now on (``self.versions``)."""
        self.versions.advance(step)

    def check_alive(self) -> None:
        for w, p in enumerate(self.procs):
            rc = p.poll()
            if rc is not None and rc != 0:
                tail = _tail(os.path.join(self.log_dir, f"worker{w}.log"))
                raise WorkerDied(f"rollout worker {w} exited with code {rc}; last lines of its log:\n{tail}")

    def source(self, step: int, max_seq_len: int) -> "TransportSource":
        return TransportSource(self, step, max_seq_len)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        if self.weight_publisher is not None:
            self.weight_publisher.close()
        self.receiver.close()


def open_fleet(cfg, *, model_dir: str, start_step: int, reward_floor: float) -> RolloutFleet:
    """The rollout plane of a training run (trainer rank 0 only): run directory, secret, worker specs, workers.

    ``cfg`` is the run's ``TrainConfig``: its ``rl`` and ``rollout`` sections go to the workers as they are; the
    spec's other fields are derived here, once. ``reward_floor``: what a failed trajectory counts with."""
    run_dir = cfg.rollout.run_dir or os.path.join(cfg.checkpoint.save or os.path.join("runs", "tsync"),
                                                  "rollout_plane")
    os.makedirs(run_dir, exist_ok=True)
    for name in os.listdir(run_dir):  # stale specs of a previous job must not start workers early
        if name.startswith("worker") and name.endswith(".json"):
            os.remove(os.path.join(run_dir, name))
    spec = WorkerSpec(
        rl=cfg.rl, rollout=cfg.rollout,
        engine_dtype="bfloat16" if cfg.precision.bf16 else "float32",
        stream_turns=cfg.rl.algorithm == "opd" and cfg.learner.mode == "stream-turn",
        model_dir=model_dir, start_step=start_step, worker_id=0,
        endpoint=cfg.rollout.endpoint or f"ipc://{os.path.abspath(run_dir)}/events.sock",
        secret_file=cfg.rollout.secret_file or make_run_secret(run_dir),
        weights_dir=fresh_dir(os.path.join(run_dir, "weights")),
        weight_sync_addr="",  # broadcast: set by the fleet once it hosts the group's store
        # NCCL only between GPUs: the trainer on CUDA and vLLM engines (the embedded engine receives CPU tensors)
        weight_sync_backend="nccl" if cfg.rollout.engine == "vllm" and torch.cuda.is_available() else "gloo",
    )
    fleet = RolloutFleet(spec, run_dir, launch=cfg.rollout.launch == "local")
    if cfg.rollout.launch == "external":
        n = cfg.rollout.num_workers
        print(f"[tsync] waiting for {n} external rollout worker(s): run "
              f"`python -m megatron_tsync.runtime.worker {run_dir}/worker<w>.json` (w = 0..{n - 1})", flush=True)
    fleet.reward_floor = reward_floor
    return fleet


class TransportSource:
    """The learner's view of one step's trajectories as they arrive over the wire (arrival order).

    In async mode a worker may finish a trajectory of step ``k + 1`` (sampled with weights the learner accepts now)
    while the learner still trains step ``k``: the source of step ``k`` leaves it with the fleet (``fleet.early``)
    and the source of step ``k + 1`` delivers it first — if its version is inside that step's window by then."""

    def __init__(self, fleet: RolloutFleet, step: int, max_seq_len: int):
        self.fleet = fleet
        self.step = step
        self.max_seq_len = max_seq_len
        rl = fleet.spec.rl
        self.expected = set(traj_ids(step, rl.groups_per_step, rl.group_size))
        self.seen: set[str] = set()
        self.samples: list[Sample] = []  # in arrival order (for --dump-rollouts)
        self.t0 = time.perf_counter()
        self.errors = 0
        self.stall_timeout_s = fleet.spec.rollout.stall_timeout_s
        self.last_event = time.perf_counter()
        self._early = []
        for ev in fleet.early.pop(step, []):
            if ev.policy_version in fleet.versions:
                self._early.append(ev)
            else:
                log.warning("dropping early trajectory %s: policy version %d is outside %s of step %d", ev.traj_id,
                            ev.policy_version, fleet.versions, step)

    def _events(self, timeout_s: float) -> list:
        """This step's events: those that arrived early (see the class docstring) first, then the receiver's."""
        early, self._early = self._early, []
        return early + self.fleet.receiver.poll(0 if early else int(timeout_s * 1000))

    def _progress(self, got_any: bool) -> None:
        """After a poll: note progress, or check the workers and the stall timeout (``rollout.stall_timeout_s``)."""
        now = time.perf_counter()
        if got_any:
            self.last_event = now
            return
        self.fleet.check_alive()
        if now - self.last_event > self.stall_timeout_s:
            missing = sorted(self.expected - self.seen)
            raise TimeoutError(f"step {self.step}: no trajectory for {self.stall_timeout_s:.0f}s; "
                               f"{len(missing)} missing, e.g. {missing[:5]}")

    def poll(self, timeout_s: float) -> list[Sample]:
        out = []
        for ev in self._events(timeout_s):
            if getattr(ev, "KIND", "") != "trajectory":  # turn events: only the OPD source uses them
                continue
            s = self._to_sample(ev)
            if s is not None:
                out.append(s)
        self._progress(bool(out))
        return out

    def _to_sample(self, ev) -> Sample | None:
        if ev.traj_id not in self.expected:
            ids = parse_traj_id(ev.traj_id)
            if ids is not None and ids[0] > self.step:  # async: a later step's, early
                self.fleet.early.setdefault(ids[0], []).append(ev)
                return None
            log.warning("dropping unexpected trajectory %s (%s; this is step %d)", ev.traj_id,
                        "not a trajectory id" if ids is None else f"step {ids[0]} group {ids[1]}", self.step)
            return None
        if ev.traj_id in self.seen:
            log.warning("dropping duplicate trajectory %s", ev.traj_id)
            return None
        self.seen.add(ev.traj_id)
        ids = torch.as_tensor(ev.token_ids.astype("int64"))
        mask = torch.as_tensor(ev.loss_mask.astype("float32"))
        beh = torch.as_tensor(ev.logprobs.astype("float64"))
        reward = float(ev.reward)
        if ev.status != "ok":
            self.errors += 1
            reward = self.fleet.reward_floor  # the learner's rule, whatever the worker sent
            log.warning("trajectory %s failed (%s); it counts with reward %s and no gradient", ev.traj_id,
                        ev.error[:200], reward)
        if ids.numel() > self.max_seq_len:  # oversize: keep the group whole, train nothing from it
            log.warning("trajectory %s has %d tokens > --seq-length %d: kept in its group without gradient",
                        ev.traj_id, ids.numel(), self.max_seq_len)
            ids, mask, beh = ids[: self.max_seq_len], torch.zeros(self.max_seq_len), beh[: self.max_seq_len]
        if ev.status != "ok" or ids.numel() < 2:
            n = max(ids.numel(), 2)
            ids = torch.cat([ids, torch.zeros(n - ids.numel(), dtype=torch.long)])
            mask, beh = torch.zeros(n), torch.zeros(n, dtype=torch.float64)
        s = Sample(traj_id=ev.traj_id, group_id=ev.group_id, group_size=ev.group_size, token_ids=ids, loss_mask=mask,
                   reward=reward,
                   policy_version=ev.policy_version, behaviour_logp=beh, arrival_s=time.perf_counter() - self.t0,
                   meta=dict(ev.meta))
        self.samples.append(s)
        return s

    def exhausted(self) -> bool:
        return self.seen >= self.expected


_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                  "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE")


def worker_env() -> dict:
    """The trainer's environment minus its launcher's rendezvous (torchrun / srun ranks): workers are separate
    single-process programs, not members of the trainer's process group."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in list(env):
        if k in _LAUNCHER_VARS or k.startswith("TORCHELASTIC_") or k.startswith("SLURM_PROCID"):
            env.pop(k)
    return env


def bind_address(endpoint: str) -> str:
    """What the learner binds for an endpoint workers connect to: ``tcp://HOST:PORT`` → ``tcp://*:PORT`` (workers on
    other nodes connect to HOST); ipc:// and loopback addresses bind as given."""
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint[len("tcp://"):].rpartition(":")
        if host not in ("127.0.0.1", "localhost", "*", "0.0.0.0") and port:
            return f"tcp://*:{port}"
    return endpoint


def weight_sync_host(endpoint: str) -> str:
    """The address workers reach the weight-sync store at: the host of a ``tcp://HOST:PORT`` event endpoint (this
    node's name for a wildcard), else (ipc://: workers on this node) the loopback address."""
    import socket

    if endpoint.startswith("tcp://"):
        host = endpoint[len("tcp://"):].rpartition(":")[0].strip("[]")
        return socket.getfqdn() if host in ("*", "0.0.0.0", "") else host
    return "127.0.0.1"


def make_run_secret(run_dir: str) -> str:
    from megatron_tsync.transport import write_secret_file

    path = os.path.join(run_dir, "secret.hex")
    if os.path.exists(path):
        os.remove(path)
    write_secret_file(path)
    return path


def fresh_dir(path: str) -> str:
    if os.path.exists(path):
        shutil.rmtree(path)
    os.makedirs(path)
    return path


def default_run_dir() -> str:
    return tempfile.mkdtemp(prefix="tsync-run-")


def _tail(path: str, n: int = 30) -> str:
    try:
        with open(path, "rb") as f:
            return b"".join(f.readlines()[-n:]).decode(errors="replace")
    except OSError:
        return "(no log)"
