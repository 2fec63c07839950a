"""The sections of the run's configuration that have no other home: ``ModelConfig``, ``ParallelConfig``,
``RLConfig``, ``RolloutConfig``, ``CheckpointConfig``, ``LoggingConfig``, with the accepted values of their string
fields. Each checks its own fields in ``__post_init__`` (:class:`~.plain.ConfigError` naming them by dotted path).
Standard library only (the sampling check loads ``rollout.engine`` when it runs).
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from typing import Any, Mapping

from megatron_tsync.config.plain import ConfigError, _check, _from_plain, _to_plain

# Accepted values of the string fields. Those owned by a registry elsewhere (advantage estimators, aggregations, KL
# estimators, policy-loss kinds) are pinned against it by tests/test_config.py; the copies exist so that building
# the argument parser needs no torch import.
RL_ALGORITHMS = ("grpo", "opd")
RL_MODES = ("sync", "stream-group", "stream-trajectory", "async", "stream-turn")
OPD_OBJECTIVES = ("sampled", "full-vocab")
ADVANTAGE_ESTIMATORS = ("grpo", "grpo_unbiased", "dr_grpo", "rloo", "grpo_batch_std")
POLICY_LOSSES = ("ppo_clip", "none")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3")
KL_MODES = ("none", "loss", "reward")
AUX_STRATEGIES = ("second-backward", "defer")
OLD_LOGPROBS = ("trainer", "engine")
OPTIMIZERS = ("adam", "sgd")
PARAMS_DTYPES = ("float32", "float64")
FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("delayed", "tensorwise", "mxfp8", "blockwise")
REWARD_KINDS = ("binary", "bounded", "continuous")
ROLLOUT_ENGINES = ("embedded", "vllm")
WEIGHT_SYNCS = ("file", "broadcast")
RECOMPUTE_GRANULARITIES = ("full", "selective")  # megatron-core TransformerConfig.recompute_granularity
RECOMPUTE_METHODS = ("uniform", "block")  # TransformerConfig.recompute_method
TINY_FAMILIES = ("llama", "qwen2", "qwen3", "llama3", "qwen3_moe", "qwen3_5")  # model/tiny_model.FAMILIES (a test keeps them equal)
LATENCY_PROFILES = ("none", "uniform", "swe-like", "independent")


def _check_sampling(section: Any, prefix: str) -> None:
    """The section's fields named like a field of the engines' ``SamplingConfig`` (``rollout/engine.py``), checked by
    ``SamplingConfig`` itself: its rules are written once, where they are used, and reported here by dotted path."""
    from megatron_tsync.rollout.engine import SamplingConfig

    own = {f.name for f in dataclasses.fields(section)}
    names = [f.name for f in dataclasses.fields(SamplingConfig) if f.name in own]
    try:
        SamplingConfig(**{n: getattr(section, n) for n in names})
    except ValueError as e:  # its messages start with the field's name
        head = str(e).split(" ", 1)[0]
        raise ConfigError(f"{prefix}.{e}", *([f"{prefix}.{head}"] if head in names else [])) from None


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """Linux's CPU-list syntax (``/proc/<pid>/status`` ``Cpus_allowed_list``, ``taskset -c``): ``"0-3,8"`` →
    ``(0, 1, 2, 3, 8)``, sorted, without duplicates. ValueError on anything else (empty, negative, ``3-1``)."""
    out: set[int] = set()
    for part in str(text).replace(" ", "").split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if m is None:
            raise ValueError(f"{text!r} is not a CPU list (like 0-3,8): bad part {part!r}")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise ValueError(f"{text!r} is not a CPU list (like 0-3,8): range {part!r} runs backwards")
        out.update(range(lo, hi + 1))
    return tuple(sorted(out))


def _check_cpus(text: str | None, path: str) -> None:
    if text is None:
        return
    try:
        parse_cpu_list(text)
    except ValueError as e:
        raise ConfigError(f"{path}: {e}", path) from None


class _Section:
    """``to_dict`` / ``from_dict`` of one section on its own (what a rollout worker's spec carries)."""

    _PATH: typing.ClassVar[str]

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (JSON/YAML-safe), as in ``TrainConfig.to_dict``."""
        return _to_plain(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]):
        """Inverse of ``to_dict``; missing keys take their defaults, unknown keys are a ConfigError naming them."""
        return _from_plain(cls, data, cls._PATH)


# ------------------------------------------------------------------------------------------------------ sections
@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The policy model."""

    path: str | None = None
    """Hugging Face model folder (config.json, tokenizer, safetensors) the policy is initialised from."""
    init_tiny_model: bool = False
    """Create a tiny random model at ``path`` if the folder does not exist yet (quickstart and tests)."""
    tiny_model_family: str = "llama"
    """The family of the tiny model ``init_tiny_model`` creates (``model/tiny_model.py``): llama, qwen2, qwen3,
    llama3 or qwen3_moe (4 experts, top-2); the CPU recipes of each family use it."""
    sft_warmup_steps: int = 0
    """Supervised warm-start steps on the task's demonstrations before RL (0 = off)."""
    sft_warmup_lr: float | None = None
    """Learning rate of the warm start (Adam); None = ``training.sft.WARM_START_OPTIM``'s 1e-3, which suits the
    128-wide quickstart model; wider models want less (a 512 x 4-layer one: 3e-4)."""
    moe_aux_loss_coeff: float = 0.0
    """MoE load-balancing loss coefficient (megatron's ``--moe-aux-loss-coeff``). Only 0 is accepted: megatron
    injects the aux-loss gradient inside the policy-loss backward, and streaming scales a trajectory's backward by
    its advantage coefficients, so the term would be advantage-weighted (not exact; ``model/moe.py``)."""
    moe_router_replay: bool = False
    """MoE router replay: engines record the experts each token was routed to, the events carry them, and the
    learner's forwards (training, π_θ0, OPD's turns) route every token to those experts (``model/moe.py``)."""
    ref_model: str | None = None
    """Hugging Face folder of the KL term's reference model, built like the policy (same builder, conversion and
    TP/PP layout; ``training/reference.py``); None = a frozen copy of the policy's initial weights (after ``load``
    and the warm start; saved under ``SAVE/reference`` for resumes). Needs ``learner.loss.kl_mode`` loss or reward."""

    recompute_granularity: str | None = None
    """Activation recomputation of the learner's policy model (megatron's ``--recompute-granularity``): ``full``
    keeps only each recomputed layer's input and re-runs the layer in the backward, ``selective`` re-runs the core
    attention only (megatron-core's default ``recompute_modules``); None = keep every activation. Only the trained
    model recomputes: the frozen reference, teacher and rollout engine never run a backward."""
    recompute_method: str | None = None
    """With ``full``: ``uniform`` checkpoints every chunk of ``recompute_num_layers`` layers, ``block`` the first
    ``recompute_num_layers`` layers of each pipeline stage (the rest keep their activations)."""
    recompute_num_layers: int | None = None
    """With ``full``: layers per checkpointed chunk (uniform) or layers recomputed per pipeline stage (block);
    between 1 and the layers of one stage (checked when the model is built)."""

    def recompute_overrides(self) -> dict[str, Any]:
        """The TransformerConfig fields of the recomputation flags ({} when off), for the policy's ``build_model``."""
        if self.recompute_granularity is None:
            return {}
        return dict(recompute_granularity=self.recompute_granularity, recompute_method=self.recompute_method,
                    recompute_num_layers=self.recompute_num_layers)

    def _check_recompute(self) -> None:
        """megatron-core 0.16.1's TransformerConfig rules, refused before anything is built."""
        g, m, n = self.recompute_granularity, self.recompute_method, self.recompute_num_layers
        names = ("model.recompute_granularity", "model.recompute_method", "model.recompute_num_layers")
        _check(g is None or g in RECOMPUTE_GRANULARITIES,
               f"model.recompute_granularity must be one of {RECOMPUTE_GRANULARITIES}, got {g!r}", names[0])
        _check(m is None or m in RECOMPUTE_METHODS,
               f"model.recompute_method must be one of {RECOMPUTE_METHODS}, got {m!r}", names[1])
        _check(g is not None or (m is None and n is None),
               "model.recompute_method / recompute_num_layers need model.recompute_granularity full", *names)
        _check(g != "full" or (m is not None and n is not None),
               "model.recompute_granularity full needs model.recompute_method (uniform|block) and "
               "model.recompute_num_layers (megatron-core refuses it without them)", *names)
        _check(g != "selective" or (m is None and n is None),
               "model.recompute_granularity selective recomputes core attention in every layer: "
               "model.recompute_method and recompute_num_layers apply to full only", *names)
        _check(n is None or n >= 1, f"model.recompute_num_layers must be >= 1, got {n}", names[2])

    def __post_init__(self) -> None:
        self._check_recompute()
        _check(not (self.moe_router_replay and self.recompute_granularity),
               "model.moe_router_replay with model.recompute_granularity is refused: the recomputed forward in the "
               "backward would route by the router's own top-k, not the replayed experts (model/moe.py)",
               "model.moe_router_replay", "model.recompute_granularity")
        _check(self.moe_aux_loss_coeff == 0.0,
               f"model.moe_aux_loss_coeff {self.moe_aux_loss_coeff} is refused: megatron adds the MoE load-balancing "
               "gradient inside the policy-loss backward, which streaming scales by the trajectory's advantage "
               "coefficients, so streamed gradients would not equal sync ones (only 0 is exact; see model/moe.py)",
               "model.moe_aux_loss_coeff")
        _check(self.tiny_model_family in TINY_FAMILIES,
               f"model.tiny_model_family must be one of {TINY_FAMILIES}, got {self.tiny_model_family!r}",
               "model.tiny_model_family")
        _check(self.tiny_model_family == "llama" or self.init_tiny_model,
               "model.tiny_model_family needs model.init_tiny_model (it picks the family of the tiny model created)",
               "model.tiny_model_family", "model.init_tiny_model")
        _check(not self.init_tiny_model or bool(self.path),
               "model.init_tiny_model needs model.path (the folder to create the tiny model in)",
               "model.init_tiny_model", "model.path")
        _check(self.sft_warmup_steps >= 0, f"model.sft_warmup_steps must be >= 0, got {self.sft_warmup_steps}",
               "model.sft_warmup_steps")
        _check(self.sft_warmup_lr is None or self.sft_warmup_lr > 0,
               f"model.sft_warmup_lr must be > 0, got {self.sft_warmup_lr}", "model.sft_warmup_lr")


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """Model parallelism of the learner (data parallelism is whatever the world size leaves)."""

    tensor_model_parallel_size: int = 1
    """Tensor-parallel ranks per model replica (TP)."""
    pipeline_model_parallel_size: int = 1
    """Pipeline stages per model replica (PP)."""
    context_parallel_size: int = 1
    """Context-parallel ranks per model replica (CP: a trajectory's sequence split across ranks)."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state across data-parallel ranks (Megatron's distributed optimizer)."""
    expert_model_parallel_size: int = 1
    """MoE experts split over this many ranks (EP, taken from the data-parallel ranks). Every MoE layer's token
    all-to-all spans the EP ranks, which stream different trajectories: the learner keeps them in lockstep, one
    gradient destination per slot, idle microbatches where a rank has nothing (``model.parallel.ExpertLockstep``,
    ``training.stream_fb``; with ``--deterministic`` one trajectory per slot over the EP group; the OPD learner's
    turn forwards in lanes, ``training.opd_lanes``). Every learner feature: docs/moe_matrix.md."""
    trainer_cpus: str | None = None
    """CPU cores the trainer ranks of a node run on (a CPU list, ``"0-3,8"``): every thread of the rank is pinned to
    them (``os.sched_setaffinity``) and torch's intra-op threads set to their number; several ranks on a node
    split the list into contiguous shares when it has a core per rank (``runtime/affinity.py``). None = unpinned
    (torch threads from ``OMP_NUM_THREADS``)."""

    def __post_init__(self) -> None:
        _check_cpus(self.trainer_cpus, "parallel.trainer_cpus")
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                     "expert_model_parallel_size"):
            value = getattr(self, name)
            _check(value >= 1, f"parallel.{name} must be >= 1, got {value}", f"parallel.{name}")

    @property
    def model_parallel_size(self) -> int:
        """Ranks per model replica: TP × PP × CP."""
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size

    def data_parallel_size(self, world_size: int) -> int:
        """DP = world_size / (TP × PP × CP); raises ConfigError when it does not divide."""
        mp = self.model_parallel_size
        _check(world_size % mp == 0,
               f"world size {world_size} is not divisible by parallel.tensor_model_parallel_size × "
               f"parallel.pipeline_model_parallel_size × parallel.context_parallel_size = {mp}",
               "parallel.tensor_model_parallel_size", "parallel.pipeline_model_parallel_size",
               "parallel.context_parallel_size")
        return world_size // mp


