"""``megatron_tsync/model/compat/startup.py``: torch.optim's optimizers built and stepped after
``defer_optimizer_dynamo_import()`` compute bitwise what torch's unpatched ones compute (float64, Adam(W) and SGD,
several steps, ``zero_grad``, a ``state_dict`` round trip), leave the grad mode as it was, and never import
``torch._dynamo`` (0.5-0.7 CPU-s per process: docs/testing.md); once something imports it, torch's own wrappers take
over and the results stay the same. Each case runs in a fresh interpreter (the patch and the import are
process-wide)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROBE = """
import json, sys
import torch
import megatron_tsync
from megatron_tsync.model.compat import defer_optimizer_dynamo_import

def run():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(7, dtype=torch.float64))
    q = torch.nn.Parameter(torch.randn(7, dtype=torch.float64))
    r = torch.nn.Parameter(torch.randn(7, dtype=torch.float64))
    opts = [torch.optim.AdamW([p], lr=0.1, weight_decay=0.01), torch.optim.SGD([q], lr=0.1, momentum=0.9),
            torch.optim.Adam([r], lr=0.05)]
    for k in range(3):
        for o, x in zip(opts, (p, q, r)):
            x.grad = torch.sin(x.detach() * (k + 1))
            o.step()
            o.zero_grad()
    sd = opts[0].state_dict()
    opts[0].load_state_dict(sd)
    p.grad = torch.cos(p.detach())
    opts[0].step()
    return [x.detach().tolist() for x in (p, q, r)]

patch = sys.argv[1] == "patched"
changed = defer_optimizer_dynamo_import() if patch else None
first = run()
out = {"changed": changed, "dynamo_after_first": "torch._dynamo" in sys.modules, "grad_mode": torch.is_grad_enabled(),
       "first": first}
import torch._dynamo
out["second"] = run()
print(json.dumps(out))
"""


def _probe(mode):
    p = subprocess.run([sys.executable, "-W", "ignore", "-c", PROBE, mode], cwd=ROOT, capture_output=True, text=True,
                       timeout=180, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_optimizers_match_torch_bitwise_without_importing_dynamo():
    ref, got = _probe("plain"), _probe("patched")
    assert ref["dynamo_after_first"] is True  # torch.optim imports it unpatched: what the patch saves
    assert got["changed"] > 0 and got["dynamo_after_first"] is False and got["grad_mode"] is True
    assert got["first"] == ref["first"] and got["second"] == ref["second"] == ref["first"]
