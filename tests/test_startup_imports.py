"""Start-up cost of the processes the project launches (trainer, rollout worker, torchrun ranks, converters): the
module chains they import, up to and including ``megatron.core``, load none of torch's compiler stack
(``torch._dynamo`` / ``torch._inductor``: ~2 CPU-s), wandb (~0.6 CPU-s) or TensorBoard (~0.35 CPU-s). A structural
check, not a timing one: it fails when one of those imports comes back (``megatron_tsync/__init__.py`` explains the
window in which they are hidden; docs/testing.md has the measurements). TensorBoard stays importable afterwards for
``--tensorboard-dir`` (``runtime/context.py``)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROBE = """
import json, sys
import megatron_tsync.train, megatron_tsync.runtime.loop, megatron_tsync.runtime.worker
import megatron_tsync.runtime.context, megatron_tsync.model.parallel, megatron_tsync.model.builder
import megatron_tsync.training.optimizer, megatron_tsync.training.checkpointing
import megatron.core, megatron.core.timers, megatron.core.models.gpt, megatron.core.optimizer
heavy = ["torch._dynamo", "torch._inductor", "wandb", "tensorboard", "torch.utils.tensorboard"]
loaded = [m for m in heavy if m in sys.modules]
summary_writer_in_timers = megatron.core.timers.SummaryWriter
from torch.utils.tensorboard import SummaryWriter
print(json.dumps({"loaded": loaded, "timers_summary_writer": summary_writer_in_timers,
                  "tensorboard_after": SummaryWriter.__name__}))
"""


@pytest.mark.slow
def test_process_module_chains_skip_compiler_wandb_and_tensorboard():
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", PROBE], cwd=ROOT, capture_output=True, text=True,
                         timeout=180, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"loaded": [], "timers_summary_writer": None, "tensorboard_after": "SummaryWriter"}, got
