"""Test-wide setup: CPU threads, a free rendezvous port, one single-process megatron group per session."""

import os
import socket
import time
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")

import pytest  # noqa: E402

from tests._scheduling import make_scheduler, order_longest_first  # noqa: E402
from tests._suite_report import CpuMeter, SuiteReport  # noqa: E402


def pytest_configure(config):
    """The end-of-run summary (total, 15 slowest, failures with their first line), once, in the controller; the CPU
    meter where the tests run."""
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(SuiteReport(), "tsync_suite_report")
    if hasattr(config, "workerinput") or getattr(config.option, "dist", "no") == "no":  # where the tests run
        config.pluginmanager.register(CpuMeter(), "tsync_cpu_meter")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist: modules ordered longest first (tests/_scheduling.py)."""
    if hasattr(config, "workerinput"):
        order_longest_first(items)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist: one work unit per module, the SLURM modules one unit (tests/_scheduling.py)."""
    return make_scheduler(config, log)


def until(cond, timeout_s: float = 30.0) -> bool:
    """Polls `cond` until it holds (True) or `timeout_s` passed (False): waiting on an event, not a fixed sleep."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def checkpoint_tensors(ck_dir, scratch_dir, step: int | None = None) -> dict:
    """{name: tensor} of checkpoint `step` (default: the latest) of a megatron_tsync save folder: the model's weights
    and the optimizer's state under megatron's sharded names, read in this process with torch.distributed.checkpoint
    (the torch_dist format is DCP) — the bytes the run saved, without a converter process between. The HF export is
    checked by tests/tools/test_convert_checkpoint.py."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ck_dir, scratch_dir = str(ck_dir), str(scratch_dir)
    if step is None:
        with open(os.path.join(ck_dir, "latest_checkpointed_iteration.txt")) as f:
            step = int(f.read())
    out = os.path.join(scratch_dir, f"{os.path.basename(ck_dir.rstrip('/'))}_{step}.pt")
    dcp_to_torch_save(os.path.join(ck_dir, f"iter_{step:07d}"), out)
    flat, todo = {}, [("", torch.load(out, weights_only=False))]
    while todo:
        prefix, d = todo.pop()
        for k, v in d.items():
            if isinstance(v, dict):
                todo.append((f"{prefix}{k}.", v))
            elif torch.is_tensor(v):
                flat[prefix + k] = v
    os.remove(out)
    assert flat, f"no tensor in checkpoint {step} of {ck_dir}"
    return flat


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def megatron_single():
    """torch.distributed (gloo, world 1) + megatron model parallel TP=1/PP=1 in this process."""
    import torch

    torch.set_num_threads(1)
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_port())
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(k, None)
    from megatron_tsync.model.parallel import initialize_parallel

    return initialize_parallel(1, 1)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A tiny HF Llama + local tokenizer shared by the rollout/runtime tests (made once per session)."""
    from megatron_tsync.model.tiny_model import make_tiny_model

    d = tmp_path_factory.getbasetemp() / "tiny_llama_rollout"
    if not (d / "config.json").exists():
        make_tiny_model(str(d), seed=0)
    return str(d)
