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


MOE_PROBE = """
import json, sys
import torch
from megatron_tsync.model.parallel import initialize_parallel, destroy_parallel
from megatron_tsync.model.hf_conversion import load_hf_dir, load_hf_into_model
from megatron_tsync.model.builder import build_model
from megatron_tsync.model.logprobs import model_logits
from megatron.core.transformer.moe.router import TopKRouter
initialize_parallel(1, 1, seed=1)
arch, state = load_hf_dir(sys.argv[1])
model = build_model(arch, seed=1)
load_hf_into_model(model, state)
dynamo_before = "torch._dynamo" in sys.modules
out = model_logits(model, (torch.arange(12).view(1, 12) * 7) % arch.vocab_size)
out.float().square().mean().backward()
print(json.dumps({"dynamo_before": dynamo_before, "dynamo_after": "torch._dynamo" in sys.modules,
                  "skips": getattr(TopKRouter._apply_expert_bias, "_tsync_skip_idle", False),
                  "finite": bool(torch.isfinite(out).all())}))
destroy_parallel()
"""


@pytest.mark.slow
def test_moe_forward_backward_without_expert_bias_compiles_nothing(tmp_path):
    """``compat.versions._skip_idle_expert_bias``: megatron's ``TopKRouter._apply_expert_bias`` (torch.compile'd,
    called at every routing, a no-op without ``moe_router_enable_expert_bias``) is skipped when idle, so a MoE
    forward / backward imports no torch._dynamo (the logits are checked against transformers by the MoE tests)."""
    from megatron_tsync.model.tiny_model import make_tiny_model  # transformers' modeling code imports torch._dynamo

    path = make_tiny_model(str(tmp_path / "moe"), family="qwen3_moe", seed=0, experts=4, topk=2)
    p = subprocess.run([sys.executable, "-W", "ignore", "-c", MOE_PROBE, path], cwd=ROOT,
                       capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="0",
                                RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"))
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got == {"dynamo_before": False, "dynamo_after": False, "skips": True, "finite": True}, got
