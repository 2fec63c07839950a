"""A peer process of the weight-broadcast tests: ``python tsync_weight_peer.py ROLE CONFIG.json``.

Roles:
- ``receive``: join as ``rank``, then for every entry of ``plan`` wait for ``expect`` and record the digests of what
  arrived (or the error); writes ``{"steps": [...], "rejected": {...}}`` to ``out``;
- ``send-then-die``: host the store (writes its port to ``port_file``), wait for the receiver, then either exit before
  sending anything (``when`` = "before") or right after the manifest (``when`` = "mid");
- ``join-then-die``: join as ``rank`` and exit without receiving.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import torch


def digest(t: torch.Tensor) -> str:
    h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def digests(state: dict) -> dict[str, str]:
    return {k: digest(v) for k, v in state.items()}


def main() -> int:
    from megatron_tsync.transport.weight_broadcast import (
        BroadcastWeightPublisher,
        BroadcastWeightSubscriber,
        WeightSyncGroup,
    )

    role, cfg_path = sys.argv[1], sys.argv[2]
    with open(cfg_path) as f:
        cfg = json.load(f)
    key = bytes.fromhex(cfg["key"])
    torch.set_num_threads(1)
    if role == "receive":
        g = WeightSyncGroup.join(cfg["host"], cfg["port"], cfg["rank"], cfg["world_size"],
                                 connect_timeout_s=60, op_timeout_s=cfg.get("op_timeout_s", 60))
        sub = BroadcastWeightSubscriber(g, key)
        steps = []
        for step in cfg["plan"]:
            t0 = time.perf_counter()
            try:
                v, state = sub.wait_for(step["expect"], timeout_s=step.get("timeout_s", 60))
                steps.append({"version": v, "digests": digests(state), "seconds": time.perf_counter() - t0})
            except Exception as e:  # noqa: BLE001 - recorded for the test to check
                steps.append({"error": type(e).__name__, "message": str(e)})
        with open(cfg["out"] + ".tmp", "w") as f:
            json.dump({"steps": steps, "rejected": sub.rejected}, f)
        os.replace(cfg["out"] + ".tmp", cfg["out"])
        return 0
    if role == "join-then-die":
        WeightSyncGroup.join(cfg["host"], cfg["port"], cfg["rank"], cfg["world_size"], connect_timeout_s=60,
                             op_timeout_s=60)
        os._exit(3)
    if role == "send-then-die":
        g = WeightSyncGroup.host(2, op_timeout_s=60)
        with open(cfg["port_file"] + ".tmp", "w") as f:
            f.write(str(g.port))
        os.replace(cfg["port_file"] + ".tmp", cfg["port_file"])
        g.connect(timeout_s=60)
        if cfg["when"] == "before":
            time.sleep(0.5)
            os._exit(3)

        class DiesAfterManifest(BroadcastWeightPublisher):
            def _pack(self, *a, **k):
                os._exit(3)

        DiesAfterManifest(g, key, bucket_bytes=1024).publish({"w": torch.ones(4096)}, 0)
    return 1


if __name__ == "__main__":
    sys.exit(main())
