"""π_ref: the reference model of the KL term, scored by the learner when a trajectory lands (design note §4).

The reference is a frozen megatron ``GPTModel`` stage built exactly like the policy (``model.builder.build_model``
under the same TP/PP process groups: every rank holds the reference shard that matches its policy shard), either a
copy of the policy's initial weights (:meth:`ReferenceModel.frozen_copy`, the default) or a Hugging Face folder
loaded through the same conversion path as ``--model`` (:meth:`ReferenceModel.from_hf_dir`, ``--ref-model``).
:meth:`ReferenceModel.score` runs a forward-only pass through megatron's schedule (``get_forward_backward_func``,
``forward_only=True``), so with PP the reference goes through the same pipeline machinery as the policy forward, and
writes ``Sample.ref_logp`` (T,) float64 on the last stage (entry 0, which has no prediction, is 0); other stages
run their part of the pipeline only. It is a collective over the TP/PP group of one DP replica: every rank of the
replica passes the same samples in the same order (the learner scores each trajectory on the replica that trains it).
At EP > 1 a MoE reference's all-to-alls also span the expert-parallel ranks, which score different trajectories: they
agree on the most forwards any of them runs and the others run idle ones (``model.parallel.ExpertLockstep``, as
``training.old_logprobs`` does; ``--deterministic``: one real forward per slot over the group, ``one_per_slot``),
so every rank of the group calls :meth:`ReferenceModel.score` at the same points.

:func:`shape_rewards` implements ``--kl-mode reward`` exactly: the shaped reward of trajectory i is

    r'_i = r_i − β · Σ_t w_t · kl_t(log π_θ0(a_t), log π_ref(a_t))

(the sum over its action tokens, as verl folds a token-level penalty into an outcome reward), with π_θ0 the trainer's
log-probs at the batch's starting weights (``training.old_logprobs``, a forward-only pass on arrival). r'_i is a
detached scalar known on arrival, so every group-affine advantage stays affine in it (A_i = α_g r'_i + β_g) and a
group's bucket still closes with two scalars (streaming_math.md §1, §4). The KL sum is computed on the owning
replica's last stage and summed over the world (one contributor per trajectory: exact), so every rank's planner sees
the same shaped reward.

Why the learner and not the engines (measured on the tiny model, hidden 128 × 2 layers, one CPU thread): this scorer
takes about 68 ms per 128-token trajectory and 290 ms per 512-token one, and a plain forward of the same model, which
is what an engine-side scorer would run, takes 93 ms and 276 ms. The two cost the same, as they should: one forward
of the whole trajectory. On the engine side, though, that forward sits on the rollout's critical path (the reward
lands later and the learner idles longer), every rollout worker needs its own copy of the reference, and each
trajectory sends T more floats over the wire. On the learner it fills time spent waiting for rewards: in a live tiny
run the learner was idle 80–100 % of each step.

Cost: one parameter copy of this rank's shard (the frozen reference) and one forward-only pass per trajectory
(``--kl-mode loss``), plus one forward-only policy pass at θ0 per trajectory (``--kl-mode reward``).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from megatron_tsync.algorithms.kl import sequence_kl
from megatron_tsync.model import compat
from megatron_tsync.model.builder import unwrap
from megatron_tsync.model.logprobs import vocab_parallel_logprobs
from megatron_tsync.model.parallel import ExpertLockstep
from megatron_tsync.streaming.ready_queue import Sample
from megatron_tsync.training.stream_fb import SHAPED_REWARD, THETA0_LOGP

__all__ = ["KL_SUM", "ReferenceModel", "shape_rewards"]

KL_SUM = "kl_sum"  # Sample.meta key: Σ_t w_t kl_t at θ0 (float), set on every rank by shape_rewards
REF_MODEL = "ref_model"  # Sample.meta key: the tag of the reference that scored it (on every rank of its replica)


class ReferenceModel:
    """A frozen reference ``GPTModel`` stage and its forward-only scorer (module docstring)."""

    def __init__(self, model, *, temperature: float = 1.0, source: str = "frozen initial weights"):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.model = model
        self.model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.temperature = temperature
        self.source = source
        self.fb = get_forward_backward_func()
        self.forwards = 0
        self.busy: list[tuple[float, float]] = []
        self.lockstep = ExpertLockstep(model.config)  # EP > 1: idle forwards keep the expert all-to-alls matched
        self.tag = f"{source}#{id(self):x}"  # JSON-able (Sample.meta is dumped); a sample may meet several learners

    @classmethod
    def frozen_copy(cls, policy, precision=None, *, temperature: float = 1.0, seed: int = 0) -> "ReferenceModel":
        """A copy of the policy's current weights (call it before the first optimizer step). ``policy``: the
        (DDP-wrapped) policy stage; the copy is built by ``build_model`` with the policy's arch and this layout."""
        from megatron_tsync.model.builder import build_model

        src = unwrap(policy)
        model = build_model(src.arch, precision, seed=seed)
        with torch.no_grad():
            mine = dict(model.named_parameters())
            theirs = dict(src.named_parameters())
            if set(mine) != set(theirs):
                raise KeyError(f"reference and policy stages differ: {sorted(set(mine) ^ set(theirs))}")
            for name, p in mine.items():
                p.copy_(theirs[name])
        return cls(model, temperature=temperature)

    @classmethod
    def from_hf_dir(cls, path: str, precision=None, *, policy=None, temperature: float = 1.0,
                    seed: int = 0) -> "ReferenceModel":
        """Build from a transformers folder (``--ref-model DIR``) through the policy's builder/conversion path, as
        this rank's TP/PP stage. ``policy``: checked to share the vocabulary (log-probs of the same token ids)."""
        from megatron_tsync.model.builder import build_model
        from megatron_tsync.model.hf_conversion import load_hf_dir, load_hf_into_model

        arch, state = load_hf_dir(path)
        if policy is not None and unwrap(policy).arch.vocab_size != arch.vocab_size:
            raise ValueError(f"--ref-model {path}: vocab_size {arch.vocab_size} differs from the policy's "
                             f"{unwrap(policy).arch.vocab_size} (the reference must share the tokenizer)")
        model = build_model(arch, precision, seed=seed)
        load_hf_into_model(model, state)
        return cls(model, temperature=temperature, source=path)

    def begin_batch(self) -> None:
        self.forwards = 0
        self.busy = []

    def score(self, samples: list[Sample]) -> None:
        """Set ``s.ref_logp`` (T,) float64 on the last stage for every sample this reference has not scored yet
        (recorded rollouts that carry ``ref_logp`` keep theirs; ones scored by another reference are rescored).
        Collective over this replica's TP/PP group, and at EP > 1 over the expert-parallel group (module docstring)."""
        real = [s for s in samples  # rank-consistent: meta and recorded ref_logp are the same on every rank
                if s.meta.get(REF_MODEL) != self.tag and (s.ref_logp is None or REF_MODEL in s.meta)]
        todo: list[Sample | None] = self.lockstep.pad(real)  # None: an idle forward
        if not todo:
            return
        t0 = time.perf_counter()
        with torch.no_grad():
            self.fb(forward_step_func=self._forward_step, data_iterator=iter(todo), model=[self.model],
                    num_microbatches=len(todo), seq_length=max([s.token_ids.shape[0] for s in real] or [2]),
                    micro_batch_size=1, forward_only=True)
        for s in real:
            s.meta[REF_MODEL] = self.tag
        self.forwards += len(real)
        self.busy.append((t0, time.perf_counter()))

    def _forward_step(self, data_iterator, model):
        s: Sample | None = next(data_iterator)
        dev = next(self.model.parameters()).device
        if s is None:  # an expert-lockstep idle forward (2 tokens)
            out = model(torch.zeros(1, 2, dtype=torch.long, device=dev), torch.arange(2, device=dev)[None], None)
            return out, lambda logits: (logits.new_zeros(()), torch.tensor(0, dtype=torch.int), {})
        ids = s.token_ids.to(dev).unsqueeze(0)  # (1, T)
        pos = torch.arange(ids.shape[1], device=dev).unsqueeze(0)
        with compat.forward_without_cpu_mode():
            out = model(ids, pos, None)  # last stage: (1, T, V/tp) logits; other stages: hidden states

        def loss(logits):
            lp = vocab_parallel_logprobs(logits[:, :-1], ids[:, 1:], temperature=self.temperature)[0]  # (T-1,)
            s.ref_logp = torch.cat([lp.new_zeros(1), lp]).detach().double().cpu()  # (T,)
            return logits.new_zeros(()), torch.tensor(1, dtype=torch.int), {}

        return out, loss


