"""What verifying a drafted turn costs against generating it: ``SpeculativeEngine`` vs the embedded engine's plain
``generate``, one process, the same rows, prompts and seeds.

For each (prompt length, turn length): 64 rows (``--rows``); drafts made under θ_k by one engine, verified under
θ_{k+1} by another (``--noise`` perturbs θ_{k+1}: 0 keeps every draft, the best case; > 0 makes rejections, whose
rows are redrawn and continued); the time of plain generation of the same turns under θ_{k+1} next to it. Repeats
interleaved, medians. Prints one row per setting: plain ms, verify ms, their ratio, tokens kept.

    OMP_NUM_THREADS=1 python tools/bench_speculation.py [--settings 30x12,30x32,30x64,200x32] [--noise 0]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time


def _settings(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        p, _, t = part.partition("x")
        out.append((int(p), int(t)))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--settings", default="30x12,30x32,30x64,200x32", help="PROMPTxTURN token lengths, comma-separated")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--noise", type=float, default=0.0, help="θ_{k+1} = θ_k + noise·std·N(0,1) per tensor")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.setdefault("MASTER_PORT", str(s.getsockname()[1]))
    from megatron_tsync.model.parallel import initialize_parallel
    from megatron_tsync.model.tiny_model import make_tiny_model
    from megatron_tsync.rollout.embedded_engine import EmbeddedEngine
    from megatron_tsync.rollout.engine import SamplingConfig, derive_seed
    from megatron_tsync.rollout.speculative import SpeculativeEngine, draft_turns

    initialize_parallel(1, 1)
    model_dir = make_tiny_model(os.path.join(tempfile.mkdtemp(prefix="bench-spec-"), "model"), seed=0)
    old, new = (EmbeddedEngine.from_hf_dir(model_dir, max_batch_rows=a.rows) for _ in range(2))
    if a.noise:
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in new.model.parameters():
                p.add_(a.noise * p.std() * torch.randn(p.shape, generator=g))
    rows = []
    g = torch.Generator().manual_seed(0)
    for P, T in _settings(a.settings):
        prompts = [torch.randint(9, new.vocab_size, (P,), generator=g).tolist() for _ in range(a.rows)]
        sampling = SamplingConfig(max_new_tokens=T, stop_token_ids=(2,))
        seeds = [derive_seed(1, i) for i in range(a.rows)]
        plain, verify, kept, drafted = [], [], 0, 0
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            new.generate(prompts, sampling, 1, seeds=seeds)
            plain.append(time.perf_counter() - t0)
            spec = SpeculativeEngine(new, old, draft_turns(old, prompts, seeds, [T] * a.rows, sampling))
            t0 = time.perf_counter()
            spec.generate(prompts, sampling, 1, seeds=seeds)
            verify.append(time.perf_counter() - t0)
            kept, drafted = kept + spec.stats.kept_tokens, drafted + spec.stats.drafted_tokens
        row = {"prompt": P, "turn": T, "plain_ms": 1e3 * statistics.median(plain),
               "verify_ms": 1e3 * statistics.median(verify), "kept_frac": kept / max(drafted, 1)}
        row["ratio"] = row["verify_ms"] / row["plain_ms"]
        rows.append(row)
        print(f"prompt {P:4d} turn {T:3d}: plain {row['plain_ms']:6.0f} ms  verify {row['verify_ms']:6.0f} ms  "
              f"({row['ratio']:.2f}x)  kept {row['kept_frac']:.0%}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": a.rows, "noise": a.noise, "results": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
