"""CPU weight hand-off, trainer → inference engines, through a shared directory.

``publish_weights(state_dict, directory, version, key)`` writes ``weights-v<version>.safetensors`` atomically (a temp
file in the same directory, fsync, ``os.replace``), then a signed manifest ``manifest-v<version>.json`` the same way::

    {"format": "megatron_tsync.weights/1", "version": 7, "file": "weights-v000000000007.safetensors",
     "sha256": "<hex of the file>", "size": 12345, "num_tensors": 42, "hmac": "<HMAC-SHA256 over the rest>"}

The manifest is written last, so a manifest that exists names a complete file.  Versions must increase; the last
``keep`` (2) versions are kept and older ones deleted (manifest first, then file).

``WeightSubscriber(directory, key)`` reads the newest manifest, verifies its HMAC (``BadSignature``), reads the file
*once* into memory, checks size and sha256 on those bytes (``BadSignature``) and parses the same bytes with
safetensors — nothing unverified is ever parsed, and no pickle is involved.  A manifest that is not valid JSON or
disagrees with its file name raises ``Malformed``.  A version deleted by garbage collection while being read is
retried with the then-newest one.

The other path, a collective broadcast from the trainer's rank 0 to the engines (gloo on CPU, NCCL on GPU), is
:mod:`megatron_tsync.transport.weight_broadcast` (``--weight-sync broadcast``); :class:`WeightPublisher` is the
protocol both publishers implement.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any, Protocol

import safetensors.torch
import torch

from .codec import check_key
from .errors import BadSignature, Malformed

__all__ = ["MANIFEST_FORMAT", "publish_weights", "WeightSubscriber", "WeightPublisher", "FileWeightPublisher"]

MANIFEST_FORMAT = "megatron_tsync.weights/1"
_MANIFEST_RE = re.compile(r"^manifest-v(\d{12})\.json$")
_WEIGHTS_RE = re.compile(r"^weights-v(\d{12})\.safetensors$")
_MANIFEST_FIELDS = ("format", "version", "file", "sha256", "size", "num_tensors")


def _weights_name(version: int) -> str:
    return f"weights-v{version:012d}.safetensors"


def _manifest_name(version: int) -> str:
    return f"manifest-v{version:012d}.json"


def _manifest_tag(body: dict[str, Any], key: bytes) -> str:
    canonical = json.dumps({k: body[k] for k in _MANIFEST_FIELDS}, sort_keys=True, separators=(",", ":"))
    return hmac.new(key, canonical.encode(), hashlib.sha256).hexdigest()


def _versions(directory: Path, pattern: re.Pattern[str]) -> list[int]:
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := pattern.match(n)))


def _atomic_write(directory: Path, final: str, write: Any) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{final}.", suffix=".tmp", dir=directory)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, directory / final)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _cpu_tensors(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached contiguous CPU tensors, each owning its storage (safetensors refuses shared/partial storages, and
    Megatron parameters are views into one contiguous buffer)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state_dict.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise TypeError(f"state_dict entries must be str -> Tensor, got {name!r}: {type(t).__name__}")
        t = t.detach().to("cpu").contiguous()
        if t.untyped_storage().nbytes() != t.numel() * t.element_size() or t.storage_offset() != 0:
            t = t.clone()
        out[name] = t
    ptrs: dict[int, str] = {}
    for name, t in out.items():  # tied weights (one storage under two names): give the second its own copy
        p = t.untyped_storage().data_ptr()
        if p in ptrs and t.numel():
            out[name] = t.clone()
        ptrs.setdefault(p, name)
    return out


def publish_weights(state_dict: dict[str, torch.Tensor], directory: str | os.PathLike[str], version: int,
                    key: bytes, *, keep: int = 2) -> Path:
    """Publishes ``state_dict`` as ``version``; returns the manifest's path.  ``version`` must exceed every version
    already published in ``directory``."""
    key = check_key(key)
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"version must be a non-negative int, got {version!r}")
    if keep < 1:
        raise ValueError("keep must be >= 1")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    published = _versions(d, _MANIFEST_RE)
    if published and version <= published[-1]:
        raise ValueError(f"version {version} <= latest published version {published[-1]} in {d}")
    tensors = _cpu_tensors(state_dict)
    fname = _weights_name(version)
    _atomic_write(d, fname, lambda p: safetensors.torch.save_file(tensors, p, metadata={"version": str(version)}))
    h, size = hashlib.sha256(), 0
    with open(d / fname, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            size += len(chunk)
    body: dict[str, Any] = {"format": MANIFEST_FORMAT, "version": version, "file": fname, "sha256": h.hexdigest(),
                            "size": size, "num_tensors": len(tensors)}
    body["hmac"] = _manifest_tag(body, key)

    def write_manifest(p: str) -> None:
        with open(p, "w") as f:
            json.dump(body, f, sort_keys=True)

    _atomic_write(d, _manifest_name(version), write_manifest)
    _fsync_dir(d)
    _garbage_collect(d, keep)
    return d / _manifest_name(version)


def _garbage_collect(d: Path, keep: int) -> None:
    kept = _versions(d, _MANIFEST_RE)[-keep:]
    if not kept:
        return
    for v in _versions(d, _MANIFEST_RE):
        if v < kept[0]:
            (d / _manifest_name(v)).unlink(missing_ok=True)
    for v in _versions(d, _WEIGHTS_RE):
        if v < kept[0]:
            (d / _weights_name(v)).unlink(missing_ok=True)


class WeightSubscriber:
    """Engine side: ``latest()`` → ``(version, state_dict)`` or ``None``; ``wait_for(version, timeout_s)``."""

    def __init__(self, directory: str | os.PathLike[str], key: bytes, *, poll_interval_s: float = 0.05) -> None:
        self.directory = Path(directory)
        self._key = check_key(key)
        self.poll_interval_s = poll_interval_s

    def _manifest(self, version: int) -> dict[str, Any]:
        path = self.directory / _manifest_name(version)
        with open(path, "rb") as f:  # FileNotFoundError propagates (GC race): callers retry
            raw = f.read(1 << 16)
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise Malformed(f"manifest {path.name}: not JSON: {exc}") from None
        if not isinstance(body, dict) or any(k not in body for k in (*_MANIFEST_FIELDS, "hmac")):
            raise Malformed(f"manifest {path.name}: missing fields (need {_MANIFEST_FIELDS + ('hmac',)})")
        tag = body["hmac"]
        if not isinstance(tag, str) or not hmac.compare_digest(tag.encode(), _manifest_tag(body, self._key).encode()):
            raise BadSignature(f"manifest {path.name}: HMAC does not verify (wrong key or tampered manifest)")
        if body["format"] != MANIFEST_FORMAT or body["version"] != version or body["file"] != _weights_name(version):
            raise Malformed(f"manifest {path.name}: format/version/file disagree with its name: "
                            f"{body['format']!r}, {body['version']!r}, {body['file']!r}")
        return body

    def latest_version(self) -> int | None:
        """Newest published version (its manifest verified), or ``None``."""
        for _ in range(5):
            versions = _versions(self.directory, _MANIFEST_RE)
            if not versions:
                return None
            try:
                return int(self._manifest(versions[-1])["version"])
            except FileNotFoundError:
                continue
        return None

    def load(self, version: int) -> dict[str, torch.Tensor]:
        """Loads one version after verifying manifest HMAC, size and sha256."""
        body = self._manifest(version)
        with open(self.directory / body["file"], "rb") as f:
            data = f.read()
        if len(data) != body["size"] or not hmac.compare_digest(hashlib.sha256(data).hexdigest(), body["sha256"]):
            raise BadSignature(f"weights {body['file']}: size/sha256 differ from the signed manifest")
        return safetensors.torch.load(data)

    def latest(self) -> tuple[int, dict[str, torch.Tensor]] | None:
        """``(version, state_dict)`` of the newest published version, or ``None`` when nothing is published."""
        for _ in range(5):
            versions = _versions(self.directory, _MANIFEST_RE)
            if not versions:
                return None
            try:
                return versions[-1], self.load(versions[-1])
            except FileNotFoundError:  # garbage-collected under us: a newer one exists now
                continue
        raise RuntimeError(f"{self.directory}: versions keep disappearing while being read")

    def wait_for(self, version: int, timeout_s: float) -> tuple[int, dict[str, torch.Tensor]]:
        """Waits until a version ``>= version`` is published; returns the newest ``(version, state_dict)``.  The caller
        compares the returned version with the one it asked for (zero staleness wants them equal)."""
        deadline = time.monotonic() + timeout_s
        while True:
            v = self.latest_version()
            if v is not None and v >= version:
                got = self.latest()
                if got is not None and got[0] >= version:
                    return got
            if time.monotonic() >= deadline:
                raise TimeoutError(f"weights version >= {version} not published in {self.directory} within "
                                   f"{timeout_s}s (latest: {v})")
            time.sleep(self.poll_interval_s)


class WeightPublisher(Protocol):
    """What the trainer calls after each optimizer step: :class:`FileWeightPublisher` (files) and
    :class:`~megatron_tsync.transport.weight_broadcast.BroadcastWeightPublisher` (gloo / NCCL broadcast)."""

    def publish(self, state_dict: dict[str, torch.Tensor], version: int) -> None: ...


class FileWeightPublisher:
    """:class:`WeightPublisher` over :func:`publish_weights` (CPU, shared directory)."""

    def __init__(self, directory: str | os.PathLike[str], key: bytes, *, keep: int = 2) -> None:
        self.directory, self._key, self.keep = Path(directory), check_key(key), keep

    def publish(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        publish_weights(state_dict, self.directory, version, self._key, keep=self.keep)

