"""Tail time after the last turn, per OPD learner mode, on a synthetic multi-turn workload (one CPU process).

B trajectories of K turns (each: tool output with loss_mask 0, then a generated turn); turn k of trajectory i becomes
available (teacher-scored) at (k + 1)·gap + i·stagger seconds. Every mode trains the same batch; we print the step time,
the tail (work after the last turn arrived, barrier included), the learner busy time and the activation bytes kept
alive (peak over the step), plus the serial-learner prediction of ``simulate_opd_timeline`` from per-turn costs
measured here, the ideal bound (a zero-overhead learner that starts each turn's work the instant it exists, the body
backward of a trajectory after its last turn) and, per mode, speedup and tail against sync OPD and the fraction of
the ideal step time.

    python examples/opd/bench_turns.py [--hidden 256 --layers 4 --vocab 4096 --turns 8 --turn-len 100]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--trajectories", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-len", type=int, default=40)
    ap.add_argument("--tool-len", type=int, default=8)
    ap.add_argument("--gap", type=float, default=0.3)
    ap.add_argument("--stagger", type=float, default=0.05)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args(argv)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(k, None)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.setdefault("MASTER_PORT", str(s.getsockname()[1]))
    import torch

    from megatron_tsync.streaming.ready_queue import Sample
    from megatron_tsync.model.builder import ModelArch, build_model
    from megatron_tsync.training.opd_learner import (ListChunkSource, OPDLearner, OPDLearnerConfig,
                                                     chunks_from_sample, simulate_opd_timeline)
    from megatron_tsync.training.optimizer import OptimConfig, build_optimizer, wrap_ddp
    from megatron_tsync.model.parallel import initialize_parallel
    from megatron_tsync.training.stream_fb import BatchShape

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    initialize_parallel(1, 1)
    arch = ModelArch("llama", a.vocab, a.hidden, 2 * a.hidden, a.layers, 4, 2, a.hidden // 4)
    g = torch.Generator().manual_seed(0)
    samples, ends = [], {}
    for i in range(a.trajectories):
        mask, e = [0.0] * 8, []
        for k in range(a.turns):
            mask += ([0.0] * a.tool_len if k else []) + [1.0] * a.turn_len
            e.append(len(mask))
        T = len(mask)
        samples.append(Sample(f"t{i}", f"t{i}", 1, torch.randint(0, a.vocab, (T,), generator=g), torch.tensor(mask),
                              0.0, teacher_logp=-torch.rand(T, generator=g, dtype=torch.float64) * 3))
        ends[f"t{i}"] = e[:-1]
    chunks, times = [], []
    for k in range(a.turns):
        for i, s in enumerate(samples):
            chunks.append(chunks_from_sample(s, ends[s.traj_id])[k])
            times.append((k + 1) * a.gap + i * a.stagger)
    order = sorted(range(len(chunks)), key=lambda j: times[j])
    model = build_model(arch, seed=0)
    ddp = wrap_ddp(model)
    opt = build_optimizer(ddp, OptimConfig(optimizer="sgd", lr=0.0, clip_grad=0))
    shape = BatchShape(num_sequences=a.trajectories, max_len=samples[0].token_ids.shape[0])
    rows = {}
    for mode, hf in (("sync", False), ("stream-trajectory", False), ("stream-turn", False), ("stream-turn", True)):
        name = mode + ("-head-first" if hf else "")
        L = OPDLearner(ddp, opt, OPDLearnerConfig(mode=mode, head_first=hf))
        best = None
        for _ in range(a.repeats + 1):  # the first run warms up
            r = L.train_step(ListChunkSource([chunks[j] for j in order], [times[j] for j in order]), shape)
            best = r if best is None or r.tail_s < best.tail_s else best
        rows[name] = {"step_s": round(best.step_s, 3), "tail_s": round(best.tail_s, 3),
                      "busy_s": round(best.busy_s, 3), "peak_graph_MB": round(best.peak_graph_bytes / 2**20, 2),
                      "max_traj_graph_MB": round(best.max_traj_graph_bytes / 2**20, 2)}
    # per-turn costs for the timeline model: a whole trajectory's fwd+bwd split evenly over its turns
    per_traj = rows["stream-trajectory"]["busy_s"] / a.trajectories
    fw = [[per_traj / 3 / a.turns] * a.turns for _ in samples]
    bw = [[2 * per_traj / 3 / a.turns] * a.turns for _ in samples]
    arr = [[(k + 1) * a.gap + i * a.stagger for k in range(a.turns)] for i in range(a.trajectories)]
    model_pred = simulate_opd_timeline(arr, fw, bw, head_fraction=0.2)
    # ideal bound: a zero-overhead serial learner running each turn's work the instant it exists, with the exact
    # scheme's constraint that the body backward of a trajectory runs after its last turn (head-first split)
    ideal = model_pred["stream-turn-head-first"]
    sync = rows["sync"]
    summary = {m: {"step_s": r["step_s"], "tail_s": r["tail_s"], "speedup_vs_sync": round(sync["step_s"] / r["step_s"], 3),
                   "tail_vs_sync": round(r["tail_s"] / sync["tail_s"], 3) if sync["tail_s"] else None,
                   "fraction_of_ideal_step": round(ideal["step_s"] / r["step_s"], 3)} for m, r in rows.items()}
    print(json.dumps({"config": vars(a), "measured": rows, "timeline_model": model_pred,
                      "ideal_step_s": round(ideal["step_s"], 3), "ideal_tail_s": round(ideal["tail_s"], 3),
                      "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
