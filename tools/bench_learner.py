"""The project's sync learner against the best plain PyTorch GRPO learner on the same batch, same weights, same loss.

    OMP_NUM_THREADS=1 python tools/bench_learner.py [--repeats 5] [--profiles quickstart medium] [--json out.json]

One process, float32, the quickstart's tiny Llama (hidden 128, 2 layers, 4 heads / 2 KV heads, vocab 512). Per
profile one batch of 64 trajectories (8 groups x 8, binary rewards, the first quarter of each trajectory prompt).
Rows (one gradient each; SGD with lr 0 so every repeat sees the same weights):

- ``tsync sync``: ``Learner.train_step`` in ``sync`` mode, the way ``--rl-mode sync`` runs it (the learner's defaults:
  ``--sequence-packing`` with ``--max-packed-tokens``; megatron's schedule, DDP grad buffers, the barrier);
- ``tsync sync, unpacked``: the same, one trajectory per microbatch;
- ``torch padded`` (the baseline): transformers ``LlamaForCausalLM`` (SDPA attention) holding the same weights,
  trajectories sorted by length, right-padded microbatches of up to ``--torch-tokens`` padded tokens, the GRPO token-mean
  loss written out by hand (advantages (r - mean_g) / (std_g + 1e-6)), one ``backward`` per microbatch;
- ``torch padded, unsorted``: the same in arrival order (what a learner that does not sort gets).

The two gradients are compared (max |a - b| / max |b| over all parameters; fp32, so ~1e-6 is agreement) and the time
ratios are taken within one run, configurations round-robin so machine noise hits them alike; median and min-max over
``--repeats``. Also one sequence's forward+backward at 1,024 and 4,096 tokens (``--single``): the project's model vs
the transformers model, time and peak memory in a subprocess each (resident set sampled every 2 ms), to show memory linear in length.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.filterwarnings("ignore")

ARCH = dict(family="llama", vocab_size=512, hidden_size=128, ffn_hidden_size=352, num_layers=2, num_attention_heads=4,
            num_kv_heads=2, head_dim=32, max_position_embeddings=8192)
PROFILES = {"quickstart": (40, 200), "medium": (128, 512), "long": (512, 1536)}


def _samples(lo: int, hi: int, seed: int, groups: int = 8, G: int = 8):
    """64 trajectories as tools/bench_packing.py makes them (uniform lengths, first quarter prompt, 0/1 rewards)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_packing import _samples as packing_samples

    return packing_samples(lo, hi, seed, groups=groups, G=G, vocab=ARCH["vocab_size"])


def _advantages(samples) -> list[float]:
    """GRPO's (r - mean_g) / (std_g + 1e-6), population std, straight from the definition."""
    by_group: dict[str, list[float]] = {}
    for s in samples:
        by_group.setdefault(s.group_id, []).append(s.reward)
    stats = {}
    for gid, rs in by_group.items():
        m = sum(rs) / len(rs)
        stats[gid] = (m, (sum((r - m) ** 2 for r in rs) / len(rs)) ** 0.5)
    return [(s.reward - stats[s.group_id][0]) / (stats[s.group_id][1] + 1e-6) for s in samples]


def torch_grpo_step(model, samples, max_tokens: int, *, sort: bool = True) -> None:
    """Plain PyTorch GRPO gradient (ratio 1, token-mean): length-sorted right-padded microbatches through SDPA."""
    import torch

    adv = _advantages(samples)
    n_tok = sum(int(s.loss_mask[1:].sum()) for s in samples)
    order = sorted(range(len(samples)), key=lambda i: samples[i].token_ids.numel()) if sort else list(range(len(samples)))
    batches, cur = [], []
    for i in order:  # greedy: grow the microbatch while the padded size fits
        T = samples[i].token_ids.numel()
        if cur and (len(cur) + 1) * max(T, max(samples[j].token_ids.numel() for j in cur)) > max_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    batches.append(cur)
    for b in batches:
        L = max(samples[i].token_ids.numel() for i in b)
        ids = torch.zeros(len(b), L, dtype=torch.long)
        w = torch.zeros(len(b), L - 1)
        for r, i in enumerate(b):
            s = samples[i]
            ids[r, : s.token_ids.numel()] = s.token_ids
            w[r, : s.token_ids.numel() - 1] = s.loss_mask[1:] * adv[i]
        logits = model(input_ids=ids).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        ratio = torch.exp(logp - logp.detach())
        (-(ratio * w).sum() / n_tok).backward()


def _torch_step(hf, sgd, samples, max_tokens: int, sort: bool) -> None:
    """What one plain PyTorch step costs: zero the grads, the GRPO gradient, the optimizer step."""
    sgd.zero_grad(set_to_none=True)
    torch_grpo_step(hf, samples, max_tokens, sort=sort)
    sgd.step()


