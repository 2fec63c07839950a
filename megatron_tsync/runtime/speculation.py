"""A rollout worker's speculative drafting (``--speculative-rollouts``; the rule is ``rollout/speculative.py``).

The worker's engine holds θ_k for all of step k, so it can draft step k+1's first turns (their prompts are known in
advance) under θ_k whenever it has nothing else to do: while every trajectory of step k still running is in a tool
call or its verifier (the agent loop's ``idle_work`` hook; a trajectory that needs the engine interrupts the draft
within one decode step), and after the worker's share of step k is done, until θ_{k+1} is published (the
deadline: checked before every decode step). All of them are drafted in one batch; an interrupted draft is resumed
later from its own tokens. Two engines ping-pong: when θ_{k+1} lands, the engine that drafted keeps θ_k and becomes
the draft engine (it recomputes q(·) at rejected positions); the other one loads θ_{k+1} — the load the worker does
every step anyway — and verifies. No weights are copied; the memory cost is a second engine.

Each draft is keyed by the seed the agent loop passes for the trajectory's first turn (``derive_seed(step seed,
seed_index, 0)``), so a draft meets exactly its trajectory; re-dispatched work (other seeds) is never speculated.
"""

from __future__ import annotations

import logging
import time

from megatron_tsync.rollout.engine import derive_seed
from megatron_tsync.rollout.speculative import Draft, SpeculativeEngine, extend_drafts

log = logging.getLogger("megatron_tsync.worker")



def step_seed(rl_seed: int, step: int) -> int:
    """The sampling seed of ``step`` (the worker's ``_run_step`` seeds its agent loop with it)."""
    return rl_seed * 100003 + step


class Drafter:
    """Drafts for the worker's next step; ``attach(step)`` returns the engine that step's rollout uses."""

    def __init__(self, worker, make_engine):
        self.w = worker
        self.make_engine = make_engine  # () -> a second engine of the same model (built at the first draft)
        self.spare = None
        self.step = None  # the step the drafts are for
        self.todo: dict[int, tuple[tuple[int, ...], int]] = {}  # key -> (prompt, cap) of every first turn to draft
        self.drafts: dict[int, Draft] = {}
        self.draft_s = 0.0
        self.last: SpeculativeEngine | None = None

    def job(self, step: int):
        """A drafting job ``job(interrupt)`` for ``step`` under the engine's current weights (which must be
        θ_{step-1}), or None when there is nothing (left) to draft."""
        spec = self.w.spec
        if not spec.start_step < step < spec.rl.train_iters or self.w.engine.policy_version != step - 1:
            return None  # no next step, or the engine holds other weights (e.g. for re-dispatched work)
        if self.step != step:
            self._plan(step)
        if all(k in self.drafts and (self.drafts[k].closed or len(self.drafts[k].tokens) >= c)
               for k, (_, c) in self.todo.items()):
            return None
        return self._run

    def _run(self, interrupt) -> None:
        if interrupt():
            return
        if self.spare is None:
            self.spare = self.make_engine()
        t0 = time.perf_counter()
        extend_drafts(self.w.engine, self.drafts, self.todo, self.w.config.sampling, interrupt)
        self.draft_s += time.perf_counter() - t0

    def draft_some(self, step: int, landed) -> bool:
        """While the worker waits for θ_step: drafts until ``landed()`` (the weights are there); False when there
        was nothing (left) to draft."""
        job = self.job(step)
        if job is None:
            return False
        job(landed)
        return True

    def _plan(self, step: int) -> None:
        spec, w = self.w.spec, self.w
        insts = w.task.sample_prompts(step, spec.rl.groups_per_step, spec.rl.seed)
        budget, cap_turn = spec.rollout.speculative_draft_tokens, w.config.sampling.max_new_tokens
        self.step, self.todo, self.drafts, self.draft_s = step, {}, {}, 0.0
        encoded: dict[int, tuple[int, ...]] = {}
        for g, i in w.step_items():
            if g not in encoded:
                encoded[g] = tuple(w.codec.encode(insts[g].prompt_text))
            prompt = encoded[g]
            cap = min(cap_turn, w.config.max_total_tokens - len(prompt))
            if budget:
                cap = min(cap, budget)
            if cap >= 1:
                self.todo[derive_seed(step_seed(spec.rl.seed, step), g * spec.rl.group_size + i, 0)] = (prompt, cap)

    def before_load(self, step: int) -> None:
        """θ_step is about to be loaded: with drafts for ``step``, swap engines so the drafting one keeps θ_{step-1}."""
        if self.step == step and self.drafts and self.spare is not None:
            self.w.engine, self.spare = self.spare, self.w.engine

    def attach(self, step: int):
        """The engine of ``step``'s rollout: verifying the drafts made for it, or the worker's engine."""
        if self.last is not None:
            log.info("worker %d: verification of step %d: %s", self.w.spec.worker_id, step - 1, self.last.stats)
        self.last = None
        if self.step != step or not self.drafts or self.w.engine.policy_version != step:
            return self.w.engine
        drafts, self.drafts, self.todo = self.drafts, {}, {}
        drafts = {k: d for k, d in drafts.items() if d.version == step - 1 == self.spare.policy_version}
        self.last = SpeculativeEngine(self.w.engine, self.spare, drafts)
        log.info("worker %d: step %d verifies %d drafts (%d tokens, drafted in %.2fs)", self.w.spec.worker_id, step,
                 len(drafts), sum(len(d.tokens) for d in drafts.values()), self.draft_s)
        return self.last

    def meta(self, seed: int | None) -> dict:
        """A trajectory's event meta: its first turn's draft (tokens drafted / kept), if it had one."""
        if self.last is None or seed is None or seed not in self.last.outcome:
            return {}
        drafted, kept = self.last.outcome[seed]
        return {"spec_drafted": drafted, "spec_kept": kept}
