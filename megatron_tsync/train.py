"""Training entry point: ``python -m megatron_tsync.train [flags]`` or ``tsync-train [flags]``.

Flags follow Megatron-LM where they overlap (``--tensor-model-parallel-size``, ``--lr``, ``--load``, ``--save``,
...) plus the RL flags; ``--config FILE`` reads YAML/JSON. See ``megatron_tsync/arguments.py``.
"""

import sys


def main(argv=None) -> int:
    from megatron_tsync.arguments import parse_args
    from megatron_tsync.runtime.loop import run

    cfg = parse_args(argv)
    run(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
