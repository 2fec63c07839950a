"""The shared secret that signs every frame and weight manifest.

Where it comes from, first match wins:

1. an explicit ``path`` argument to :func:`load_secret`;
2. ``TSYNC_SECRET``: the key as hex (at least 32 hex digits = 16 bytes);
3. ``TSYNC_SECRET_FILE``: a path to a file holding the hex key.

A key file must be a regular file readable by its owner only (mode 0600 or 0400; any group/other bit is refused,
as ssh does for private keys).  Make one with ``python -m megatron_tsync.transport.secret PATH`` (or print a fresh
key to stdout with no argument).  The same key must reach the learner and every rollout worker — e.g. a 0600 file on
a shared filesystem, or the env var set by the job script.

Runs: the key that signs a run's events is not the shared secret itself but :func:`run_key` of it and the run's id
(:func:`new_run_id`, drawn by each trainer process at start-up). Two runs sharing one secret file (a rerun, a resumed
run, a second job) therefore sign with different keys: an event of another run does not verify under this run's key,
and the channel tells it apart from a forgery by re-deriving the key of the run id the frame names
(``channel.EventReceiver``, counted as ``wrong_run``).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import stat
import sys
from collections.abc import Mapping

__all__ = ["ENV_VAR", "ENV_FILE_VAR", "MIN_SECRET_BYTES", "SecretError", "generate_secret", "load_secret",
           "new_run_id", "run_key", "write_secret_file"]

ENV_VAR = "TSYNC_SECRET"
ENV_FILE_VAR = "TSYNC_SECRET_FILE"
MIN_SECRET_BYTES = 16

_HOW = (f"set {ENV_VAR} to a hex key or {ENV_FILE_VAR} to a 0600 file holding one; generate one with "
        "`python -m megatron_tsync.transport.secret PATH`")


class SecretError(RuntimeError):
    """The shared secret is missing, unreadable, badly formatted or too exposed."""


def generate_secret(nbytes: int = 32) -> bytes:
    """A fresh random key (``secrets.token_bytes``)."""
    if nbytes < MIN_SECRET_BYTES:
        raise ValueError(f"a secret needs at least {MIN_SECRET_BYTES} bytes")
    return secrets.token_bytes(nbytes)


_RUN_ID = re.compile(r"[0-9a-f]{8,64}")


def new_run_id() -> str:
    """A fresh run id: 16 random hex digits (one per trainer process; a resumed run gets a new one)."""
    return secrets.token_hex(8)


def run_key(secret: bytes, run_id: str) -> bytes:
    """The key that signs the events of run ``run_id``: HMAC-SHA256(secret, "tsync-run-key/v1:" + run_id).

    Anyone holding the secret can derive it (the learner does, to recognise another run's events); without the
    secret it is unknown, and one run's key says nothing about another's."""
    if not isinstance(run_id, str) or not _RUN_ID.fullmatch(run_id):
        raise ValueError(f"run id must be 8–64 lowercase hex digits, got {run_id!r}")
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"a secret needs at least {MIN_SECRET_BYTES} bytes")
    return hmac.new(bytes(secret), b"tsync-run-key/v1:" + run_id.encode(), hashlib.sha256).digest()


def _parse_hex(text: str, where: str) -> bytes:
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        raise SecretError(f"{where}: not a hex string") from None
    if len(key) < MIN_SECRET_BYTES:
        raise SecretError(f"{where}: key of {len(key)} bytes, need at least {MIN_SECRET_BYTES}")
    return key


def _read_file(path: str) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise SecretError(f"secret file {path!r}: cannot open: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SecretError(f"secret file {path!r}: not a regular file")
        if st.st_mode & 0o077:
            raise SecretError(f"secret file {path!r}: mode {stat.S_IMODE(st.st_mode):04o} lets group/others access "
                              "it; `chmod 600` it")
        if st.st_uid != os.getuid():
            raise SecretError(f"secret file {path!r}: owned by uid {st.st_uid}, not by this user ({os.getuid()})")
        with os.fdopen(fd, "r", closefd=False) as f:
            text = f.read(4096)
    finally:
        os.close(fd)
    return _parse_hex(text, f"secret file {path!r}")


def load_secret(path: str | os.PathLike[str] | None = None, *, env: Mapping[str, str] | None = None) -> bytes:
    """Returns the shared key; raises :class:`SecretError` saying how to provide one when none is found."""
    env = os.environ if env is None else env
    if path is not None:
        return _read_file(os.fspath(path))
    if env.get(ENV_VAR):
        return _parse_hex(env[ENV_VAR], f"${ENV_VAR}")
    if env.get(ENV_FILE_VAR):
        return _read_file(env[ENV_FILE_VAR])
    raise SecretError(f"no shared secret configured: {_HOW}")


def write_secret_file(path: str | os.PathLike[str], key: bytes | None = None) -> bytes:
    """Creates ``path`` (mode 0600, must not exist) holding ``key`` (a fresh one by default) as hex; returns the key."""
    key = generate_secret() if key is None else key
    if len(key) < MIN_SECRET_BYTES:
        raise ValueError(f"a secret needs at least {MIN_SECRET_BYTES} bytes")
    fd = os.open(os.fspath(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key.hex() + "\n")
    return key


if __name__ == "__main__":  # python -m megatron_tsync.transport.secret [PATH]
    if len(sys.argv) > 1:
        write_secret_file(sys.argv[1])
        print(f"wrote a new secret to {sys.argv[1]} (mode 0600); export {ENV_FILE_VAR}={sys.argv[1]}")
    else:
        print(generate_secret().hex())
