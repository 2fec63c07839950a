"""``megatron_tsync/__init__.py``: importing ``megatron.core`` after the package does not load torch's compiler stack
(the fused kernels megatron-core decorates with ``torch.compile`` are compiled at their first call instead) nor wandb
(importable as usual afterwards), leaves ``torch.compile`` itself untouched, and a deferred function computes what the
compiled one computes."""

import json
import os
import subprocess
import sys

import pytest
import torch

import megatron_tsync

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROBE = """
import json, sys
import megatron_tsync, torch
real = torch.compile
import megatron.core, megatron.core.models.gpt
from megatron.core import jit
from megatron.core.fusions import fused_bias_geglu
from megatron.core import timers
wandb_loaded = "wandb" in sys.modules
import wandb  # the tests extra installs it: still importable after the window
print(json.dumps({
    "wandb_loaded_by_megatron": wandb_loaded,
    "wandb_after": type(wandb).__name__,
    "timers_wandb": timers.wandb,
    "dynamo_loaded": "torch._dynamo" in sys.modules,
    "inductor_loaded": "torch._inductor.compile_fx" in sys.modules,
    "torch_compile_restored": torch.compile is real,
    "finder_left": any(type(f).__name__ == "_DeferTorchCompile" for f in sys.meta_path),
    "jit_fuser_deferred": getattr(jit.jit_fuser, "func", None) is megatron_tsync._compile_at_first_call,
    "geglu_name": fused_bias_geglu.geglu.__name__,
}))
"""


@pytest.mark.slow
def test_megatron_import_after_the_package_skips_the_compiler_stack():
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", PROBE], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"wandb_loaded_by_megatron": False, "wandb_after": "module", "timers_wandb": None,
                   "dynamo_loaded": False, "inductor_loaded": False, "torch_compile_restored": True,
                   "finder_left": False, "jit_fuser_deferred": True, "geglu_name": "geglu"}, got


def test_deferred_compile_builds_once_at_the_first_call_and_matches():
    built = []

    def compile_fn(model, **kwargs):
        built.append(kwargs)
        return torch.compile(model, **kwargs)

    def f(x):
        return torch.tanh(x) * x + 1

    lazy = megatron_tsync._compile_at_first_call(compile_fn, f, backend="eager")
    as_decorator = megatron_tsync._compile_at_first_call(compile_fn, backend="eager")(f)
    assert built == [] and lazy.__name__ == "f"
    x = torch.randn(5, dtype=torch.float64)
    assert torch.equal(lazy(x), f(x)) and torch.equal(lazy(2 * x), f(2 * x))
    assert torch.equal(as_decorator(x), f(x))
    assert built == [{"backend": "eager"}, {"backend": "eager"}]  # once per wrapper, with the caller's options


def test_exit_freezes_gc_after_the_other_exit_handlers():
    """megatron_tsync/__init__.py: at exit every object goes to gc's permanent generation, so the interpreter's
    shutdown skips its full collections (seconds per trainer process); it runs after handlers registered later
    (LIFO), e.g. gloo's destroy_parallel, and before those registered earlier (here: the probe, which sees it)."""
    code = ("import atexit, gc; atexit.register(lambda: print('frozen', gc.get_freeze_count() > 0)); "
            "atexit.register(lambda: None); import megatron_tsync; "
            "atexit.register(lambda: print('later', gc.get_freeze_count() > 0))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["later", "False", "frozen", "True"]
    with_triton = "import sys, types; sys.modules['triton'] = types.ModuleType('triton'); " + code
    out = subprocess.run([sys.executable, "-c", with_triton], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["later", "False", "frozen", "False"]  # vLLM's processes: triton's nanobind leak check
