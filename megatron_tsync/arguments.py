"""Command-line flags → :class:`megatron_tsync.config.TrainConfig`, once, at the entry point.

Flag names follow Megatron-LM where they overlap (``--tensor-model-parallel-size``, ``--lr``, ``--clip-grad``,
``--load`` ...). Every flag is one row of ``_FLAGS``: its option strings, the ``TrainConfig`` field(s) it sets and its
argparse keywords. Flags left out of the command line are absent from the namespace (``argparse.SUPPRESS``), so the
dataclass defaults are the only defaults, and "given explicitly" is simply "present".

``--config FILE`` (YAML, or JSON for ``*.json``) holds flag values keyed by flag name without the leading dashes,
dashed or underscored (``clip-grad: 0`` or ``clip_grad: 0``); ``true`` turns a switch on, ``null`` leaves a value
at its default. The file's entries are parsed exactly like flags placed before the command line, so flags on the
command line override them and every value goes through the same type and choice checks.

Errors are argparse errors (usage, ``error: ...``, exit code 2) naming the flags involved. Invalid combinations are
detected by the dataclasses (``config.ConfigError`` names fields, reported here as the flags that set them); only
rules about the flags themselves live here (``--micro-batch-size``, ``--min-lr``, ``--global-batch-size``,
``--reward-kind``/``--reward-range``, ``--fp8-recipe``, the world size against TP × PP × CP when it is known).

``build_parser`` and ``--help`` import neither torch nor megatron (help's defaults: ``help_defaults.py``);
``parse_args`` imports torch when it builds the config. An unknown flag is one line naming the nearest known one
(``unrecognized argument --lerning-rate; did you mean --lr?``), like an unknown ``--config`` key.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Any, NamedTuple, Sequence

from megatron_tsync import config as C

__all__ = ["build_parser", "parse_args", "flag_for_field"]


class _Flag(NamedTuple):
    names: tuple[str, ...]
    fields: tuple[str, ...]  # TrainConfig paths this flag sets (empty: handled in _special)
    kwargs: dict
    group: str


_G_PAR, _G_BATCH, _G_OPT, _G_PREC, _G_RL, _G_ROLL, _G_MODEL, _G_CKPT, _G_LOG = (
    "parallelism", "batch and steps", "optimizer", "precision", "RL algorithm", "rollout", "model", "checkpointing",
    "logging and debugging")


def _f(names, fields, group, **kwargs) -> _Flag:
    names = (names,) if isinstance(names, str) else tuple(names)
    fields = (fields,) if isinstance(fields, str) else tuple(fields)
    return _Flag(names, fields, kwargs, group)


_SWITCH = dict(action=argparse.BooleanOptionalAction)  # every switch has its --no- form
_FLAGS: tuple[_Flag, ...] = (
    # ---- parallelism
    _f("--tensor-model-parallel-size", "parallel.tensor_model_parallel_size", _G_PAR, type=int, metavar="TP",
       help="tensor-parallel ranks per model replica"),
    _f("--pipeline-model-parallel-size", "parallel.pipeline_model_parallel_size", _G_PAR, type=int, metavar="PP",
       help="pipeline stages per model replica"),
    _f("--context-parallel-size", "parallel.context_parallel_size", _G_PAR, type=int, metavar="CP",
       help="context-parallel ranks per model replica"),
    _f("--expert-model-parallel-size", "parallel.expert_model_parallel_size", _G_PAR, type=int, metavar="EP",
       help="MoE: ranks the experts are split over, taken from the data-parallel ranks (every learner keeps them in "
            "lockstep: GRPO, OPD, --deterministic, a KL reference)"),
    _f("--use-distributed-optimizer", ("parallel.use_distributed_optimizer", "optim.use_distributed_optimizer"),
       _G_PAR, **_SWITCH, help="shard optimizer state across data-parallel ranks"),
    _f("--trainer-cpus", "parallel.trainer_cpus", _G_PAR, metavar="LIST",
       help="CPU cores of the trainer ranks on a node, e.g. 0-3,8 (pinned; torch threads = their number; ranks "
            "of a node share them out); default unpinned"),
    # ---- batch and steps
    _f("--micro-batch-size", (), _G_BATCH, type=int, metavar="1",
       help="must be 1: streaming runs one trajectory per microbatch"),
    _f("--global-batch-size", (), _G_BATCH, type=int, metavar="N",
       help="trajectories per step (= groups per step × group size); sets the groups per step"),
    _f("--groups-per-step", "rl.groups_per_step", _G_BATCH, type=int, metavar="N", help="prompts (groups) per step"),
    _f(("--group-size", "--num-samples-per-prompt"), "rl.group_size", _G_BATCH, type=int, metavar="G",
       help="trajectories per prompt"),
    _f("--train-iters", "rl.train_iters", _G_BATCH, type=int, metavar="N", help="optimizer steps"),
    _f("--seq-length", "rl.seq_length", _G_BATCH, type=int, metavar="N", help="tokens per trajectory at most"),
    _f("--seed", "rl.seed", _G_BATCH, type=int, help="seed of prompts, sampling and initialisation"),
    # ---- optimizer
    _f("--optimizer", "optim.optimizer", _G_OPT, choices=C.OPTIMIZERS, help="optimizer"),
    _f("--lr", "optim.lr", _G_OPT, type=float, help="learning rate (constant)"),
    _f("--min-lr", (), _G_OPT, type=float,
       help="accepted for Megatron compatibility; must equal --lr (no learning-rate schedule yet)"),
    _f("--weight-decay", "optim.weight_decay", _G_OPT, type=float, help="decoupled weight decay"),
    _f("--adam-beta1", "optim.adam_beta1", _G_OPT, type=float, help="Adam β1"),
    _f("--adam-beta2", "optim.adam_beta2", _G_OPT, type=float, help="Adam β2"),
    _f("--adam-eps", "optim.adam_eps", _G_OPT, type=float, help="Adam ε"),
    _f("--sgd-momentum", "optim.sgd_momentum", _G_OPT, type=float, help="SGD momentum"),
    _f("--clip-grad", "optim.clip_grad", _G_OPT, type=float, help="global gradient-norm clip (0 = off)"),
    _f("--max-consecutive-skipped-steps", "rl.max_consecutive_skipped_steps", _G_OPT, type=int, metavar="N",
       help="a step with a NaN/inf loss or gradient skips its update (weights unchanged, counted in skipped_steps); "
            "N such steps in a row stop the run with exit code 3 and no checkpoint (0 = never stop)"),
    # ---- precision
    _f("--bf16", "precision.bf16", _G_PREC, **_SWITCH, help="bfloat16 parameters and compute"),
    _f("--params-dtype", "precision.params_dtype", _G_PREC, choices=C.PARAMS_DTYPES,
       help="parameter dtype without --bf16 (float64: CPU verification runs, needs --clip-grad 0)"),
    _f("--fp8-format", "precision.fp8_format", _G_PREC, choices=C.FP8_FORMATS,
       help="FP8 compute via Transformer Engine (GPU)"),
    _f("--fp8-recipe", "precision.fp8_recipe", _G_PREC, choices=C.FP8_RECIPES, help="FP8 scaling recipe"),
    # ---- RL algorithm
    _f("--rl-algorithm", "rl.algorithm", _G_RL, choices=C.RL_ALGORITHMS,
       help="grpo (verifier rewards) or opd (on-policy distillation from --teacher-model)"),
    _f("--rl-mode", "learner.mode", _G_RL, choices=C.RL_MODES,
       help="when gradients are computed: sync (after the batch), stream-group (per closed group), "
            "stream-trajectory (per arriving trajectory), async (off-policy by <= --max-staleness steps), "
            "stream-turn (per turn; opd only)"),
    _f("--opd-objective", "rl.opd_objective", _G_RL, choices=C.OPD_OBJECTIVES,
       help="opd: sampled (reverse KL on the sampled tokens; teacher log-probs) or full-vocab (exact reverse KL over "
            "the vocabulary; the teacher's full logits per token are kept until the learner uses them: tokens x "
            "vocab x 4 bytes per open trajectory, e.g. 8k x 152k = 5 GB; fine for small vocabularies)"),
    _f("--max-staleness", "rl.max_staleness", _G_RL, type=int, metavar="K",
       help="async mode: policy versions a trajectory may lag the trainer (required > 0 with --rl-mode async)"),
    _f("--advantage-estimator", "learner.estimator", _G_RL, choices=C.ADVANTAGE_ESTIMATORS,
       help="group advantage estimator"),
    _f("--advantage-eps", "learner.estimator_eps", _G_RL, type=float, help="ε in the std normalisation"),
    _f("--policy-loss", "learner.loss.policy.kind", _G_RL, choices=C.POLICY_LOSSES,
       help="ppo_clip (clipped surrogate) or none (plain importance-weighted policy gradient)"),
    _f("--clip-ratio-low", "learner.loss.policy.clip_low", _G_RL, type=float,
       help="ε_low: ratio clipped at 1 − ε_low"),
    _f("--clip-ratio-high", "learner.loss.policy.clip_high", _G_RL, type=float,
       help="ε_high: ratio clipped at 1 + ε_high"),
    _f("--dual-clip", "learner.loss.policy.dual_clip", _G_RL, type=float, metavar="C",
       help="dual-clip constant c > 1 for negative advantages (default off)"),
    _f("--tis-cap", "learner.loss.policy.tis_cap", _G_RL, type=float, metavar="C",
       help="truncated importance sampling cap to the inference engine's log-probs (default off)"),
    _f("--loss-aggregation", "learner.loss.aggregation", _G_RL, choices=C.AGGREGATIONS,
       help="how token losses are averaged (seq-mean-token-sum-norm: sum over the batch / (B · L_max), L_max = "
            "min(--max-turns × --max-new-tokens, --seq-length))"),
    _f("--kl-coef", "learner.loss.kl_coef", _G_RL, type=float,
       help="KL penalty coefficient β (> 0; needs --kl-mode loss or reward)"),
    _f("--kl-estimator", "learner.loss.kl_kind", _G_RL, choices=C.KL_ESTIMATORS,
       help="KL estimator per token: k1 = log π − log π_ref, k2 = ½(log π − log π_ref)², k3 = low-variance (Schulman)"),
    _f("--kl-mode", "learner.loss.kl_mode", _G_RL, choices=C.KL_MODES,
       help="KL to the reference model (--ref-model, default the frozen initial policy; scored by the learner when "
            "a trajectory lands): a loss term β·Σ kl, folded into the reward r − β·Σ kl at θ0, or none"),
    _f("--ref-model", "model.ref_model", _G_RL, metavar="HF_DIR",
       help="reference model of the KL term, a Hugging Face folder like --model (default: frozen initial weights)"),
    _f("--entropy-coef", "learner.loss.entropy_coef", _G_RL, type=float, help="entropy bonus coefficient"),
    _f("--num-minibatches", "learner.num_minibatches", _G_RL, type=int, metavar="M",
       help="optimizer steps per batch; minibatch membership by group index (minibatch j streams after step j-1)"),
    _f("--ppo-epochs", "learner.epochs", _G_RL, type=int, metavar="E",
       help="passes over each batch (epochs after the first are synchronous)"),
    _f("--aux-strategy", "learner.aux_strategy", _G_RL, choices=C.AUX_STRATEGIES,
       help="how KL/entropy loss terms stream: a second backward per trajectory, or defer to group close"),
    _f("--old-logprobs", "learner.loss.old_logprobs", _G_RL, choices=C.OLD_LOGPROBS,
       help="π_old of the ratio: the trainer's (ratio 1 at the first minibatch) or the engine's log-probs"),
    _f("--max-open-groups", "learner.max_open_groups", _G_RL, type=int, metavar="N",
       help="gradient buckets open at once (>= 1; default unlimited)"),
    _f("--dp-assignment", "learner.dp_assignment", _G_RL, choices=("auto", "arrival", "group", "balanced", "spill"),
       help="which data-parallel rank trains a trajectory: auto (default: spill in GRPO stream-trajectory, arrival "
            "otherwise), arrival (the i-th to land goes to rank i mod DP: every rank "
            "holds a bucket for every open group) or group (all of a group's trajectories on one rank, the one with "
            "the fewest tokens assigned when its first member lands: each rank holds buckets only for its own groups, "
            "about 1/DP of them; the same update) or balanced (by group, each new group on the rank with the least "
            "predicted work: its groups' landed mean tokens × group size, so uneven groups do not leave ranks idle at "
            "the barrier) or spill (by group, but a member spills to the least-loaded rank when its group's rank would "
            "exceed it by more than the longest trajectory, 3x early in the step tapering to 1x at its end: the "
            "step of arrival order at far fewer open groups per rank). GRPO; "
            "--deterministic always assigns by group"),
    _f("--max-device-buckets", "learner.max_device_buckets", _G_RL, type=int, metavar="N",
       help="bucket residency: a device cache of N preallocated bucket-vector slots (>= 2); the vectors beyond N "
            "live in a pinned host arena, moved on a side stream and prefetched for the next microbatch "
            "(default: all on the accelerator)"),
    _f("--bucket-device-gib", "learner.bucket_device_gib", _G_RL, type=float, metavar="GIB",
       help="bucket residency: a device cache of as many bucket vectors as GIB GiB holds (at least 2; with "
            "--max-device-buckets the smaller of the two)"),
    _f("--bucket-host-gib", "learner.bucket_host_gib", _G_RL, type=float, metavar="GIB",
       help="bucket residency: the host arena's size, allocated once in slabs (default: what each step's open groups "
            "can need beyond the device cache, refused if host memory cannot hold it); a step needing more stops "
            "with an error"),
    _f("--accumulate-on-host", "learner.accumulate_on_host", _G_RL, **_SWITCH,
       help="host accumulation: the batch accumulator and every bucket vector live in pinned host memory and "
            "megatron's grad buffer is each microbatch's scratch, copied to the host (side stream) and added there "
            "after its backward: no gradient vector on the accelerator besides the grad buffer; --bucket-host-gib "
            "sizes its arena; not with --max-device-buckets / --bucket-device-gib, --deterministic, "
            "--pack-across-groups (default off)"),
    _f("--skip-zero-advantage", "learner.skip_zero_advantage", _G_RL, action=argparse.BooleanOptionalAction,
       help="no forward/backward for trajectories whose advantage is exactly 0 (all-equal groups) when no KL/entropy "
            "term needs them; their tokens still count in the denominators; exact (default on)"),
    _f("--stream-wait-for-variance", "learner.wait_for_variance", _G_RL, action=argparse.BooleanOptionalAction,
       help="stream-trajectory with --skip-zero-advantage: a trajectory whose group's rewards are so far all equal "
            "waits until one differs (until then the whole group may turn out advantage 0 and its bucket work be "
            "wasted); the waiting ones then share microbatches; exact either way (default on)"),
    _f("--stream-coalesce-ms", "learner.coalesce_ms", _G_RL, type=float, metavar="MS",
       help="streaming modes: once a reward lands, collect the rewards landing in the next MS ms too, so they share "
            "microbatches (work waits at most MS ms; the step's last reward never waits; default 0: none)"),
    _f("--stream-coalesce-tokens", "learner.coalesce_tokens", _G_RL, type=int, metavar="N",
       help="streaming modes: once a reward lands, keep collecting rewards until the landed trajectories hold N "
            "tokens (a microbatch's worth; with --stream-coalesce-ms: whichever comes first), so a learner bound by "
            "per-microbatch overhead runs full microbatches; the step's last reward never waits; default 0: none"),
    _f("--stream-full-microbatches", "learner.full_microbatches", _G_RL, action=argparse.BooleanOptionalAction,
       help="streaming modes with --sequence-packing: a packed microbatch runs once it is full (no landed trajectory "
            "still fits in --max-packed-tokens); the rest waits for the next arrivals, and everything runs at the "
            "step's end at the latest; when a group closes, its waiting trajectories become accumulator "
            "trajectories with their advantage (no bucket work for them). With "
            "--pack-across-groups the learner runs about sync's number of microbatches, each as soon as it fills; "
            "trajectories that may still be deferred (PPO clip, ratio != 1) never wait; exact"),
    _f("--shared-prefix", "learner.shared_prefix", _G_RL, action=argparse.BooleanOptionalAction,
       help="run a group's trajectories that share a prompt and a gradient destination as one microbatch: the "
            "prompt's forward and backward once, each continuation attending to it (T×T mask, local layer spec; "
            "at most --max-packed-tokens tokens); exact"),
    _f("--sequence-packing", "learner.sequence_packing", _G_BATCH, action=argparse.BooleanOptionalAction,
       help="pack several trajectories into one microbatch (THD: one causal attention per segment) when their "
            "gradients go to the same place; the update is unchanged (--no-sequence-packing overrides a config)"),
    _f("--pack-across-groups", "learner.pack_across_groups", _G_BATCH, action=argparse.BooleanOptionalAction,
       help="stream-trajectory with --sequence-packing: trajectories of different groups and rewards share a packed "
            "microbatch; its one backward sends each token row's weight-gradient terms to that trajectory's bucket "
            "(row-split weight gradients, model/row_split.py); fewer, fuller microbatches, the same update (dense "
            "models on the local layer spec, not Transformer Engine's; not with --deterministic, "
            "--max-device-buckets or sequence parallelism)"),
    _f("--max-packed-tokens", "learner.max_packed_tokens", _G_BATCH, type=int, metavar="N",
       help="tokens per packed microbatch at most (with --sequence-packing; longer trajectories run alone)"),
    _f("--deterministic", "learner.deterministic", _G_BATCH, **_SWITCH,
       help="bitwise mode: the gradient sum does not depend on arrival order (canonical-order reduction, one vector "
            "per trajectory until its group closes; torch deterministic kernels; no --sequence-packing), so sync, "
            "stream-group and stream-trajectory give identical weights and runs with one seed repeat bit for bit"),
    _f("--reward-kind", (), _G_RL, choices=C.REWARD_KINDS,
       help="what the learner may assume about rewards (default: declared by the --verifier; may assume less than "
            "it declares, never more: a contradiction is an error)"),
    _f("--reward-range", (), _G_RL, type=float, nargs=2, metavar=("LO", "HI"),
       help="reward bounds (binary: the two values; default: declared by the --verifier)"),
    _f("--max-turns", "rl.max_turns", _G_RL, type=int, help="generated turns per trajectory"),
    _f("--max-new-tokens", "rl.max_new_tokens", _G_RL, type=int, help="generated tokens per turn"),
    # ---- rollout
    _f("--temperature", ("rollout.temperature", "learner.loss.temperature"), _G_ROLL, type=float,
       help="sampling temperature (also used for the learner's log-probs)"),
    _f("--top-k", "rollout.top_k", _G_ROLL, type=int, help="top-k sampling (0 = off)"),
    _f("--top-p", "rollout.top_p", _G_ROLL, type=float, help="nucleus sampling (1 = off)"),
    _f("--rollout-engine", "rollout.engine", _G_ROLL, choices=C.ROLLOUT_ENGINES, help="inference engine"),
    _f("--rollout-tensor-parallel-size", "rollout.engine_tensor_parallel_size", _G_ROLL, type=int, metavar="TP",
       help="tensor-parallel size of each rollout worker's vLLM engine (the GPUs one worker uses; vllm only)"),
    _f("--rollout-workers", "rollout.num_workers", _G_ROLL, type=int, metavar="N", help="rollout worker processes"),
    _f("--task", "rollout.task", _G_ROLL, help="task name (runtime.tasks registry)"),
    _f("--verifier", "rollout.verifier", _G_ROLL, help="verifier name (rollout.verifiers registry)"),
    _f("--tau2-keep-trivial-tasks", "rollout.tau2_keep_trivial_tasks", _G_ROLL, **_SWITCH,
       help="τ² tasks: keep the tasks a do-nothing conversation solves (τ²'s evaluator scores it 1.0); by default "
            "they are left out of training and held-out evaluation (docs/tau2.md)"),
    _f("--latency-profile", "rollout.latency_profile", _G_ROLL, metavar="PROFILE",
       help=f"simulated environment latency: {', '.join(C.LATENCY_PROFILES)}, or a JSON file"),
    _f("--latency-scale", "rollout.latency_scale", _G_ROLL, type=float, metavar="S",
       help="multiplier (seconds) of the latency profile"),
    _f("--rollout-endpoint", "rollout.endpoint", _G_ROLL, metavar="ZMQ_ADDR",
       help="ZeroMQ endpoint trajectories arrive on (default: ipc socket in the run directory)"),
    _f("--rollout-launch", "rollout.launch", _G_ROLL, choices=("local", "external"),
       help="local: start the rollout workers as subprocesses; external: write their specs to --rollout-dir and "
            "wait for workers started elsewhere (srun on rollout nodes)"),
    _f("--rollout-dir", "rollout.run_dir", _G_ROLL, metavar="DIR",
       help="rollout-plane directory on a shared filesystem: worker specs, secret, weight versions, logs"),
    _f("--secret-file", "rollout.secret_file", _G_ROLL, metavar="FILE",
       help="shared transport key (default: a fresh key per run)"),
    _f("--rollout-max-num-seqs", "rollout.max_num_seqs", _G_ROLL, type=int, metavar="N",
       help="requests one rollout engine call takes at most (vLLM's max_num_seqs; 0: the engine's default: vLLM 256, "
            "the embedded engine every waiting request)"),
    _f("--rollout-frontier-first", "rollout.frontier_first", _G_ROLL, **_SWITCH,
       help="serve earlier groups' trajectories first (vLLM: priority scheduling; embedded engine: needs "
            "--rollout-max-num-seqs), so the oldest open groups close first (docs/streaming.md)"),
    _f("--sandbox-timeout", "rollout.sandbox_timeout_s", _G_ROLL, type=float, metavar="S",
       help="wall-clock limit of one sandboxed tool call, seconds"),
    _f("--harness-cmd", "rollout.harness_cmd", _G_ROLL, metavar="CMD",
       help="harness-driven rollouts: run this shell command per episode against the worker's OpenAI-compatible "
            "endpoint (docs/harness.md)"),
    _f("--harness-fn", "rollout.harness_fn", _G_ROLL, metavar="MODULE:FN",
       help="harness-driven rollouts: await this async function per episode in the worker (docs/harness.md)"),
    _f("--harness-timeout", "rollout.harness_timeout_s", _G_ROLL, type=float, metavar="S",
       help="wall-clock limit of one harness episode, seconds (then: a failed trajectory, harness_timeout)"),
    _f("--harness-chat-format", "rollout.harness_chat_format", _G_ROLL, choices=("model", "tag"),
       help="endpoint message rendering: the model's chat template, or the agent loop's <tool>NAME: ARGS</tool> text"),
    _f("--rollout-stall-timeout", "rollout.stall_timeout_s", _G_ROLL, type=float, metavar="S",
       help="give up on a step when no trajectory arrived for S seconds while the workers are alive"),
    _f("--rollout-heartbeat-timeout", "rollout.heartbeat_timeout_s", _G_ROLL, type=float, metavar="S",
       help="a worker silent for S seconds is hung (its trajectories are re-dispatched); a worker exits when the "
            "trainer is silent for S seconds"),
    _f("--rollout-retries", "rollout.worker_retries", _G_ROLL, type=int, metavar="N",
       help="worker failures a run survives by re-dispatching; one more fails the step (checkpoint saved)"),
    _f("--rollout-cpus", "rollout.cpus", _G_ROLL, metavar="LIST",
       help="CPU cores of the rollout workers (engines and sandboxed tool calls), e.g. 4-7 (pinned; workers the "
            "trainer starts share them out); default: the cores the trainer was started with"),
    _f("--rollout-gpus", "rollout.gpus", _G_ROLL, metavar="LIST",
       help="GPUs of the rollout workers the trainer starts on its node, e.g. 4,5,6,7 (each worker gets "
            "--rollout-tensor-parallel-size of them as CUDA_VISIBLE_DEVICES; must not overlap the trainer's GPUs); "
            "default: workers inherit the trainer's devices"),
    _f("--speculative-rollouts", "rollout.speculative", _G_ROLL, **_SWITCH,
       help="workers draft the next step's first turns under the current weights while the learner finishes, and "
            "verify them exactly under the new weights (zero staleness; embedded engine, file weight sync)"),
    _f("--speculative-draft-tokens", "rollout.speculative_draft_tokens", _G_ROLL, type=int, metavar="N",
       help="tokens drafted per trajectory at most (0 = the whole first turn)"),
    _f("--teacher-model", "rollout.teacher_model", _G_ROLL, metavar="HF_DIR", help="teacher model (opd)"),
    _f("--weight-sync", "rollout.weight_sync", _G_ROLL, choices=C.WEIGHT_SYNCS,
       help="how weights reach the engines after each step: signed safetensors files in --rollout-dir, or a "
            "broadcast from trainer rank 0 (gloo on CPU, NCCL with vLLM on GPUs)"),
    _f("--weight-sync-bucket-mb", "rollout.weight_sync_bucket_mb", _G_ROLL, type=int, metavar="MB",
       help="bucket size of the weight broadcast, MiB"),
    # ---- model
    _f("--model", "model.path", _G_MODEL, metavar="HF_DIR", help="Hugging Face model folder of the policy"),
    _f("--init-tiny-model", "model.init_tiny_model", _G_MODEL, **_SWITCH,
       help="create a tiny random model at --model if it does not exist (a --config file's covers its own model "
            "path only)"),
    _f("--tiny-model-family", "model.tiny_model_family", _G_MODEL, choices=C.TINY_FAMILIES,
       help="family of the tiny model --init-tiny-model creates (qwen3_moe: 4 experts, top-2; qwen3_5: the Gated "
            "DeltaNet hybrid, linear and full attention layers alternating)"),
    _f("--moe-aux-loss-coeff", "model.moe_aux_loss_coeff", _G_MODEL, type=float, metavar="C",
       help="MoE load-balancing loss; only 0 (streaming would weight its gradient by the advantage)"),
    _f("--moe-router-replay", "model.moe_router_replay", _G_MODEL, **_SWITCH,
       help="MoE: the learner routes each token to the experts the engine chose for it (recorded per token)"),
    _f("--recompute-granularity", "model.recompute_granularity", _G_MODEL, choices=C.RECOMPUTE_GRANULARITIES,
       help="activation recomputation of the trained model: full (whole layers, needs --recompute-method and "
            "--recompute-num-layers) or selective (core attention); default off"),
    _f("--recompute-method", "model.recompute_method", _G_MODEL, choices=C.RECOMPUTE_METHODS,
       help="full recomputation: uniform (every chunk of N layers) or block (the first N layers of each stage)"),
    _f("--recompute-num-layers", "model.recompute_num_layers", _G_MODEL, type=int, metavar="N",
       help="full recomputation: layers per chunk (uniform) or recomputed layers per pipeline stage (block)"),
    _f("--sft-warmup-steps", "model.sft_warmup_steps", _G_MODEL, type=int, metavar="N",
       help="supervised warm-start steps on the task's demonstrations before RL (0 = off)"),
    _f("--sft-warmup-lr", "model.sft_warmup_lr", _G_MODEL, type=float, metavar="LR",
       help="learning rate of the supervised warm start (default 1e-3, for the 128-wide quickstart model)"),
    # ---- checkpointing
    _f("--load", "checkpoint.load", _G_CKPT, metavar="DIR", help="checkpoint to resume from"),
    _f("--save", "checkpoint.save", _G_CKPT, metavar="DIR", help="checkpoint directory to save to"),
    _f("--save-interval", "checkpoint.save_interval", _G_CKPT, type=int, metavar="N",
       help="save every N steps (default: only at the end)"),
    _f("--finetune", "checkpoint.finetune", _G_CKPT, **_SWITCH,
       help="load only model weights from --load (no optimizer state, step 0)"),
    _f("--load-fallback", "checkpoint.load_fallback", _G_CKPT, **_SWITCH,
       help="if the latest checkpoint of --load fails its checksums, resume from the newest older one that verifies"),
    _f("--keep-last-checkpoints", "checkpoint.keep_last", _G_CKPT, type=int, metavar="N",
       help="after each save delete all but the newest N checkpoints of --save (default: keep all)"),
    _f("--exit-duration-in-mins", "checkpoint.exit_duration_in_mins", _G_CKPT, type=float, metavar="M",
       help="stop after M minutes of wall time (at a step boundary, agreed by every rank), save and exit 0 with "
            "SAVE/tsync_stop.json saying finished false (default: no budget)"),
    _f("--override-loaded-config", "checkpoint.override_loaded_config", _G_CKPT, **_SWITCH,
       help="resume even if the checkpoint's run-defining config (model, algorithm, mode, group shape, lr, seed, "
            "precision) differs from this run's (a warning per field; default: an error listing the fields)"),
    # ---- logging and debugging
    _f("--tensorboard-dir", "logging.tensorboard_dir", _G_LOG, metavar="DIR", help="TensorBoard event directory"),
    _f("--log-interval", "logging.log_interval", _G_LOG, type=int, metavar="N", help="log every N steps"),
    _f("--dump-rollouts", "logging.dump_rollouts", _G_LOG, metavar="DIR", help="record every step's trajectories"),
    _f("--replay-rollouts", "logging.replay_rollouts", _G_LOG, metavar="DIR",
       help="train on recorded trajectories instead of generating"),
    _f("--replay-shuffle-seed", "logging.replay_shuffle_seed", _G_LOG, type=int, metavar="S",
       help="replay each recorded step in a random arrival order (seeded) instead of the recorded one"),
    _f("--dump-grads", "logging.dump_grads", _G_LOG, metavar="DIR",
       help="save each optimizer update's normalised gradient (docs/formats.md)"),
    _f("--no-progress", "logging.progress", _G_LOG, action="store_false", help="no progress bar"),
    _f("--stop-on-no-signal", "logging.stop_on_no_signal", _G_LOG, type=int, metavar="K",
       help="stop (exit 1, one line with the causes) after K steps in a row without learning signal (every group "
            "zero-variance, every trajectory failed, grad-norm 0); 0 = warn once and go on"),
    _f("--eval-interval", "logging.eval_interval", _G_LOG, type=int, metavar="N",
       help="held-out evaluation at the first step, every N steps and at the end (task's eval split; 0 = off)"),
    _f("--eval-prompts", "logging.eval_prompts", _G_LOG, type=int, metavar="N",
       help="held-out prompts per evaluation (one fixed set)"),
    _f("--eval-greedy", "logging.eval_greedy", _G_LOG, action=argparse.BooleanOptionalAction,
       help="greedy decoding for the held-out evaluation (default); --no-eval-greedy: one sample per prompt at the "
            "rollout temperature, fixed seeds"),
    _f("--wandb-project", "logging.wandb_project", _G_LOG, metavar="NAME",
       help="also log the TensorBoard scalars and the config to Weights & Biases (offline unless WANDB_API_KEY is "
            "set or WANDB_MODE says otherwise)"),
    _f("--wandb-exp-name", "logging.wandb_exp_name", _G_LOG, metavar="NAME", help="W&B run name"),
    _f("--wandb-save-dir", "logging.wandb_save_dir", _G_LOG, metavar="DIR",
       help="directory of the W&B run folder (default: SAVE/wandb, else ./wandb)"),
)

# TrainConfig fields set by flags handled in _special (for error messages).
_SPECIAL_FIELDS = {
    "learner.reward_spec.kind": "--reward-kind",
    "learner.reward_spec.lo": "--reward-range",
    "learner.reward_spec.hi": "--reward-range",
    "learner.reward_spec": "--reward-kind/--reward-range",
}


def _dest(flag: _Flag) -> str:
    return flag.names[0].lstrip("-").replace("-", "_")


def flag_for_field(path: str) -> str | None:
    """The flag that sets ``TrainConfig`` field ``path`` (e.g. ``"optim.clip_grad"`` → ``"--clip-grad"``)."""
    for flag in _FLAGS:
        if path in flag.fields:
            return flag.names[0]
    return _SPECIAL_FIELDS.get(path)


# ------------------------------------------------------------------------------------------------------ parser
class _Parser(argparse.ArgumentParser):
    """Shows each flag's default (read from the dataclasses, so only when help is asked for)."""

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        """argparse's, but an unknown flag is one line with the nearest known flag, not the whole usage."""
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            self.exit(2, f"{self.prog}: error: {unrecognized_message(self, extras)}\n")
        return ns

    def format_help(self) -> str:
        defaults = _help_defaults()
        for action in self._actions:
            flag = _BY_DEST.get(action.dest)
            if flag is None or not flag.fields or action.help is None or "(default" in action.help:
                continue
            value: Any = defaults
            for part in flag.fields[0].split("."):
                value = value.get(part, {}) if isinstance(value, dict) else {}
            if value != {} and not isinstance(action, argparse._StoreConstAction):
                action.help += f" (default: {value})"
        return super().format_help()


