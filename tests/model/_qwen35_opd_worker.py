"""OPD on the Qwen3.5-style hybrid at TP = 2, then PP = 2 (tests/model/test_qwen35.py; 2 gloo processes).

tests/training/_workers/opd_worker.py's ``token-mean`` case with the tiny qwen3_5 model (random init of its
architecture, as that worker does for its Llama): stream-turn (the incremental forward carrying the linear layers'
conv window and recurrent state; under PP the per-chunk p2p path) and the turn-cut control, each against sync.
Rank 0 writes {layout: opd_worker's report row of the case} as JSON.
"""

import argparse
import json
import os
import sys


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hf", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "training", "_workers"))
    import opd_worker as W

    from megatron_tsync.model.hf_conversion import load_hf_dir
    from megatron_tsync.model.parallel import destroy_parallel, initialize_parallel

    W.TINY, _ = load_hf_dir(a.hf)
    W.CASES = {"token-mean": W.CASES["token-mean"]}
    out = {}
    for layout in ("tp2", "pp2"):
        dims = initialize_parallel(*W.LAYOUTS[layout])
        out[layout] = W.run_cases(dims, modes=("stream-turn", "cut"))["token-mean"]
    if dims.rank == 0:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    destroy_parallel()


if __name__ == "__main__":
    main()
