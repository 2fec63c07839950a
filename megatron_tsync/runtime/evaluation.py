"""Held-out evaluation during training (``--eval-interval N``): the policy's success on prompts it never trains on.

What is measured: the task's ``eval`` split (``runtime/tasks.py``: disjoint from the training prompts by
construction), one fixed set of ``--eval-prompts`` instances for the whole run (drawn with the run's seed), rolled out
with the real stack — the agent loop, the task's tools in the sandbox (or its environment's episodes), its verifier
— and scored exactly as the rollout workers score a trajectory (``worker.score_trajectory``: the same verifier,
so reasoning-gym's ``score_answer`` runs in the sandbox here too, ``rollout/reasoning_gym_scorer.py``). Decoding is greedy by
default (``--no-eval-greedy``: one sample per prompt at the rollout temperature, fixed seeds), so two evaluations
differ only by the weights.

When: at the run's first step (after the warm start or the resume: the baseline), every ``N`` steps, and at the end;
each policy version once. The evaluation of θ_k runs right after θ_k is published, so in the streaming modes the
workers generate step k's trajectories meanwhile.

Where: trainer rank 0, with the policy itself (``EmbeddedEngine`` over the live model, its train/eval mode restored
afterwards; no copy of the weights, no torch RNG drawn: training is unchanged — ``tests/runtime/test_evaluation.py``).
That needs the whole model on rank 0: TP = PP = EP = CP = 1 (any DP). Larger layouts are refused by pre-flight; evaluate their
checkpoints with ``examples/tiny_agent/evaluate.py`` (or a converted folder in your own harness).
Why not on the rollout workers: they hold θ_k already, but an evaluation there would take their engines from the next
step's rollouts just the same, and the trainer would have to wait for it to report (or report late, at another
version); on rank 0 it is one synchronous call at a known version, in every ``--rl-mode`` alike (the loop is the same
for sync, stream-group, stream-trajectory, async and OPD's stream-turn: ``tests/runtime/test_evaluation.py``,
``test_train_e2e.py``, ``test_opd_e2e.py``). θ_k is published first, so in every live mode the workers roll out
step k meanwhile (sharing the cores with it on a small CPU machine). Its cost is in the summary line (seconds in all and per
training step): on the tiny agent, 256 sampled prompts take 3-7 s on a loaded 2-core machine, ≈0.2 s per step at
``--eval-interval 20``.

Output: a ``[tsync] held-out …`` line per evaluation, TensorBoard/W&B ``eval/success_rate`` and ``eval/mean_reward``
at the version's step, and ``eval.json`` next to ``history.json`` (one record per evaluation).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time

EVAL_TB_NAMES = {"success_rate": "eval/success_rate", "mean_reward": "eval/mean_reward"}


def eval_layout_error(cfg) -> str | None:
    """Why ``--eval-interval`` cannot run in this layout (None: it can)."""
    p = cfg.parallel
    sizes = {"TP": p.tensor_model_parallel_size, "PP": p.pipeline_model_parallel_size,
             "EP": p.expert_model_parallel_size, "CP": p.context_parallel_size}
    if cfg.logging.eval_interval and any(v > 1 for v in sizes.values()):
        return ("--eval-interval evaluates with the policy in trainer rank 0, which needs the whole model there "
                f"(TP, PP, EP and CP 1; got {', '.join(f'{k} {v}' for k, v in sizes.items())}): evaluate checkpoints "
                "with examples/tiny_agent/evaluate.py instead")
    return None


class HeldOutEval:
    """The evaluator of one run (trainer rank 0). ``due(v)`` says whether version ``v`` is evaluated; ``run(v)``
    evaluates the policy now (it must hold θ_v) and returns the record it also keeps in ``records``."""

    def __init__(self, cfg, task, model_dir: str, model, first_step: int):
        from transformers import AutoTokenizer

        from megatron_tsync.model.tokenizer import TokenizerCodec
        from megatron_tsync.rollout.agent_loop import AgentConfig
        from megatron_tsync.runtime.worker import sampling_config

        self.cfg, self.task, self.model, self.first = cfg, task, model, first_step
        lc = cfg.logging
        self.interval, self.greedy = lc.eval_interval, lc.eval_greedy
        self.instances = task.sample_prompts(0, lc.eval_prompts, cfg.rl.seed, split="eval")
        tok = AutoTokenizer.from_pretrained(model_dir)
        self.codec = TokenizerCodec(tok)
        sampling = sampling_config(cfg.rollout, cfg.rl, tok, getattr(task, "tool_stop_text", "</tool>"))
        seed = cfg.rl.seed * 7919 + 17  # fixed: an evaluation's samples depend on the weights only
        sampling = dataclasses.replace(sampling, seed=seed, **({"top_k": 1} if self.greedy else {}))
        self.config = AgentConfig(sampling=sampling, max_turns=cfg.rl.max_turns, max_total_tokens=cfg.rl.seq_length)
        self.records: list[dict] = []
        self._sandbox = self._env = self._tools = self._verifier = None

    def due(self, version: int) -> bool:
        if not self.interval or any(r["version"] == version for r in self.records):
            return False
        return version == self.first or version % self.interval == 0 or version == self.cfg.rl.train_iters

    def _setup(self) -> None:
        from megatron_tsync.rollout.agent_loop import RegistryTools
        from megatron_tsync.rollout.envs.base import EnvTools
        from megatron_tsync.rollout.sandbox import Sandbox, SandboxConfig
        from megatron_tsync.rollout.verifiers import get_verifier

        self._sandbox = Sandbox(SandboxConfig(wall_timeout_s=self.cfg.rollout.sandbox_timeout_s))
        if hasattr(self.task, "make_environment"):  # the task's environment owns tools and reward
            self._env, self._tools = self.task.make_environment(self._sandbox), EnvTools()
        else:  # no simulated latency here: the evaluation measures the policy, not the tools' timing
            self._tools = RegistryTools(self._sandbox)
            self._verifier = get_verifier(self.task.verifier, **self.task.verifier_kwargs)

    def run(self, version: int) -> dict:
        from megatron_tsync.rollout.embedded_engine import EmbeddedEngine

        if self._tools is None:
            self._setup()
        t0 = time.perf_counter()
        was_training = self.model.training
        try:
            engine = EmbeddedEngine(self.model, version=version)  # the live policy: eval mode, no copy
            rewards, statuses = asyncio.run(self._rollout(engine))
        finally:
            self.model.train(was_training)
        n, hi = len(rewards), float(self.task.reward_spec.hi)
        success = sum(1 for r in rewards if r >= hi) / n
        rec = {"version": version, "success_rate": success, "stderr": math.sqrt(success * (1 - success) / n),
               "mean_reward": sum(rewards) / n, "errors": sum(1 for s in statuses if s != "ok"), "prompts": n,
               "greedy": self.greedy, "seconds": round(time.perf_counter() - t0, 2)}
        self.records.append(rec)
        return rec

    async def _rollout(self, engine) -> tuple[list[float], list[str]]:
        from megatron_tsync.rollout.agent_loop import AgentLoop
        from megatron_tsync.runtime.worker import score_trajectory

        prompts = [self.codec.encode(inst.prompt_text) for inst in self.instances]
        meta = [{"inst": inst} for inst in self.instances]
        if self._env is not None:
            for m in meta:
                m["episode"] = await self._env.start(m["inst"].meta.get("env_task", m["inst"]))
        loop = AgentLoop(engine, self.codec, self.config, tools=self._tools)
        trajs = await loop.run_async(prompts, metadata=meta)
        spec = self.task.reward_spec
        scored = await asyncio.gather(*(score_trajectory(t, self.codec, t.metadata["inst"], t.metadata.get("episode"),
                                                         self._verifier, float(spec.lo), spec) for t in trajs))
        return [r for r, _, _ in scored], [s for _, s, _ in scored]

    def line(self, rec: dict) -> str:
        what = "greedy" if rec["greedy"] else "sampled"
        err = f", {rec['errors']} errors" if rec["errors"] else ""
        return (f"[tsync] held-out v{rec['version']}: success {rec['success_rate']:.2f} ± {rec['stderr']:.2f}, "
                f"reward {rec['mean_reward']:.3f} ({rec['prompts']} prompts, {what}{err}, {rec['seconds']:.1f}s)")

    def summary(self) -> str:
        """``held-out success a → b (vI → vJ, N prompts, greedy; evaluation S s in all, s/step per training step)``
        (one evaluation: ``held-out success b (vJ, …)``), or "" before any."""
        if not self.records:
            return ""
        a, b = self.records[0], self.records[-1]
        score = (f"{a['success_rate']:.2f} → {b['success_rate']:.2f} (v{a['version']} → v{b['version']}"
                 if len(self.records) > 1 else f"{b['success_rate']:.2f} (v{b['version']}")
        spent = sum(r.get("seconds", 0.0) for r in self.records)
        steps = b["version"] - a["version"]
        cost = f"; evaluation {spent:.1f}s in all" + (f", {spent / steps:.2f}s per training step" if steps else "")
        return (f"held-out success {score}, {b['prompts']} prompts, {'greedy' if b['greedy'] else 'sampled'}"
                f"{cost})")

    def close(self) -> None:
        for owner in (self._sandbox, self._verifier):  # the verifier's own sandbox too (reasoning_gym's scorer)
            if owner is not None and hasattr(owner, "close"):
                owner.close()
