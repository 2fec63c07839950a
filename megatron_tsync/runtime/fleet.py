"""Learner side of the rollout plane: worker processes, the event receiver, the weight hand-off.

:func:`open_fleet` writes one :class:`~megatron_tsync.runtime.worker.WorkerSpec` per worker (the run's ``rl`` and
``rollout`` config sections plus this run's facts) and builds the :class:`RolloutFleet`, which starts the rollout
workers as separate processes (or, with ``--rollout-launch external``, waits for workers started by srun elsewhere),
publishes the policy weights of each version (signed files, or with ``weight_sync == "broadcast"`` a broadcast to
every worker from a group whose store it hosts), and turns verified ``TrajectoryEvent`` s into
:class:`~megatron_tsync.streaming.ready_queue.Sample` s for the learner through :class:`TransportSource`.

Events of a policy version outside the fleet's :class:`~megatron_tsync.transport.versions.VersionWindow` are
rejected by the receiver and counted (``receiver.rejected``). No event for ``rollout.stall_timeout_s`` seconds raises
a ``TimeoutError`` naming the count and a few of the step's missing trajectory ids.

Supervision (``runtime/supervision.py``; with ``--weight-sync file``): every poll of a step's source lets the
fleet's :class:`~megatron_tsync.runtime.supervision.WorkerSupervisor` check the workers — a process that exited, or a
heartbeat stale for ``--rollout-heartbeat-timeout`` (hung; a process this fleet started is SIGKILLed) — and
re-dispatch a failed worker's missing trajectories of the step to live workers under the same policy version (and
its share of every later step). A group may then hold trajectories from two workers; each is a sample from the same
θ_k, and the group's advantage scalars are computed when its last trajectory lands, on the final set, so the update
is the synchronous update on the trajectories used (streaming_math: a bucket's (P, Q, ρ) do not care which worker
sampled a member). ``--rollout-retries`` failures are survived; one more raises ``WorkerDied`` naming the worker and
the trajectories not received (the loop saves a checkpoint first). Each step's :class:`StepLedger` accounts for every
trajectory (used, re-dispatched with its reason, dropped with its reason): logged when the step has all its
trajectories, and in the step's row (``ledger_*``, ``worker_failures``, ``recovery_s``). With ``--weight-sync
broadcast`` a dead worker breaks the collective: ``WorkerDied`` at once, as before. The fleet writes its own
heartbeat (``hb/trainer.json``, with the run id): workers on other nodes exit when it stops; workers it started also
die with it by ``PR_SET_PDEATHSIG``. Events are signed with the run's key (``secret.run_key`` of a run id drawn per
trainer process): a stale worker of an earlier run is rejected and counted (``wrong_run``), even with a shared
``--secret-file``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

from megatron_tsync.runtime import affinity, launch_env
from megatron_tsync.runtime.validation import screen
from megatron_tsync.runtime import supervision as sv
from megatron_tsync.runtime.harness import FAIL_KEY as HARNESS_FAIL_KEY
from megatron_tsync.runtime.signal_health import FAIL_KEY, fail_kind
from megatron_tsync.runtime.worker import WEIGHT_SYNC_OP_TIMEOUT_S, WEIGHT_WAIT_S, WorkerSpec
from megatron_tsync.streaming.ready_queue import Sample
from megatron_tsync.transport.errors import FarFuture, WrongVersion
from megatron_tsync.transport.ids import parse_traj_id, traj_ids
from megatron_tsync.transport.versions import VersionWindow

log = logging.getLogger(__name__)


WorkerDied = sv.WorkerFailure
"""A rollout worker failed and the run cannot go on (``.worker``, ``.step``, ``.missing``)."""


class RolloutFleet:
    def __init__(self, base_spec: WorkerSpec, run_dir: str, *, launch: bool = True, log_dir: str | None = None):
        from megatron_tsync.transport import EventReceiver, load_secret

        self.spec = base_spec
        self.run_dir = run_dir
        self.key = load_secret(path=base_spec.secret_file)
        # the policy versions accepted now: the one owner of that window; the receiver asks it for every frame
        self.versions = VersionWindow(base_spec.start_step, base_spec.rl.max_staleness)
        self.reward_floor = 0.0  # what a failed trajectory counts with (the task's lowest reward; set by open_fleet)
        self.routing_expect: tuple[int, int, int] | None = None  # --moe-router-replay: (layers, topk, experts)
        # the rewards the learner assumes (--reward-kind/--reward-range; set by open_fleet): the edge rejects others
        self.reward_spec = None
        # async mode: trajectories of a later step that arrived while an earlier one was trained (by step), only for
        # steps the run can still use (up to max(1, --max-staleness) ahead) and within EARLY_BYTES_CAP in all
        self.early: dict[int, list] = {}
        self.early_bytes = 0
        self.receiver = EventReceiver(bind_address(base_spec.endpoint), self.key,
                                      expected_version_fn=self.versions.accepted, run_id=base_spec.run_id)
        self.procs: list[subprocess.Popen] = []
        self.abort_check = None  # the loop's StopFlag.check_abort: SIGTERM aborts the step at the next poll
        self.log_dir = log_dir or os.path.join(run_dir, "worker_logs")
        os.makedirs(self.log_dir, exist_ok=True)
        ro = base_spec.rollout
        self.ledgers: dict[int, sv.StepLedger] = {}
        self.supervisor = sv.WorkerSupervisor(
            num_workers=ro.num_workers, groups_per_step=base_spec.rl.groups_per_step,
            group_size=base_spec.rl.group_size, run_dir=run_dir, run_id=base_spec.run_id,
            key=sv_key(self.key, base_spec.run_id), timeout_s=ro.heartbeat_timeout_s, retries=ro.worker_retries,
            procs=self.procs, log_tail=lambda w: _tail(os.path.join(self.log_dir, f"worker{w}.log")))
        # before the specs exist: a worker never sees a directory without its run's trainer heartbeat
        self.heartbeat = sv.BeatWriter(os.path.join(run_dir, "hb", "trainer.json"), base_spec.run_id,
                                       sv.beat_interval(ro.heartbeat_timeout_s)).start()
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
        base = dict(worker_env(), TSYNC_PARENT_PID=str(os.getpid()))  # the worker sets PR_SET_PDEATHSIG
        pinned = set(os.sched_getaffinity(0)) != set(affinity.startup_cpus())  # --trainer-cpus: not inherited
        for w, path in enumerate(self.spec_paths):
            out = open(os.path.join(self.log_dir, f"worker{w}.log"), "ab")
            cpus = affinity.worker_cpus(self.spec.rollout, w, pinned)  # --rollout-cpus share, from exec on
            env = launch_env.worker_process_env(base, self.spec.rollout, w)  # scrubbed; --rollout-gpus share
            with affinity.children_on(cpus):
                self.procs.append(
                    subprocess.Popen([sys.executable, "-m", "megatron_tsync.runtime.worker", path],
                                     env=env if cpus is None else dict(env, OMP_NUM_THREADS=str(len(cpus))),
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

    def supervise(self, source: "TransportSource") -> None:
        """After a poll of a step's source: an urgent stop (``StopRequested``), worker failures (re-dispatch, or
        ``WorkerDied`` past the budget)."""
        if self.abort_check is not None:
            self.abort_check()
        if self.weight_publisher is not None:
            return self.check_alive()  # broadcast: the collective needs every worker, nothing to re-dispatch
        self.supervisor.check(source.seen, set(getattr(source, "delivered", ())))  # OPD: turns streamed

    def begin_source(self, source: "TransportSource") -> sv.StepLedger:
        """The ledger of the step ``source`` serves; the supervisor re-dispatches dead workers' shares of it."""
        ledger = self.ledgers[source.step] = sv.StepLedger(source.step, sorted(source.expected))
        for k in [k for k in self.ledgers if k < source.step - 8]:
            del self.ledgers[k]

        def version_of(gid: str) -> int:  # a group's trajectories are all sampled from one policy version
            got = [s.policy_version for s in source.samples if s.group_id == gid]
            acc = self.versions.accepted()
            return got[0] if got else (acc if isinstance(acc, int) else acc[-1])

        self.supervisor.begin(source.step, ledger, version_of)
        return ledger

    def check_alive(self) -> None:
        for w, p in enumerate(self.procs):
            rc = p.poll()
            if rc is not None and rc != 0:
                tail = _tail(os.path.join(self.log_dir, f"worker{w}.log"))
                raise WorkerDied(f"rollout worker {w} exited with code {rc}; last lines of its log:\n{tail}")

    def source(self, step: int, max_seq_len: int) -> "TransportSource":
        return TransportSource(self, step, max_seq_len)

    def close(self, grace_s: float = 10.0) -> None:
        """Workers see the trainer's heartbeat say "closed" and leave with 0 within a second, mid-step or not
        (``supervision.TrainerWatch``; external ones too); the ones this fleet started get ``grace_s`` to leave, then
        SIGKILL (they ignore SIGTERM: a job-wide signal is the trainer's)."""
        self.heartbeat.stop(closed=True)
        deadline = time.monotonic() + grace_s
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        stopped = set()
        for w, p in enumerate(self.procs):
            if p.poll() is None:
                p.kill()
                stopped.add(w)
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                log.warning("rollout worker pid %d did not exit after SIGKILL", p.pid)
        if self.procs:
            print(f"[tsync] {close_message([p.returncode for p in self.procs], stopped, grace_s)}", flush=True)
        if self.weight_publisher is not None:
            self.weight_publisher.close()
        self.receiver.close()


