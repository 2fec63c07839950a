"""Same HF weights, same data, any layout: per-token log-probs, the gradient (HF names) and the weights after one
optimizer step, written by global rank 0 to --out-dir/LAYOUT.pt (torch.save). Run with 1 process (``--layouts
single``, the reference) and with 2 (``--layouts tp2 pp2 dp2``: the layouts one after the other in the same 2
processes, model parallelism re-initialised between them); tests/training/test_parallel_equivalence.py compares
them."""

import argparse
import os
import warnings

warnings.filterwarnings("ignore")
import torch
import torch.distributed as dist

from megatron_tsync.runtime.rollout_io import grads_to_hf
from megatron_tsync.model.hf_conversion import load_hf_dir, load_hf_into_model, megatron_to_hf
from megatron_tsync.model.logprobs import vocab_parallel_logprobs
from megatron_tsync.model.builder import PrecisionConfig, build_model
from megatron_tsync.training.optimizer import OptimConfig, build_optimizer, finalize_and_scale, wrap_ddp
from megatron_tsync.model.parallel import destroy_parallel, initialize_parallel


def batch(vocab, n=4, T=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (T - i,), generator=g) for i in range(n)]


LAYOUTS = {"single": (1, 1, 1), "tp2": (2, 1, 1), "pp2": (1, 2, 1), "dp2": (1, 1, 1),
           "ep2": (1, 1, 2)}  # (tp, pp, ep); dp = world / (tp × pp); ep2: MoE experts split over the 2 DP ranks


def run(model_dir, dims, out):
    arch, hf = load_hf_dir(model_dir)
    model = build_model(arch, PrecisionConfig(), seed=0)
    load_hf_into_model(model, hf)
    ddp = wrap_ddp(model)
    opt = build_optimizer(ddp, OptimConfig(optimizer="adam", lr=1e-3, clip_grad=1.0))
    seqs = batch(arch.vocab_size)
    mine = [s for i, s in enumerate(seqs) if i % dims.dp == dims.dp_rank]
    n_tok = sum(s.numel() - 1 for s in seqs)
    logps = {}

    def fwd(it, m):
        i, s = next(it)
        ids = s.unsqueeze(0)
        out = m(ids, torch.arange(ids.shape[1]).unsqueeze(0), None)

        def loss(o):
            lp = vocab_parallel_logprobs(o[:, :-1], ids[:, 1:])
            logps[i] = lp.detach().clone()
            tot = -lp.sum()
            return tot, torch.tensor(lp.numel(), dtype=torch.int), {"l": tot.detach()}

        return out, loss

    from megatron.core.pipeline_parallel import get_forward_backward_func

    items = [(i, s) for i, s in enumerate(seqs) if i % dims.dp == dims.dp_rank]
    get_forward_backward_func()(forward_step_func=fwd, data_iterator=iter(items), model=[ddp],
                                num_microbatches=len(items), seq_length=max(s.numel() for s in mine),
                                micro_batch_size=1, forward_only=False)
    finalize_and_scale(ddp, float(n_tok))
    grads = grads_to_hf(ddp)
    opt.step()
    weights = megatron_to_hf(ddp)
    # gather log-probs from the last stage of every DP replica to global rank 0
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {k: v for k, v in logps.items()} if dims.is_last_stage and dims.tp_rank == 0 else {})
    all_lp = {}
    for d in gathered:
        all_lp.update(d)
    if dims.rank == 0:
        torch.save({"logprobs": all_lp, "grads": grads, "weights": weights}, out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--layouts", nargs="+", required=True, choices=list(LAYOUTS))
    ap.add_argument("--out-dir", required=True)
    a = ap.parse_args()
    for layout in a.layouts:
        tp, pp, ep = LAYOUTS[layout]
        dims = initialize_parallel(tp, pp, ep=ep)
        run(a.model, dims, os.path.join(a.out_dir, f"{layout}.pt"))
    destroy_parallel()


if __name__ == "__main__":
    main()
