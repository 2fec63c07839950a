"""Checkpoint integrity: a checksum of every file a save writes, verified before a load reads anything; what a full
disk during a save looks like.

``iter_XXXXXXX/tsync_checksums.json`` (written last, before the directory is renamed into place)::

    {"format": 1, "algorithm": "sha256", "files": {"common.pt": [size, "hex"], "rng/rank_00000.pt": [...], ...}}

Every file of the checkpoint directory but the manifest itself is listed (``dist_checkpointing``'s ``*.distcp``,
``metadata.json``, ``common.pt``, the RNG states, ``tsync_meta.json``). The files are hashed round-robin over the
ranks (file ``i`` by rank ``i % world``), so each rank reads about ``1/world`` of the checkpoint, at save and at load.
A load compares size, then SHA-256, of every listed file and raises :class:`CheckpointCorrupt` naming the first bad
file (missing, truncated / padded, or altered — a single flipped bit changes the digest) before the model is touched.
Checkpoints written before this format have no manifest: they load unverified, with a warning.

A save that fails is cleaned up (the partial ``.tmp`` directory removed, the tracker untouched, so the previous
checkpoint stays the latest); when the disk is full (``ENOSPC`` / ``EDQUOT`` in the exception chain, or a probe
write in the save directory fails with one) the error says so: torch's zip writer reports a full disk as
"unexpected pos …", which names neither the cause nor the file.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil

import torch.distributed as dist

MANIFEST = "tsync_checksums.json"
_CHUNK = 8 << 20
_FULL = (errno.ENOSPC, errno.EDQUOT)


class CheckpointCorrupt(RuntimeError):
    """A checkpoint file is missing, has the wrong size or the wrong checksum; ``path`` names it."""

    def __init__(self, msg: str, path: str):
        super().__init__(msg)
        self.path = path


class CheckpointSaveError(RuntimeError):
    """A save failed (``disk_full`` when the device ran out of space); the previous checkpoint is still the latest."""

    def __init__(self, msg: str, *, disk_full: bool):
        super().__init__(msg)
        self.disk_full = disk_full


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _files(d: str) -> list[str]:
    out = []
    for root, _, names in os.walk(d):
        for n in names:
            rel = os.path.relpath(os.path.join(root, n), d)
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def _world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _gather(obj):
    """Every rank's ``obj`` (a list on every rank)."""
    rank, world = _world()
    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


def write_manifest(d: str) -> None:
    """Hashes every file of ``d`` (round-robin over the ranks) and writes ``d/tsync_checksums.json`` on rank 0.
    Collective."""
    rank, world = _world()
    files = _files(d) if rank == 0 else None
    if world > 1:
        box = [files]
        dist.broadcast_object_list(box, src=0)
        files = box[0]
    mine = {f: [os.path.getsize(os.path.join(d, f)), sha256_file(os.path.join(d, f))]
            for i, f in enumerate(files) if i % world == rank}
    merged: dict = {}
    for part in _gather(mine):
        merged.update(part)
    if rank == 0:
        with open(os.path.join(d, MANIFEST), "w") as f:
            json.dump({"format": 1, "algorithm": "sha256", "files": dict(sorted(merged.items()))}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())


def _check_file(d: str, rel: str, size: int, digest: str) -> str | None:
    path = os.path.join(d, rel)
    if not os.path.isfile(path):
        return f"{path}: missing (the checkpoint's manifest lists it)"
    got = os.path.getsize(path)
    if got != size:
        return f"{path}: {got} bytes, {size} when saved ({'truncated' if got < size else 'padded'})"
    if sha256_file(path) != digest:
        return f"{path}: SHA-256 differs from the one recorded at save (the file was altered or corrupted)"
    return None


def verify(d: str) -> bool:
    """Checks every file of checkpoint directory ``d`` against its manifest; raises :class:`CheckpointCorrupt`
    naming the first bad file. Returns False (nothing verified) for a checkpoint without a manifest. Collective."""
    rank, world = _world()
    manifest = os.path.join(d, MANIFEST)
    if not os.path.isdir(d):
        raise CheckpointCorrupt(f"{d}: checkpoint directory missing", d)
    if not os.path.exists(manifest):
        return False
    try:
        with open(manifest) as f:
            files = json.load(f)["files"]
        items = sorted((str(k), int(v[0]), str(v[1])) for k, v in files.items())
    except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
        raise CheckpointCorrupt(f"{manifest}: unreadable checksum manifest ({type(exc).__name__}: {exc})",
                                manifest) from None
    bad = [(rel, why) for i, (rel, size, digest) in enumerate(items) if i % world == rank
           for why in [_check_file(d, rel, size, digest)] if why]
    found = sorted(b for part in _gather(bad) for b in part)
    if found:
        rel, why = found[0]
        more = f" ({len(found) - 1} more bad file(s): {[r for r, _ in found[1:4]]})" if len(found) > 1 else ""
        raise CheckpointCorrupt(f"damaged checkpoint {d}: {why}{more}", os.path.join(d, rel))
    return True


def disk_full(exc: BaseException | None, probe_dir: str) -> bool:
    """Whether a failed write was a full disk: ``ENOSPC`` / ``EDQUOT`` anywhere in the exception chain, else a 1 MiB
    probe write in ``probe_dir`` fails with one (torch's zip writer reports a full disk as "unexpected pos")."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in _FULL or "No space left on device" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    probe = os.path.join(probe_dir, f".tsync_space_probe.{os.getpid()}")
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * (1 << 20))
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        return e.errno in _FULL
    finally:
        try:
            os.remove(probe)
        except OSError:
            pass
    return False


def free_bytes(path: str) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None
