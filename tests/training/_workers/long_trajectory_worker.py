"""One long trajectory (200 turns, ≥ 16k tokens) trained in float64, streamed and sync, with or without activation
recomputation; one process (under torchrun --nproc 1) so that its peak RSS is its own.

Writes {"peak_rss_mib": after the streamed step, "saved_mib": bytes autograd kept for the backward of the long
trajectory's forward, "stream_s", "sync_s"} to OUT.json and the two flat gradients to OUT.pt.
usage: long_trajectory_worker.py OUT TOKENS on|off [--no-sync] (--no-sync: the streamed step only, "sync" null)
"""

import json
import os
import resource
import sys
import time

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..")))
from megatron_tsync.algorithms.streamability import RewardSpec  # noqa: E402
from megatron_tsync.model.builder import ModelArch, PrecisionConfig, build_model  # noqa: E402
from megatron_tsync.model.parallel import initialize_parallel  # noqa: E402
from megatron_tsync.streaming.ready_queue import ListSource, Sample  # noqa: E402
from megatron_tsync.training.learner import Learner, LearnerConfig, shape_for  # noqa: E402
from megatron_tsync.training.opd_learner import SavedBytes  # noqa: E402
from megatron_tsync.training.optimizer import OptimConfig, build_optimizer, wrap_ddp  # noqa: E402

TURNS = 200
# smaller than stream_cases.TINY (hidden 64, 4 heads of 16): a 16k-token float64 step of TINY takes ~55 s here,
# almost all of it causal attention; 2 heads of 8 over 32 wide is 4x cheaper at the same length
LONG = ModelArch(family="llama", vocab_size=256, hidden_size=32, ffn_hidden_size=64, num_layers=2,
                 num_attention_heads=2, num_kv_heads=1, head_dim=8, max_position_embeddings=32768)
FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def samples(tokens: int) -> list[Sample]:
    """The long trajectory (each turn: a tool output, loss mask 0, then the model's action) and a short member of its
    group with the other binary reward (the advantages are non-zero)."""
    g = torch.Generator().manual_seed(0)
    turn = tokens // TURNS
    mask = torch.zeros(tokens)
    for k in range(TURNS):
        mask[k * turn + turn // 2:(k + 1) * turn] = 1

    def one(i: int, n: int, r: float) -> Sample:
        return Sample(traj_id=f"t{i}", group_id="g", group_size=2, token_ids=torch.randint(0, 256, (n,), generator=g),
                      loss_mask=mask[:n].clone(), reward=r,
                      behaviour_logp=-torch.rand(n, generator=g, dtype=torch.float64) - 1.0)

    return [one(0, tokens, 1.0), one(1, 64, 0.0)]


def step(ddp, opt, mode: str, S: list[Sample]) -> torch.Tensor:
    learner = Learner(ddp, opt, LearnerConfig(mode=mode, estimator="grpo", reward_spec=RewardSpec.binary(0.0, 1.0)))
    got = {}
    learner.grad_hook = lambda d: got.setdefault("g", torch.cat([b.grad_data.clone() for b in d.buffers]))
    sizes, shape = shape_for(S)
    learner.train_step(ListSource(S if mode == "sync" else S[::-1]), sizes, shape)  # streamed: the long one last
    return got["g"]


def saved_bytes(ddp, tokens: int) -> int:
    ids = torch.randint(0, 256, (1, tokens), generator=torch.Generator().manual_seed(1))
    saved = SavedBytes(ddp.parameters())
    with saved():
        out = ddp(ids, torch.arange(tokens).unsqueeze(0), None)  # (1, T, V)
    out.sum().backward()
    ddp.zero_grad_buffer()
    return saved.bytes


def main() -> None:
    out, tokens, rec = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "on"
    torch.set_num_threads(1)
    initialize_parallel(1, 1)
    ddp = wrap_ddp(build_model(LONG, PrecisionConfig(params_dtype=torch.float64), seed=0, **(FULL if rec else {})))
    opt = build_optimizer(ddp, OptimConfig(optimizer="sgd", lr=0.0, clip_grad=0))
    S = samples(tokens)
    t0 = time.perf_counter()
    streamed = step(ddp, opt, "stream-trajectory", S)
    t1 = time.perf_counter()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    sync = None if "--no-sync" in sys.argv else step(ddp, opt, "sync", S)
    t2 = time.perf_counter()
    report = dict(peak_rss_mib=rss, stream_s=t1 - t0, sync_s=t2 - t1, saved_mib=saved_bytes(ddp, tokens) / 2**20,
                  tokens=tokens, turns=TURNS, recompute=rec)
    torch.save({"streamed": streamed, "sync": sync}, out + ".pt")
    with open(out + ".json", "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
