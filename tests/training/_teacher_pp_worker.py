"""The OPD teacher under PP=2 (torchrun, gloo): every stage holds the whole teacher; writes its scores per rank.

``python -m torch.distributed.run --nproc_per_node=2 _teacher_pp_worker.py HF_DIR OUT_PREFIX``: rank r writes
OUT_PREFIX.r.pt = {"layers", "logp", "session_logp", "session_logits"} for the token ids of ``token_ids()``.
"""

import sys
import warnings

warnings.filterwarnings("ignore")
import torch  # noqa: E402


def token_ids() -> torch.Tensor:
    return torch.randint(3, 300, (29,), generator=torch.Generator().manual_seed(5))


def chunked(scorer, ids):
    """Session scores over uneven chunks (an empty one included): (logp (T,), logits (T − 1, V))."""
    sess = scorer.session(keep_logits=True)
    parts = []
    for a, b in ((0, 1), (1, 9), (9, 9), (9, 20), (20, ids.shape[0])):
        lp, lg = sess.extend(ids[:b], a)
        if lg is not None:
            parts.append(lg)
    return lp, torch.cat(parts)


def main():
    from megatron_tsync.training.teacher import TeacherScorer
    from megatron_tsync.model.builder import PrecisionConfig
    from megatron_tsync.model.parallel import destroy_parallel, initialize_parallel

    torch.set_num_threads(1)
    dims = initialize_parallel(1, 2)
    t = TeacherScorer.from_hf_dir(sys.argv[1], PrecisionConfig(params_dtype=torch.float64))
    ids = token_ids()
    lp, lg = chunked(t, ids)
    torch.save({"layers": len(t.model.decoder.layers), "logp": t.score(ids), "session_logp": lp,
                "session_logits": lg}, f"{sys.argv[2]}.{dims.rank}.pt")
    destroy_parallel()


if __name__ == "__main__":
    main()
