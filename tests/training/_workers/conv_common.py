"""Shared helpers of the conversion / checkpoint / tool tests: isolated subprocesses, free ports, tiny models."""

import os
import signal
import socket
import subprocess
import sys
import time

WORKERS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(WORKERS, "..", "..", ".."))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_isolated(args: list[str], *, nproc: int = 1, timeout: float = 300.0, env: dict | None = None,
                 bare: bool = False):
    """Run ``python args...`` (nproc == 1, as rank 0 of 1) or ``torchrun --nproc_per_node nproc args...`` in its
    own session; afterwards kill whatever it left behind in that session (dist_checkpointing's manager
    processes survive a SIGKILLed parent). ``bare``: a single process without RANK/WORLD_SIZE (a tool that
    decides itself whether to spawn). Timeouts guard against hangs (the shared CI machines are slow at times).
    Returns (returncode, output, seconds)."""
    e = dict(os.environ)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS"):
        e.pop(k, None)
    e["OMP_NUM_THREADS"] = "1"
    e["PYTHONWARNINGS"] = "ignore"
    e.update(env or {})
    port = free_port()
    if nproc == 1 and not bare:
        e.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        cmd = [sys.executable] + args
    elif nproc == 1:
        cmd = [sys.executable] + args
    else:
        # --standalone: the agent binds its store on port 0 (a port picked beforehand can be taken meanwhile)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--standalone"] + args
    t0 = time.time()
    import tempfile

    # Output goes to a file, not a pipe: orphans of a killed worker would hold a pipe open.
    with tempfile.TemporaryFile(mode="w+") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=e, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, text=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_session(proc.pid)
            proc.wait()
            log.seek(0)
            raise AssertionError(f"timed out after {timeout}s: {' '.join(cmd)}\n{log.read()[-4000:]}")
        finally:
            _kill_session(proc.pid)
        log.seek(0)
        out = log.read()
    return proc.returncode, out, time.time() - t0


def _kill_session(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def make_models(root: str) -> dict[str, str]:
    """Tiny test models: Llama (untied, GQA 4/2) and Qwen2 (qkv bias, tied, MQA 4/1 so TP=2 splits a group)."""
    from megatron_tsync.model.tiny_model import make_tiny_model

    return {
        "llama": make_tiny_model(os.path.join(root, "llama"), family="llama", kv_heads=2, seed=1),
        "qwen2": make_tiny_model(os.path.join(root, "qwen2"), family="qwen2", kv_heads=1, tie=True, seed=2),
    }


def make_qwen3_models(root: str) -> dict[str, str]:
    """Tiny Qwen3 (QK-norm; head_dim 64 ≠ hidden/heads = 32): untied GQA 4/2 and tied MQA 4/1 (TP=2 splits a
    group), and a tiny Llama with llama3 RoPE scaling (original_max_position_embeddings 64, untied, GQA 4/2)."""
    from megatron_tsync.model.tiny_model import make_tiny_model

    return {
        "qwen3": make_tiny_model(os.path.join(root, "qwen3"), family="qwen3", kv_heads=2, head_dim=64, seed=3),
        "qwen3_tied": make_tiny_model(os.path.join(root, "qwen3_tied"), family="qwen3", kv_heads=1, head_dim=64,
                                      tie=True, seed=4),
        "llama3": make_tiny_model(os.path.join(root, "llama3"), family="llama3", kv_heads=2, seed=5),
    }
