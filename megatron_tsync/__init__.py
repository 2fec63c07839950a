"""megatron_tsync: exact streaming-gradient RL post-training on Megatron-Core.

Importing the package does two things besides defining ``__version__``: it makes the first import of ``megatron.core``
in this process cheaper (:func:`_defer_torch_compile_in_megatron_import`: torch's compiler stack, wandb and
TensorBoard are not loaded by it), and it makes the process's exit cheaper (:func:`_freeze_gc_at_exit`).
Everything else that touches megatron-core versions or patches it lives in
``megatron_tsync/model/compat/``; this one hook cannot, because it has to be in
place before any module imports ``megatron.core`` and this file is the only one every such module runs first.
"""

from __future__ import annotations

import atexit
import functools
import gc
import importlib.abc
import sys

__version__ = "0.1.0"


class _DeferTorchCompile(importlib.abc.MetaPathFinder):
    """megatron-core applies ``torch.compile`` to its fused kernels as a decorator when its modules are imported
    (``megatron.core.jit.jit_fuser``). Each decoration imports torch._dynamo and torch._inductor: 1.9 of the 3.6
    CPU-seconds that ``import megatron.core`` costs (torch 2.13, megatron-core 0.16.1, measured with ``-X importtime``),
    paid by every trainer rank, rollout worker and converter process, whether or not a fused kernel ever runs (none
    does with the layer specs of ``model/builder.py``, which switch the fusions off). While ``megatron.core``'s own
    package body runs, ``torch.compile(fn)`` returns a wrapper that compiles ``fn`` at its first call instead: the same
    compiled function, built when torch.compile builds it anyway (torch.compile compiles at the first call), so no
    behaviour changes; only unused kernels stop costing start-up time. ``torch.compile`` is restored right after, and
    the finder removes itself at the first ``megatron.core`` import (nothing happens if megatron-core is imported
    before ``megatron_tsync``, or not at all).

    In the same window ``wandb`` is hidden (``sys.modules["wandb"] = None``, so ``import wandb`` raises ImportError)
    unless the process already imported it: megatron-core's package body imports it only for optional hooks this
    project never calls (``megatron.core.timers``' wandb writer, the dynamic inference engine's metrics; they see
    wandb as absent), and the import costs 0.65 CPU-s per process where wandb is installed. This project's own W&B
    logging (``runtime/wandb_log.py``, ``--wandb-project``) imports wandb afterwards as usual.
    ``torch.utils.tensorboard`` is hidden the same way (``megatron.core.timers``' ``SummaryWriter`` is None; 0.3-0.4
    CPU-s per process: it imports tensorboard and its protobufs); ``--tensorboard-dir`` (``runtime/context.py``)
    imports it afterwards as usual."""

    def find_spec(self, name, path=None, target=None):
        if name != "megatron.core":
            return None
        _remove_finder()
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _CompileDeferringLoader(spec.loader)
                return spec
        return None


class _CompileDeferringLoader(importlib.abc.Loader):
    """Runs the wrapped loader's ``exec_module`` with ``torch.compile`` deferred; everything else is the wrapped
    loader's (``get_resource_reader``, ``get_code``, ...)."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, attr):
        return getattr(self._inner, attr)

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        import torch

        real = torch.compile
        torch.compile = functools.partial(_compile_at_first_call, real)
        hidden = [m for m in _HIDDEN_WHILE_IMPORTING if m not in sys.modules]
        for m in hidden:
            sys.modules[m] = None
        try:
            self._inner.exec_module(module)
        finally:
            torch.compile = real
            for m in hidden:
                if m in sys.modules and sys.modules[m] is None:
                    del sys.modules[m]


# Hidden (``import`` raises ImportError) while megatron.core's package body runs, unless already imported: see
# _DeferTorchCompile. Both are imported by ``megatron.core.timers`` only (``try: import ... except ImportError``), for
# its optional metric writers, which this project never calls.
_HIDDEN_WHILE_IMPORTING = ("wandb", "torch.utils.tensorboard")


def _compile_at_first_call(compile_fn, model=None, **kwargs):
    """``torch.compile(model, **kwargs)`` built at the wrapper's first call; ``torch.compile(**kwargs)`` used as a
    decorator factory works the same way."""
    if model is None:
        return functools.partial(_compile_at_first_call, compile_fn, **kwargs)
    compiled = None

    @functools.wraps(model)
    def call(*args, **kw):
        nonlocal compiled
        if compiled is None:
            compiled = compile_fn(model, **kwargs)
        return compiled(*args, **kw)

    return call


def _remove_finder():
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _DeferTorchCompile)]


def _defer_torch_compile_in_megatron_import():
    if "megatron.core" not in sys.modules and not any(isinstance(f, _DeferTorchCompile) for f in sys.meta_path):
        sys.meta_path.insert(0, _DeferTorchCompile())


_defer_torch_compile_in_megatron_import()


def _freeze_gc_at_exit():
    """At interpreter exit, after every other exit handler (``atexit`` runs last what registered first, and this
    registers when the package is first imported), move every object into ``gc``'s permanent generation. The
    interpreter's own shutdown then skips the full garbage collections it makes while it tears its modules down, which
    in a process holding torch, megatron-core and transformers traverse millions of objects: measured here, a trainer
    run's exit after its last line took 10.4 s (at load ~30) and 0.8 s with the freeze; a process that only imports
    the stack 5.4 → 4.0 CPU-s. Nothing the run wrote is affected: files, checkpoints, TensorBoard and W&B are closed
    explicitly before this (``RunContext.close``), exit handlers (gloo's ``destroy_parallel``, logging's flush, weakref
    finalizers) have all run, and objects that are not in reference cycles are still freed as the modules are
    cleared; only cyclic garbage is left for the operating system to reclaim with the process. Not where ``triton``
    is loaded (vLLM's processes): its nanobind bindings check at their teardown that their objects were collected and
    print pages of "leaked" warnings when they were not."""
    atexit.register(_freeze_unless_nanobind_checks)


def _freeze_unless_nanobind_checks():
    if "triton" not in sys.modules:
        gc.freeze()


_freeze_gc_at_exit()