def _is_contributor() -> bool:
    """One rank per DP replica reports a trajectory's KL sum: its last PP stage, TP rank 0, CP rank 0."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return True
    return (ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
            and ps.get_context_parallel_rank() == 0)


def shape_rewards(samples: list[Sample], *, dp_rank: int, coef: float, kind: str) -> None:
    """``--kl-mode reward``: ``s.meta[SHAPED_REWARD] = r − coef · Σ_t w_t kl_t`` and ``s.meta[KL_SUM]`` on every rank.

    Needs π_θ0 (``s.meta[THETA0_LOGP]``) and π_ref (``s.ref_logp``) on the last stage of the replica that owns each
    sample (``s.dp_rank == dp_rank``). Collective over the world when it has several ranks: every rank calls it with
    the same samples in the same order."""
    if not samples:
        return
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    sums = torch.zeros(len(samples), dtype=torch.float64, device=dev)  # on the device: NCCL reduces device tensors
    if _is_contributor():
        for i, s in enumerate(samples):
            if s.dp_rank != dp_rank:
                continue
            lp0 = s.meta.get(THETA0_LOGP)
            if s.ref_logp is None:
                raise ValueError(f"trajectory {s.traj_id}: --kl-mode reward needs reference log-probs (a reference "
                                 "model in the learner, or recorded ref_logp)")
            if lp0 is None:
                raise AssertionError(f"trajectory {s.traj_id}: π_θ0 was not scored before shaping its reward")
            lp0 = lp0.detach().double().cpu().unsqueeze(0)  # (1, T-1)
            ref = s.ref_logp[1:].double().unsqueeze(0)  # (1, T-1)
            w = s.loss_mask[1:].double().unsqueeze(0)  # (1, T-1)
            sums[i] = sequence_kl(lp0, ref, w, kind)[0]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(sums)  # one nonzero contribution per entry: exact
    for s, k in zip(samples, sums.cpu().tolist()):
        s.meta[KL_SUM] = k
        s.meta[SHAPED_REWARD] = s.reward - coef * k
