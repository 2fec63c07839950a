"""A long start-up or evaluation phase says it is alive: ``[tsync] NAME: 20 s so far (STATUS)`` every ``every_s``
seconds while it runs (warm start, held-out evaluation), from a daemon thread, so a phase that takes minutes (a τ²
warm start took 862 s without a word) is never silent for longer than ``every_s``."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Iterator

EVERY_S = 10.0


@contextlib.contextmanager
def announce(name: str, *, enabled: bool = True, every_s: float = EVERY_S, status: Callable[[], str] = lambda: "",
             out: Callable[[str], None] | None = None) -> Iterator[None]:
    """While the block runs, every ``every_s`` seconds: ``[tsync] NAME: N s so far (status())`` (nothing when the
    block ends sooner, or when not ``enabled``: other ranks)."""
    if not enabled:
        yield
        return
    emit = out or (lambda line: print(line, flush=True))
    done = threading.Event()
    t0 = time.perf_counter()

    def beat() -> None:
        while not done.wait(every_s):
            s = status()
            try:
                emit(f"[tsync] {name}: {time.perf_counter() - t0:.0f} s so far" + (f" ({s})" if s else ""))
            except (ValueError, OSError):  # stdout closed at exit: never fail the run over a progress line
                return

    thread = threading.Thread(target=beat, name=f"phase:{name}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=1.0)
