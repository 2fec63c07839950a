"""CPU support: megatron-core on a CPU-only torch (concern 1 of :mod:`megatron_tsync.model.compat`).

megatron-core hard-codes CUDA in many places (``torch.cuda.current_device()`` in the global memory buffer, RoPE and
the grad buffers; ``device="cuda"`` in the causal mask and the schedules; ``Tensor.cuda()``; the
``'torch.cuda.FloatTensor'`` type assertion in ``clip_grads``; ``torch.cuda.synchronize`` in dist_checkpointing; the
CUDA RNG tracker used for tensor-parallel init). :func:`install_cpu_support` redirects those to the CPU; it is a
no-op when CUDA is available. Also here: the forward / backward outside the CUDA→CPU function mode, and the MoE
dispatcher's split sizes on CPU.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_LOCK = threading.Lock()
_INSTALLED = False


def cuda_available() -> bool:
    return torch.cuda.is_available()


def _is_cuda(d: Any) -> bool:
    if isinstance(d, torch.device):
        return d.type == "cuda"
    if isinstance(d, str):
        return d.startswith("cuda")
    return isinstance(d, int) and not isinstance(d, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Maps CUDA device requests to the CPU (installed only when CUDA is unavailable)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs = dict(kwargs)
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.to and len(args) > 1 and any(_is_cuda(a) for a in args[1:]):
            args = tuple("cpu" if (i and _is_cuda(a)) else a for i, a in enumerate(args))
        return func(*args, **kwargs)


class _CpuEvent:
    """Stand-in for ``torch.cuda.Event`` with ``enable_timing`` semantics on the wall clock."""

    def __init__(self, *args, **kwargs):
        self._t = None

    def record(self, *args, **kwargs):
        self._t = time.perf_counter()

    def synchronize(self):
        pass

    def query(self):
        return True

    def wait(self, *args, **kwargs):
        pass

    def elapsed_time(self, end: "_CpuEvent") -> float:
        return (end._t - self._t) * 1000.0


_MODE: _CudaToCpuMode | None = None


def install_cpu_support() -> bool:
    """Make megatron-core usable on a CPU-only torch. Idempotent; returns True when it installed anything.

    Must run before megatron builds models or process groups; :func:`megatron_tsync.model.parallel.
    initialize_parallel` calls it. The function mode is per-thread in torch: megatron code that runs in other
    threads (none of the paths we use) would not see it.
    """
    global _INSTALLED, _MODE
    if cuda_available():
        return False
    with _LOCK:
        if _INSTALLED:
            return False
        torch.cuda.current_device = lambda: "cpu"
        torch.cuda.synchronize = lambda *a, **k: None
        torch.cuda.Event = _CpuEvent
        _MODE = _CudaToCpuMode()
        _MODE.__enter__()  # stays active for the life of the process
        _install_cpu_rng_tracker()
        _install_cpu_checkpoint_rng()
        _install_cpu_streams()
        _INSTALLED = True
    return True


class _CpuStream:
    """Stand-in for ``torch.cuda.Stream`` (megatron's MoE all-to-all dispatcher makes a device-to-host stream)."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def synchronize(self):
        pass

    def record_event(self, event=None):
        event = event or _CpuEvent()
        event.record()
        return event


_CPU_STREAM = _CpuStream()


def _install_cpu_streams() -> None:
    """``torch.cuda.Stream`` / ``current_stream`` / ``stream(...)`` as no-ops (everything runs in program order)."""
    torch.cuda.Stream = _CpuStream
    torch.cuda.current_stream = lambda *a, **k: _CPU_STREAM
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()


@contextlib.contextmanager
def forward_without_cpu_mode():
    """A model forward outside the CUDA→CPU function mode, which costs a Python call per torch function (a
    100-token forward+backward of the tiny model: 11.0 ms with it, 9.4 ms without). Megatron's layers on CPU need
    only ``torch.cuda.current_device`` (patched to "cpu", not the mode); its schedules (``device="cuda"``) stay
    inside the mode. No-op with CUDA, or when another function mode is on top of ours."""
    top = None
    if _MODE is not None and torch._C._len_torch_function_stack() > 0:
        top = torch._C._get_function_stack_at(torch._C._len_torch_function_stack() - 1)
    if not isinstance(top, _CudaToCpuMode):
        yield
        return
    with torch.overrides._pop_mode_temporarily():
        yield


_FAST_BACKWARD = False


def install_backward_without_cpu_mode() -> None:
    """megatron's ``schedules.backward_step`` outside the CUDA→CPU function mode, as :func:`forward_without_cpu_mode`
    does for forwards: the Python-side backwards it runs (megatron's linear layers, row-split weight gradients) then
    dispatch torch functions without a Python call each. Idempotent; no-op with CUDA or without the mode."""
    global _FAST_BACKWARD
    if _FAST_BACKWARD or _MODE is None:
        return
    from megatron.core.pipeline_parallel import schedules

    orig = schedules.backward_step

    @functools.wraps(orig)
    def backward_step(*args, **kwargs):
        with forward_without_cpu_mode():
            return orig(*args, **kwargs)

    schedules.backward_step = backward_step
    _FAST_BACKWARD = True


def ensure_cpu_mode_in_thread() -> None:
    """Enter the CUDA→CPU function mode in the calling thread (torch keeps mode stacks per thread)."""
    if _MODE is not None and not cuda_available():
        _CudaToCpuMode().__enter__()


def _install_cpu_rng_tracker() -> None:
    import megatron.core.tensor_parallel.random as mrand

    base = mrand.CudaRNGStatesTracker

    class CpuRNGStatesTracker(base):
        """Megatron's RNG tracker on torch's CPU generator (fork() swaps the CPU RNG state)."""

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"cuda rng state {name} already exists")
            self.seeds_.add(seed)
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name=mrand._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"cuda rng state {name} is not added")
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

    mrand.CudaRNGStatesTracker = CpuRNGStatesTracker


