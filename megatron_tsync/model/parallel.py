"""Process groups from torchrun or SLURM environment variables; the one owner of topology.

gloo on CPU, NCCL on GPU. Tensor (TP), pipeline (PP), data (DP) and, on GPU, context (CP) parallelism via
megatron-core's ``parallel_state``. The run's orchestration and the learners receive a :class:`ParallelDims` (or the
groups/ranks taken from it) explicitly: ``runtime/`` (context, grpo, opd), ``training.learner.Learner`` (dp_rank,
pp_size), ``training.opd_learner.OPDLearner`` (dp/pp groups), ``training.sft.sft_warmup`` (dp_group), the planner.

What still reads megatron-core's global ``parallel_state`` (as megatron-core's own ``GPTModel``, DDP and pipeline
schedules do, so passing groups to these few helpers alone would not make the process stateless; megatron's
``pg_collection`` API for that differs between 0.16 and newer releases): ``model.builder.build_model`` (TP/PP size,
first/last stage), ``model.hf_conversion`` (TP/PP coordinates and groups of the weight gather),
``model.logprobs`` (the TP group when none is passed), ``training.checkpointing`` (the layout recorded in the
metadata), and :class:`ParallelDims`'s group accessors themselves.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import os

import torch
import torch.distributed as dist

from megatron_tsync.model import compat
from megatron_tsync.model.launcher import launcher_env  # noqa: F401 - re-exported (model.parallel.launcher_env)


@dataclasses.dataclass(frozen=True)
class ParallelDims:
    """Sizes and this process's coordinates. Groups are megatron-core's (``parallel_state``)."""

    world_size: int
    rank: int
    local_rank: int
    tp: int
    pp: int
    dp: int
    cp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    backend: str
    ep: int = 1  # expert-parallel ranks (MoE): experts split over EP ranks taken from DP (x CP)
    ep_rank: int = 0

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def is_logging_rank(self) -> bool:
        """The rank that prints and writes TensorBoard: DP 0, TP 0, last PP stage (where losses live)."""
        return self.dp_rank == 0 and self.tp_rank == 0 and self.is_last_stage

    def tp_group(self):
        from megatron.core import parallel_state as ps

        return ps.get_tensor_model_parallel_group()

    def pp_group(self):
        from megatron.core import parallel_state as ps

        return ps.get_pipeline_model_parallel_group()

    def dp_group(self):
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_group(with_context_parallel=True)

    def model_parallel_group(self):
        from megatron.core import parallel_state as ps

        return ps.get_model_parallel_group()


class PortInUse(RuntimeError):
    """The rendezvous port (MASTER_PORT) of a multi-process run is taken; the message says which and what to do."""


def initialize_parallel(
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    *,
    ep: int = 1,
    seed: int = 1234,
    backend: str | None = None,
    timeout_s: float = 600.0,
) -> ParallelDims:
    """Initialise torch.distributed and megatron-core model parallelism. Idempotent for the same sizes.

    ``ep``: expert-model-parallel size (MoE); megatron carves it out of the data-parallel (× CP) ranks, so
    world / (TP × PP) must divide by it (expert tensor parallelism = TP)."""
    from megatron.core import parallel_state as ps

    compat.install_cpu_support()
    rank, world, local_rank = launcher_env()
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    if cp > 1 and not torch.cuda.is_available():
        raise ValueError("context parallelism (--context-parallel-size > 1) needs GPUs; it is not supported on CPU")
    if world % (tp * pp * cp) != 0:
        raise ValueError(
            f"world size {world} is not divisible by TP×PP×CP = {tp}×{pp}×{cp}; "
            "choose --tensor-model-parallel-size / --pipeline-model-parallel-size that divide the process count"
        )
    if ep < 1 or (world // (tp * pp)) % ep != 0:
        raise ValueError(
            f"--expert-model-parallel-size {ep} must divide the data-parallel × context-parallel ranks "
            f"world / (TP × PP) = {world // (tp * pp)}"
        )
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        _destroy_at_exit(backend)
        if world == 1:
            # one process: an in-process store, no port. A port picked beforehand (bind to 0, close, export) can be
            # taken by another process before the store binds it (EADDRINUSE), and the 29500 default is taken by
            # any other single-process run on the node; nothing outside this process joins its default group
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29500")
            try:
                dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
            except (RuntimeError, OSError) as e:  # DistNetworkError (a RuntimeError) and friends
                if "EADDRINUSE" not in str(e) and "address already in use" not in str(e).lower():
                    raise
                raise PortInUse(f"MASTER_PORT {os.environ['MASTER_PORT']} on {os.environ['MASTER_ADDR']} is already "
                                f"in use by another process (rank {rank} of {world} could not listen on it): "
                                "export MASTER_PORT=<a free port> (or torchrun --master-port) and start again") \
                    from None
    if ps.model_parallel_is_initialized():
        if (ps.get_tensor_model_parallel_world_size() != tp or ps.get_pipeline_model_parallel_world_size() != pp
                or ps.get_expert_model_parallel_world_size() != ep):
            ps.destroy_model_parallel()
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
            **({"expert_model_parallel_size": ep} if ep > 1 else {}),
        )
    compat.model_parallel_seed(seed)
    torch.manual_seed(seed)
    return current_dims(backend)


def current_dims(backend: str | None = None) -> ParallelDims:
    from megatron.core import parallel_state as ps

    rank, _, local_rank = launcher_env()
    return ParallelDims(
        world_size=dist.get_world_size(),
        rank=dist.get_rank(),
        local_rank=local_rank,
        tp=ps.get_tensor_model_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_world_size(),
        dp=ps.get_data_parallel_world_size(),
        cp=ps.get_context_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        backend=backend or dist.get_backend(),
        ep=ps.get_expert_model_parallel_world_size(),
        ep_rank=ps.get_expert_model_parallel_rank(),
    )


class ExpertLockstep:
    """EP > 1: every MoE layer's token all-to-all (forward and backward) is a collective over the expert-parallel
    group, whose ranks are different data-parallel replicas. The streaming learner's replicas see the same arrivals
    in the same order (and so reach the same schedule points) but train different trajectories, so at each point
    they agree on the most microbatches any of them runs (:meth:`count`), and a rank with fewer runs idle ones
    (2 tokens, zero loss: they join the all-to-alls and add exact zeros to the gradient). At EP = 1 it is off and
    costs nothing.

    ``dp_ranks``: the data-parallel ranks of this expert-parallel group (the trajectories whose tokens can reach this
    rank's experts; the deterministic mode keeps a canonical vector for each of them, ``training.stream_fb``).

    ``one_per_slot`` (the deterministic mode): forward-only passes (:meth:`pad`) hold one real microbatch per slot over
    the group, rank by rank, instead of one per rank, so that a trajectory's bits do not depend on which trajectory
    another rank ran beside it (an expert's GEMM then holds the tokens of both, and a GEMM's rounding of a row may
    depend on the rows beside it). Measured: without it a live float32 run pair at EP = 2 with a KL reference
    differed in the 9th digit of the step's loss between arrival orders (the float64 worker test did not show it)."""

    def __init__(self, model_config=None):
        from megatron.core import parallel_state as ps

        moe = model_config is None or bool(getattr(model_config, "num_moe_experts", None))
        self.group = ps.get_expert_model_parallel_group() if moe and ps.get_expert_model_parallel_world_size() > 1 \
            else None
        self.idle = 0  # idle microbatches run so far
        self.one_per_slot = False
        self.dp_ranks: frozenset[int] = frozenset()
        if self.group is not None:  # the EP peers' positions in this rank's DP group (no collective)
            dp = dist.get_process_group_ranks(ps.get_data_parallel_group())
            self.dp_ranks = frozenset(dp.index(r) for r in dist.get_process_group_ranks(self.group) if r in dp)

    @property
    def on(self) -> bool:
        return self.group is not None

    def schedule(self, keys: list) -> list:
        """The slots of one run point: ``keys`` are this rank's microbatches' gradient destinations (hashable);
        every key any rank of the group has, in first-seen order (rank by rank), as many times as the rank that
        has it most (collective over the group: an ``all_gather_object``). ``keys`` itself when off."""
        if self.group is None:
            return list(keys)
        gathered: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(gathered, list(keys), group=self.group)
        most: dict = {}
        for ks in gathered:
            counts: dict = {}
            for k in ks:
                counts[k] = counts.get(k, 0) + 1
            for k, n in counts.items():
                most[k] = max(most.get(k, 0), n)
        slots = [k for k, n in most.items() for _ in range(n)]  # dicts keep first-seen order
        self.idle += len(slots) - len(keys)
        return slots

    def pad(self, items: list) -> list:
        """The microbatches of one forward-only pass: ``items`` and None for each idle forward, so that every rank of
        the group runs as many (:meth:`count`), or with ``one_per_slot`` every other rank's items run beside idle
        forwards here (rank by rank; collective over the group). ``items`` when off."""
        if self.group is None:
            return list(items)
        if not self.one_per_slot:
            return list(items) + [None] * (self.count(len(items)) - len(items))
        counts: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(counts, len(items), group=self.group)
        q = dist.get_rank(self.group)
        before, after = sum(counts[:q]), sum(counts[q + 1:])
        self.idle += before + after
        return [None] * before + list(items) + [None] * after

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is true on some rank of the group (collective over it); ``flag`` when off."""
        if self.group is None:
            return flag
        t = torch.tensor([int(flag)], dtype=torch.int64,
                         device=device() if dist.get_backend(self.group) == "nccl" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())

    def count(self, n: int) -> int:
        """The largest ``n`` over the expert-parallel group (collective over it); ``n`` when off."""
        if self.group is None:
            return n
        t = torch.tensor([n], dtype=torch.int64, device=device() if dist.get_backend(self.group) == "nccl" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        self.idle += int(t.item()) - n
        return int(t.item())


_AT_EXIT = []


def _destroy_at_exit(backend: str) -> None:
    """Tear the process group down before the interpreter finalises, in every process that forgot to (scripts,
    workers, tools, a test's subprocess). A gloo group still alive at finalisation can abort the process after it
    finished its work ("terminate called without an active exception", rc -6: gloo's C++ threads hold work objects
    while Python tears down; seen under load in CI). gloo only: an NCCL group is left to the launcher, where destroying
    it beside dead peers can block."""
    if backend == "gloo" and not _AT_EXIT:
        atexit.register(destroy_parallel)
        _AT_EXIT.append(True)


def destroy_parallel() -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
