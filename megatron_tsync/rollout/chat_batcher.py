"""The engine thread of the OpenAI-compatible endpoint (``rollout/openai_server.py``): concurrent requests of
different episodes are handed to ONE ``engine.generate`` call (those waiting when it frees up, plus any arriving
within ``wait_s``), grouped by sampling parameters; each request keeps its own seed and cap, so batched results equal
one-at-a-time ones."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time

from megatron_tsync.rollout.engine import RolloutEngine, SamplingConfig

__all__ = ["EngineBatcher"]


class EngineBatcher:
    """One engine thread serving every request; waiting requests with equal sampling go into one ``generate``."""

    def __init__(self, engine: RolloutEngine, wait_s: float):
        self.engine, self.wait_s = engine, float(wait_s)
        self.pending: list[tuple[list[int], SamplingConfig, int | None, concurrent.futures.Future]] = []
        self.cond = threading.Condition()
        self.closed = False
        self.batches: list[int] = []  # batch sizes, for tests and metrics
        self.thread = threading.Thread(target=self._loop, name="chat-engine", daemon=True)
        self.thread.start()

    def generate(self, prompt: list[int], sampling: SamplingConfig, seed: int | None):
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self.cond:
            if self.closed:
                raise RuntimeError("the server is closed")
            self.pending.append((prompt, sampling, seed, fut))
            self.cond.notify()
        return fut.result()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify()
        self.thread.join()

    def _loop(self) -> None:
        while True:
            with self.cond:
                while not self.pending and not self.closed:
                    self.cond.wait()
                if self.closed and not self.pending:
                    return
            time.sleep(self.wait_s)  # let concurrent requests join this batch
            with self.cond:
                jobs, self.pending = self.pending, []
            groups: dict[tuple, list] = {}
            for job in jobs:  # same sampling except the cap; seeded and unseeded requests apart
                key = (dataclasses.replace(job[1], max_new_tokens=1), job[2] is None)
                groups.setdefault(key, []).append(job)
            for (cfg, unseeded), group in groups.items():
                self._run(cfg, unseeded, group)

    def _run(self, cfg: SamplingConfig, unseeded: bool, group: list) -> None:
        from megatron_tsync.rollout.agent_loop import _truncate

        cap = max(job[1].max_new_tokens for job in group)
        self.batches.append(len(group))
        try:
            outs = self.engine.generate([job[0] for job in group], dataclasses.replace(cfg, max_new_tokens=cap), 1,
                                        seeds=None if unseeded else [job[2] for job in group])
        except Exception as e:
            if len(group) > 1 and isinstance(e, ValueError):  # one bad request: find it, serve the others
                for job in group:
                    self._run(cfg, unseeded, [job])
                return
            for job in group:
                job[3].set_exception(e)
            return
        for job, out in zip(group, outs):
            job[3].set_result(_truncate(out[0], job[1].max_new_tokens))
