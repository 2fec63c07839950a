"""Sequence packing on CPU: sync learner step time and microbatch count, packed vs one trajectory per microbatch.

    OMP_NUM_THREADS=1 python tools/bench_packing.py [--json out.json] [--repeats 3]

The quickstart's tiny model (Llama, hidden 128, 2 layers, 4 heads / 2 KV heads, vocab 512), float32, SGD lr 0, one
process, the real Megatron learner (``Learner.train_step`` in sync mode: every trajectory of the batch through
``get_forward_backward_func``, barrier, optimizer step). Batches of 64 trajectories (8 groups × 8) with uniform random
lengths in each profile's range. Rows: profile × ``max_packed_tokens`` (0 = no packing); median step seconds of
``--repeats`` steps after one warm-up round (configurations run round-robin), microbatches per step and the
packed/unpacked time ratio.

Packed microbatches go through the THD path on CPU too (the local spec's ``compat.SDPAttention``: one causal SDPA
per segment, linear in the pack), as through Transformer Engine's on GPU; before that the local spec's dense T×T mask
made packing 3-4x slower than unpacked (``tools/bench_attention.py`` compares both attentions).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.filterwarnings("ignore")

PROFILES = {"short (24-128 tok)": (24, 128), "medium (128-512 tok)": (128, 512), "long (512-1536 tok)": (512, 1536)}
PACKS = {"short (24-128 tok)": (0, 512, 2048), "medium (128-512 tok)": (0, 1024, 2048),
         "long (512-1536 tok)": (0, 2048)}


def _samples(lo, hi, seed, groups=8, G=8, vocab=512):
    import torch

    from megatron_tsync.streaming.ready_queue import Sample

    rnd = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(groups):
        for i in range(G):
            T = rnd.randint(lo, hi)
            mask = torch.ones(T)
            mask[: T // 4] = 0
            out.append(Sample(f"g{k}t{i}", f"g{k}", G, torch.randint(0, vocab, (T,), generator=g), mask,
                              float(rnd.random() < 0.5)))
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--profiles", nargs="*", default=list(PROFILES))
    a = ap.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    from megatron_tsync.streaming.ready_queue import ListSource
    from megatron_tsync.training.learner import Learner, LearnerConfig, shape_for
    from megatron_tsync.model.builder import ModelArch, build_model
    from megatron_tsync.training.optimizer import OptimConfig, build_optimizer, wrap_ddp
    from megatron_tsync.model.parallel import initialize_parallel

    initialize_parallel(1, 1)
    arch = ModelArch(family="llama", vocab_size=512, hidden_size=128, ffn_hidden_size=352, num_layers=2,
                     num_attention_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=4096)
    ddp = wrap_ddp(build_model(arch, seed=0))
    opt = build_optimizer(ddp, OptimConfig(optimizer="sgd", lr=0.0, clip_grad=0.0))
    rows = []
    for name in a.profiles:
        lo, hi = PROFILES[name]
        learners = {m: Learner(ddp, opt, LearnerConfig(mode="sync", sequence_packing=m > 0,
                                                       max_packed_tokens=m or 4096)) for m in PACKS[name]}
        times = {m: [] for m in learners}
        mbs = {}
        for r in range(a.repeats + 1):  # round-robin over the configurations: machine noise hits them alike
            S = _samples(lo, hi, seed=100 + r)
            sizes, shape = shape_for(S)
            for m, L in learners.items():
                t = time.perf_counter()
                res = L.train_step(ListSource(S), sizes, shape)
                if r:  # the first round warms up
                    times[m].append(time.perf_counter() - t)
                mbs[m] = res.microbatches
        tokens = sum(s.token_ids.numel() for s in S)
        for m in learners:
            rows.append({"profile": name, "max_packed_tokens": m, "step_s": statistics.median(times[m]),
                         "step_s_min": min(times[m]), "microbatches": mbs[m], "trajectories": len(S),
                         "tokens": tokens})
            print(f"{name:<22} max_packed_tokens {m:>5}: step {rows[-1]['step_s']:.3f}s (min {min(times[m]):.3f}), "
                  f"{mbs[m]:>3} microbatches for {len(S)} trajectories ({tokens} tokens)", flush=True)
    base = {r["profile"]: r["step_s"] for r in rows if r["max_packed_tokens"] == 0}
    for r in rows:
        r["time_vs_unpacked"] = r["step_s"] / base[r["profile"]]
    print(f"\n{'profile':<22}{'max tokens':>11}{'microbatches':>14}{'step s':>9}{'vs unpacked':>13}")
    for r in rows:
        print(f"{r['profile']:<22}{r['max_packed_tokens']:>11}{r['microbatches']:>14}{r['step_s']:>9.3f}"
              f"{r['time_vs_unpacked']:>12.2f}x")
    out = {"rows": rows, "threads": torch.get_num_threads(), "repeats": a.repeats}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
