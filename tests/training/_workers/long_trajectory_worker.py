"""One long trajectory (200 turns, ≥ 16k tokens) trained in float64 with and without activation recomputation; one
process (under torchrun --nproc 1) so that the peak RSS is the test's own.

Two models with the same weights, "on" (full recomputation) and "off". In order: the streamed step "on", then the
streamed step "off" (ru_maxrss read after each: the high-water mark rises during "off" only if "off" needs more
memory at its peak than "on" did; read in this order, "off" after "on", ``peak_rss_mib["off"] > ["on"]`` is that
claim), then the sync step "on", then the bytes autograd keeps for the long trajectory's forward under each model (a
forward under ``SavedBytes``; the graph is dropped, no backward). Writes {rec: {"peak_rss_mib", "saved_mib",
"stream_s", "sync_s"}} to OUT.json and {rec: {"streamed", "sync"}} flat gradients to OUT.pt ("sync" of "off": None).
usage: long_trajectory_worker.py OUT TOKENS
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
# almost all of it causal attention; one head of 8 over 32 wide is ~8x cheaper at the same length. Two layers, so
# that full/uniform/1 checkpoints each layer on its own and the recomputed backward chains through both
LONG = ModelArch(family="llama", vocab_size=256, hidden_size=32, ffn_hidden_size=64, num_layers=2,
                 num_attention_heads=1, num_kv_heads=1, head_dim=8, max_position_embeddings=32768)
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
    del out  # the graph (and what it saved) goes with it; its size is what was counted
    return saved.bytes


def main() -> None:
    out, tokens = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)
    initialize_parallel(1, 1)
    S = samples(tokens)
    models, report, grads = {}, {}, {}
    for rec in ("on", "off"):
        recompute = FULL if rec == "on" else {}
        ddp = wrap_ddp(build_model(LONG, PrecisionConfig(params_dtype=torch.float64), seed=0, **recompute))
        models[rec] = (ddp, build_optimizer(ddp, OptimConfig(optimizer="sgd", lr=0.0, clip_grad=0)))
    for rec in ("on", "off"):  # "on" first: see the docstring
        t0 = time.process_time()
        grads[rec] = {"streamed": step(*models[rec], "stream-trajectory", S), "sync": None}
        report[rec] = dict(peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # KiB on Linux
                           stream_s=time.process_time() - t0, tokens=tokens, turns=TURNS, recompute=rec == "on")
    t0 = time.process_time()
    grads["on"]["sync"] = step(*models["on"], "sync", S)
    report["on"]["sync_s"] = time.process_time() - t0
    for rec in ("on", "off"):
        report[rec]["saved_mib"] = saved_bytes(models[rec][0], tokens) / 2**20
    torch.save(grads, out + ".pt")
    with open(out + ".json", "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
