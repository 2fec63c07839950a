"""runtime/phase.py: a long phase (warm start, held-out evaluation) prints that it is alive, a short one nothing."""

import threading

from megatron_tsync.runtime.phase import announce


def test_a_long_phase_says_so_and_a_short_one_stays_quiet():
    lines, two = [], threading.Event()

    def out(line):
        lines.append(line)
        if len(lines) >= 2:
            two.set()

    with announce("supervised warm start", every_s=0.01, status=lambda: "step 3/175, loss 1.234", out=out):
        assert two.wait(10.0)  # event-driven: the phase lasts until two progress lines came
    n = len(lines)
    assert lines[0].startswith("[tsync] supervised warm start: ") and lines[0].endswith(
        " s so far (step 3/175, loss 1.234)")
    quiet = []
    with announce("held-out evaluation v0", every_s=3600, out=quiet.append):
        pass
    with announce("held-out evaluation v0", enabled=False, every_s=0.0001, out=quiet.append):
        pass
    assert quiet == [] and len(lines) == n  # nothing after the phase ended
