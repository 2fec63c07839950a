"""Planner/simulator: predict a cluster's step time per mode, speedups and bucket memory from a latency trace before
renting it (``python -m megatron_tsync.plan``; docs/planner.md). The learner's order of work comes from the project's
own ``streaming.planner.StepPlanner``."""
