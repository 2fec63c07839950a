"""Learner work per step with less work for the same exact update: --shared-prefix and --skip-zero-advantage.

    OMP_NUM_THREADS=1 python tools/bench_less_work.py [--repeats 5] [--json out.json]

One process, float32, the quickstart's tiny Llama and its tokenizer (made in a temporary folder), the real learner
(``Learner.train_step``; SGD lr 0, so every repeat sees the same weights). Two batches of 64 trajectories:

- ``swe-lite``: 8 swe-lite tasks (``rollout/envs/swe_lite.py``) x G = 8: the task's real prompt (role, tool help,
  issue text, tokenized) and the known fix's tool calls and observations (``demonstration_segments``), each
  trajectory cut after a random number of its steps and given random action tokens of its own (so continuations
  differ); rewards 0/1 with both values in every group;
- ``zero-variance``: quickstart-sized trajectories (40-200 tokens), 10 groups of 8 of which 4 have equal rewards
  (40 %, the share the issue expects of binary rewards at a 10-30 % pass rate).

Rows per batch (configurations round-robin, ``--repeats`` repeats after one warm-up round):
``today`` (sync, --sequence-packing, neither feature), ``skip`` (--skip-zero-advantage), ``shared``
(--shared-prefix), ``both``; and ``stream-trajectory`` with both and every reward landing at once (what streaming
costs over sync when nothing can overlap). ``learner_work_s`` is the learner's busy time (``StepResult.busy_s``:
schedule calls, group closes, the barrier); ``vs_today`` its ratio to the ``today`` row of the same batch; the
gradients of every row are compared with ``today``'s (fp32 relative, max over parameters).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.filterwarnings("ignore")

CONFIGS = {"today": dict(mode="sync"), "skip": dict(mode="sync", skip_zero_advantage=True),
           "shared": dict(mode="sync", shared_prefix=True), "both": dict(mode="sync", skip_zero_advantage=True,
                                                                         shared_prefix=True),
           "stream-trajectory, both": dict(mode="stream-trajectory", skip_zero_advantage=True, shared_prefix=True)}


def swe_lite_batch(tok, seed: int = 0, groups: int = 8, G: int = 8, vocab: int = 512):
    import torch

    from megatron_tsync.rollout.envs.swe_lite import generate_tasks
    from megatron_tsync.rollout.envs.workspace_env import demonstration_segments
    from megatron_tsync.streaming.ready_queue import Sample

    rnd = random.Random(seed)
    out = []
    for k, task in enumerate(generate_tasks(seed, groups)):
        segs = demonstration_segments(task)
        prompt = tok.encode(segs[0][0])
        for i in range(G):
            ids, mask = list(prompt), [0] * len(prompt)
            for text, action in segs[1: 1 + 2 * rnd.randint(1, (len(segs) - 1) // 2)]:
                t = tok.encode(text)
                if action:  # this trajectory's own sample: perturb the call's tokens
                    t = [rnd.randrange(vocab) if rnd.random() < 0.3 else x for x in t]
                ids += t
                mask += [int(action)] * len(t)
            r = float(i % 2) if i < 2 else float(rnd.random() < 0.3)
            out.append(Sample(f"g{k}t{i}", f"g{k}", G, torch.tensor(ids), torch.tensor(mask, dtype=torch.float32),
                              r))
    return out


def zero_variance_batch(seed: int = 1, groups: int = 10, G: int = 8, zero: int = 4, vocab: int = 512):
    import torch

    from megatron_tsync.streaming.ready_queue import Sample

    rnd = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(groups):
        for i in range(G):
            T = rnd.randint(40, 200)
            mask = torch.ones(T)
            mask[: T // 4] = 0
            r = float(k % 2) if k < zero else (float(i % 2) if i < 2 else float(rnd.random() < 0.5))
            out.append(Sample(f"g{k}t{i}", f"g{k}", G, torch.randint(0, vocab, (T,), generator=g), mask, r))
    return out


def _rows(name: str, samples, ddp, opt, repeats: int, packed_tokens: int) -> list[dict]:
    import torch

    from megatron_tsync.streaming.ready_queue import ListSource
    from megatron_tsync.training.learner import Learner, LearnerConfig, shape_for

    defaults = dict(sequence_packing=True, max_packed_tokens=packed_tokens, skip_zero_advantage=False,
                    shared_prefix=False)
    learners = {k: Learner(ddp, opt, LearnerConfig(**{**defaults, **v})) for k, v in CONFIGS.items()}
    sizes, shape = shape_for(samples)
    work = {k: [] for k in learners}
    wall = {k: [] for k in learners}
    last = {}
    grads = {}
    for r in range(repeats + 1):
        for k, L in learners.items():
            got = {}
            L.grad_hook = lambda d, got=got: got.setdefault("g", torch.cat([b.grad_data.clone() for b in d.buffers]))
            t = time.perf_counter()
            res = L.train_step(ListSource(samples, batch=len(samples)), sizes, shape)
            if r:
                work[k].append(res.busy_s)
                wall[k].append(time.perf_counter() - t)
            last[k], grads[k] = res, got["g"]
    base = statistics.median(work["today"])
    tokens = sum(s.token_ids.numel() for s in samples)
    prompt = sum(int((s.loss_mask.cumsum(0) == 0).sum()) for s in samples)
    rows = []
    for k in learners:
        st = last[k].planner_stats
        diff = float((grads[k] - grads["today"]).abs().max() / grads["today"].abs().max())
        rows.append({"batch": name, "config": k, "learner_work_s": statistics.median(work[k]),
                     "work_min_s": min(work[k]), "work_max_s": max(work[k]), "step_s": statistics.median(wall[k]),
                     "vs_today": statistics.median(work[k]) / base, "microbatches": last[k].microbatches,
                     "skipped": st.get("skipped_zero_advantage", 0), "shared": st.get("shared_prefix_items", 0),
                     "grad_rel_diff_vs_today": diff, "tokens": tokens, "prompt_frac": prompt / tokens})
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--packed-tokens", type=int, default=4096)
    ap.add_argument("--batches", nargs="*", default=["swe-lite", "zero-variance"], choices=["swe-lite", "zero-variance"])
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    from megatron_tsync.model.builder import build_model
    from megatron_tsync.model.hf_conversion import load_hf_dir, load_hf_into_model
    from megatron_tsync.model.parallel import initialize_parallel
    from megatron_tsync.model.tiny_model import make_tiny_model
    from megatron_tsync.training.optimizer import OptimConfig, build_optimizer, wrap_ddp

    initialize_parallel(1, 1)
    with tempfile.TemporaryDirectory() as d:
        make_tiny_model(d, seed=0)
        tok = AutoTokenizer.from_pretrained(d)
        arch, state = load_hf_dir(d)
    arch = arch.__class__(**{**arch.__dict__, "max_position_embeddings": 8192})
    model = build_model(arch, seed=0)
    load_hf_into_model(model, state)
    ddp = wrap_ddp(model)
    opt = build_optimizer(ddp, OptimConfig(optimizer="sgd", lr=0.0, clip_grad=0.0))
    batches = {"swe-lite": lambda: swe_lite_batch(tok), "zero-variance": zero_variance_batch}
    rows = []
    for b in a.batches:
        rows += _rows(b, batches[b](), ddp, opt, a.repeats, a.packed_tokens)
    out = {"rows": rows, "repeats": a.repeats, "cpus": os.cpu_count(), "load_avg": os.getloadavg()}
    print(f"learner work per step (median, min-max over {a.repeats} repeats; one process, 1 thread; load "
          f"{out['load_avg'][0]:.1f})")
    print(f"{'batch':<15}{'config':<25}{'work s':>8}{'min':>7}{'max':>7}{'vs today':>10}{'mbs':>5}{'skip':>6}"
          f"{'shared':>8}{'grad diff':>11}{'prompt':>8}")
    for r in rows:
        print(f"{r['batch']:<15}{r['config']:<25}{r['learner_work_s']:>8.3f}{r['work_min_s']:>7.3f}"
              f"{r['work_max_s']:>7.3f}{r['vs_today']:>9.2f}x{r['microbatches']:>5}{r['skipped']:>6}{r['shared']:>8}"
              f"{r['grad_rel_diff_vs_today']:>11.1e}{r['prompt_frac']:>7.0%}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