_BY_DEST = {_dest(f): f for f in _FLAGS}

# Megatron-LM / common spellings of flags that exist here under another name (for "did you mean").
_ALIASES = {"learning-rate": "--lr", "lr-rate": "--lr", "max-seq-length": "--seq-length", "seq-len": "--seq-length",
            "max-length": "--seq-length", "tp": "--tensor-model-parallel-size", "pp": "--pipeline-model-parallel-size",
            "tensor-parallel-size": "--tensor-model-parallel-size", "num-samples": "--group-size",
            "num-rollout-workers": "--rollout-workers", "iterations": "--train-iters", "steps": "--train-iters",
            "kl-loss-coef": "--kl-coef", "max-response-length": "--max-new-tokens", "load-dir": "--load",
            "save-dir": "--save", "eps-clip": "--clip-ratio-low"}


def suggest_flag(name: str, parser: argparse.ArgumentParser) -> str | None:
    """The known flag nearest to ``name`` (dashes or underscores, with or without the leading ``--``), or None."""
    import difflib

    key = name.split("=", 1)[0].lstrip("-").replace("_", "-").lower()
    flags = {o.lstrip("-"): o for a in parser._actions for o in a.option_strings if o.startswith("--")}
    flags.pop("help", None)
    if key in _ALIASES:
        return _ALIASES[key]
    prefixed = sorted(f for f in flags if f.startswith(key)) if len(key) >= 3 else []
    if len(prefixed) == 1:  # an abbreviation (not accepted: the surface is exactly the list of flags)
        return flags[prefixed[0]]
    close = difflib.get_close_matches(key, [*flags, *_ALIASES], n=1, cutoff=0.6)
    if not close:
        return None
    return flags.get(close[0]) or _ALIASES[close[0]]


