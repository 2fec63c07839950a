"""What every algorithm's run shares: topology, the policy (Megatron DDP + optimizer), the task, checkpoints, the
weight hand-off to the rollout plane, signals and logs. The loop (``runtime/loop.py``) drives it; an algorithm
(``runtime/grpo.py``, ``runtime/opd.py``) adds its learner and its event source.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time

import torch.distributed as dist
from transformers import AutoTokenizer

from megatron_tsync.config import TrainConfig
from megatron_tsync.model.builder import build_model
from megatron_tsync.model.hf_conversion import load_hf_dir, load_hf_into_model, megatron_to_hf
from megatron_tsync.model.parallel import ParallelDims, initialize_parallel
from megatron_tsync.model.tiny_model import make_tiny_model
from megatron_tsync.model.tokenizer import TokenizerCodec
from megatron_tsync.runtime import run_dir, wandb_log
from megatron_tsync.runtime.fleet import RolloutFleet, open_fleet
from megatron_tsync.runtime.stop import StopFlag
from megatron_tsync.runtime.phase import announce
from megatron_tsync.runtime.tasks import task_from_config
from megatron_tsync.runtime.validation import check_tokenizer_fits
from megatron_tsync.training.checkpointing import load_checkpoint, save_checkpoint, shield_checkpoint_writer
from megatron_tsync.training.optimizer import build_optimizer, wrap_ddp
from megatron_tsync.training.reference import ReferenceModel
from megatron_tsync.training.sft import build_sft_optimizer, sft_warmup

log = logging.getLogger("megatron_tsync")
REFERENCE_DIR = "reference"  # SAVE/reference: the frozen initial reference of the KL term (a checkpoint of its own)


def model_dir(cfg: TrainConfig, rank: int) -> str:
    """``--model``: a Hugging Face folder (created tiny and random with ``--init-tiny-model`` if missing)."""
    path = cfg.model.path
    if path is None:
        raise ValueError("--model PATH (a Hugging Face folder) is required")
    if not os.path.exists(os.path.join(path, "config.json")):
        if not cfg.model.init_tiny_model:
            raise FileNotFoundError(f"--model {path}: no config.json (pass --init-tiny-model to create a tiny one)")
        if rank == 0:  # one line: a random model is trained only where the user asked for it (--init-tiny-model)
            print(f"[tsync] --model {path} does not exist: creating a tiny random {cfg.model.tiny_model_family} model "
                  "there (--init-tiny-model)", flush=True)
            make_tiny_model(path, family=cfg.model.tiny_model_family, seed=cfg.rl.seed)
    if dist.is_initialized():
        dist.barrier()
    return path


class RunContext:
    """Start-up of a run: process groups, the policy from ``--model``, its optimizer, ``--load``, the SFT warm start.

    Attributes the algorithms use: ``cfg``, ``dims`` (:class:`ParallelDims`), ``model_dir``, ``task``, ``ddp``,
    ``opt``, ``step`` (the next optimizer step), ``state`` (trainer state saved with the checkpoint), ``stop``,
    ``history`` (one row per step), ``tb`` (TensorBoard writer on the logging rank, else None), ``reference``
    (the KL term's reference model, ``training.reference.ReferenceModel``, or None without a KL term).
    """

    def __init__(self, cfg: TrainConfig, stop: StopFlag):
        self.cfg, self.stop = cfg, stop
        p = cfg.parallel
        self.dims: ParallelDims = initialize_parallel(p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                                                      p.context_parallel_size, ep=p.expert_model_parallel_size,
                                                      seed=cfg.rl.seed)
        # --save: one trainer per folder (lock), stale .tmp folders of a killed save removed, stop record cleared
        self.run_lock = run_dir.claim(cfg, self.dims.rank, self.dims.world_size)
        if cfg.checkpoint.save:
            # the checkpoint writer's helper process now, not at the first save: that save may be the one a SLURM
            # time-out asked for, while the job's signal waves and srun's forced termination are still under way,
            # and a helper started then died before it answered (EOFError, no checkpoint: twice in
            # tests/slurm/test_stop_requeue.py, with and without the signals blocked while it booted)
            shield_checkpoint_writer()
        self.model_dir = model_dir(cfg, self.dims.rank)
        self.task = task_from_config(cfg.rollout)
        arch, hf_state = load_hf_dir(self.model_dir)
        check_tokenizer_fits(self.model_dir, arch.vocab_size)  # ids past the embedding would crash the learner
        if cfg.model.moe_router_replay and not arch.num_experts:
            raise ValueError(f"--moe-router-replay needs a MoE model; {self.model_dir} has no experts")
        replay = {"moe_enable_routing_replay": True} if cfg.model.moe_router_replay else {}
        # recomputation: the trained policy only (the reference, teacher and engine models never run a backward)
        model = build_model(arch, cfg.precision, seed=cfg.rl.seed, **replay, **cfg.model.recompute_overrides())
        load_hf_into_model(model, hf_state)
        self.ddp = wrap_ddp(model, use_distributed_optimizer=p.use_distributed_optimizer)
        self.opt = build_optimizer(self.ddp, dataclasses.replace(cfg.optim,
                                                                 use_distributed_optimizer=p.use_distributed_optimizer))
        self.step = 0
        self.state: dict = {}
        self.history: list[dict] = []
        self._load()
        if self.step == 0 and cfg.model.sft_warmup_steps > 0 and not self.state.get("sft_done"):
            self._sft()
        self.reference = self._reference()
        self.tb = None
        if cfg.logging.tensorboard_dir and self.dims.is_logging_rank:
            from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only when asked for

            self.tb = SummaryWriter(cfg.logging.tensorboard_dir)
        self.wandb = wandb_log.open_run(cfg) if cfg.logging.wandb_project and self.dims.is_logging_rank else None

    # ------------------------------------------------------------------ checkpoints
    def _load(self) -> None:
        ck = self.cfg.checkpoint
        if not ck.load:
            return
        got = load_checkpoint(ck.load, self.ddp, None if ck.finetune else self.opt, fallback=ck.load_fallback)
        if got is None:
            log.info("--load %s: no checkpoint yet, starting from the model", ck.load)
            return
        step, state = got
        self.step = 0 if ck.finetune else step
        self.state = state or {}
        if not ck.finetune:  # a new experiment from another's weights is what --finetune is for
            run_dir.check_resume(self.state.get("run_config"), self.cfg, ck.load)
        if self.dims.rank == 0:
            print(f"[tsync] resumed from {ck.load} at step {self.step}", flush=True)

    def _reference(self) -> ReferenceModel | None:
        """π_ref of the KL term, with the policy's layout: ``--ref-model DIR``, else the frozen initial policy (a copy
        of the weights now, at step 0; on a resume the copy saved under ``LOAD/reference``). Collective."""
        cfg, lc = self.cfg, self.cfg.learner.loss
        if lc.kl_mode == "none":
            return None
        kw = dict(temperature=lc.temperature, seed=cfg.rl.seed)
        if cfg.model.ref_model:
            return ReferenceModel.from_hf_dir(cfg.model.ref_model, cfg.precision, policy=self.ddp, **kw)
        ref = ReferenceModel.frozen_copy(self.ddp, cfg.precision, **kw)
        self._ref_fresh = self.step == 0  # a fresh start overwrites a SAVE/reference left by an earlier run
        if self.step > 0:  # resumed: the weights just loaded are not the initial ones
            src = os.path.join(cfg.checkpoint.load, REFERENCE_DIR)
            if not os.path.exists(os.path.join(src, "latest_checkpointed_iteration.txt")):
                raise FileNotFoundError(f"--load {cfg.checkpoint.load}: resuming with --kl-mode {lc.kl_mode} needs the "
                                        f"frozen initial reference saved in {src} (or --ref-model DIR)")
            load_checkpoint(src, ref.model, None, load_rng=False)
            ref.source = f"frozen initial weights ({src})"
        return ref

    def _save_reference(self) -> None:
        """The frozen initial reference, once per ``--save`` folder (under ``SAVE/reference``), for resumes."""
        if self.reference is None or self.cfg.model.ref_model:
            return
        dst = os.path.join(self.cfg.checkpoint.save, REFERENCE_DIR)
        if self._ref_fresh or not os.path.exists(os.path.join(dst, "latest_checkpointed_iteration.txt")):
            save_checkpoint(dst, 0, self.reference.model)
            self._ref_fresh = False

    def save(self) -> None:
        if not self.cfg.checkpoint.save:
            return
        self._save_reference()
        self.state["history_tail"] = self.history[-5:]
        self.state["run_config"] = run_dir.run_config(self.cfg)  # compared on a resume
        path = save_checkpoint(self.cfg.checkpoint.save, self.step, self.ddp, self.opt, self.state,
                               hf_assets_src=self.model_dir, keep_last=self.cfg.checkpoint.keep_last)
        if self.dims.rank == 0:
            print(f"[tsync] saved checkpoint {path}", flush=True)

    def _sft(self) -> None:
        t0 = time.perf_counter()
        codec = TokenizerCodec(AutoTokenizer.from_pretrained(self.model_dir))
        sft_opt, clip = build_sft_optimizer(self.ddp)  # float64: clips in float64 itself (megatron: float32 only)
        steps, last = self.cfg.model.sft_warmup_steps, {}
        with announce("supervised warm start", enabled=self.dims.rank == 0,
                      status=lambda: f"step {last['k'] + 1}/{steps}, loss {last['loss']:.3f}" if last else "step 0"):
            losses = sft_warmup(self.ddp, sft_opt, codec, self.task, steps, batch_size=16,
                                seed=self.cfg.rl.seed + 1,  # not the RL prompts
                                lr=self.cfg.model.sft_warmup_lr, log=lambda k, loss: last.update(k=k, loss=loss),
                                dp_group=self.dims.dp_group() if self.dims.dp > 1 else None, clip_grad=clip)
        # the RL optimizer's fp32 master copies (if any) must see the new weights
        if hasattr(self.opt, "reload_model_params"):
            self.opt.reload_model_params()
        self.state["sft_done"] = True
        if self.dims.rank == 0:
            print(f"[tsync] supervised warm start: {len(losses)} steps, loss {losses[0]:.3f} → {losses[-1]:.3f} "
                  f"({time.perf_counter() - t0:.0f}s)", flush=True)

    # ------------------------------------------------------------------ rollout plane
    def open_fleet(self) -> RolloutFleet | None:
        """Trainer rank 0 owns the rollout plane (the other ranks get what lands by broadcast); None elsewhere."""
        if self.dims.rank != 0:
            return None
        return open_fleet(self.cfg, model_dir=self.model_dir, start_step=self.step,
                          reward_floor=float(self.task.reward_spec.lo))

    def publish(self, fleet: RolloutFleet | None, version: int) -> None:
        """Weights of ``version`` to the engines. Collective over TP/PP: every rank calls it."""
        state = megatron_to_hf(self.ddp)
        if fleet is not None:
            fleet.publish(state, version)

    def heldout_eval(self):
        """The run's held-out evaluator (``runtime/evaluation.py``) on trainer rank 0 with ``--eval-interval``, else
        None (pre-flight refused the layouts it cannot run in)."""
        if not self.cfg.logging.eval_interval or self.dims.rank != 0:
            return None
        from megatron_tsync.runtime.evaluation import HeldOutEval

        return HeldOutEval(self.cfg, self.task, self.model_dir, self.ddp, first_step=self.step)

    # ------------------------------------------------------------------ logs
    def write_scalars(self, row: dict, names: dict[str, str], k: int) -> None:
        """TensorBoard (and W&B): ``row[key]`` under ``names[key]`` at step ``k`` (None values skipped)."""
        if self.wandb is not None:
            self.wandb.log(row, names, k)
        if self.tb is None:
            return
        for key, tag in names.items():
            if row.get(key) is not None:
                self.tb.add_scalar(tag, row[key], k)
        self.tb.flush()

    def save_history(self, evals: list[dict] | None = None) -> None:
        """Per-step metrics as ``history.json`` next to the checkpoints (or the TensorBoard folder), the held-out
        evaluations as ``eval.json``, and the learning curve ``learning_curve.png`` (``runtime/curves.py``)."""
        out = self.cfg.checkpoint.save or self.cfg.logging.tensorboard_dir
        if not out:
            return
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "history.json"), "w") as f:
            json.dump(self.history, f, indent=1)
        if evals:
            with open(os.path.join(out, "eval.json"), "w") as f:
                json.dump(evals, f, indent=1)
        from megatron_tsync.runtime.curves import learning_curve

        path = learning_curve(self.history, evals or [], os.path.join(out, "learning_curve.png"),
                              title=f"{self.cfg.rl.algorithm} {self.cfg.learner.mode} on {self.cfg.rollout.task}")
        if path:
            print(f"[tsync] learning curve {path}", flush=True)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.close()
        if self.run_lock is not None:
            self.run_lock.release()


def progress_bar(done: int, total: int, width: int = 20) -> str:
    fill = int(width * done / max(total, 1))
    return f"[{'#' * fill}{'.' * (width - fill)}] {done}/{total}"


def grad_norm_text(row: dict) -> str:
    """The progress line's grad-norm (the mean over the step's applied optimizer steps): ``skipped`` when the step's
    update was skipped (non-finite; ``runtime/stop.py``), ``n/a`` when none reported one."""
    if row.get("update_skipped"):
        return "skipped"
    return "n/a" if row.get("grad_norm") is None else f"{row['grad_norm']:.3f}"


def skipped_text(row: dict) -> str:
    """`` skipped N``: the run's skipped updates so far, once there is one."""
    return f" skipped {row['skipped_steps']}" if row.get("skipped_steps") else ""
