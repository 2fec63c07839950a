"""Fixed CPU cost of one Megatron microbatch versus a bare torch forward/backward of the same tiny model.

Streaming runs one microbatch per trajectory, so this per-microbatch overhead decides whether per-trajectory
streaming pays. Single process, OMP_NUM_THREADS=1. Prints a table and (``--json``) writes the numbers.

    python tools/bench_microbatch.py [--seq 64] [--iters 30] [--json out.json]

Rows (median ms of a forward+backward of one sequence):
- ``hf``: transformers ``LlamaForCausalLM`` of the same config (bare torch);
- ``gpt-direct``: megatron ``GPTModel`` called directly, log-probs via ``token_logprobs``, ``loss.backward()``;
- ``megatron-schedule``: DDP-wrapped model through ``get_forward_backward_func`` (1 microbatch), the path the
  streaming executor takes, including the grad-routing pre-hook and the loss function;
- overhead = megatron-schedule − gpt-direct (the schedule + DDP + routing cost).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.filterwarnings("ignore")


def _interleaved_ms(fns: dict, iters: int, warmup: int = 5) -> dict:
    """Median and minimum ms of each function, run round-robin so machine noise hits all paths alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    ts = {k: [] for k in fns}
    for _ in range(iters):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            ts[k].append((time.perf_counter() - t) * 1000)
    return {k: (statistics.median(v), min(v)) for k, v in ts.items()}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    from transformers import LlamaConfig, LlamaForCausalLM

    from megatron_tsync.algorithms.streamability import RewardSpec
    from megatron_tsync.streaming.accumulator import GroupBuckets
    from megatron_tsync.streaming.buckets import BucketPool, GradRouter
    from megatron_tsync.streaming.planner import StepPlanner
    from megatron_tsync.streaming.ready_queue import Sample
    from megatron_tsync.model.hf_conversion import load_hf_into_model
    from megatron_tsync.model.logprobs import token_logprobs
    from megatron_tsync.model.builder import ModelArch, build_model
    from megatron_tsync.training.optimizer import wrap_ddp
    from megatron_tsync.model.parallel import initialize_parallel
    from megatron_tsync.training.stream_fb import BatchShape, LossConfig, StreamExecutor
    from megatron_tsync.algorithms.advantages import get_advantage_estimator
    from megatron_tsync.streaming.planner import Dest, WorkItem

    initialize_parallel(1, 1)
    hf_cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512, max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(hf_cfg).float()
    arch = ModelArch.from_hf_config(hf_cfg.to_dict())
    ids = torch.randint(0, 512, (1, a.seq))

    def hf_step():
        out = hf(ids).logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).sum()
        out.backward()

    gpt = build_model(arch, seed=0)
    load_hf_into_model(gpt, hf.state_dict())

    def direct_step():
        token_logprobs(gpt, ids).sum().backward()

    ddp = wrap_ddp(build_model(arch, seed=0))
    router = GradRouter(ddp)
    buckets = GroupBuckets(router, BucketPool(router.accumulator))
    ex = StreamExecutor(ddp, buckets, LossConfig())
    planner = StepPlanner(get_advantage_estimator("grpo"), {"g": 2}, mode="stream-trajectory",
                          reward_spec=RewardSpec.binary(), loss_kind="ppo_clip")
    ex.begin_step(planner, BatchShape(num_sequences=2, max_len=a.seq))
    ex.add_sample(Sample("t0", "g", 2, ids[0], torch.ones(a.seq), 1.0))
    item = WorkItem("t0", "g", 1.0, Dest.ACCUM, advantage=0.5)

    def sched_step():
        ex.run([item])

    t = _interleaved_ms({"hf": hf_step, "gpt-direct": direct_step, "megatron-schedule": sched_step}, a.iters)
    rows = {k: v[0] for k, v in t.items()}
    rows.update({f"{k}_min": v[1] for k, v in t.items()})
    rows["overhead_ms"] = rows["megatron-schedule"] - rows["gpt-direct"]
    rows["overhead_min_ms"] = rows["megatron-schedule_min"] - rows["gpt-direct_min"]
    rows["seq"] = a.seq
    print(f"{'path':<22}{'median ms':>12}{'min ms':>10}")
    for k in ("hf", "gpt-direct", "megatron-schedule"):
        print(f"{k:<22}{rows[k]:>12.2f}{rows[k + '_min']:>10.2f}")
    print(f"{'overhead (sched-direct)':<22}{rows['overhead_ms']:>12.2f}{rows['overhead_min_ms']:>10.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
