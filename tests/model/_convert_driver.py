"""Several tools/convert_checkpoint.py conversions in one launch (tests/model/test_qwen3.py, test_qwen3_moe.py,
test_glm4_moe_lite.py).

``--jobs FILE``: a JSON list of the tool's argument lists, run in order through the tool's own ``main(argv)`` in
this process: under torchrun (WORLD_SIZE set) that is the tool's launcher path (every rank converts, ``run``: the
layout initialised, converted, torn down), one process without a launcher its single-process path. One launch
then serves every conversion of a test module instead of a tool process (plus its spawned ranks) per conversion;
the world process group stays up between conversions (a second init_process_group on torchrun's agent store
finds the first one's keys), so the driver lets the tool's ``destroy_parallel`` tear down only the model-parallel
groups until the last conversion; initialize_parallel re-creates them at the next layout as it does for any
change of sizes. The tool's own spawning of local ranks (and its command line) stays covered by
tests/tools/test_convert_checkpoint.py, which runs it as a command.

``--then SCRIPT ARGS...``: afterwards run that worker script as ``__main__`` in the same processes (its own
initialize_parallel / destroy_parallel), so a module's logits worker and its conversions share one launch.
"""

import argparse
import importlib.util
import json
import os
import sys


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--jobs", required=True)
    p.add_argument("--then", nargs=argparse.REMAINDER, default=None, help="a worker script and its arguments")
    a = p.parse_args()
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools", "convert_checkpoint.py")
    spec = importlib.util.spec_from_file_location("convert_checkpoint_tool", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    from megatron.core import parallel_state as ps

    from megatron_tsync.model import parallel

    with open(a.jobs) as f:
        jobs = json.load(f)
    destroy = parallel.destroy_parallel
    parallel.destroy_parallel = lambda: ps.destroy_model_parallel() if ps.model_parallel_is_initialized() else None
    try:
        for argv in jobs:
            print("[convert_driver]", " ".join(argv), flush=True)
            tool.main(argv)
    finally:
        parallel.destroy_parallel = destroy
    if a.then:
        import runpy

        sys.argv = list(a.then)
        runpy.run_path(a.then[0], run_name="__main__")
    destroy()


if __name__ == "__main__":
    sys.exit(main())