def close_message(codes: list, stopped: set, grace_s: float) -> str:
    """The line the trainer prints when it has closed its workers: how many exited 0, how many it stopped (still
    running ``grace_s`` after the close; SIGKILL, not a crash), and the exit codes of any that failed."""
    parts = []
    clean = sum(1 for w, c in enumerate(codes) if c == 0 and w not in stopped)
    if clean:
        parts.append(f"{clean} exited 0")
    if stopped:
        parts.append(f"{len(stopped)} stopped (still running {grace_s:g}s after the close: killed)")
    failed = {w: c for w, c in enumerate(codes) if c != 0 and w not in stopped}
    if failed:
        parts.append(f"{len(failed)} failed earlier (exit codes " + ", ".join(f"worker {w}: {c}" for w, c in
                                                                              failed.items()) + ")")
    return "rollout workers closed: " + ", ".join(parts)


_IPC_PATH_MAX = 100  # bytes: a unix socket path must fit sockaddr_un.sun_path (108 with the NUL; 104 on macOS)


def ipc_endpoint(run_dir: str) -> str:
    """The default event endpoint: ``ipc://RUN_DIR/events.sock``, or, when that path is too long for a unix socket,
    a socket in the temporary directory named by a hash of the run directory (the same run directory, the same
    socket; another run directory, another socket)."""
    import hashlib

    path = os.path.join(os.path.abspath(run_dir), "events.sock")
    if len(path.encode()) <= _IPC_PATH_MAX:
        return f"ipc://{path}"
    short = os.path.join(tempfile.gettempdir(), f"tsync-{hashlib.sha256(path.encode()).hexdigest()[:16]}.sock")
    if len(short.encode()) > _IPC_PATH_MAX:
        raise ValueError(f"the event socket path {short!r} is longer than {_IPC_PATH_MAX} bytes (TMPDIR too long); "
                         "set --rollout-endpoint (e.g. tcp://127.0.0.1:PORT)")
    log.info("run directory too long for a unix socket path (%d bytes): events on %s", len(path.encode()), short)
    return f"ipc://{short}"


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
    shutil.rmtree(os.path.join(run_dir, "assign"), ignore_errors=True)  # a previous run's re-dispatches
    spec = WorkerSpec(
        rl=cfg.rl, rollout=cfg.rollout,
        engine_dtype="bfloat16" if cfg.precision.bf16 else "float32",
        stream_turns=cfg.rl.algorithm == "opd" and cfg.learner.mode == "stream-turn",
        model_dir=model_dir, start_step=start_step, worker_id=0,
        endpoint=cfg.rollout.endpoint or ipc_endpoint(run_dir),
        secret_file=cfg.rollout.secret_file or make_run_secret(run_dir),
        run_id=new_run_id(),  # this trainer process: a stale worker of an earlier run is rejected
        weights_dir=fresh_dir(os.path.join(run_dir, "weights")),
        weight_sync_addr="",  # broadcast: set by the fleet once it hosts the group's store
        # NCCL only between GPUs: the trainer on CUDA and vLLM engines (the embedded engine receives CPU tensors)
        weight_sync_backend="nccl" if cfg.rollout.engine == "vllm" and torch.cuda.is_available() else "gloo",
        record_routing=cfg.model.moe_router_replay,
        reward_spec=dataclasses.asdict(cfg.learner.reward_spec),
    )
    fleet = RolloutFleet(spec, run_dir, launch=cfg.rollout.launch == "local")
    if cfg.rollout.launch == "external":
        n = cfg.rollout.num_workers
        print(f"[tsync] waiting for {n} external rollout worker(s): run "
              f"`python -m megatron_tsync.runtime.worker {run_dir}/worker<w>.json` (w = 0..{n - 1})", flush=True)
    fleet.reward_floor = reward_floor
    fleet.reward_spec = cfg.learner.reward_spec
    fleet.routing_expect = routing_expect(model_dir) if cfg.model.moe_router_replay else None
    return fleet