@dataclasses.dataclass(frozen=True)
class RLConfig(_Section):
    """The RL loop: algorithm, step size in trajectories, trajectory limits."""

    _PATH: typing.ClassVar[str] = "rl"

    algorithm: str = "grpo"
    """"grpo" (group-relative policy optimisation on verifier rewards) or "opd" (on-policy distillation from
    ``rollout.teacher_model``)."""
    opd_objective: str = "sampled"
    """OPD only: "sampled" (per-token reverse KL on the sampled tokens, needs teacher log-probs) or "full-vocab"
    (Σ_v π_s(v)(log π_s(v) − log π_t(v)) per token: needs the teacher's full logits, scored by
    ``rollout.teacher_model`` on the learner side and kept until the turn's forward: tokens × vocab floats per open
    trajectory, e.g. 8k tokens × 152k vocab × 4 B ≈ 5 GB)."""
    train_iters: int = 100
    """Optimizer steps to train for."""
    group_size: int = 8
    """Trajectories sampled per prompt (G); advantages are relative within a group."""
    groups_per_step: int = 4
    """Prompts (groups) per optimizer step: a step consumes groups_per_step × group_size trajectories."""
    max_turns: int = 4
    """Generated turns per trajectory (a turn ends at a tool call, an answer, EOS or max_new_tokens)."""
    max_new_tokens: int = 64
    """Generated tokens per turn at most (the engines' ``SamplingConfig.max_new_tokens``)."""
    seq_length: int = 1024
    """Tokens per trajectory at most: prompt + every turn + tool results."""
    max_staleness: int = 0
    """Async mode only (``learner.mode == "async"``, then > 0): how many optimizer steps older than the
    trainer the policy that generated a trajectory may be. 0 otherwise."""
    seed: int = 1234
    """Seed of prompt sampling, rollout sampling and model initialisation."""
    max_consecutive_skipped_steps: int = 3
    """Stop the run (exit code 3, no checkpoint) after this many steps in a row whose optimizer update was skipped for
    a non-finite loss or gradient (``training/barrier.py``, ``runtime/stop.py``); 0: never stop."""

    @property
    def max_action_tokens(self) -> int:
        """L_max of ``seq-mean-token-sum-norm``: the most action (loss) tokens one trajectory can have,
        min(max_turns × max_new_tokens, seq_length) — every turn generates at most max_new_tokens, and the whole
        trajectory is cut at seq_length. A constant known before the batch (Dr.GRPO's generation budget)."""
        return min(self.max_turns * self.max_new_tokens, self.seq_length)

    def __post_init__(self) -> None:
        _check(self.algorithm in RL_ALGORITHMS, f"rl.algorithm must be one of {RL_ALGORITHMS}, got {self.algorithm!r}",
               "rl.algorithm")
        _check(self.opd_objective in OPD_OBJECTIVES,
               f"rl.opd_objective must be one of {OPD_OBJECTIVES}, got {self.opd_objective!r}", "rl.opd_objective")
        for name in ("train_iters", "group_size", "groups_per_step", "max_turns", "seq_length"):
            value = getattr(self, name)
            _check(value >= 1, f"rl.{name} must be >= 1, got {value}", f"rl.{name}")
        _check_sampling(self, "rl")
        _check(self.max_staleness >= 0, f"rl.max_staleness must be >= 0, got {self.max_staleness}",
               "rl.max_staleness")
        _check(self.max_consecutive_skipped_steps >= 0,
               f"rl.max_consecutive_skipped_steps must be >= 0, got {self.max_consecutive_skipped_steps}",
               "rl.max_consecutive_skipped_steps")
        _check(self.max_new_tokens <= self.seq_length,
               f"rl.max_new_tokens ({self.max_new_tokens}) exceeds rl.seq_length ({self.seq_length})",
               "rl.max_new_tokens", "rl.seq_length")

    @property
    def sequences_per_step(self) -> int:
        """Trajectories per optimizer step (Megatron's global batch size)."""
        return self.groups_per_step * self.group_size


