"""One training run: model, rollout plane, steps, checkpoints, logs. ``megatron_tsync.train`` calls :func:`run`.

Per step ``k`` (zero staleness): publish weights version ``k`` → workers roll out step ``k`` with them and
stream trajectory events → the learner consumes them as they land (``--rl-mode``) → barrier and optimizer
step → version ``k + 1``. ``async`` mode lets workers run up to ``--max-staleness`` versions ahead and trains
each batch synchronously with engine log-probs as π_old and truncated importance sampling (the off-policy
baseline users would otherwise pick).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import time

import torch
import torch.distributed as dist

from megatron_tsync.config import TrainConfig

log = logging.getLogger("megatron_tsync")


class _StopFlag:
    """SIGTERM / SIGUSR1 (SLURM's pre-timeout signal) / SIGINT: finish the step, save, exit.

    Installed at the very start of :func:`run`, so a signal during start-up (model load, SFT) is honoured too."""

    def __init__(self):
        self.stop = False
        self.signum = None
        for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            try:
                signal.signal(s, self._handler)
            except ValueError:  # not the main thread
                pass

    def _handler(self, signum, frame):
        self.stop, self.signum = True, signum
        log.warning("signal %d: will save a checkpoint after the current step and exit", signum)


def _model_dir(cfg: TrainConfig, rank: int) -> str:
    path = cfg.model.path
    if path is None:
        raise ValueError("--model PATH (a Hugging Face folder) is required")
    if not os.path.exists(os.path.join(path, "config.json")):
        if not cfg.model.init_tiny_model:
            raise FileNotFoundError(f"--model {path}: no config.json (pass --init-tiny-model to create a tiny one)")
        if rank == 0:
            from megatron_tsync.model.tiny_model import make_tiny_model

            log.info("creating a tiny model at %s", path)
            make_tiny_model(path, seed=cfg.rl.seed)
    if dist.is_initialized():
        dist.barrier()
    return path


def _learner_cfg(cfg: TrainConfig, reward_spec):
    lc = cfg.learner
    mode = lc.mode
    loss = lc.loss
    if mode == "async":
        mode = "sync"
        loss = dataclasses.replace(loss, old_logprobs="engine")
    return dataclasses.replace(lc, mode=mode, loss=loss, reward_spec=reward_spec)


class Trainer:
    def __init__(self, cfg: TrainConfig):
        from megatron_tsync.runtime.tasks import get_task
        from megatron_tsync.model.hf_conversion import load_hf_dir, load_hf_into_model
        from megatron_tsync.training.learner import Learner
        from megatron_tsync.model.builder import build_model
        from megatron_tsync.training.optimizer import build_optimizer, wrap_ddp
        from megatron_tsync.model.parallel import initialize_parallel

        self.cfg = cfg
        if cfg.learner.num_minibatches > cfg.rl.groups_per_step:
            raise ValueError(f"--num-minibatches {cfg.learner.num_minibatches} > {cfg.rl.groups_per_step} groups per "
                             "step: minibatches are made of whole groups")
        p = cfg.parallel
        self.dims = initialize_parallel(p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                                        p.context_parallel_size, seed=cfg.rl.seed)
        self.model_dir = _model_dir(cfg, self.dims.rank)
        self.task = get_task(cfg.rollout.task, verifier=cfg.rollout.verifier)
        arch, hf_state = load_hf_dir(self.model_dir)
        model = build_model(arch, cfg.precision, seed=cfg.rl.seed)
        load_hf_into_model(model, hf_state)
        self.ddp = wrap_ddp(model, use_distributed_optimizer=p.use_distributed_optimizer)
        self.opt = build_optimizer(self.ddp, dataclasses.replace(cfg.optim, use_distributed_optimizer=p.use_distributed_optimizer))
        self.step = 0
        self.state: dict = {}
        self._load()
        if self.step == 0 and cfg.model.sft_warmup_steps > 0 and not self.state.get("sft_done"):
            self._sft()
        self.learner = Learner(self.ddp, self.opt, _learner_cfg(cfg, self.task.reward_spec),
                               dp_rank=self.dims.dp_rank, pp_size=self.dims.pp)
        self.stop = _STOP if _STOP is not None else _StopFlag()
        self.tb = None
        if cfg.logging.tensorboard_dir and self.dims.is_logging_rank:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(cfg.logging.tensorboard_dir)
        self.history: list[dict] = []

    # ------------------------------------------------------------------ checkpoints
    def _load(self) -> None:
        from megatron_tsync.training.checkpointing import load_checkpoint

        ck = self.cfg.checkpoint
        if not ck.load:
            return
        got = load_checkpoint(ck.load, self.ddp, None if ck.finetune else self.opt)
        if got is None:
            log.info("--load %s: no checkpoint yet, starting from the model", ck.load)
            return
        step, state = got
        self.step = 0 if ck.finetune else step
        self.state = state or {}
        if self.dims.rank == 0:
            print(f"[tsync] resumed from {ck.load} at step {self.step}", flush=True)

    def save(self) -> None:
        from megatron_tsync.training.checkpointing import save_checkpoint

        if not self.cfg.checkpoint.save:
            return
        self.state["history_tail"] = self.history[-5:]
        path = save_checkpoint(self.cfg.checkpoint.save, self.step, self.ddp, self.opt, self.state,
                               hf_assets_src=self.model_dir)
        if self.dims.rank == 0:
            print(f"[tsync] saved checkpoint {path}", flush=True)

    def _sft(self) -> None:
        from transformers import AutoTokenizer

        from megatron_tsync.model.tokenizer import TokenizerCodec
        from megatron_tsync.runtime.sft import sft_warmup
        from megatron_tsync.training.optimizer import OptimConfig, build_optimizer

        t0 = time.perf_counter()
        codec = TokenizerCodec(AutoTokenizer.from_pretrained(self.model_dir))
        sft_lr = getattr(self.cfg.model, "sft_lr", 1e-3)
        sft_opt = build_optimizer(self.ddp, OptimConfig(optimizer="adam", lr=sft_lr, clip_grad=1.0))
        losses = sft_warmup(self.ddp, sft_opt, codec, self.task, self.cfg.model.sft_warmup_steps,
                            batch_size=16, seed=self.cfg.rl.seed + 1)  # not the RL prompts
        # the RL optimizer's fp32 master copies (if any) must see the new weights
        self.opt.reload_model_params() if hasattr(self.opt, "reload_model_params") else None
        self.state["sft_done"] = True
        if self.dims.rank == 0:
            print(f"[tsync] supervised warm start: {len(losses)} steps, loss {losses[0]:.3f} → {losses[-1]:.3f} "
                  f"({time.perf_counter() - t0:.0f}s)", flush=True)

    # ------------------------------------------------------------------ rollouts
    def _fleet(self):
        from megatron_tsync.runtime.fleet import open_fleet

        if self.dims.rank != 0:  # rank 0 owns the rollout plane and broadcasts what lands (BroadcastSource)
            return None
        return open_fleet(self.cfg, model_dir=self.model_dir, start_step=self.step,
                          reward_floor=float(self.task.reward_spec.lo))

    def _publish(self, fleet, version: int) -> None:
        from megatron_tsync.model.hf_conversion import megatron_to_hf

        state = megatron_to_hf(self.ddp)  # collective over TP/PP: every rank calls it
        if fleet is not None:
            fleet.publish(state, version)

    # ------------------------------------------------------------------ loop
    def train(self) -> list[dict]:
        from megatron_tsync.streaming.ready_queue import ListSource
        from megatron_tsync.training.stream_fb import BatchShape

        cfg = self.cfg
        replay = cfg.logging.replay_rollouts
        live = not replay
        fleet = self._fleet() if live else None
        try:
            if live:
                self._publish(fleet, self.step)
            t_run = time.perf_counter()
            first = saved = self.step
            while self.step < cfg.rl.train_iters and not self.stop.stop:
                k = self.step
                if replay:
                    from megatron_tsync.runtime.rollout_io import load_rollouts

                    samples, groups = load_rollouts(replay, k)
                    if cfg.logging.replay_shuffle_seed is not None:
                        import random

                        random.Random(cfg.logging.replay_shuffle_seed * 1_000_003 + k).shuffle(samples)
                    for i, s in enumerate(samples):
                        s.dp_rank = i % self.dims.dp
                    source = ListSource(samples)
                    sizes = {g: samples[0].group_size for g in groups}
                else:
                    from megatron_tsync.runtime.worker import group_ids

                    from megatron_tsync.runtime.fleet import BroadcastSource

                    if fleet is not None:
                        fleet.begin_step(k)
                    source = fleet.source(k, cfg.rl.seq_length) if fleet is not None else None
                    if self.dims.world_size > 1:
                        source = BroadcastSource(source, self.dims.dp)
                    sizes = {g: cfg.rl.group_size for g in group_ids(k, cfg.rl.groups_per_step)}
                shape = BatchShape(num_sequences=sum(sizes.values()), max_len=cfg.rl.seq_length)
                self._grad_dump_hook(k)
                res = self.learner.train_step(source, sizes, shape)
                self.step += 1
                samples = samples if replay else source.samples
                if cfg.logging.dump_rollouts and self.dims.rank == 0:
                    from megatron_tsync.runtime.rollout_io import dump_rollouts

                    dump_rollouts(cfg.logging.dump_rollouts, k, samples, list(sizes))
                if live and self.step < cfg.rl.train_iters:
                    self._publish(fleet, self.step)
                self._log(k, res, samples, fleet, time.perf_counter() - t_run, self.step - first)
                si = cfg.checkpoint.save_interval
                if si and self.step % si == 0:
                    self.save()
                    saved = self.step
            if cfg.checkpoint.save and saved != self.step:  # the end of the run, or a signal
                self.save()
        finally:
            if fleet is not None:
                fleet.close()
            if self.tb is not None:
                self.tb.close()
        self._summary()
        return self.history

    def _grad_dump_hook(self, k: int) -> None:
        root = self.cfg.logging.dump_grads
        if not root:
            return
        from megatron_tsync.runtime.rollout_io import dump_grads

        learner = self.learner
        learner.grad_hook = lambda m: dump_grads(root, k, m, divisor=learner.last_divisor, write=self.dims.rank == 0)

    def _log(self, k, res, samples, fleet, elapsed, done) -> None:
        rewards = [s.reward for s in samples]
        success = [1.0 if s.reward >= self.task.reward_spec.hi else 0.0 for s in samples]
        row = {
            "step": k, "reward": sum(rewards) / max(len(rewards), 1), "success_rate": sum(success) / max(len(success), 1),
            "loss": res.loss_sum, "grad_norm": res.grad_norm, "step_time_s": res.step_s, "idle_frac": res.idle_frac,
            "tail_after_last_arrival_s": res.work_after_last_arrival_s,
            "open_groups_peak_vectors": res.peak_bucket_vectors, "bucket_peak_bytes": res.peak_bucket_bytes,
            "events_rejected": fleet.receiver.rejected if fleet is not None else 0,
            "staleness": max((k - s.policy_version) for s in samples) if samples else 0,
            "trajectories": res.num_trajectories, **{f"plan_{a}": b for a, b in res.planner_stats.items()},
            "theta0_forwards": getattr(getattr(self.learner, "theta0", None), "forwards", 0),
            **{f"offload_{a}": b for a, b in (res.offload or {}).items()},
        }
        self.history.append(row)
        if self.tb is not None:
            names = {"reward": "rollout/reward", "success_rate": "rollout/success_rate", "loss": "train/loss",
                     "grad_norm": "train/grad_norm", "step_time_s": "perf/step_time_s", "idle_frac": "perf/learner_idle_frac",
                     "open_groups_peak_vectors": "stream/bucket_vectors_peak", "bucket_peak_bytes": "stream/bucket_bytes_peak",
                     "events_rejected": "transport/events_rejected", "staleness": "rollout/staleness"}
            write_scalars(self.tb, row, names, k)
        if self.dims.is_logging_rank and (k % max(self.cfg.logging.log_interval, 1) == 0):
            left = self.cfg.rl.train_iters - self.step
            eta = elapsed / max(done, 1) * left
            bar = _bar(self.step, self.cfg.rl.train_iters) if self.cfg.logging.progress else f"step {self.step}"
            print(f"[tsync] {bar} reward {row['reward']:.3f} success {row['success_rate']:.2f} "
                  f"step {res.step_s:5.2f}s idle {res.idle_frac:4.0%} grad-norm {row['grad_norm'] or 0:.3f} "
                  f"rejected {row['events_rejected']} ETA {eta:5.0f}s", flush=True)

    def _summary(self) -> None:
        if not self.history or not self.dims.is_logging_rank:
            return
        h = self.history
        n = max(1, min(10, len(h) // 3))  # first / last third (≤ 10 steps): per-step success is noisy
        first = sum(r["success_rate"] for r in h[:n]) / n
        last = sum(r["success_rate"] for r in h[-n:]) / n
        mean_step = sum(r["step_time_s"] for r in h) / len(h)
        print(f"[tsync] summary: mode {self.cfg.learner.mode}, {len(h)} steps, success {first:.2f} → {last:.2f} "
              f"(first/last {n} steps), reward {h[0]['reward']:.3f} → {h[-1]['reward']:.3f}, "
              f"mean step {mean_step:.2f}s, learner idle {sum(r['idle_frac'] for r in h) / len(h):.0%}", flush=True)
        save_history(self.cfg, h)


def write_scalars(tb, row: dict, names: dict[str, str], k: int) -> None:
    """TensorBoard: ``row[key]`` under ``names[key]`` at step ``k`` (None values skipped)."""
    for key, tag in names.items():
        if row.get(key) is not None:
            tb.add_scalar(tag, row[key], k)
    tb.flush()


def save_history(cfg: TrainConfig, history: list[dict]) -> None:
    """Per-step metrics as ``history.json`` next to the checkpoints (or the TensorBoard folder)."""
    out = cfg.checkpoint.save or cfg.logging.tensorboard_dir
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "history.json"), "w") as f:
            json.dump(history, f, indent=1)


def _bar(done: int, total: int, width: int = 20) -> str:
    fill = int(width * done / max(total, 1))
    return f"[{'#' * fill}{'.' * (width - fill)}] {done}/{total}"


_STOP: _StopFlag | None = None


def run(cfg: TrainConfig) -> list[dict]:
    global _STOP
    _STOP = _StopFlag()
    logging.basicConfig(level=os.environ.get("TSYNC_LOG", "WARNING"), format="[%(name)s] %(message)s")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if cfg.rl.algorithm == "opd":
        from megatron_tsync.runtime.opd_trainer import OPDTrainer

        t = OPDTrainer(cfg)
    else:
        if cfg.learner.mode == "stream-turn":
            raise ValueError("--rl-mode stream-turn is for --rl-algorithm opd")
        t = Trainer(cfg)
    hist = t.train()
    from megatron_tsync.model.parallel import destroy_parallel

    destroy_parallel()
    return hist