EARLY_BYTES_CAP = 256 << 20
"""Bytes of early trajectories (token ids, masks, log-probs, routing) parked for later steps, at most."""


def _event_bytes(ev) -> int:
    arrays = (getattr(ev, k, None) for k in ("token_ids", "loss_mask", "logprobs", "routing"))
    return 512 + sum(int(getattr(a, "nbytes", 0)) for a in arrays if a is not None)


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
        self.fail_kinds: dict[str, int] = {}  # failed trajectories of the step by kind (runtime/signal_health.py)
        self.stall_timeout_s = fleet.spec.rollout.stall_timeout_s
        self.last_event = time.perf_counter()
        self.ledger = fleet.begin_source(self)
        self._ledger_logged = False
        self._early = []
        for ev in fleet.early.pop(step, []):
            fleet.early_bytes -= _event_bytes(ev)
            if ev.policy_version in fleet.versions:
                self._early.append(ev)
            else:  # counted like the receiver's own version rejections
                stats = fleet.receiver.stats
                stats[WrongVersion.reason] = stats.get(WrongVersion.reason, 0) + 1
                log.warning("dropping early trajectory %s: policy version %d is outside %s of step %d", ev.traj_id,
                            ev.policy_version, fleet.versions, step)

    def _events(self, timeout_s: float) -> list:
        """This step's events: those that arrived early (see the class docstring) first, then the receiver's; only
        those the learner's edge accepts (``runtime/validation.py``), plus failed stand-ins for rejected ones."""
        early, self._early = self._early, []
        return screen(self, early + self.fleet.receiver.poll(0 if early else int(timeout_s * 1000)))

    def _progress(self, got_any: bool) -> None:
        """After a poll: note progress, or check the workers and the stall timeout (``rollout.stall_timeout_s``)."""
        now = time.perf_counter()
        self.fleet.supervise(self)
        if got_any:
            self.last_event = now
            return
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
                self._park(ev, ids[0])
                return None
            why = "not a trajectory id" if ids is None else f"step {ids[0]} group {ids[1]}"
            log.warning("dropping unexpected trajectory %s (%s; this is step %d)", ev.traj_id, why, self.step)
            self.ledger.dropped.append((ev.traj_id, f"unexpected: {why}"))
            return None
        if ev.traj_id in self.seen:
            log.warning("dropping duplicate trajectory %s", ev.traj_id)
            self.ledger.dropped.append((ev.traj_id, f"duplicate (from worker {ev.meta.get('worker', '?')})"))
            return None
        self.seen.add(ev.traj_id)
        self.ledger.used.append(ev.traj_id)
        self._log_ledger()
        ids = torch.as_tensor(ev.token_ids.astype("int64"))
        mask = torch.as_tensor(ev.loss_mask.astype("float32"))
        beh = torch.as_tensor(ev.logprobs.astype("float64"))
        reward = float(ev.reward)
        meta = {k: v for k, v in ev.meta.items() if k not in (FAIL_KEY, "fail_detail")}  # the trainer's keys
        if ev.status != "ok":
            self.errors += 1
            reward = self.fleet.reward_floor  # the learner's rule, whatever the worker sent
            kind = fail_kind(ev.error, ev.meta.get(HARNESS_FAIL_KEY))
            meta.update({FAIL_KEY: kind, "fail_detail": ev.error[:200]})
            self.fail_kinds[kind] = self.fail_kinds.get(kind, 0) + 1
            if self.fail_kinds[kind] == 1:  # one line per kind per step; the step's row counts them all
                log.warning("trajectory %s failed (%s: %s); it counts with reward %s and no gradient (further %s "
                            "failures of step %d are counted, not logged)", ev.traj_id, kind, ev.error[:200],
                            reward, kind, self.step)
        if ids.numel() > self.max_seq_len:  # oversize: keep the group whole, train nothing from it
            log.warning("trajectory %s has %d tokens > --seq-length %d: kept in its group without gradient",
                        ev.traj_id, ids.numel(), self.max_seq_len)
            ids, mask, beh = ids[: self.max_seq_len], torch.zeros(self.max_seq_len), beh[: self.max_seq_len]
        if ev.status != "ok" or ids.numel() < 2:
            n = max(ids.numel(), 2)
            ids = torch.cat([ids, torch.zeros(n - ids.numel(), dtype=torch.long)])
            mask, beh = torch.zeros(n), torch.zeros(n, dtype=torch.float64)
        routing = None
        if self.fleet.routing_expect is not None and ev.status == "ok":
            routing, why = _event_routing(ev, self.fleet.routing_expect, ids.numel())
            if routing is None:
                log.warning("trajectory %s: %s (--moe-router-replay): kept in its group without gradient",
                            ev.traj_id, why)
                mask = torch.zeros_like(mask)
        s = Sample(traj_id=ev.traj_id, group_id=ev.group_id, group_size=ev.group_size, token_ids=ids, loss_mask=mask,
                   reward=reward,
                   policy_version=ev.policy_version, behaviour_logp=beh, arrival_s=time.perf_counter() - self.t0,
                   meta=meta, routing=routing)
        self.samples.append(s)
        return s

    def _park(self, ev, step: int) -> None:
        """Keep an early trajectory for the source of ``step`` if the run can still use it: at most
        max(1, --max-staleness) steps ahead (sync modes: the next step), within ``EARLY_BYTES_CAP`` bytes of parked
        events in all; otherwise drop it and count it (``far_future``): a flood of far-future ids costs a counter,
        not memory."""
        fleet = self.fleet
        ahead = max(1, fleet.spec.rl.max_staleness)
        size = _event_bytes(ev)
        why = (f"step {step} is more than {ahead} ahead of step {self.step}" if step > self.step + ahead else
               f"the parked early trajectories would exceed {EARLY_BYTES_CAP} bytes"
               if fleet.early_bytes + size > EARLY_BYTES_CAP else "")
        if not why:
            fleet.early.setdefault(step, []).append(ev)
            fleet.early_bytes += size
            return
        stats = fleet.receiver.stats
        stats[FarFuture.reason] = stats.get(FarFuture.reason, 0) + 1
        if stats[FarFuture.reason] <= 5 or stats[FarFuture.reason] % 10_000 == 0:
            log.warning("dropping early trajectory %s: %s (%d dropped so far)", ev.traj_id, why,
                        stats[FarFuture.reason])
            fleet.receiver.recent_rejections.append((FarFuture.reason, f"{ev.traj_id}: {why}"[:512]))

    def exhausted(self) -> bool:
        return self.seen >= self.expected

    def _log_ledger(self) -> None:
        """Once the step has all its trajectories: its ledger on stdout when anything happened (else the log)."""
        if self._ledger_logged or not self.seen >= self.expected:
            return
        self._ledger_logged = True
        led = self.ledger
        if led.redispatched or led.dropped or led.failures:
            print(led.line(), flush=True)
        else:
            log.info(led.line())


