"""The learner's edge: what an authentic, schema-valid event must also satisfy before it reaches the learner, and
the start-up check that the tokenizer fits the model.

The transport (``transport/codec.py``, ``schema.py``) checks what any receiver can: the signature, the policy version,
the layout of every field, finite numbers everywhere (``meta`` included), and log-probs an engine can produce —
reason ``bad_logprob``: NaN / inf, above 0, or a behaviour log-prob below ``schema.LOGPROB_FLOOR`` (a forged -1e4
made the async learner's loss NaN). Those trajectories are accounted here like the edge's own rejections. What only the learner knows is checked
here, on every event the receiver hands over (:func:`screen`, called by ``TransportSource._events``):

* token ids ``< vocab_size`` of the model (``config.json`` of ``--model``): an id past the embedding would crash the
  forward pass (``IndexError``) — reason ``out_of_vocab``;
* at most ``--seq-length`` tokens — ``too_long``;
* the group: ``group_id`` is the group of ``traj_id`` and ``group_size`` is ``--group-size`` — ``bad_group``;
* the reward of a trajectory reported ``ok`` is one the learner's ``--reward-kind/--reward-range`` admits (binary:
  exactly lo or hi; bounded: in [lo, hi]) — ``bad_reward``: the exact clip rule of the streaming planner relies on
  it, so one off-spec reward (a custom verifier's bug, a compromised worker) would otherwise stop the run.

Rejections are counted in ``receiver.stats[reason]`` next to the transport's own (``receiver.rejected`` sums them;
the log row shows them per reason).

No valid event is lost and the step still completes: an authentic trajectory rejected for its content (here, or by
the codec's schema check: ``receiver.rejected_events``) is remembered by its id. A valid event with that id that
arrives later still counts (first valid one wins). Once every other trajectory of the step has arrived, each
remembered one counts in its group as a *failed* trajectory — the task's lowest reward, no gradient — exactly as if
its worker had reported an error; nothing of the rejected event's content reaches the learner. Frames rejected
before their signature is verified (oversize, bad signature, unsigned) name nothing that can be trusted: they are
counted only.
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import Any

import numpy as np

from megatron_tsync.model.builder import ModelArch
from megatron_tsync.runtime.preflight import tokenizer_overflow
from megatron_tsync.transport import TrajectoryEvent
from megatron_tsync.transport.errors import (REJECT_REASONS, BadGroup, BadReward, OutOfVocab, TooLong,
                                             TransportError)
from megatron_tsync.transport.ids import group_id, parse_traj_id

log = logging.getLogger(__name__)

__all__ = ["EdgeValidator", "screen", "check_tokenizer_fits", "model_vocab_size", "rejection_row", "REJECTION_TB_NAMES"]

REJECTION_TB_NAMES = {f"rejected_{r}": f"transport/rejected_{r}" for r in REJECT_REASONS}
"""TensorBoard tags of :func:`rejection_row`'s keys."""


def rejection_row(fleet: Any) -> dict[str, int]:
    """``rejected_<reason>``: the run's rejections so far, per reason (all zero without a fleet)."""
    stats = fleet.receiver.stats if fleet is not None else {}
    return {f"rejected_{r}": int(stats.get(r, 0)) for r in REJECT_REASONS}


def model_vocab_size(model_dir: str) -> int | None:
    """``vocab_size`` of ``model_dir/config.json`` (the embedding's rows), or None when the folder has none."""
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        return None
    return int(ModelArch.from_hf_dir(model_dir).vocab_size)


def check_tokenizer_fits(model_dir: str, vocab_size: int, tokenizer: Any = None) -> None:
    """Refuses a tokenizer that can produce ids ``>= vocab_size`` (the model's embedding rows), naming both sizes."""
    if tokenizer is None:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(model_dir)
        except Exception as e:  # transformers / tokenizers raise many types, none naming the file
            files = sorted(f for f in os.listdir(model_dir) if f.startswith(("tokenizer", "special_tokens", "vocab",
                                                                              "merges")))
            raise ValueError(f"--model {model_dir}: cannot load its tokenizer from {files or 'no tokenizer files'} "
                             f"({type(e).__name__}: {e})") from None
    msg = tokenizer_overflow(model_dir, len(tokenizer), max(tokenizer.get_vocab().values(), default=-1), vocab_size)
    if msg:
        raise ValueError(msg)


