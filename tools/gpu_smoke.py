"""GPU smoke test: the checks only a GPU can run, in one script (≤ 9 minutes on one GPU), table printed last.

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
6. ``packed-thd-bf16`` / ``packed-thd-fp8``: sequence packing on the TE spec (THD ``PackedSeqParams``, no T×T
   mask): sync packed and stream-trajectory packed vs unpacked sync gradient (bf16 2e-2 / FP8 5e-2 relative), and
   the packed path must really have taken the THD branch. Never run yet (no GPU where it was written).
7. ``nccl-weight-sync``: trainer → engine weight broadcast over NCCL (``transport.weight_broadcast``, the code the
   CPU tests run with gloo): 1 GiB of bf16 from cuda:0 to a receiver process on cuda:1, bit-identical (sha256 per
   tensor), GB/s. Needs 2 GPUs (NCCL refuses two ranks on one device): skipped with one. Never run yet.
8. ``vllm-native-ipc``: vLLM's native weight transfer, backend ``ipc`` (CUDA IPC, colocated: this process's cuda:0
   tensors into a vLLM engine core on the same GPU, ``VLLMEngine.weight_sync_client`` + vLLM's
   ``IPCTrainerWeightTransferEngine``): greedy samples and log-probs after the IPC update equal those after the same
   weights loaded by ``update_weights`` (bit-identical), and differ from before; ``policy_version`` moves. Never run.
9. ``vllm-native-nccl``: the same with backend ``nccl`` (vLLM's ``NCCLTrainerWeightTransferEngine``, packed, trainer
   on cuda:0, vLLM on cuda:1: the cross-node path on one node). Needs 2 GPUs. Never run yet. ``vllm-native-sparse``:
   backend ``sparse_nccl`` with only the changed entries (``vllm_weight_sync.sparse_patches``, 10% of them).
10. ``vllm-routing``: a tiny Qwen3-MoE in vLLM with ``record_routing=True`` (``enable_return_routed_experts``, Model
   Runner V2): ``Completion.routing`` has the embedded engine's (P, L, k) shape and the same expert sets as megatron's
   own router (``model.moe.record_routing``) on the same tokens, float32 (pass: ≥ 99% of (position, layer) sets
   equal; near-ties may flip), and reloading identical weights leaves samples and log-probs bit-identical (the
   MoE reload bug that vLLM's CPU build has; ``rollout/vllm_compat.py``). Never run yet.
11. ``gated-delta-fla``: ``fla``'s Triton ``chunk_gated_delta_rule`` (float32, grouped value heads, initial state, T
   not a multiple of its chunk) and ``fused_recurrent_gated_delta_rule`` (one decode step from the carried state)
   vs ``megatron_tsync.model.gated_delta`` in float64: outputs and final state ≤ 5e-3 relative, the chunked form's
   gradients (q, k, v, g, β, initial state) ≤ 2e-2 (TF32 dots). Skipped without CUDA or ``fla``. Never run yet.
12. ``bucket-residency``: bucket residency's arenas and copy engine (``streaming/arena.py``, ``mover.py``): the host
   arena's slabs are pinned; a 256 MiB device→host and host→device copy on the side stream, issued before a chain of
   matmuls on the compute stream, overlaps them (pass: ≥ 50% of each copy's time inside the matmuls' interval, from
   CUDA timing events) and round-trips bit-exactly; GB/s each way. Then stream-trajectory (float32, 4 groups × 4
   interleaved) under a 2-slot device cache (``--max-device-buckets 2``) against the same run without residency:
   relative gradient difference ≤ 1e-6 (bitwise where the kernels are deterministic), vectors moved, prefetches and
   the compute stream's copy-wait seconds reported. Never run yet (no GPU where it was written).
13. ``host-accumulation``: ``--accumulate-on-host`` (``streaming/host_accum.py``): its arena and staging chunks are
   pinned; a flush of a 256 MiB grad-buffer scratch (side-stream chunk copies, host adds on the worker thread) issued
   before a chain of matmuls (the next microbatch's forward) overlaps them (pass: ≥ 50 % of the shorter of the two
   hidden, from wall times of each alone and both together) and lands exactly (the host destination equals the
   scratch's contents, bitwise); then stream-trajectory (4 groups × 4 interleaved) with host accumulation against
   device accumulation: float32 ≤ 1e-6 relative, float64 ≤ 1e-12; flushes, GB D2H, copy / host-add / wait seconds
   reported. Never run yet (no GPU where it was written).
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
    from megatron_tsync.model.builder import ModelArch

    return ModelArch(family="llama", vocab_size=32000, hidden_size=1024, ffn_hidden_size=2816, num_layers=8,
                     num_attention_heads=16, num_kv_heads=4, head_dim=64, max_position_embeddings=4096)


def _grad(mode, precision, samples, order, packing=None, keep_dtype=False, **learner):
    import torch

    from megatron_tsync.streaming.ready_queue import ListSource
    from megatron_tsync.training.learner import Learner, LearnerConfig, shape_for
    from megatron_tsync.model.builder import build_model
    from megatron_tsync.training.optimizer import OptimConfig, build_optimizer, wrap_ddp

    m = build_model(_arch(), precision, seed=0)
    ddp = wrap_ddp(m)
    opt = build_optimizer(ddp, OptimConfig(optimizer="sgd", lr=0.0, clip_grad=0.0))
    L = Learner(ddp, opt, LearnerConfig(mode=mode, sequence_packing=packing is not None,
                                        max_packed_tokens=packing or 4096, **learner))
    got = {}
    L.grad_hook = lambda d: got.setdefault("g", torch.cat([(b.grad_data if keep_dtype else b.grad_data.float()).clone()
                                                           for b in d.buffers]))
    sizes, shape = shape_for(samples)
    res = L.train_step(ListSource(order, batch=4 if packing else 1), sizes, shape)  # packing: 4 rewards per poll
    res.thd = L.exec._thd  # the packed path took Transformer Engine's THD branch
    return got["g"], res


def _samples(n_groups=4, G=4, T=512, seed=0, min_T=None):
    import random

    import torch

    from megatron_tsync.streaming.ready_queue import Sample

    rnd = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n_groups):
        for i in range(G):
            T_i = T if min_T is None else rnd.randint(min_T, T)
            mask = torch.ones(T_i)
            mask[:32] = 0
            out.append(Sample(f"g{k}t{i}", f"g{k}", G, torch.randint(0, 32000, (T_i,), generator=g), mask,
                              float(rnd.random() < 0.5)))
    return out


@check("te-spec")
def te_spec():
    if not _cuda():
        return "skip", "no CUDA device"
    if not _te():
        return "skip", "Transformer Engine not importable"
    import torch

    from megatron_tsync.model.logprobs import token_logprobs
    from megatron_tsync.model.builder import PrecisionConfig, build_model, choose_layer_spec

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
    from megatron_tsync.model.builder import PrecisionConfig

    return _exact(PrecisionConfig(bf16=True), 2e-2)


@check("stream-exact-fp8")
def exact_fp8():
    import torch

    if not (_cuda() and _te()):
        return "skip", "needs CUDA + Transformer Engine"
    if torch.cuda.get_device_capability() < (8, 9):
        return "skip", f"FP8 needs compute capability ≥ 8.9, device has {torch.cuda.get_device_capability()}"
    from megatron_tsync.model.builder import PrecisionConfig

    return _exact(PrecisionConfig(bf16=True, fp8_format="hybrid"), 5e-2)


def _packed(precision, tol):
    """Sequence packing on the TE spec (THD ``PackedSeqParams``): sync packed and stream-trajectory packed vs sync
    unpacked. Variable lengths (100..600 tokens), 2048 tokens per packed microbatch."""
    import random

    S = _samples(T=600, min_T=100, seed=3)
    order = list(S)
    random.Random(2).shuffle(order)
    g_ref, r_ref = _grad("sync", precision, S, S)
    g_sync, r_sync = _grad("sync", precision, S, S, packing=2048)
    g_st, r_st = _grad("stream-trajectory", precision, S, order, packing=2048)
    if not r_sync.thd:
        return "fail", "the packed microbatches did not take the THD branch (TE attention not detected)"
    e1 = float((g_sync - g_ref).norm() / g_ref.norm())
    e2 = float((g_st - g_ref).norm() / g_ref.norm())
    ok = e1 < tol and e2 < tol and r_sync.microbatches < r_ref.microbatches
    return ("pass" if ok else "fail"), (f"THD packed vs unpacked sync {e1:.2e}, stream-trajectory packed vs unpacked "
                                        f"sync {e2:.2e} (tolerance {tol:g}); microbatches {r_ref.microbatches} → "
                                        f"{r_sync.microbatches} (sync), {r_st.microbatches} (stream-trajectory)")


@check("packed-thd-bf16")
def packed_bf16():
    if not (_cuda() and _te()):
        return "skip", "needs CUDA + Transformer Engine"
    from megatron_tsync.model.builder import PrecisionConfig

    return _packed(PrecisionConfig(bf16=True), 2e-2)


@check("packed-thd-fp8")
def packed_fp8():
    import torch

    if not (_cuda() and _te()):
        return "skip", "needs CUDA + Transformer Engine"
    if torch.cuda.get_device_capability() < (8, 9):
        return "skip", f"FP8 needs compute capability ≥ 8.9, device has {torch.cuda.get_device_capability()}"
    from megatron_tsync.model.builder import PrecisionConfig

    return _packed(PrecisionConfig(bf16=True, fp8_format="hybrid"), 5e-2)


@check("learner-mfu")
def mfu():
    if not _cuda():
        return "skip", "no CUDA device"
    import torch

    from megatron_tsync.model.builder import PrecisionConfig

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


def _vllm_model(hf_dir):
    """(the model folder, None) for a vLLM check, or (None, why it is skipped): CUDA, vLLM importable; no
    ``--hf-model``: a tiny model made here."""
    if not _cuda():
        return None, "no CUDA device"
    try:
        import vllm  # noqa: F401
    except Exception:
        return None, "vllm not importable"
    if hf_dir is None:
        from megatron_tsync.model.tiny_model import make_tiny_model

        hf_dir = make_tiny_model("/tmp/tsync_gpu_smoke_model", seed=0)
    return hf_dir, None


@check("vllm-cuda")
def vllm_cuda(hf_dir):
    hf_dir, why = _vllm_model(hf_dir)
    if why:
        return "skip", why
    from megatron_tsync.rollout.engine import SamplingConfig
    from megatron_tsync.rollout.vllm_engine import VLLMEngine

    eng = VLLMEngine(hf_dir, dtype="bfloat16", seed=0)
    outs = eng.generate([[0, 5, 6, 7]], SamplingConfig(max_new_tokens=16), n=4)
    return "pass", f"generated {sum(len(c.token_ids) for c in outs[0])} tokens"


@check("vllm-priority")
def vllm_priority(hf_dir):
    """Frontier-first rollouts on vLLM's CUDA build: an engine with the priority scheduler and 2 sequences at a time
    returns the same seeded completions with and without per-request priorities, and admits the low-priority-value
    requests first (their first scheduled time, where vLLM reports request metrics)."""
    hf_dir, why = _vllm_model(hf_dir)
    if why:
        return "skip", why
    from megatron_tsync.rollout.engine import SamplingConfig
    from megatron_tsync.rollout.vllm_engine import VLLMEngine

    eng = VLLMEngine(hf_dir, dtype="bfloat16", seed=0, max_num_seqs=2, scheduling_policy="priority")
    prompts = [[0, 5 + i, 6, 7] for i in range(8)]
    cfg = SamplingConfig(max_new_tokens=32, seed=5)
    prio = [7, 6, 5, 4, 3, 2, 1, 0]
    same = [c[0].token_ids for c in eng.generate(prompts, cfg)] == \
        [c[0].token_ids for c in eng.generate(prompts, cfg, priorities=prio)]
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    outs = eng.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                            SamplingParams(max_tokens=32, ignore_eos=True), use_tqdm=False, priority=prio)
    first = [getattr(getattr(o, "metrics", None), "first_scheduled_time", None) for o in outs]
    if None in first:
        order = "order not observable (no request metrics)"
    else:
        ranked = [i for i, _ in sorted(enumerate(first), key=lambda x: x[1])]
        order = f"admission order by priority value {[prio[i] for i in ranked]}"
        same = same and [prio[i] for i in ranked[:2]] == [0, 1]
    return ("pass" if same else "fail"), f"same completions with priorities: {same}; {order}"


_NCCL_RECEIVER = r"""
import hashlib, sys, torch
from megatron_tsync.transport.weight_broadcast import BroadcastWeightSubscriber, WeightSyncGroup
torch.cuda.set_device(1)
g = WeightSyncGroup.join("127.0.0.1", int(sys.argv[1]), 1, 2, backend="nccl", device="cuda:1", connect_timeout_s=120,
                         op_timeout_s=120)