def _event_routing(ev, expect: tuple[int, int, int], t: int):
    """(routing (P, L, k) uint8/int16 tensor, None) for a trajectory event, or (None, why) when it is unusable.
    ``expect`` = (MoE layers, top-k, experts) of the policy; ``t`` its (possibly clipped) length."""
    layers, k, experts = expect
    if ev.routing is None:
        return None, "no routing in the event"
    if tuple(ev.routing_shape) != (layers, k):
        return None, f"routing for {tuple(ev.routing_shape)} (layers, topk), the model has {(layers, k)}"
    if ev.routing.size and int(ev.routing.max()) >= experts:
        return None, f"expert index {int(ev.routing.max())} >= {experts} experts"
    r = torch.from_numpy(ev.routing.reshape(-1, layers, k).copy())
    return r[:t], ""


def routing_expect(model_dir: str) -> tuple[int, int, int]:
    """(MoE layers, top-k, experts) of an HF MoE folder, what router-replay events must carry (a dense-first model,
    GLM-4.7-Flash's, routes in its MoE layers only)."""
    from megatron_tsync.model.builder import ModelArch

    arch = ModelArch.from_hf_dir(model_dir)
    if not arch.num_experts:
        raise ValueError(f"--moe-router-replay needs a MoE model; {model_dir}/config.json has no experts")
    return arch.num_layers - arch.moe_first_k_dense, arch.moe_router_topk, arch.num_experts