def unrecognized_message(parser: argparse.ArgumentParser, extras: Sequence[str]) -> str:
    """``unrecognized argument --lerning-rate; did you mean --lr?`` for the unknown tokens ``extras``."""
    unknown = [t.split("=", 1)[0] for t in extras if t.startswith("-")] or list(extras)
    hints = [suggest_flag(tok, parser) if tok.startswith("-") else None for tok in unknown]
    if len(unknown) == 1:
        return f"unrecognized argument {unknown[0]}" + (f"; did you mean {hints[0]}?" if hints[0] else "")
    parts = [f"{tok} (did you mean {hint}?)" if hint else tok for tok, hint in zip(unknown, hints)]
    return f"unrecognized arguments {', '.join(parts)}"


def _help_defaults() -> dict:
    """``TrainConfig().to_dict()`` as the snapshot ``help_defaults.py`` keeps (no torch import; a test keeps it
    current)."""
    from megatron_tsync.help_defaults import DEFAULTS

    return DEFAULTS


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The argument parser of a training run (no torch import). Omitted flags are absent from the namespace."""
    p = _Parser(prog=prog, description="megatron_tsync: streaming GRPO / on-policy distillation on Megatron-Core.",
                argument_default=argparse.SUPPRESS, allow_abbrev=False)
    p.add_argument("--config", metavar="FILE",
                   help="YAML or JSON file of flag values (keys: flag names without dashes); flags override it")
    groups: dict[str, argparse._ArgumentGroup] = {}
    for flag in _FLAGS:
        g = groups.get(flag.group) or groups.setdefault(flag.group, p.add_argument_group(flag.group))
        g.add_argument(*flag.names, dest=_dest(flag), **flag.kwargs)
    return p


# ------------------------------------------------------------------------------------------------------ --config
def _config_tokens(parser: argparse.ArgumentParser, path: str) -> list[str]:
    """The entries of a --config file as command-line tokens (placed before the real command line)."""
    try:
        with open(path) as fh:
            if path.endswith(".json"):
                import json

                data = json.load(fh)
            else:
                import yaml

                data = yaml.safe_load(fh)
    except (OSError, ValueError) as e:
        parser.error(f"argument --config: cannot read {path}: {e}")
    except Exception as e:  # noqa: BLE001 - yaml.YAMLError and friends
        parser.error(f"argument --config: cannot parse {path}: {e}")
    if data is None:
        return []
    if not isinstance(data, dict):
        parser.error(f"argument --config: {path} must hold a mapping of flag names to values")
    by_name = {opt.lstrip("-").replace("-", "_"): (opt, a) for a in parser._actions for opt in a.option_strings}
    tokens: list[str] = []
    for key, value in data.items():
        norm = str(key).replace("-", "_")
        if norm in ("config", "help", "h") or norm not in by_name:
            close = suggest_flag(str(key), parser) if norm not in ("config", "help", "h") else None
            hint = f" (did you mean {close.lstrip('-')!r}?)" if close else ""
            parser.error(f"argument --config: unknown key {key!r} in {path}{hint}; keys are flag names without "
                         "the leading dashes")
        opt, action = by_name[norm]
        if value is None:
            continue
        if isinstance(action, (argparse._StoreConstAction, argparse.BooleanOptionalAction)):  # switches
            if not isinstance(value, bool):
                parser.error(f"argument --config: key {key!r} in {path} is a switch: use true or false")
            if isinstance(action, argparse.BooleanOptionalAction):  # --X / --no-X: the config says which
                tokens.append(action.option_strings[0] if value else action.option_strings[1])
            elif value:
                tokens.append(opt)
        elif isinstance(value, (list, tuple)):
            tokens += [opt, *(_token(v) for v in value)]
        else:
            tokens.append(f"{opt}={_token(value)}")
    return tokens


def _token(value: Any) -> str:
    return repr(value) if isinstance(value, float) else str(value)


# ------------------------------------------------------------------------------------------------------ parse
def parse_args(argv: Sequence[str] | None = None, *, world_size: int | None = None) -> "C.TrainConfig":
    """Parse flags (and ``--config``) into a validated ``TrainConfig``; errors exit with code 2.

    world_size: ranks of the training job, to check TP × PP × CP divides it; default ``$WORLD_SIZE``, and the check
    is skipped when neither is known (e.g. parsing outside ``torchrun``).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    file_tokens = _config_tokens(parser, known.config) if known.config else []
    if file_tokens:  # the file's values alone first, so that a bad one is reported with the file's name
        in_file = build_parser()
        in_file.error = lambda msg: parser.error(f"{msg} (in --config {known.config})")  # type: ignore[method-assign]
        file_args = vars(in_file.parse_args(file_tokens))
    args = vars(parser.parse_args(file_tokens + argv))
    args.pop("config", None)
    if file_tokens:
        _tiny_model_scope(parser, file_args, args, argv, known.config)

    tree: dict[str, Any] = {}
    for dest, value in args.items():
        for path in _BY_DEST[dest].fields:
            _put(tree, path, value)
    _special(parser, args, tree)
    try:
        cfg = C.TrainConfig.from_dict(tree)
        if world_size is None and os.environ.get("WORLD_SIZE"):
            world_size = int(os.environ["WORLD_SIZE"])
        if world_size is not None:
            cfg.parallel.data_parallel_size(world_size)
    except C.ConfigError as e:
        parser.error(_from_file(_as_flag_error(e), file_tokens, argv, known.config))
    return cfg


