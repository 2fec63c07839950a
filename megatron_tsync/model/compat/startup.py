"""torch.optim without importing torch's compiler stack (a torch-version detail, hence in ``compat``).

torch.optim (2.x) imports ``torch._dynamo`` the first time an optimizer is built or stepped: ``Optimizer.step`` of
every built-in optimizer is wrapped by ``_use_grad_for_differentiable``, which runs ``import torch._dynamo`` and
``torch._dynamo.graph_break()`` at every call, and ``add_param_group`` / ``zero_grad`` / ``state_dict`` /
``load_state_dict`` are wrapped by ``torch._disable_dynamo``, which imports it at the first call to build
``torch._dynamo.disable(fn)``. That import (torch._dynamo and, through it, parts of torch._inductor) costs
0.5-0.7 CPU-s per process (torch 2.13, measured in a trainer rank: docs/testing.md), paid by every trainer rank,
torchrun rank and tool process that builds an optimizer.

Both wrappers only matter while dynamo traces the optimizer: ``graph_break()`` outside a trace does nothing and
``disable(fn)`` outside a trace calls ``fn``. Nothing can be traced before ``torch._dynamo`` is imported (its
frame-evaluation hook is installed by ``torch._dynamo`` only), so :func:`defer_optimizer_dynamo_import` makes them
call the function directly *while* ``torch._dynamo`` is not in ``sys.modules`` and hand over to torch's own wrapper
(unchanged) as soon as it is, e.g. when a ``torch.compile``'d function first runs. The optimizers compute exactly what
they computed (same functions, same grad mode); only the import is skipped in processes that never compile.

Applied to torch.optim's built-in optimizer classes (``Optimizer`` and its subclasses defined by then) whose
methods are torch's own wrappers, recognised by their code objects; anything else (another torch version that
wraps differently, an optimizer class defined later) is left as it is.
"""

from __future__ import annotations

import functools
import sys
import types

_applied = False


def _dynamo_loaded() -> bool:
    return "torch._dynamo" in sys.modules


def defer_optimizer_dynamo_import() -> int:
    """Patch once (idempotent); returns how many methods were changed (0 when torch wraps differently or
    ``torch._dynamo`` is already imported: nothing to save)."""
    global _applied
    if _applied:
        return 0
    _applied = True
    if _dynamo_loaded():
        return 0
    import torch
    from torch.optim import optimizer as topt

    disable = getattr(torch, "_disable_dynamo", None)
    use_grad = getattr(topt, "_use_grad_for_differentiable", None)
    if disable is None or use_grad is None:
        return 0
    disable_code = disable(lambda: None).__code__
    use_grad_code = use_grad(lambda self: None).__code__
    classes, todo = [], [topt.Optimizer]
    while todo:
        c = todo.pop()
        if c not in classes:
            classes.append(c)
            todo.extend(c.__subclasses__())
    changed = 0
    for cls in classes:
        if not cls.__module__.startswith("torch.optim"):
            continue
        for name, fn in list(vars(cls).items()):
            if not isinstance(fn, types.FunctionType):
                continue
            if fn.__code__ is disable_code:
                changed += _seed_disable(fn)
            elif fn.__code__ is use_grad_code and hasattr(fn, "__wrapped__"):
                setattr(cls, name, _grad_mode_only(fn))
                changed += 1
    return changed


def _seed_disable(inner) -> int:
    """``torch._disable_dynamo``'s wrapper looks up ``fn.__dynamo_disable`` and builds it (importing
    torch._dynamo) when absent; it is seeded with a function that calls ``fn`` while dynamo is not imported and
    builds torch's own ``torch._dynamo.disable(fn, recursive, wrapping=False)`` (what the wrapper would have
    built) once it is."""
    cells = dict(zip(inner.__code__.co_freevars, (c.cell_contents for c in inner.__closure__ or ())))
    fn, recursive = cells.get("fn"), cells.get("recursive", True)
    if fn is None or getattr(fn, "__dynamo_disable", None) is not None:
        return 0

    @functools.wraps(fn)
    def until_dynamo(*args, **kwargs):
        if not _dynamo_loaded():
            return fn(*args, **kwargs)
        import torch._dynamo

        real = torch._dynamo.disable(fn, recursive, wrapping=False)
        fn.__dynamo_disable = real
        return real(*args, **kwargs)

    fn.__dynamo_disable = until_dynamo
    return 1


def _grad_mode_only(wrapped):
    """``_use_grad_for_differentiable``'s wrapper without its two ``graph_break()`` calls while dynamo is not
    imported (the same grad mode around the same function); torch's wrapper itself once it is."""
    func = wrapped.__wrapped__

    @functools.wraps(func)
    def _use_grad(*args, **kwargs):
        if _dynamo_loaded():
            return wrapped(*args, **kwargs)
        import torch

        self = args[0]
        prev_grad = torch.is_grad_enabled()
        try:
            torch.set_grad_enabled(self.defaults["differentiable"])
            return func(*args, **kwargs)
        finally:
            torch.set_grad_enabled(prev_grad)

    return _use_grad