def _hf_model(megatron_model, arch):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from megatron_tsync.model.hf_conversion import hf_config_dict, megatron_to_hf

    cfg = LlamaConfig(**{k: v for k, v in hf_config_dict(arch).items() if k not in ("architectures", "torch_dtype")})
    cfg._attn_implementation = "sdpa"
    hf = LlamaForCausalLM(cfg).to(torch.float32)
    missing, unexpected = hf.load_state_dict(megatron_to_hf(megatron_model), strict=False)
    if unexpected or [k for k in missing if "rotary" not in k]:
        raise RuntimeError(f"weights do not map: missing {missing}, unexpected {unexpected}")
    return hf


def _hf_grads(hf) -> dict:
    return {n: p.grad.detach().clone() for n, p in hf.named_parameters() if p.grad is not None}


def _gradient_diff(ddp, learner, hf, samples, sizes, shape, torch_tokens: int) -> float:
    """max |g_tsync - g_torch| / max |g_torch| over every parameter (the learner's gradient after the barrier)."""
    from megatron_tsync.model.hf_conversion import megatron_to_hf
    from megatron_tsync.streaming.ready_queue import ListSource

    got = {}
    learner.grad_hook = lambda d: got.update({n: p.main_grad.clone() for n, p in d.named_parameters()})
    learner.train_step(ListSource(samples), sizes, shape)
    learner.grad_hook = None
    saved = {n: p.data for n, p in ddp.named_parameters()}
    try:  # export the gradient through the same name map as the weights
        for n, p in ddp.named_parameters():
            p.data = got[n].view_as(p.data)
        ours = megatron_to_hf(ddp.module if hasattr(ddp, "module") else ddp)
    finally:
        for n, p in ddp.named_parameters():
            p.data = saved[n]
    hf.zero_grad(set_to_none=True)
    torch_grpo_step(hf, samples, torch_tokens)
    return _rel_diff(ours, _hf_grads(hf))


def _rel_diff(ours: dict, theirs: dict) -> float:
    num = max(float((ours[k] - theirs[k]).abs().max()) for k in theirs)
    den = max(float(v.abs().max()) for v in theirs.values())
    return num / den


def _batch_rows(a) -> list[dict]:
    import torch

    from megatron_tsync.model.builder import ModelArch, build_model
    from megatron_tsync.model.hf_conversion import megatron_to_hf
    from megatron_tsync.model.parallel import initialize_parallel
    from megatron_tsync.streaming.ready_queue import ListSource
    from megatron_tsync.training.learner import Learner, LearnerConfig, shape_for
    from megatron_tsync.training.optimizer import OptimConfig, build_optimizer, wrap_ddp

    torch.set_num_threads(1)
    initialize_parallel(1, 1)
    arch = ModelArch(**ARCH)
    ddp = wrap_ddp(build_model(arch, seed=0))
    opt = build_optimizer(ddp, OptimConfig(optimizer="sgd", lr=0.0, clip_grad=0.0))
    hf = _hf_model(ddp.module if hasattr(ddp, "module") else ddp, arch)
    sgd = torch.optim.SGD(hf.parameters(), lr=0.0)
    learners = {"tsync sync": Learner(ddp, opt, LearnerConfig(mode="sync", sequence_packing=True,
                                                               max_packed_tokens=a.packed_tokens)),
                "tsync sync, unpacked": Learner(ddp, opt, LearnerConfig(mode="sync"))}
    rows = []
    for prof in a.profiles:
        S = _samples(*PROFILES[prof], seed=7)
        sizes, shape = shape_for(S)
        fns = {name: (lambda L=L: L.train_step(ListSource(S), sizes, shape)) for name, L in learners.items()}
        fns["torch padded"] = lambda: _torch_step(hf, sgd, S, a.torch_tokens, True)
        fns["torch padded, unsorted"] = lambda: _torch_step(hf, sgd, S, a.torch_tokens, False)
        times = {k: [] for k in fns}
        for r in range(a.repeats + 1):  # round-robin; the first round warms up
            for k, fn in fns.items():
                t = time.perf_counter()
                fn()
                if r:
                    times[k].append(time.perf_counter() - t)
        diff = _gradient_diff(ddp, learners["tsync sync"], hf, S, sizes, shape, a.torch_tokens)
        base = statistics.median(times["torch padded"])
        tokens = sum(s.token_ids.numel() for s in S)
        for k, ts in times.items():
            rows.append({"profile": prof, "learner": k, "step_s": statistics.median(ts), "step_s_min": min(ts),
                         "step_s_max": max(ts), "vs_torch": statistics.median(ts) / base, "tokens": tokens,
                         "trajectories": len(S), "grad_rel_diff_vs_torch": diff if k == "tsync sync" else None})
    return rows