def _tiny_model_scope(parser: argparse.ArgumentParser, file_args: dict, args: dict, argv: list[str],
                      path: str) -> None:
    """A ``--config`` file's ``init-tiny-model: true`` creates a tiny random model at the file's own ``model`` path
    only: with another ``--model`` on the command line (and no ``--init-tiny-model`` there) a folder that does not
    exist is an error, not a silently created random model (a mistyped path would otherwise train one, rc 0)."""
    given = {t.split("=", 1)[0] for t in argv if t.startswith("--")}
    if not file_args.get("init_tiny_model") or given & {"--init-tiny-model", "--no-init-tiny-model"}:
        return
    model = args.get("model")
    if model is None or model == file_args.get("model"):
        return
    args["init_tiny_model"] = False
    if "--tiny-model-family" not in given:  # the file's family belongs to the file's tiny model
        args.pop("tiny_model_family", None)
    if not os.path.isfile(os.path.join(model, "config.json")):
        parser.error(f"argument --model: {model} is not a Hugging Face model folder (no config.json); "
                     f"init-tiny-model in --config {path} creates a tiny random model only at its own model path "
                     f"({file_args.get('model')}): add --init-tiny-model to create one at {model}")


def _from_file(msg: str, file_tokens: list[str], argv: list[str], path: str | None) -> str:
    """``msg`` plus which of the flags it names were set by the ``--config`` file (and not on the command line)."""
    import re

    given = {t.split("=", 1)[0] for t in argv if t.startswith("--")}
    mine = {t.split("=", 1)[0] for t in file_tokens if t.startswith("--")} - given
    named = [f for f in dict.fromkeys(re.findall(r"--[a-z0-9][a-z0-9-]*", msg)) if f in mine]
    return f"{msg} ({', '.join(named)} set in --config {path})" if named else msg


