"""A run's start-up only (``RunContext``: the model, ``--init-tiny-model``, the supervised warm start), then a save at
step 0 under ``--save`` and exit: the warm start that several live runs of one test module load with ``--load DIR
--finetune`` (the saved trainer state says the warm start is done, so they skip it) instead of each repeating it.

``python tests/runtime/_warm_start.py TRAIN-FLAGS`` (the flags of ``python -m megatron_tsync.train``).
"""

import logging
import os
import sys

import torch

from megatron_tsync.arguments import parse_args
from megatron_tsync.model.parallel import destroy_parallel
from megatron_tsync.runtime.context import RunContext
from megatron_tsync.runtime.stop import StopFlag


def main(argv):
    cfg = parse_args(argv)
    logging.basicConfig(level=os.environ.get("TSYNC_LOG", "WARNING"), format="[%(name)s] %(message)s")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    ctx = RunContext(cfg, StopFlag(install=False))
    assert ctx.state.get("sft_done") or not cfg.model.sft_warmup_steps, "no warm start was done"
    ctx.save()
    ctx.close()
    destroy_parallel()


if __name__ == "__main__":
    main(sys.argv[1:])