class EdgeValidator:
    """The checks of the module docstring for one rollout plane; remembers the rejected trajectories per step."""

    def __init__(self, *, vocab_size: int | None, max_seq_len: int, group_size: int, groups_per_step: int = 1 << 30,
                 horizon: int = 0, reward_spec: Any = None):
        self.vocab_size, self.max_seq_len, self.group_size = vocab_size, max_seq_len, group_size
        self.reward_spec = reward_spec  # algorithms.streamability.RewardSpec the learner assumes; None: unchecked
        self.groups_per_step, self.horizon = groups_per_step, horizon  # horizon: steps ahead a worker may run
        self.step = 0
        # step -> traj_id -> (policy_version, reason, detail): rejected, no valid event with that id yet
        self.pending: dict[int, dict[str, tuple[int, str, str]]] = {}
        self.accounted = 0  # rejected trajectories that counted in their group as failed

    def check(self, ev: Any) -> TransportError | None:
        """The first rule ``ev`` breaks (a typed error with its reason), or None."""
        ids = ev.token_ids
        if self.vocab_size is not None and ids.size and int(ids.max()) >= self.vocab_size:
            i = int(np.argmax(ids >= self.vocab_size))
            return OutOfVocab(f"{ev.traj_id}: token id {int(ids[i])} at index {i} >= vocab_size {self.vocab_size}")
        if ids.size > self.max_seq_len:
            return TooLong(f"{ev.traj_id}: {ids.size} tokens > --seq-length {self.max_seq_len}")
        parsed = parse_traj_id(ev.traj_id)
        if parsed is not None and ev.group_id != group_id(parsed[0], parsed[1]):
            return BadGroup(f"{ev.traj_id}: group_id {ev.group_id!r} is not the trajectory's group")
        if getattr(ev, "KIND", "") == "trajectory" and ev.group_size != self.group_size:
            return BadGroup(f"{ev.traj_id}: group_size {ev.group_size} != --group-size {self.group_size}")
        if getattr(ev, "KIND", "") == "trajectory" and ev.status == "ok" and self.reward_spec is not None:
            try:
                self.reward_spec.check(float(ev.reward))
            except ValueError as e:
                return BadReward(f"{ev.traj_id}: {e} (--reward-kind/--reward-range)")
        return None

    def remember(self, traj_id: str, version: int, reason: str, detail: str) -> None:
        """Only ids the rollout plane can still owe (this step or up to ``horizon`` ahead): bounded memory."""
        parsed = parse_traj_id(traj_id)
        if parsed is None:
            return
        s, g, i = parsed
        if self.step <= s <= self.step + self.horizon and g < self.groups_per_step and i < self.group_size:
            self.pending.setdefault(s, {}).setdefault(traj_id, (version, reason, detail))

    def screen(self, receiver: Any, step: int, outstanding: set[str], events: list) -> list:
        """``events`` without the invalid ones, plus a failed stand-in for each remembered rejection of ``step``
        once ``outstanding`` (the step's trajectories not yet delivered) holds nothing else."""
        self.step = step
        while receiver.rejected_events:
            tid, _gid, version, reason, detail = receiver.rejected_events.popleft()
            self.remember(tid, version, reason, detail)
        out = []
        for ev in events:
            err = self.check(ev)
            if err is None:
                out.append(ev)
                continue
            receiver.stats[err.reason] = receiver.stats.get(err.reason, 0) + 1
            receiver.recent_rejections.append((err.reason, err.detail[:512]))
            log.warning("rejected %s event: %s: %s", getattr(ev, "KIND", "?"), err.reason, err.detail)
            if getattr(ev, "KIND", "") == "trajectory":
                self.remember(ev.traj_id, int(ev.policy_version), err.reason, err.detail)
        for old in [s for s in self.pending if s < step]:
            del self.pending[old]
        mine = self.pending.get(step, {})
        arrived = {ev.traj_id for ev in out if getattr(ev, "KIND", "") == "trajectory"}
        for tid in arrived:
            mine.pop(tid, None)  # a valid event for it came after all
        left = outstanding - arrived
        if mine and left and left <= mine.keys():
            for tid in sorted(left):
                out.append(self._stand_in(tid, *mine.pop(tid)))
        return out

    def _stand_in(self, tid: str, version: int, reason: str, detail: str) -> TrajectoryEvent:
        """A failed trajectory in place of a rejected one: ids only; the learner gives it the task's lowest reward."""
        self.accounted += 1
        s, g, _ = parse_traj_id(tid)  # type: ignore[misc]
        empty = np.zeros(0, np.int32)
        return TrajectoryEvent(traj_id=tid, group_id=group_id(s, g), group_size=self.group_size,
                               policy_version=version,
                               token_ids=empty, prompt_len=0, loss_mask=np.zeros(0, np.uint8),
                               logprobs=np.zeros(0, np.float32), reward=0.0, status="error",
                               error=f"rejected at the learner's edge: {reason}: {detail}"[:1000])


_BY_FLEET: "weakref.WeakKeyDictionary[Any, EdgeValidator]" = weakref.WeakKeyDictionary()


def screen(source: Any, events: list) -> list:
    """The edge of one step's source (``runtime.fleet.TransportSource``): its fleet's :class:`EdgeValidator`
    applied to ``events`` (see :meth:`EdgeValidator.screen`)."""
    fleet = source.fleet
    v = _BY_FLEET.get(fleet)
    if v is None:
        vocab = model_vocab_size(fleet.spec.model_dir)
        if vocab is None:
            log.warning("%s has no config.json: token ids are not checked against a vocabulary", fleet.spec.model_dir)
        rl = fleet.spec.rl
        v = _BY_FLEET[fleet] = EdgeValidator(vocab_size=vocab, max_seq_len=source.max_seq_len,
                                             group_size=rl.group_size, groups_per_step=rl.groups_per_step,
                                             horizon=rl.max_staleness,
                                             reward_spec=fleet.reward_spec)
    v.max_seq_len = source.max_seq_len
    return v.screen(fleet.receiver, source.step, source.expected - source.seen, events)