def worker_env() -> dict:
    """The trainer's environment minus its launcher's rendezvous (torchrun / srun task variables,
    ``launch_env.scrub_launcher_env``): workers are separate single-process programs, not members of the trainer's
    process group."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    launch_env.scrub_launcher_env(env)
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


LEDGER_TB_NAMES = {"ledger_used": "rollout/ledger_used", "ledger_redispatched": "rollout/ledger_redispatched",
                   "ledger_dropped": "rollout/ledger_dropped", "worker_failures": "rollout/worker_failures",
                   "recovery_s": "rollout/recovery_s", "wrong_run_events": "transport/wrong_run_events"}
"""TensorBoard tags of :func:`ledger_row`'s keys."""


def ledger_row(fleet: RolloutFleet | None, step: int) -> dict:
    """A step's ledger for the log row: ``ledger_used`` / ``ledger_redispatched`` / ``ledger_dropped`` trajectories,
    ``worker_failures`` during the step, ``recovery_s`` (a failed worker's last heartbeat → its trajectories
    re-dispatched, the longest of the step; None without a failure); ``wrong_run_events``: trajectory and turn
    events of another run rejected so far (``wrong_run`` also counts their pings). Empty without a fleet (replay)."""
    led = fleet.ledgers.get(step) if fleet is not None else None
    if led is None:
        return {}
    kinds = fleet.receiver.wrong_run_kinds
    return {**led.row(), "wrong_run_events": kinds.get("trajectory", 0) + kinds.get("turn", 0)}


def sv_key(secret: bytes, run_id: str) -> bytes:
    """The key re-dispatch files are signed with: the run's event key."""
    from megatron_tsync.transport.secret import run_key

    return run_key(secret, run_id)


def new_run_id() -> str:
    from megatron_tsync.transport.secret import new_run_id as fresh

    return fresh()


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
