"""The local layer spec's core attention on CPU: torch SDPA (compat.SDPAttention) vs megatron's DotProductAttention.

    OMP_NUM_THREADS=1 python tools/bench_attention.py [--repeats 3] [--lengths 1024 4096] [--json out.json]

The quickstart's tiny model (Llama, hidden 128, 2 layers, 4 heads / 2 KV heads, vocab 512), float32, one process.
Every configuration runs in its own subprocess (old and new interleaved), so each gets its own peak memory: the
growth of ``ru_maxrss`` over one forward+backward, after a 64-token warm-up. Rows:

- ``single T``: one sequence of T tokens, forward + backward (sum of the next-token log-softmax);
- ``packed`` / ``unpacked``: a 4-trajectory microbatch (lengths ``--pack``), as one packed forward (block-diagonal
  mask + per-token RoPE positions, what ``training.stream_fb`` feeds the local spec) or as 4 separate forwards;
  ``packed THD``: the same pack given as ``PackedSeqParams`` (THD, no T×T mask; SDPAttention only).

Printed: seconds (median and min–max of ``--repeats``), peak MB, and the same-run ratios new/old and
packed/unpacked (the machine may be shared: compare ratios, not absolute times).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.filterwarnings("ignore")


def _model(variant: str):
    import torch

    from megatron_tsync.model import compat  # before megatron.core: its import then skips torch's compiler stack
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron_tsync.model.builder import ModelArch, build_model
    from megatron_tsync.model.parallel import initialize_parallel

    torch.set_num_threads(1)
    initialize_parallel(1, 1)
    arch = ModelArch(family="llama", vocab_size=512, hidden_size=128, ffn_hidden_size=352, num_layers=2,
                     num_attention_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=8192)
    model = build_model(arch, seed=0)
    cores = [m for m in model.modules() if isinstance(m, DotProductAttention)]
    assert all(type(m).__name__ == "SDPAttention" for m in cores), "the local spec should build SDPAttention"
    if variant == "old":
        for m in cores:
            m.__class__ = DotProductAttention
    compat.install_per_token_rope(model)
    return model, arch


def _fb(model, ids, pos=None, mask=None, thd=None):
    """One forward + backward; ids (1, T)."""
    import torch

    from megatron_tsync.model import compat

    with compat.rope_positions(model, pos):
        logits = model(ids, (pos if pos is not None else torch.arange(ids.shape[1])).unsqueeze(0), mask,
                       packed_seq_params=thd)
    torch.log_softmax(logits.float(), -1).amax(-1).sum().backward()


def _child(variant: str, case: str, lengths: list[int], repeats: int) -> dict:
    import torch

    from megatron_tsync.training.packing import layout_for

    model, arch = _model(variant)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, arch.vocab_size, (1, n), generator=g) for n in lengths]
    _fb(model, seqs[0][:, :64])  # warm-up (not the measured shape: the peak below is the measured run's)

    def run():
        layout = layout_for(lengths)
        if case == "packed":
            _fb(model, torch.cat(seqs, 1), layout.position_ids(), layout.block_causal_mask())
        elif case == "thd":
            _fb(model, torch.cat(seqs, 1), None, None, layout.packed_seq_params())
        else:
            for s in seqs:
                _fb(model, s)
        model.zero_grad()

    times = []
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for _ in range(repeats):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    peak_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024.0
    return {"times": times, "peak_mb": peak_mb}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(variant, case, lengths, repeats) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, case, ",".join(map(str, lengths)),
           str(repeats)]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONWARNINGS="ignore")
    for _ in range(3):  # a shared machine: the free port may be taken before the child binds it
        env["MASTER_PORT"] = str(_free_port())
        out = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if "EADDRINUSE" not in out.stderr:
            break
    if out.returncode != 0:
        raise RuntimeError(f"{variant} {case} {lengths} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _fmt(r: dict) -> str:
    t = r["times"]
    return f"{statistics.median(t):7.3f} s [{min(t):.3f}-{max(t):.3f}] {r['peak_mb']:7.1f} MB"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--lengths", type=int, nargs="*", default=[1024, 4096])
    ap.add_argument("--pack", type=int, nargs="*", default=[256, 512, 768, 512])
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    cases = [(f"single {n}", "single", [n]) for n in a.lengths]
    cases += [("unpacked x4", "unpacked", a.pack), ("packed x4", "packed", a.pack)]
    res: dict = {}
    for label, case, lengths in cases:
        for variant in ("old", "new"):
            res[f"{label} {variant}"] = r = _spawn(variant, case, lengths, a.repeats)
            print(f"{label:12s} {variant}: {_fmt(r)}", flush=True)
    res["packed x4 thd new"] = r = _spawn("new", "thd", a.pack, a.repeats)  # the old attention has no THD path
    print(f"{'packed x4':12s} THD new: {_fmt(r)}", flush=True)
    med = {k: statistics.median(v["times"]) for k, v in res.items()}
    print("ratios (same run, medians):")
    for label, _, _ in cases:
        print(f"  {label:12s} new/old time {med[label + ' new'] / med[label + ' old']:.3f}  peak "
              f"{res[label + ' new']['peak_mb']:.1f} / {res[label + ' old']['peak_mb']:.1f} MB")
    for v in ("old", "new"):
        print(f"  packed/unpacked ({v}) time {med['packed x4 ' + v] / med['unpacked x4 ' + v]:.3f}")
    print(f"  packed THD/unpacked (new) time {med['packed x4 thd new'] / med['unpacked x4 new']:.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        v, c, ls, rep = sys.argv[2:6]
        print(json.dumps(_child(v, c, [int(x) for x in ls.split(",")], int(rep))))
    else:
        main()
