"""π_θ0: the trainer's log-probs at the batch's starting weights, for minibatches ≥ 2 and later epochs (design §5).

With several optimizer steps per batch (``--num-minibatches M``, ``--ppo-epochs E``) the PPO ratio of every
trajectory after the first step is ``π_θ / π_θ0``. The first minibatch's trajectories get π_θ0 for free: their
forward-backward runs at θ0 and the executor keeps the detached log-probs (``StreamExecutor.keep_theta0``). Every other
trajectory gets a forward-only pass through megatron's schedule:

* arriving before the batch's first optimizer step (the weights are still θ0): at once, on arrival — while the learner
  would otherwise wait for rewards;
* arriving later: under a snapshot of θ0 taken right before the first optimizer step, and only if some trajectory of
  the batch had not arrived by then. The snapshot is swapped in by re-pointing ``param.data`` (no copy of the current
  weights) and swapped back at once.

Cost: one forward (no backward) per trajectory outside the first minibatch, plus one copy of the model's parameters
(this rank's TP/PP shard, in the parameter dtype) while a late trajectory can still arrive. ``--old-logprobs engine``
avoids both by using the rollout engine's log-probs (π_θ0 up to engine numerics).

Not run on a GPU here. With FP8 Transformer Engine layers the swap would also need TE's cached FP8 weight casts
refreshed, which this module does not do: the config refuses FP8 + several steps per batch + trainer π_old
(``TrainConfig.validate``; use ``--old-logprobs engine`` there).
"""

from __future__ import annotations

import contextlib
import time

import torch

from megatron_tsync.streaming.ready_queue import Sample
from megatron_tsync.model import compat, moe
from megatron_tsync.model.builder import unwrap
from megatron_tsync.model.logprobs import vocab_parallel_logprobs
from megatron_tsync.model.parallel import ExpertLockstep
from megatron_tsync.training.stream_fb import THETA0_LOGP


class Theta0Logprobs:
    """Forward-only π_θ0 for the samples of one batch; owns the θ0 snapshot."""

    def __init__(self, ddp_model, temperature: float = 1.0):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.model = ddp_model
        self.temperature = temperature
        self.fb = get_forward_backward_func()
        self.lockstep = ExpertLockstep(unwrap(ddp_model).config)
        self.snapshot: list[torch.Tensor] | None = None
        self.moved = False  # weights differ from θ0 (an optimizer step of this batch has run)
        self.forwards = 0  # trajectories scored by a forward-only pass (this batch)
        self.swapped_forwards = 0  # ... of which under the θ0 snapshot
        self.busy: list[tuple[float, float]] = []

    def begin_batch(self) -> None:
        self.snapshot, self.moved = None, False
        self.forwards = self.swapped_forwards = 0
        self.busy = []

    def before_first_step(self, all_scored: bool) -> None:
        """Called right before the batch's first optimizer step; keeps θ0 only if a late trajectory may need it."""
        if not all_scored:
            self.snapshot = [p.detach().clone() for p in self.model.parameters()]
        self.moved = True

    def end_batch(self) -> None:
        self.snapshot = None

    def score(self, samples: list[Sample]) -> None:
        """Store π_θ0 of tokens 1..T−1 in ``s.meta[THETA0_LOGP]`` (last PP stage; other stages run their part).

        Collective over the TP/PP group: every rank of this DP replica passes the same samples in the same order."""
        todo: list[Sample | None] = self.lockstep.pad(samples)  # EP > 1: idle forwards (None) keep the expert
        if not todo:  # all-to-alls matched
            return
        t0 = time.perf_counter()
        if self.moved and self.snapshot is None:
            raise AssertionError("θ0 snapshot missing: a trajectory arrived after the first step but the learner "
                                 "declared the batch fully scored")
        with self._at_theta0(), torch.no_grad():
            self.fb(forward_step_func=self._forward_step, data_iterator=iter(todo), model=[self.model],
                    num_microbatches=len(todo), seq_length=max(s.token_ids.shape[0] for s in todo if s is not None)
                    if samples else 2,
                    micro_batch_size=1, forward_only=True)
        self.forwards += len(samples)
        self.swapped_forwards += len(samples) if self.moved else 0
        self.busy.append((t0, time.perf_counter()))

    @contextlib.contextmanager
    def _at_theta0(self):
        if not self.moved:
            yield
            return
        params = list(self.model.parameters())
        current = [p.data for p in params]
        try:
            for p, t in zip(params, self.snapshot):
                p.data = t
            yield
        finally:
            for p, t in zip(params, current):
                p.data = t

    def _forward_step(self, data_iterator, model):
        s: Sample | None = next(data_iterator)
        dev = _device()
        if s is None:  # an expert-lockstep idle forward
            out = model(torch.zeros(1, 2, dtype=torch.long, device=dev), torch.arange(2, device=dev)[None], None)
            return out, lambda logits: (logits.new_zeros(()), torch.tensor(0, dtype=torch.int), {})
        ids = s.token_ids.to(dev).unsqueeze(0)
        pos = torch.arange(ids.shape[1], device=dev).unsqueeze(0)
        with moe.replay_microbatch(model, moe.microbatch_routing([s.routing], [ids.shape[1]])), \
                compat.forward_without_cpu_mode():
            out = model(ids, pos, None)

        def loss(logits):
            logp = vocab_parallel_logprobs(logits[:, :-1], ids[:, 1:], temperature=self.temperature)
            s.meta[THETA0_LOGP] = logp[0].detach().clone()
            return logits.new_zeros(()), torch.tensor(1, dtype=torch.int), {}

        return out, loss


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
