"""Engine seconds of a long multi-turn episode batch with and without KV reuse across turns (embedded engine).

    python tools/bench.py kv_reuse --trajectories 16 --turns 40 --page-lines 4 --repeats 1

A batch of ``--trajectories`` trajectories runs ``--turns`` turns in lock step (the sync worst case: every tool call
returns together): each turn the engine generates ``--max-new-tokens`` tokens per trajectory (no stop: the cost of a
turn does not depend on what the random model writes), then each trajectory gets a log-search page as its tool
output (``rollout/envs/log_search.py``, pages of ``--page-lines`` lines, in order through its world, encoded with the
tiny model's tokenizer as the agent loop does). The same requests run with ``sessions=`` (reuse: each turn prefills
only the page and the turn's prefix) and without (each turn re-prefills the whole context); both modes alternate
per repeat, and their tokens are checked to be identical (seeded sampling). Tiny Llama (hidden 128, 2 layers),
float32, one torch thread.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def _pages(codec, trajectories: int, turns: int, page_lines: int) -> list[list[list[int]]]:
    """Per trajectory, ``turns`` tool outputs: the pages of its world in order (repeating), as ``<result>`` tokens."""
    from megatron_tsync.rollout.agent_loop import _format, _observation_ids
    from megatron_tsync.rollout.envs.log_search import LogSpec, generate_world, page_header

    spec = LogSpec(files=4, min_pages=8, max_pages=12, page_lines=page_lines)
    out = []
    for t in range(trajectories):
        w = generate_world(1000 + t, spec)
        flat = [page_header(p, i + 1, len(pages)) + "\n" + txt for p, pages in w.files for i, txt in enumerate(pages)]
        out.append([_observation_ids(codec, _format(flat[k % len(flat)]), 256) for k in range(turns)])
    return out


def run_batch(engine, prompts, pages, max_new: int, reuse: bool) -> tuple[float, list, int, int]:
    """(engine seconds, every turn's tokens, longest context, (row, position) pairs prefilled) of one lock-step
    episode batch."""
    from megatron_tsync.rollout.engine import SamplingConfig

    samp = SamplingConfig(max_new_tokens=max_new, temperature=1.0)
    ctx = [list(p) for p in prompts]
    sessions = [("bench", reuse, i) for i in range(len(prompts))]
    seconds, toks, prefilled = 0.0, [], engine.prefill_positions
    for k in range(len(pages[0])):
        t0 = time.perf_counter()
        outs = engine.generate(ctx, samp, seeds=[1000 * i + k for i in range(len(ctx))],
                               sessions=sessions if reuse else None)
        seconds += time.perf_counter() - t0
        for i, (c,) in enumerate(outs):
            toks.append(c.token_ids)
            ctx[i] += c.token_ids + pages[i][k]
    for s in sessions:
        engine.release_session(s)
    return seconds, toks, max(len(c) for c in ctx), engine.prefill_positions - prefilled


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trajectories", type=int, default=16)
    ap.add_argument("--turns", type=int, default=40)
    ap.add_argument("--page-lines", type=int, default=4, help="log lines per tool output (~22 tokens each)")
    ap.add_argument("--max-new-tokens", type=int, default=8, help="tokens the engine writes per turn")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from tokenizers import Tokenizer

    from megatron_tsync.model.parallel import initialize_parallel
    from megatron_tsync.model.tiny_model import make_tiny_model
    from megatron_tsync.model.tokenizer import TokenizerCodec
    from megatron_tsync.rollout.embedded_engine import EmbeddedEngine

    initialize_parallel(1, 1, seed=0)
    d = os.path.join(tempfile.mkdtemp(prefix="bench_kv_"), "tiny")
    make_tiny_model(d, seed=0)
    engine = EmbeddedEngine.from_hf_dir(d)
    codec = TokenizerCodec(Tokenizer.from_file(os.path.join(d, "tokenizer.json")))
    prompts = [codec.encode(f"<s>Q: code of K{i % 10}? ") for i in range(a.trajectories)]
    pages = _pages(codec, a.trajectories, a.turns, a.page_lines)
    res: dict[str, list[float]] = {"full": [], "reuse": []}
    longest, prefill = 0, {}
    for _ in range(a.repeats):
        ref = None
        for mode in ("full", "reuse"):
            s, toks, longest, prefill[mode] = run_batch(engine, prompts, pages, a.max_new_tokens, mode == "reuse")
            res[mode].append(s)
            if ref is None:
                ref = toks
            elif toks != ref:
                raise SystemExit("KV reuse changed the sampled tokens")
    full, reuse = statistics.median(res["full"]), statistics.median(res["reuse"])
    out = dict(trajectories=a.trajectories, turns=a.turns, page_lines=a.page_lines, max_new_tokens=a.max_new_tokens,
               longest_context=longest, page_tokens=statistics.mean(len(p) for t in pages for p in t),
               full_s=res["full"], reuse_s=res["reuse"], speedup=full / reuse,
               prefill_positions=prefill,  # the work each mode's prefills did (per repeat; the same every repeat)
               load=os.getloadavg()[0])
    print(f"{a.trajectories} trajectories x {a.turns} turns (pages ~{out['page_tokens']:.0f} tokens, longest context "
          f"{longest}): engine {full:.1f} s full prefill, {reuse:.1f} s with KV reuse: {full / reuse:.2f}x "
          f"(load {out['load']:.1f})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