def _install_cpu_checkpoint_rng() -> None:
    """Activation recomputation on CPU (``--recompute-granularity``): megatron's ``tensor_parallel.checkpoint`` saves
    and restores "the CUDA RNG state" around the re-forward; on a CPU-only torch that state is the CPU generator's
    (the one the CPU tracker forks), so get/set map to ``torch.get_rng_state``/``set_rng_state``."""
    import megatron.core.tensor_parallel.random as mrand

    mrand._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrand._set_cuda_rng_state = lambda new_state, *a, **k: torch.set_rng_state(new_state)


def _install_cpu_moe_splits() -> None:
    """CPU: the all-to-all dispatcher's split sizes as numpy arrays, as on GPU. megatron converts them with
    ``maybe_move_tensor_to_cpu(..., as_numpy=True)``, which only acts on CUDA tensors; a CPU tensor was passed on
    to ``all_to_all_single`` as split sizes and gloo rejected it (EP > 1)."""
    import megatron.core.transformer.moe.token_dispatcher as td

    if getattr(td.maybe_move_tensor_to_cpu, "_tsync_cpu", False):
        return

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and as_numpy:
            return tensor.numpy()
        return tensor

    maybe_move_tensor_to_cpu._tsync_cpu = True
    td.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def _install_gloo_uneven_sequence_collectives() -> None:
    """CPU (gloo): megatron's MoE dispatcher at expert TP > 1 with EP > 1 gathers the tokens routed to this rank's
    experts over the expert-TP group with ``output_split_sizes`` (``torch.distributed.all_gather`` of unequal
    tensors) and reduce-scatters their gradients back with ``input_split_sizes`` (``reduce_scatter`` of unequal
    tensors); gloo takes neither ("invalid tensor size"). Both become the equal-size collectives on tensors padded
    with zeros to the longest split, then sliced: the same values (the padding adds exact zeros to no real row)."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    if getattr(mappings._gather_along_first_dim, "_tsync_gloo", False):
        return
    gather, scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    def _pad(t: torch.Tensor, n: int) -> torch.Tensor:
        return t if t.shape[0] == n else torch.cat([t, t.new_zeros((n - t.shape[0], *t.shape[1:]))])

    def gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1 or dist.get_backend(group) != "gloo":
            return gather(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(s) for s in output_split_sizes]
        n = max(sizes)
        parts = [torch.empty((n, *input_.shape[1:]), dtype=input_.dtype) for _ in sizes]
        dist.all_gather(parts, _pad(input_.contiguous(), n), group=group)
        return torch.cat([p[:s] for p, s in zip(parts, sizes)])

    def reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1 or dist.get_backend(group) != "gloo":
            return scatter(input_, group, input_split_sizes, use_global_buffer)
        sizes = [int(s) for s in input_split_sizes]
        n = max(sizes)
        chunks = [_pad(c, n) for c in torch.split(input_, sizes, dim=0)]
        out = torch.empty((n, *input_.shape[1:]), dtype=input_.dtype)
        dist.reduce_scatter(out, chunks, group=group)
        return out[:sizes[group.rank()]]

    gather_along_first_dim._tsync_gloo = True
    mappings._gather_along_first_dim = gather_along_first_dim
    mappings._reduce_scatter_along_first_dim = reduce_scatter_along_first_dim