@dataclasses.dataclass(frozen=True)
class RolloutConfig(_Section):
    """Where trajectories come from: inference engine, task, verifier, sampling, simulated latency, transport.

    The sampling fields (``temperature``, ``top_k``, ``top_p``) carry the names of ``rollout.engine.SamplingConfig``'s
    fields, which validates them and is built from them by name (``SamplingConfig.from_config``)."""

    _PATH: typing.ClassVar[str] = "rollout"

    engine: str = "embedded"
    """"embedded" (the Megatron model itself generates) or "vllm"."""
    engine_tensor_parallel_size: int = 1
    """Tensor-parallel size of each rollout worker's vLLM engine: the GPUs one worker uses (``slurm/launch_node.sh``
    gives a worker ``ROLLOUT_GPUS_PER_WORKER`` GPUs and ``slurm/common.sh`` passes that number). > 1 runs vLLM's
    engine core in its own processes; needs ``engine`` "vllm"."""
    num_workers: int = 1
    """Rollout worker processes. Must be 0 when replaying recorded rollouts (``logging.replay_rollouts``)."""
    task: str = "arithmetic-calculator"
    """Task name in ``runtime.tasks``'s registry (the prompt source)."""
    verifier: str = "exact_answer"
    """Verifier name in ``rollout.verifiers``'s registry (the reward); passed to the task."""
    tau2_keep_trivial_tasks: bool = False
    """τ² tasks (``runtime/tau2_tasks.py``): keep the tasks a do-nothing conversation solves (τ²'s evaluator scores
    it 1.0). False: they are left out of both splits (training and held-out evaluation). Only τ² tasks accept it."""
    temperature: float = 1.0
    """Sampling temperature (> 0; greedy is top_k 1); the learner's log-probs use the same temperature."""
    top_k: int = 0
    """Keep the k most likely tokens when sampling (0 = off)."""
    top_p: float = 1.0
    """Nucleus sampling threshold in (0, 1] (1 = off)."""
    latency_profile: str = "none"
    """Simulated environment latency: "none", "uniform", "swe-like", "independent", or a path to a JSON profile."""
    latency_scale: float = 1.0
    """Multiplier (seconds) applied to the latency profile's delays."""
    endpoint: str | None = None
    """ZeroMQ endpoint trajectories arrive on; None = an ipc:// socket in the run directory."""
    secret_file: str | None = None
    """File holding the transport's shared HMAC key; None = generate a fresh key per run."""
    max_num_seqs: int = 0
    """Requests one engine call of a rollout worker takes at most (vLLM's ``max_num_seqs``; the embedded engine
    batches every waiting request when 0). 0: the engine's default (vLLM: 256)."""
    frontier_first: bool = False
    """Frontier-first rollouts: the engine serves the trajectories of earlier groups ahead of later ones, so the
    oldest open groups close first and the learner holds fewer open buckets. vLLM: its ``priority`` scheduling
    policy with each request's group order; the embedded engine: the earliest requests when more wait than
    ``max_num_seqs`` (which it needs)."""
    sandbox_timeout_s: float = 10.0
    """Wall-clock limit of one sandboxed tool call, seconds."""
    teacher_model: str | None = None
    """Teacher model (Hugging Face folder) for on-policy distillation; None for GRPO."""
    launch: str = "local"
    """"local": the trainer starts its rollout workers as subprocesses. "external": it only writes their specs
    (``run_dir/worker{w}.json``), the secret and each weight version into ``run_dir`` (a shared filesystem) and waits
    for workers started elsewhere (srun on rollout nodes) with ``python -m megatron_tsync.runtime.worker SPEC``."""
    run_dir: str | None = None
    """Rollout-plane directory (specs, secret, weight versions, worker logs); None = ``SAVE/rollout_plane``."""
    weight_sync: str = "file"
    """How each version's weights reach the engines: "file" (signed safetensors in ``run_dir``, a shared
    filesystem) or "broadcast" (a process group of the trainer's rank 0 and the workers: gloo with CPU tensors;
    NCCL when the engines are vLLM on GPUs, not run on a GPU yet). See ``transport/weight_broadcast.py``."""
    weight_sync_bucket_mb: int = 256
    """Broadcast bucket size in MiB (the sender's staging buffer; tensors larger than a bucket are split)."""
    stall_timeout_s: float = 1800.0
    """The learner gives up on a step (TimeoutError naming the trajectories still missing) when no event arrived for
    this many seconds while every worker process is alive."""
    heartbeat_timeout_s: float = 60.0
    """A rollout worker whose heartbeat (``run_dir/hb/worker{w}.json``) has not changed for this many seconds is
    declared hung (killed, if the trainer started it) and its trajectories re-dispatched; a worker that sees no
    change of the trainer's heartbeat for this long exits (``runtime/supervision.py``)."""
    worker_retries: int = 2
    """Worker failures (dead or hung) one run survives by re-dispatching the failed worker's trajectories to live
    workers; one more fails the step with a checkpoint saved and a message naming the worker and its trajectories."""
    cpus: str | None = None
    """CPU cores the rollout workers run on (a CPU list, ``"4-7"``), and with them their engines and sandboxed tool
    calls (children inherit the mask): workers the trainer starts split the list into contiguous shares when it has
    a core per worker, external workers take all of it; torch's intra-op threads = the cores of the share
    (``runtime/affinity.py``). None = the cores the trainer was started with, 1 torch thread per worker."""
    gpus: str | None = None
    """GPUs of the rollout workers the trainer starts on its node (``"4,5,6,7"`` or ``"4-7"``): worker ``w`` gets
    ``CUDA_VISIBLE_DEVICES`` = its ``engine_tensor_parallel_size`` ids of the list, in order; the trainer's own GPUs
    must not overlap them (checked at start-up, ``runtime/launch_env.py``). None = workers inherit the trainer's
    devices. Needs ``launch`` "local" (srun places external workers)."""
    speculative: bool = False
    """Speculative next-batch rollouts (``rollout/speculative.py``): while a worker waits for θ_{k+1} it drafts the
    first turn of its step-(k+1) trajectories under θ_k, and verifies each draft exactly under θ_{k+1} when the
    weights land (kept with min(1, p/q), the first rejection redrawn from max(0, p − q)): the trajectories follow
    π_{k+1}, zero staleness. Embedded engine, file weight hand-off, not in async mode."""
    speculative_draft_tokens: int = 0
    """Cap on the tokens drafted per trajectory (0 = the whole first turn, up to its token cap)."""
    harness_cmd: str | None = None
    """Harness-driven rollouts (``runtime/harness.py``, docs/harness.md): each worker serves the OpenAI-compatible
    endpoint on its engine and runs this shell command once per episode (env: ``OPENAI_BASE_URL``,
    ``TSYNC_EPISODE_ID``, ``TSYNC_TASK``, ...). None = the native agent loop."""
    harness_fn: str | None = None
    """Harness-driven rollouts with an importable async function ``"module:function"`` called once per episode in the
    worker's event loop (``await fn(base_url=..., episode_id=..., task=..., model=...)``); excludes ``harness_cmd``."""
    harness_timeout_s: float = 300.0
    """Wall-clock limit of one harness episode: past it the command is killed (or the coroutine cancelled) and the
    episode counts as a failed trajectory (``harness_timeout``)."""
    harness_chat_format: str = "model"
    """How the endpoint renders messages: "model" (the model folder's chat template, Qwen-style ``<tool_call>``) or
    "tag" (the agent loop's ``<tool>NAME: ARGS</tool>`` / ``<result>`` text, ``rollout/tag_chat.py``: models trained
    on native transcripts, e.g. the tiny agent)."""

    def __post_init__(self) -> None:
        _check_cpus(self.cpus, "rollout.cpus")
        gpu_list = r"\d+(-\d+)?(,\d+(-\d+)?)*"
        _check(self.gpus is None or re.fullmatch(gpu_list, self.gpus.replace(" ", "")) is not None,
               f"rollout.gpus must be a GPU list like 4,5,6,7 or 4-7, got {self.gpus!r}", "rollout.gpus")
        _check(self.gpus is None or self.launch == "local", "rollout.gpus places the workers the trainer starts "
               "(rollout.launch local); external workers get their GPUs from their launcher", "rollout.gpus",
               "rollout.launch")
        _check(self.launch in ("local", "external"), f"rollout.launch must be 'local' or 'external', got "
               f"{self.launch!r}", "rollout.launch")
        _check(self.engine in ROLLOUT_ENGINES, f"rollout.engine must be one of {ROLLOUT_ENGINES}, got {self.engine!r}",
               "rollout.engine")
        _check(self.num_workers >= 0, f"rollout.num_workers must be >= 0, got {self.num_workers}",
               "rollout.num_workers")
        _check(bool(self.task), "rollout.task must name a task", "rollout.task")
        _check(bool(self.verifier), "rollout.verifier must name a verifier", "rollout.verifier")
        _check(self.engine_tensor_parallel_size >= 1, f"rollout.engine_tensor_parallel_size must be >= 1, got "
               f"{self.engine_tensor_parallel_size}", "rollout.engine_tensor_parallel_size")
        _check(self.engine_tensor_parallel_size == 1 or self.engine == "vllm",
               f"rollout.engine_tensor_parallel_size {self.engine_tensor_parallel_size} needs rollout.engine vllm "
               f"(the {self.engine} engine runs on one device)", "rollout.engine_tensor_parallel_size",
               "rollout.engine")
        _check_sampling(self, "rollout")
        _check(self.latency_profile in LATENCY_PROFILES or self.latency_profile.endswith(".json"),
               f"rollout.latency_profile must be one of {LATENCY_PROFILES} or a path to a .json profile, "
               f"got {self.latency_profile!r}", "rollout.latency_profile")
        _check(self.latency_scale >= 0 and math.isfinite(self.latency_scale),
               f"rollout.latency_scale must be >= 0, got {self.latency_scale}", "rollout.latency_scale")
        _check(self.sandbox_timeout_s > 0, f"rollout.sandbox_timeout_s must be > 0, got {self.sandbox_timeout_s}",
               "rollout.sandbox_timeout_s")
        _check(self.weight_sync in WEIGHT_SYNCS, f"rollout.weight_sync must be one of {WEIGHT_SYNCS}, got "
               f"{self.weight_sync!r}", "rollout.weight_sync")
        _check(self.max_num_seqs >= 0, f"rollout.max_num_seqs must be >= 0 (0: the engine's default), got "
               f"{self.max_num_seqs}", "rollout.max_num_seqs")
        _check(not self.frontier_first or self.engine == "vllm" or self.max_num_seqs > 0,
               "rollout.frontier_first orders the requests an engine call takes when more wait than it takes: the "
               "embedded engine takes every waiting request unless rollout.max_num_seqs caps it (give "
               "--rollout-max-num-seqs N)", "rollout.frontier_first", "rollout.max_num_seqs")
        _check(not (self.frontier_first and (self.harness_cmd or self.harness_fn)),
               "rollout.frontier_first orders the built-in agent loop's requests; a harness sends its own",
               "rollout.frontier_first", "rollout.harness_cmd")
        _check(self.speculative_draft_tokens >= 0, f"rollout.speculative_draft_tokens must be >= 0, got "
               f"{self.speculative_draft_tokens}", "rollout.speculative_draft_tokens")
        _check(not self.speculative or (self.engine == "embedded" and self.weight_sync == "file"),
               "rollout.speculative drafts and verifies on the embedded engine with the file weight hand-off (the "
               f"worker drafts while it waits for the next version's file); got engine {self.engine}, weight_sync "
               f"{self.weight_sync}", "rollout.speculative", "rollout.engine", "rollout.weight_sync")
        _check(not (self.harness_cmd and self.harness_fn), "rollout.harness_cmd and rollout.harness_fn are two ways to "
               "name the harness: give one", "rollout.harness_cmd", "rollout.harness_fn")
        _check(not self.harness_fn or (":" in self.harness_fn and all(self.harness_fn.split(":", 1))),
               f"rollout.harness_fn must be 'module:function', got {self.harness_fn!r}", "rollout.harness_fn")
        _check(self.harness_timeout_s > 0 and math.isfinite(self.harness_timeout_s),
               f"rollout.harness_timeout_s must be > 0, got {self.harness_timeout_s}", "rollout.harness_timeout_s")
        _check(self.harness_chat_format in ("model", "tag"), f"rollout.harness_chat_format must be 'model' or 'tag', "
               f"got {self.harness_chat_format!r}", "rollout.harness_chat_format")
        _check(not (self.speculative and (self.harness_cmd or self.harness_fn)), "rollout.speculative drafts the native "
               "agent loop's first turns; a harness drives its own episodes", "rollout.speculative",
               "rollout.harness_cmd")
        _check(1 <= self.weight_sync_bucket_mb <= 16384, f"rollout.weight_sync_bucket_mb must be in [1, 16384], got "
               f"{self.weight_sync_bucket_mb}", "rollout.weight_sync_bucket_mb")
        _check(self.stall_timeout_s > 0, f"rollout.stall_timeout_s must be > 0, got {self.stall_timeout_s}",
               "rollout.stall_timeout_s")
        _check(self.heartbeat_timeout_s > 0 and math.isfinite(self.heartbeat_timeout_s),
               f"rollout.heartbeat_timeout_s must be > 0, got {self.heartbeat_timeout_s}", "rollout.heartbeat_timeout_s")
        _check(self.worker_retries >= 0, f"rollout.worker_retries must be >= 0, got {self.worker_retries}",
               "rollout.worker_retries")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Megatron distributed checkpoints of model, optimizer and step."""

    load: str | None = None
    """Checkpoint directory to resume from (None = start from ``model.path``)."""
    save: str | None = None
    """Checkpoint directory to save to (None = never save)."""
    save_interval: int | None = None
    """Save every this many steps (None = only at the end of training, when ``save`` is set)."""
    finetune: bool = False
    """Load only the model weights from ``load``: ignore its optimizer state and step counter."""
    load_fallback: bool = False
    """When the latest checkpoint of ``load`` fails its checksums (a file missing, truncated or altered), resume from
    the newest older one that verifies instead of stopping (a warning names the damaged file)."""
    keep_last: int | None = None
    """After each save keep only the newest this many checkpoints of ``save`` (None = keep all)."""
    exit_duration_in_mins: float | None = None
    """Stop after this many minutes of wall time since the trainer process started: decided at a step boundary,
    agreed by every rank, a checkpoint saved, exit 0 with ``SAVE/tsync_stop.json`` saying ``"finished": false``
    (``runtime/stop.py``). None = no budget."""
    override_loaded_config: bool = False
    """Resume even when the run-defining configuration saved in the checkpoint (model, algorithm, mode, group shape,
    lr, seed, precision: ``runtime/run_dir.RUN_FIELDS``) differs from this run's (a warning per field); without it a
    difference is an error listing each field."""

    def __post_init__(self) -> None:
        _check(self.save_interval is None or self.save_interval >= 1,
               f"checkpoint.save_interval must be >= 1, got {self.save_interval}", "checkpoint.save_interval")
        _check(self.keep_last is None or self.keep_last >= 1,
               f"checkpoint.keep_last must be >= 1, got {self.keep_last}", "checkpoint.keep_last")
        _check(not self.load_fallback or self.load is not None, "checkpoint.load_fallback needs checkpoint.load",
               "checkpoint.load_fallback", "checkpoint.load")
        _check(self.keep_last is None or self.save is not None, "checkpoint.keep_last needs checkpoint.save",
               "checkpoint.keep_last", "checkpoint.save")
        _check(not self.finetune or self.load is not None, "checkpoint.finetune needs checkpoint.load",
               "checkpoint.finetune", "checkpoint.load")
        _check(self.exit_duration_in_mins is None or (self.exit_duration_in_mins > 0
                                                        and math.isfinite(self.exit_duration_in_mins)),
               f"checkpoint.exit_duration_in_mins must be > 0, got {self.exit_duration_in_mins}",
               "checkpoint.exit_duration_in_mins")
        _check(not self.override_loaded_config or self.load is not None,
               "checkpoint.override_loaded_config needs checkpoint.load", "checkpoint.override_loaded_config",
               "checkpoint.load")


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    """Metrics, progress and debugging dumps."""

    tensorboard_dir: str | None = None
    """TensorBoard event directory (None = no TensorBoard)."""
    log_interval: int = 1
    """Log metrics every this many steps."""
    dump_rollouts: str | None = None
    """Directory to record every step's trajectories in (replayable with ``replay_rollouts``)."""
    replay_rollouts: str | None = None
    """Directory of recorded trajectories to train on instead of generating (no rollout workers)."""
    replay_shuffle_seed: int | None = None
    """Replay each step's trajectories in a random arrival order drawn with this seed (None = recorded order)."""
    dump_grads: str | None = None
    """Directory to save the normalised gradient of each optimizer update in (after the DP reduction, before
    clipping): ``grad_step_{k:07d}``, or ``grad_step_{k:07d}_epoch_{e}_mb_{j}`` when a step makes several updates."""
    progress: bool = True
    """Show a progress bar."""
    wandb_project: str | None = None
    """Weights & Biases project: the TensorBoard scalars and the config also go to W&B (``runtime/wandb_log.py``;
    offline, into ``wandb_save_dir``, unless ``WANDB_MODE`` says otherwise or ``WANDB_API_KEY`` is set). None = off."""
    wandb_exp_name: str | None = None
    """W&B run name (None: W&B's own)."""
    wandb_save_dir: str | None = None
    """Directory W&B writes its run folder into (None: ``SAVE/wandb``, else ``./wandb``)."""
    eval_interval: int = 0
    """Held-out evaluation (``runtime/evaluation.py``) of the policy at the run's first step, every this many steps and
    at the end: the task's ``eval`` split, the real agent loop, tools and verifier, in trainer rank 0 (0 = off)."""
    eval_prompts: int = 128
    """Held-out prompts per evaluation: the same fixed set every time (the task's eval split, drawn with the seed)."""
    eval_greedy: bool = True
    """Greedy decoding for the evaluation (False: one sample per prompt at the rollout temperature, fixed seeds)."""
    stop_on_no_signal: int = 0
    """Stop the run (exit status 1, one line naming the causes, no stop record) after this many steps in a row
    without learning signal: every group zero-variance, every trajectory failed or rejected, or grad-norm 0
    (``runtime/signal_health.py``). 0 = never stop; the run warns once after min(5, this) such steps either way."""

    def __post_init__(self) -> None:
        _check(self.stop_on_no_signal >= 0,
               f"logging.stop_on_no_signal must be >= 0, got {self.stop_on_no_signal}", "logging.stop_on_no_signal")
        _check(self.log_interval >= 1, f"logging.log_interval must be >= 1, got {self.log_interval}",
               "logging.log_interval")
        _check(self.dump_rollouts is None or self.dump_rollouts != self.replay_rollouts,
               "logging.dump_rollouts and logging.replay_rollouts name the same directory: recording would "
               "overwrite the rollouts being replayed", "logging.dump_rollouts", "logging.replay_rollouts")
        _check(self.eval_interval >= 0, f"logging.eval_interval must be >= 0, got {self.eval_interval}",
               "logging.eval_interval")
        _check(self.eval_prompts >= 1, f"logging.eval_prompts must be >= 1, got {self.eval_prompts}",
               "logging.eval_prompts")
        _check(self.wandb_project is not None or (self.wandb_exp_name is None and self.wandb_save_dir is None),
               "logging.wandb_exp_name and logging.wandb_save_dir need logging.wandb_project", "logging.wandb_project")
