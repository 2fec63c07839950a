"""Weight hand-off time, trainer → engines: signed files (``--weight-sync file``) vs broadcast (``broadcast``).

    OMP_NUM_THREADS=1 python tools/bench_weight_sync.py --params 100e6 --receivers 2 [--model HF_DIR] [--json OUT]

State: ``--model`` (an HF folder's safetensors, e.g. the tiny model) or ``--params`` random float32 parameters in
transformer-like shapes. For each of ``--repeats`` versions it measures

- file: ``publish_weights`` (safetensors + sha256 + fsync + signed manifest) in this process, then one subscriber's
  ``wait_for`` (read, verify, parse) — every receiver pays that load;
- broadcast: this process as rank 0 (gloo, CPU tensors) and ``--receivers`` processes; the sender's ``publish`` and
  each receiver's ``wait_for`` (manifest + buckets into a state dict), receivers already waiting.

Reported: median seconds per version (file: publish + one load; broadcast: until the slowest receiver holds the
dict). The engine's own ``update_weights`` is not included (the same for both). CPU/gloo only; nothing here runs NCCL.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

KEY = bytes(range(32))


def random_state(params: float, seed: int = 0) -> dict[str, torch.Tensor]:
    """float32 tensors shaped like a Llama (hidden 1024, vocab 32000) up to ``params`` parameters."""
    g = torch.Generator().manual_seed(seed)
    h, v, state, n = 1024, 32000, {}, 0
    state["model.embed_tokens.weight"] = torch.randn(v, h, generator=g)
    n += v * h
    layer = 0
    while n < params:
        for name, shape in (("self_attn.q_proj", (h, h)), ("self_attn.k_proj", (h // 4, h)),
                            ("self_attn.v_proj", (h // 4, h)), ("self_attn.o_proj", (h, h)),
                            ("mlp.gate_proj", (4 * h, h)), ("mlp.up_proj", (4 * h, h)), ("mlp.down_proj", (h, 4 * h))):
            state[f"model.layers.{layer}.{name}.weight"] = torch.randn(*shape, generator=g)
            n += shape[0] * shape[1]
        state[f"model.layers.{layer}.input_layernorm.weight"] = torch.ones(h)
        layer += 1
    return state


def _receiver(port: int, rank: int, world: int, repeats: int, out: str) -> int:
    from megatron_tsync.transport.weight_broadcast import BroadcastWeightSubscriber, WeightSyncGroup

    torch.set_num_threads(1)
    sub = BroadcastWeightSubscriber(WeightSyncGroup.join("127.0.0.1", port, rank, world, op_timeout_s=600), KEY)
    times = []
    for v in range(repeats):
        receipt = sub.receive(v, timeout_s=600)
        state = dict(receipt)
        times.append(time.perf_counter() - receipt.t0)  # from the sender's announce (the receiver was waiting)
        del state
    with open(out, "w") as f:
        json.dump(times, f)
    return 0


def bench_file(state, repeats: int) -> dict:
    from megatron_tsync.transport.weights import WeightSubscriber, publish_weights

    pub, load = [], []
    with tempfile.TemporaryDirectory(prefix="tsync-bench-") as d:
        sub = WeightSubscriber(d, KEY)
        for v in range(repeats):
            t0 = time.perf_counter()
            publish_weights(state, d, v, KEY)
            t1 = time.perf_counter()
            got = sub.wait_for(v, timeout_s=60)
            t2 = time.perf_counter()
            assert got[0] == v
            pub.append(t1 - t0)
            load.append(t2 - t1)
    return {"publish_s": statistics.median(pub), "load_s": statistics.median(load),
            "total_s": statistics.median(a + b for a, b in zip(pub, load))}


def bench_broadcast(state, repeats: int, receivers: int, bucket_mb: int) -> dict:
    from megatron_tsync.transport.weight_broadcast import BroadcastWeightPublisher, WeightSyncGroup

    world = 1 + receivers
    g = WeightSyncGroup.host(world, op_timeout_s=600)
    tmp = tempfile.mkdtemp(prefix="tsync-bench-")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, __file__, "--_receiver", str(g.port), str(r), str(world), str(repeats),
                               os.path.join(tmp, f"r{r}.json")], env=env) for r in range(1, world)]
    pub = BroadcastWeightPublisher(g, KEY, bucket_bytes=bucket_mb << 20)
    times = []
    try:
        for v in range(repeats):
            if v:
                time.sleep(1.0)  # receivers are waiting for the announce, as a worker waits for the next version
            pub.publish(state, v)
            times.append(pub.last_stats["seconds"])
        for p in procs:
            assert p.wait(timeout=600) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        pub.close()
    recv = [json.load(open(os.path.join(tmp, f"r{r}.json"))) for r in range(1, world)]
    slowest = [max(r[v] for r in recv) for v in range(repeats)]
    # version 0 includes the group's rendezvous (receivers starting up): report the later ones when there are any
    keep = slice(1, None) if repeats > 1 else slice(None)
    return {"publish_s": statistics.median(times[keep]), "receive_s": statistics.median(slowest[keep]),
            "total_s": statistics.median(max(a, b) for a, b in zip(times[keep], slowest[keep])),
            "receivers": receivers, "bucket_mb": bucket_mb}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=float, default=100e6)
    ap.add_argument("--model", default=None, help="HF folder: benchmark its safetensors state instead")
    ap.add_argument("--receivers", type=int, default=2)
    ap.add_argument("--bucket-mb", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--json", default=None)
    ap.add_argument("--_receiver", nargs=5, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a._receiver:
        port, rank, world, repeats, out = a._receiver
        return _receiver(int(port), int(rank), int(world), int(repeats), out)
    torch.set_num_threads(1)
    if a.model:
        from safetensors.torch import load_file

        state = load_file(os.path.join(a.model, "model.safetensors"))
    else:
        state = random_state(a.params)
    n = sum(t.numel() for t in state.values())
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    res = {"params": n, "bytes": nbytes, "file": bench_file(state, a.repeats),
           "broadcast": bench_broadcast(state, a.repeats, a.receivers, a.bucket_mb)}
    print(json.dumps(res, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