def _single_child(impl: str, T: int, iters: int) -> dict:
    """One sequence of T tokens, forward+backward of the GRPO loss, ``iters`` times; the peak resident set above the
    one before the first step."""
    import torch

    from megatron_tsync.model.builder import ModelArch, build_model
    from megatron_tsync.model.logprobs import token_logprobs
    from megatron_tsync.model.parallel import initialize_parallel

    torch.set_num_threads(1)
    initialize_parallel(1, 1)
    arch = ModelArch(**ARCH)
    model = build_model(arch, seed=0)
    hf = _hf_model(model, arch) if impl == "torch" else None
    ids = torch.randint(0, ARCH["vocab_size"], (1, T), generator=torch.Generator().manual_seed(0))
    rss0 = _rss_mb()
    peak = [rss0]
    stop = threading.Event()

    def sample():  # ru_maxrss is the import peak at these sizes: sample the resident set while the step runs
        while not stop.is_set():
            peak[0] = max(peak[0], _rss_mb())
            time.sleep(0.002)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    ts = []
    for _ in range(iters + 1):
        t = time.perf_counter()
        if hf is None:
            logp = token_logprobs(model, ids)
        else:
            logits = hf(input_ids=ids).logits[:, :-1].float()
            logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        (-torch.exp(logp - logp.detach()).sum() / T).backward()
        ts.append(time.perf_counter() - t)
    stop.set()
    th.join()
    return {"impl": impl, "tokens": T, "fwd_bwd_s": statistics.median(ts[1:]), "min_s": min(ts[1:]),
            "max_s": max(ts[1:]), "peak_rss_mb": peak[0], "rss_growth_mb": peak[0] - rss0}


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _single_rows(a) -> list[dict]:
    rows = []
    for T in a.single:
        for impl in ("tsync", "torch"):
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "MASTER_PORT": str(_free_port())}
            out = subprocess.run([sys.executable, __file__, "--_single", impl, str(T), str(a.single_iters)],
                                 capture_output=True, text=True, env=env, check=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
        tsync, torch_ = rows[-2], rows[-1]
        tsync["vs_torch"] = tsync["fwd_bwd_s"] / torch_["fwd_bwd_s"]
        tsync["rss_growth_vs_torch"] = tsync["rss_growth_mb"] / max(torch_["rss_growth_mb"], 1e-9)
    return rows


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _print(out: dict) -> None:
    print(f"\nsame batch, same gradient: step seconds (median, min-max over {out['repeats']} repeats), one process, "
          f"{out['threads']} thread")
    print(f"{'profile':<12}{'learner':<26}{'step s':>9}{'min':>8}{'max':>8}{'vs torch':>10}{'grad diff':>11}")
    for r in out["batch"]:
        d = "" if r["grad_rel_diff_vs_torch"] is None else f"{r['grad_rel_diff_vs_torch']:.1e}"
        print(f"{r['profile']:<12}{r['learner']:<26}{r['step_s']:>9.3f}{r['step_s_min']:>8.3f}{r['step_s_max']:>8.3f}"
              f"{r['vs_torch']:>9.2f}x{d:>11}")
    if out["single"]:
        print(f"\none sequence forward+backward (subprocess each): {'impl':<7}{'tokens':>7}{'s':>8}{'peak MB':>9}"
              f"{'growth MB':>11}{'vs torch':>10}")
        for r in out["single"]:
            v = f"{r['vs_torch']:.2f}x" if "vs_torch" in r else ""
            print(f"{'':<49}{r['impl']:<7}{r['tokens']:>7}{r['fwd_bwd_s']:>8.3f}{r['peak_rss_mb']:>9.0f}"
                  f"{r['rss_growth_mb']:>11.0f}{v:>10}")


def main(argv=None) -> dict:
    if argv and argv[0] == "--_single":
        print(json.dumps(_single_child(argv[1], int(argv[2]), int(argv[3]))))
        return {}
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--profiles", nargs="*", default=["quickstart", "medium"], choices=list(PROFILES))
    ap.add_argument("--packed-tokens", type=int, default=4096, help="the learner's --max-packed-tokens")
    ap.add_argument("--torch-tokens", type=int, default=4096, help="padded tokens per torch microbatch")
    ap.add_argument("--single", type=int, nargs="*", default=[1024, 4096], help="single-sequence lengths (none: skip)")
    ap.add_argument("--single-iters", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    import torch

    out = {"batch": _batch_rows(a), "single": _single_rows(a), "repeats": a.repeats, "threads": torch.get_num_threads(),
           "cpus": os.cpu_count(), "load_avg": os.getloadavg()}
    _print(out)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
