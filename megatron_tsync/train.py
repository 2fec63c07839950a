"""Training entry point: ``python -m megatron_tsync.train [flags]`` or ``tsync-train [flags]``.

Flags follow Megatron-LM where they overlap (``--tensor-model-parallel-size``, ``--lr``, ``--load``, ``--save``,
...) plus the RL flags; ``--config FILE`` reads YAML/JSON. See ``megatron_tsync/arguments.py``.

Order: flags (``--help`` imports neither torch nor megatron), then the pre-flight checks (``runtime/preflight.py``:
model folder, tokenizer, task, layout, sequence length; one ``[tsync] error:`` line and exit code 2), then the run.
"""

import sys


def main(argv=None) -> int:
    from megatron_tsync.arguments import parse_args

    cfg = parse_args(argv)
    from megatron_tsync.runtime.preflight import run_preflight

    run_preflight(cfg)  # before torch.distributed, the model, the --save lock or any worker
    from megatron_tsync.runtime.loop import run

    run(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
