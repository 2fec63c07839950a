import os
import shutil
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tsync_transport_helpers import KEY, short_tmpdir  # noqa: E402


@pytest.fixture
def key() -> bytes:
    return KEY


@pytest.fixture
def ipc_dir():
    d = short_tmpdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(params=["ipc", "tcp"])
def endpoint(request, ipc_dir) -> str:
    """A bindable endpoint of each transport; tcp binds a wildcard port (receiver.endpoint tells which)."""
    if request.param == "ipc":
        return f"ipc://{ipc_dir}/events.sock"
    return "tcp://127.0.0.1:*"