def _put(tree: dict, path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[leaf] = value


def _special(parser: argparse.ArgumentParser, args: dict, tree: dict) -> None:
    """Flags that do not map one-to-one onto a field."""
    if args.get("micro_batch_size", 1) != 1:
        parser.error(f"argument --micro-batch-size: must be 1, got {args['micro_batch_size']}: streaming runs one "
                     "trajectory per microbatch (sequences per step are set by --global-batch-size)")
    if "min_lr" in args:
        lr = args["lr"] if "lr" in args else _default_lr()
        if args["min_lr"] != lr:
            parser.error(f"argument --min-lr: must equal --lr (there is no learning-rate schedule yet), got "
                         f"--min-lr {args['min_lr']} and --lr {lr}")
    if "global_batch_size" in args:
        gbs = args["global_batch_size"]
        g = args.get("group_size", C.RLConfig().group_size)
        if gbs < 1 or g < 1 or gbs % g:
            parser.error(f"argument --global-batch-size: {gbs} is not a positive multiple of --group-size {g} "
                         "(trajectories per step = groups per step × group size)")
        if "groups_per_step" in args and args["groups_per_step"] * g != gbs:
            parser.error(f"arguments --global-batch-size/--groups-per-step: --global-batch-size {gbs} != "
                         f"--groups-per-step {args['groups_per_step']} × --group-size {g}")
        _put(tree, "rl.groups_per_step", gbs // g)
    if "max_staleness" in args and args.get("rl_mode") != "async":
        parser.error(f"argument --max-staleness: only applies to --rl-mode async, got --rl-mode "
                     f"{args.get('rl_mode', _default_mode())}")
    if "kl_estimator" in args and args.get("kl_mode", "none") == "none":
        parser.error("argument --kl-estimator: has no effect without --kl-mode loss or reward")
    if "fp8_recipe" in args and "fp8_format" not in args:
        parser.error("argument --fp8-recipe: has no effect without --fp8-format")
    if "replay_rollouts" in args and "rollout_workers" not in args:
        _put(tree, "rollout.num_workers", 0)  # replaying needs no workers; an explicit count > 0 is an error
    _reward_spec(parser, args, tree)


def _default_mode() -> str:
    from megatron_tsync.training.learner import LearnerConfig

    return LearnerConfig().mode


def _default_lr() -> float:
    from megatron_tsync.training.optimizer import OptimConfig

    return OptimConfig().lr


def _reward_spec(parser: argparse.ArgumentParser, args: dict, tree: dict) -> None:
    """learner.reward_spec from --reward-kind/--reward-range, else from what the verifier declares."""
    base = C.reward_spec_for_verifier(args.get("verifier", C.RolloutConfig().verifier))
    kind = args.get("reward_kind", base.kind)
    given_range = args.get("reward_range")
    if kind == "continuous":
        if given_range is not None:
            parser.error("arguments --reward-kind/--reward-range: continuous rewards are unbounded; drop "
                         "--reward-range or choose --reward-kind bounded")
        lo, hi = -float("inf"), float("inf")
    elif given_range is not None:
        lo, hi = given_range
        if "reward_kind" not in args and base.kind == "continuous":
            kind = "bounded"
    elif base.is_bounded:
        lo, hi = base.lo, base.hi
    else:
        parser.error(f"argument --reward-kind: {kind} rewards need --reward-range LO HI "
                     f"(the verifier declares unbounded rewards)")
    _put(tree, "learner.reward_spec", {"kind": kind, "lo": lo, "hi": hi})


def _as_flag_error(e: C.ConfigError) -> str:
    """A ConfigError as a flag error: fields named by dotted path become the flags that set them."""
    msg = str(e)
    paths = sorted({*e.fields, *re.findall(r"\b[a-z_]+(?:\.[a-z_0-9]+)+\b", msg)}, key=len, reverse=True)
    flags: list[str] = []
    for path in paths:
        flag = flag_for_field(path)
        if flag is None:
            continue
        msg = re.sub(rf"(?<![\w.-]){re.escape(path)}(?![\w.])", flag, msg)
        if path in e.fields and flag not in flags:
            flags.append(flag)
    missing = [f for f in flags if f not in msg]
    if missing:
        return f"argument{'s' if len(missing) > 1 else ''} {'/'.join(missing)}: {msg}"
    return msg