sub = BroadcastWeightSubscriber(g, bytes(range(32)))
v, state = sub.wait_for(0, timeout_s=120)
torch.cuda.synchronize()
print("SECONDS", sub.last_stats["seconds"], flush=True)
for k, t in state.items():
    print("SHA", k, hashlib.sha256(t.cpu().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest(), flush=True)
"""


@check("nccl-weight-sync")
def nccl_sync():
    if not _cuda():
        return "skip", "no CUDA device"
    import hashlib
    import subprocess

    import torch

    if torch.cuda.device_count() < 2:
        return "skip", "needs 2 GPUs (NCCL refuses two ranks on one device); the same code runs with gloo in CPU tests"
    from megatron_tsync.transport.weight_broadcast import BroadcastWeightPublisher, WeightSyncGroup

    torch.cuda.set_device(0)
    g = WeightSyncGroup.host(2, backend="nccl", device="cuda:0", op_timeout_s=120)
    proc = subprocess.Popen([sys.executable, "-c", _NCCL_RECEIVER, str(g.port)], stdout=subprocess.PIPE, text=True)

    def alive():
        if proc.poll() is not None:
            raise RuntimeError(f"NCCL receiver exited with {proc.returncode}")

    gen = torch.Generator(device="cuda:0").manual_seed(0)
    state = {f"w{i}": torch.randn(4096, 4096, device="cuda:0", generator=gen).bfloat16() for i in range(32)}  # 1 GiB
    pub = BroadcastWeightPublisher(g, bytes(range(32)), bucket_bytes=256 << 20, poll_fn=alive, connect_timeout_s=120)
    try:
        pub.publish(state, 0)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
        pub.close()
    got = {ln.split()[1]: ln.split()[2] for ln in out.splitlines() if ln.startswith("SHA ")}
    want = {k: hashlib.sha256(t.cpu().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
            for k, t in state.items()}
    secs = float(next(ln.split()[1] for ln in out.splitlines() if ln.startswith("SECONDS ")))
    if got != want:
        return "fail", f"{sum(got.get(k) != v for k, v in want.items())} of {len(want)} tensors differ after NCCL"
    return "pass", f"1 GiB bf16 bit-identical, {pub.last_stats['seconds']:.2f}s sender / {secs:.2f}s receiver " \
                   f"({(1 << 30) / secs / 1e9:.1f} GB/s)"


def _native_source(state):
    """vLLM's ``WeightSource`` over a dict of CUDA tensors (HF names)."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class DictSource(WeightSource):
        def metadata(self):
            return [ParamMeta(k, v.dtype, tuple(v.shape)) for k, v in state.items()]

        def __iter__(self):
            return iter(state.items())

    return DictSource()


def _native_transfer(hf_dir, backend):
    """Greedy (tokens, logprobs) after a vLLM-backend update vs after ``update_weights`` of the same weights."""
    import torch
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from megatron_tsync.model.hf_conversion import load_hf_dir
    from megatron_tsync.rollout.engine import SamplingConfig
    from megatron_tsync.rollout.vllm_engine import VLLMEngine

    _, state = load_hf_dir(hf_dir)
    gen = torch.Generator().manual_seed(1)
    old = {k: v.to("cuda:0", torch.bfloat16) for k, v in state.items()}  # what the bf16 engine loads from the folder
    new = {k: torch.where(torch.rand(v.shape, generator=gen) < 0.1, v + 0.05 * torch.randn(v.shape, generator=gen),
                          v).to("cuda:0", torch.bfloat16) for k, v in state.items()}  # 10% of the entries move
    env = dict(os.environ)
    if backend != "ipc":
        os.environ["CUDA_VISIBLE_DEVICES"] = "1"  # the engine core (a child process) on GPU 1; this process keeps 0
    try:
        eng = VLLMEngine(hf_dir, dtype="bfloat16", seed=0, in_process=False, weight_transfer=backend,
                         enforce_eager=True, gpu_memory_utilization=0.3)
    finally:
        os.environ.clear()
        os.environ.update(env)
    try:
        cfg, prompts = SamplingConfig(max_new_tokens=16, seed=0, top_k=1), [[0, 5, 6, 7], [9, 10, 11]]

        def sample():
            return [(c.token_ids, c.logprobs) for cs in eng.generate(prompts, cfg) for c in cs]

        before = sample()
        client = eng.weight_sync_client()
        client.next_version = 1
        if backend == "ipc":
            from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

            info = IPCTrainerInitInfo(rank=0, packed=True)
        else:
            import socket

            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo
            from vllm.distributed.weight_transfer.sparse_nccl_engine import SparseNCCLTrainerInitInfo

            with socket.socket() as sk:
                sk.bind(("127.0.0.1", 0))
                port = sk.getsockname()[1]
            cls = NCCLTrainerInitInfo if backend == "nccl" else SparseNCCLTrainerInitInfo
            info = cls(rank=0, master_address="127.0.0.1", master_port=port, world_size=2)
        sparse = backend == "sparse_nccl"
        trainer = WeightTransferTrainerFactory.trainer_init(info, client=client,
                                                            source=None if sparse else _native_source(new))
        t = time.perf_counter()
        if sparse:
            from vllm.distributed.weight_transfer.sparse_nccl_engine import SparseWeightPatch

            from megatron_tsync.rollout.vllm_weight_sync import sparse_patches

            trainer.send_weights([SparseWeightPatch(*p) for p in sparse_patches(old, new)])
        else:
            trainer.send_weights()
        dt = time.perf_counter() - t
        by_native, version = sample(), eng.policy_version
        eng.update_weights({k: v.cpu() for k, v in new.items()}, 2)
        by_dict = sample()
        trainer.shutdown()
    finally:
        eng.close()
    if version != 1 or by_native == before:
        return "fail", f"after the {backend} update: version {version}, samples unchanged: {by_native == before}"
    if by_native != by_dict:
        return "fail", f"{backend} update differs from update_weights of the same weights"
    n = sum(v.numel() for v in new.values())
    return "pass", f"{backend}: samples/log-probs equal update_weights', {dt:.2f}s for {n} params"


@check("vllm-native-ipc")
def vllm_native_ipc(hf_dir):
    why = _vllm_native_skip()
    if why:
        return "skip", why
    return _native_transfer(hf_dir or _tiny_hf(), "ipc")


def _two_gpu_native(hf_dir, backend):
    why = _vllm_native_skip()
    if why:
        return "skip", why
    import torch

    if torch.cuda.device_count() < 2:
        return "skip", "needs 2 GPUs (NCCL refuses two ranks on one device); vLLM's ipc backend is the one-GPU path"
    return _native_transfer(hf_dir or _tiny_hf(), backend)


@check("vllm-native-nccl")
def vllm_native_nccl(hf_dir):
    return _two_gpu_native(hf_dir, "nccl")


@check("vllm-native-sparse")
def vllm_native_sparse(hf_dir):
    return _two_gpu_native(hf_dir, "sparse_nccl")


def _vllm_native_skip():
    if not _cuda():
        return "no CUDA device"
    try:
        from megatron_tsync.rollout.vllm_compat import native_weight_transfer_available
    except Exception as e:  # noqa: BLE001
        return f"vllm not importable ({e})"
    try:
        import vllm  # noqa: F401
    except Exception:
        return "vllm not importable"
    if not native_weight_transfer_available():
        return "this vLLM has no native weight-transfer API"
    return None


def _tiny_hf():
    from megatron_tsync.model.tiny_model import make_tiny_model

    return make_tiny_model("/tmp/tsync_gpu_smoke_model", seed=0)


@check("vllm-routing")
def vllm_routing():
    if not _cuda():
        return "skip", "no CUDA device"
    try:
        from megatron_tsync.rollout.vllm_compat import routed_experts_refusal
    except Exception as e:  # noqa: BLE001
        return "skip", f"vllm not importable ({e})"
    why = routed_experts_refusal()
    if why:
        return "skip", why
    import torch

    from megatron_tsync.model.builder import build_model
    from megatron_tsync.model.hf_conversion import load_hf_dir, load_hf_into_model
    from megatron_tsync.model.logprobs import token_logprobs
    from megatron_tsync.model.moe import record_routing
    from megatron_tsync.model.tiny_model import make_tiny_model
    from megatron_tsync.rollout.engine import SamplingConfig
    from megatron_tsync.rollout.vllm_engine import VLLMEngine

    d = make_tiny_model("/tmp/tsync_gpu_smoke_moe", family="qwen3_moe", seed=0, experts=8, topk=2)
    eng = VLLMEngine(d, dtype="float32", seed=0, in_process=False, record_routing=True, enforce_eager=True,
                     gpu_memory_utilization=0.3)
    arch, state = load_hf_dir(d)
    try:
        prompts = [[10, 20, 30, 40, 50], [7, 8, 9]]
        cfg = SamplingConfig(max_new_tokens=12, seed=3)
        outs = [c for cs in eng.generate(prompts, cfg, n=2) for c in cs]
        eng.update_weights(state, 1)  # identical weights: a MoE reload that skips kernel processing shows here
        again = [c for cs in eng.generate(prompts, cfg, n=2) for c in cs]
    finally:
        eng.close()
    if [(c.token_ids, c.logprobs) for c in again] != [(c.token_ids, c.logprobs) for c in outs]:
        return "fail", "reloading identical MoE weights changed the samples/log-probs (vLLM's MoE reload)"
    model = build_model(arch, seed=0, moe_enable_routing_replay=True)
    load_hf_into_model(model, state)
    model.eval()
    same = total = 0
    for i, c in enumerate(outs):
        ids = prompts[i // 2] + c.token_ids[:-1]
        if c.routing is None or c.routing.shape != (len(ids), arch.num_layers, 2):
            return "fail", f"routing shape {getattr(c.routing, 'shape', None)} for {len(ids)} positions"
        with torch.no_grad(), record_routing(model) as rec:
            token_logprobs(model, torch.tensor([ids], device="cuda"))
        ref = torch.stack(rec.indices, 1).sort(-1).values.cpu().numpy()  # (P, L, k)
        got = torch.as_tensor(c.routing.astype("int64")).sort(-1).values.numpy()
        same += int((ref == got).all(-1).sum())
        total += ref.shape[0] * ref.shape[1]
    frac = same / total
    return ("pass" if frac >= 0.99 else "fail"), f"{frac:.2%} of {total} (position, layer) expert sets equal megatron's"


def _timed_copy(mover, dst, src, a, reps):
    """Issue dst ← src on the mover's side stream, then ``reps`` matmuls a @ a on the compute stream; returns
    (copy seconds, fraction of the copy inside the matmuls' interval)."""
    import torch

    ev = [torch.cuda.Event(enable_timing=True) for _ in range(5)]
    cur = torch.cuda.current_stream()
    torch.cuda.synchronize()
    ev[0].record(cur)
    mover.mark_used(src)
    ev[1].record(mover.stream)
    mover.copy(dst, src)
    ev[2].record(mover.stream)
    ev[3].record(cur)
    for _ in range(reps):
        a = (a @ a).mul_(1e-3)  # (N, N); scaled to stay finite
    ev[4].record(cur)
    torch.cuda.synchronize()
    cs, ce, ms, me = (ev[0].elapsed_time(e) for e in ev[1:])
    inside = max(0.0, min(ce, me) - max(cs, ms))
    return (ce - cs) / 1e3, inside / max(ce - cs, 1e-9)


@check("bucket-residency")
def bucket_residency():
    if not _cuda():
        return "skip", "no CUDA device"
    import torch

    from megatron_tsync.streaming.arena import SlotArena, SlotLayout
    from megatron_tsync.streaming.mover import Mover

    dev = torch.device("cuda", torch.cuda.current_device())
    lay = SlotLayout([torch.empty(64 << 20, dtype=torch.float32, device=dev)])  # one 256 MiB vector
    host, cache = SlotArena(lay, 1, torch.device("cpu"), pin=True), SlotArena(lay, 2, dev)
    if not all(s.is_pinned() for s in host.slabs):
        return "fail", "the host arena's slabs are not pinned"
    src, back, h = cache.take(), cache.take(), host.take()
    src.parts[0].normal_()
    mover, a = Mover(dev), torch.randn(8192, 8192, device=dev)
    d2h_s, d2h_in = _timed_copy(mover, h, src, a, 12)
    h2d_s, h2d_in = _timed_copy(mover, back, h, a, 12)
    mover.ready(back)
    exact = torch.equal(back.parts[0], src.parts[0])
    gb = lay.vector_bytes / 1e9
    detail = (f"pinned arena; D2H {gb / d2h_s:.1f} GB/s ({d2h_in:.0%} overlapped), H2D {gb / h2d_s:.1f} GB/s "
              f"({h2d_in:.0%} overlapped), round trip {'exact' if exact else 'NOT exact'}")
    ok, more = _residency_learner()
    ok = ok and exact and d2h_in >= 0.5 and h2d_in >= 0.5
    return ("pass" if ok else "fail"), f"{detail}; {more}"


def _residency_learner():
    """stream-trajectory with 2 device slots vs without (float32, 4 groups × 4 interleaved): (ok, detail)."""
    import random

    from megatron_tsync.model.builder import PrecisionConfig

    S = _samples(n_groups=4, G=4, T=512, seed=5)
    order = [S[g * 4 + i] for i in range(4) for g in range(4)]  # every group open at once
    tail = order[4:]
    random.Random(3).shuffle(tail)
    order[4:] = tail
    g_ref, _ = _grad("stream-trajectory", PrecisionConfig(), S, order)
    g_res, res = _grad("stream-trajectory", PrecisionConfig(), S, order, max_device_buckets=2)
    rel = float((g_res - g_ref).norm() / g_ref.norm())
    off = res.offload
    detail = (f"stream-trajectory with 2 device slots vs without: {rel:.1e}{' (bitwise)' if rel == 0 else ''}, "
              f"{off['to_host']} out / {off['to_device']} in ({off['prefetched']} prefetched, {off['prefetch_hits']} "
              f"hits), {off['bytes_moved'] / 1e9:.2f} GB moved, copy wait {off['wait_s']:.3f} s")
    return rel <= 1e-6 and off["to_host"] > 0, detail


def _gdn_inputs(B=2, T=300, Hk=2, Hv=4, D=64):
    import torch

    from megatron_tsync.model.gated_delta import decay_and_beta, l2norm

    gen = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    g, beta = decay_and_beta(r(B, T, Hv), r(B, T, Hv), r(Hv) * 0.5, r(Hv))
    return [l2norm(r(B, T, Hk, D)), l2norm(r(B, T, Hk, D)), r(B, T, Hv, D), g, beta, r(B, Hv, D, D)]


def _rel(a, b):
    return ((a.double().cpu() - b).abs().max() / b.abs().max()).item()


@check("gated-delta-fla")
def gated_delta_fla():
    if not _cuda():
        return "skip", "no CUDA device"
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except Exception as e:  # noqa: BLE001
        return "skip", f"fla not importable ({e})"
    import torch

    from megatron_tsync.model.gated_delta import chunk_gated_delta_rule as ref_chunk
    from megatron_tsync.model.gated_delta import recurrent_gated_delta_rule as ref_step

    xs = [x.requires_grad_() for x in _gdn_inputs()]
    o_ref, s_ref = ref_chunk(*xs[:5], chunk_size=64, initial_state=xs[5])
    w = torch.randn_like(o_ref)
    ref_grads = torch.autograd.grad((o_ref * w).sum(), xs)
    dev = [x.detach().float().cuda().requires_grad_() for x in xs]
    o, s = chunk_gated_delta_rule(*dev[:5], initial_state=dev[5], output_final_state=True)
    grads = torch.autograd.grad((o * w.float().cuda()).sum(), dev)
    errs = {"o": _rel(o, o_ref.detach()), "state": _rel(s, s_ref.detach())}
    errs.update({f"d{n}": _rel(a, b) for n, a, b in zip(("q", "k", "v", "g", "beta", "h0"), grads, ref_grads)})
    step = [x.detach()[:, :1] for x in xs[:5]]  # one decode token from the carried state
    o1_ref, s1_ref = ref_step(*step, initial_state=s_ref.detach())
    o1, s1 = fused_recurrent_gated_delta_rule(*[x.float().cuda() for x in step], initial_state=s.detach(),
                                              output_final_state=True)
    errs.update({"step_o": _rel(o1, o1_ref), "step_state": _rel(s1, s1_ref)})
    bad = {k: v for k, v in errs.items() if v > (2e-2 if k.startswith("d") else 5e-3)}
    detail = ", ".join(f"{k} {v:.1e}" for k, v in errs.items())
    return ("fail" if bad else "pass"), f"relative to float64: {detail}"


@check("host-accumulation")
def host_accumulation():
    if not _cuda():
        return "skip", "no CUDA device"
    import torch

    from megatron_tsync.streaming.buckets import BucketPool, GradVector
    from megatron_tsync.streaming.host_accum import HostAccumulation

    class _Router:  # a 256 MiB fp32 "grad buffer" on the GPU
        accumulator = GradVector([torch.zeros(64 << 20, device="cuda")])

    r = _Router()
    h = HostAccumulation(r)  # CUDA: the worker thread, side stream, pinned staging
    pinned = all(s.is_pinned() for s in h.arena.slabs) and all(s.is_pinned() for s in h.staging)
    h.begin_step(1)
    q = h.acquire(BucketPool(r.accumulator), "Q")
    a = torch.randn(8192, 8192, device="cuda")

    def matmuls():
        x = a
        for _ in range(12):
            x = (x @ x).mul_(1e-3)
        return x

    def timed(flush, mm):
        h.drain()
        torch.cuda.synchronize()
        h.route([(q, 1.0)])
        h.begin_backward()  # a stand-in backward writes the scratch
        r.accumulator.parts[0].normal_()
        want = r.accumulator.parts[0].clone().cpu()
        torch.cuda.synchronize()
        t = time.perf_counter()
        if flush:
            h.flush()  # the next microbatch's forward starts: the scratch goes to the host
        if mm:
            matmuls()
        h.route([(h.accumulator, 1.0)])
        h.begin_backward()  # the next backward: waits for the scratch
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        h.dirty = False  # that stand-in backward wrote nothing
        if not flush:
            h.scratch.zero_()
        return dt, want

    timed(True, True)  # warm-up
    h.drain()
    q.zero_()
    t_flush, want = timed(True, False)
    h.drain()
    exact = torch.equal(q.parts[0], want)
    t_mm, _ = timed(False, True)
    t_both, _ = timed(True, True)
    hidden = (t_flush + t_mm - t_both) / min(t_flush, t_mm)
    h.drain()
    st = h.step_stats()
    h.close()
    detail = (f"{'pinned' if pinned else 'NOT pinned'}; flush of 256 MiB {t_flush:.3f} s "
              f"({0.268 / t_flush:.1f} GB/s), matmuls {t_mm:.3f} s, both {t_both:.3f} s: {hidden:.0%} hidden; "
              f"destination {'exact' if exact else 'NOT exact'}; D2H {st['d2h_s']:.3f} s, host add "
              f"{st['host_add_s']:.3f} s over {st['flushes']} flushes")
    ok, more = _host_accumulation_learner()
    return ("pass" if ok and pinned and exact and hidden >= 0.5 else "fail"), f"{detail}; {more}"


def _host_accumulation_learner():
    """stream-trajectory with host accumulation vs device accumulation, float32 and float64: (ok, detail)."""
    import torch

    from megatron_tsync.model.builder import PrecisionConfig

    S = _samples(n_groups=4, G=4, T=512, seed=5)
    order = [S[g * 4 + i] for i in range(4) for g in range(4)]  # every group open at once
    out, ok = [], True
    for prec, tol in ((PrecisionConfig(), 1e-6), (PrecisionConfig(params_dtype=torch.float64), 1e-12)):
        g_dev, _ = _grad("stream-trajectory", prec, S, order, keep_dtype=True)
        g_host, res = _grad("stream-trajectory", prec, S, order, keep_dtype=True, accumulate_on_host=True)
        rel = float((g_host - g_dev).norm() / g_dev.norm())
        off = res.offload
        ok = ok and rel <= tol and off["flushes"] > 0
        out.append(f"{str(prec.params_dtype).removeprefix('torch.')} {rel:.1e} (≤ {tol:g}), {off['flushes']} flushes, "
                   f"{off['d2h_bytes'] / 1e9:.2f} GB D2H, copies {off['d2h_s']:.3f} s, adds {off['host_add_s']:.3f} s, "
                   f"wait {off['wait_s']:.3f} s")
    return ok, "host vs device accumulation: " + "; ".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--hf-model", default=None)
    a = ap.parse_args(argv)
    from megatron_tsync.model.parallel import initialize_parallel

    initialize_parallel(1, 1)
    te_spec()
    exact_bf16()
    exact_fp8()
    packed_bf16()
    packed_fp8()
    mfu()
    vllm_cuda(a.hf_model)
    vllm_priority(a.hf_model)
    nccl_sync()
    vllm_native_ipc(a.hf_model)
    vllm_native_nccl(a.hf_model)
    vllm_native_sparse(a.hf_model)
    vllm_routing()
    gated_delta_fla()
    bucket_residency()
    host_accumulation()
    import torch

    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU only"
    print(f"\nGPU smoke on {dev}")
    print(f"{'check':<20}{'status':<8}{'s':>6}  detail")
    for r in RESULTS:
        print(f"{r['check']:<20}{r['status']:<8}{r['s']:>6}  {r['detail']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": dev, "results": RESULTS}, f, indent=1)
    return 0 if all(r["status"] != "fail" for r in RESULTS) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
