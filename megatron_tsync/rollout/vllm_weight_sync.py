"""Weight broadcast received **inside vLLM's worker** (``worker_extension_cls``), so tensors never touch a file.

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

Devices: with ``backend="gloo"`` buckets are CPU tensors (vLLM's CPU build; tested in tests/rollout/test_vllm_engine.py
in-process). With ``backend="nccl"`` they are allocated on the worker's CUDA device and loaded from there (no
host round trip) — written for vLLM's CUDA build, **not run** here (no GPU). With vLLM tensor parallelism every vLLM
worker is its own receiver rank and receives the full weights (``load_weights`` shards them); the trainer's world
size must count them (the rollout fleet assumes one vLLM worker per rollout worker).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["WeightSyncExtension", "EXTENSION"]

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
            self.reload_weights(weights_iterator=iter(receipt), is_checkpoint_format=True)
        finally:
            receipt.drain()
        return {"version": receipt.version, **sub.last_stats, "rejected": dict(sub.rejected)}
