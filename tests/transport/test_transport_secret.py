"""Shared secret: env var, 0600 file, clear errors."""

import os

import pytest

from megatron_tsync.transport import SecretError, generate_secret, load_secret, write_secret_file
from megatron_tsync.transport.secret import ENV_FILE_VAR, ENV_VAR


def test_env_hex() -> None:
    key = generate_secret()
    assert len(key) == 32 and key != generate_secret()
    assert load_secret(env={ENV_VAR: key.hex()}) == key
    with pytest.raises(SecretError, match="not a hex string"):
        load_secret(env={ENV_VAR: "zz" * 16})
    with pytest.raises(SecretError, match="key of 4 bytes"):
        load_secret(env={ENV_VAR: "00" * 4})


def test_missing_is_a_clear_error() -> None:
    with pytest.raises(SecretError, match=f"no shared secret configured: set {ENV_VAR}.*{ENV_FILE_VAR}"):
        load_secret(env={})


def test_file_0600(tmp_path) -> None:
    path = tmp_path / "secret"
    key = write_secret_file(path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert load_secret(path) == key
    assert load_secret(env={ENV_FILE_VAR: str(path)}) == key
    with pytest.raises(FileExistsError):
        write_secret_file(path)
    os.chmod(path, 0o644)
    with pytest.raises(SecretError, match="mode 0644 lets group/others access it"):
        load_secret(path)
    with pytest.raises(SecretError, match="cannot open"):
        load_secret(tmp_path / "absent")
    os.chmod(path, 0o600)
    os.symlink(path, tmp_path / "link")
    with pytest.raises(SecretError, match="cannot open"):
        load_secret(tmp_path / "link")  # no symlink games
