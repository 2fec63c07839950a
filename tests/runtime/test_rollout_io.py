"""Rollout dumps (--dump-rollouts / --replay-rollouts): what a dumped step gives back."""

import torch

from megatron_tsync.runtime.rollout_io import dump_rollouts, load_rollouts
from megatron_tsync.streaming.ready_queue import Sample
from megatron_tsync.training.stream_fb import THETA0_LOGP


def _sample(i: int, routed: bool) -> Sample:
    T = 6 + i
    return Sample(traj_id=f"g0t{i}", group_id="g0", group_size=2, token_ids=torch.arange(T), loss_mask=torch.ones(T),
                  reward=float(i), behaviour_logp=-torch.rand(T, dtype=torch.float64),
                  meta={"worker": 1, "finish": "stop", THETA0_LOGP: torch.zeros(T - 1)},
                  routing=torch.randint(0, 4, (T - 1, 2, 2), dtype=torch.uint8) if routed else None)


def test_round_trip_keeps_routing_and_drops_learner_tensors(tmp_path):
    """The learner's π_θ0 tensors in ``meta`` (several minibatches) are not JSON: dropped, the worker's scalars kept;
    router-replay routing (per trajectory, its own length) comes back bit-exact."""
    samples = [_sample(0, True), _sample(1, True)]
    dump_rollouts(str(tmp_path), 3, samples, ["g0"])
    back, groups = load_rollouts(str(tmp_path), 3)
    assert groups == ["g0"] and [s.traj_id for s in back] == ["g0t0", "g0t1"]
    for a, b in zip(samples, back):
        assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.routing, b.routing)
        assert b.meta == {"worker": 1, "finish": "stop"}
    dump_rollouts(str(tmp_path), 4, [_sample(0, False)], ["g0"])
    assert load_rollouts(str(tmp_path), 4)[0][0].routing is None


def test_every_dumped_tensor_is_documented(tmp_path):
    """docs/formats.md's table of ``rollouts.safetensors`` names every tensor a dump can hold (``routing.{i}``: one
    per routed trajectory)."""
    import os
    import re

    from safetensors import safe_open

    samples = [_sample(0, True), _sample(1, True)]
    for s in samples:
        s.ref_logp = s.teacher_logp = -torch.rand(s.token_ids.numel(), dtype=torch.float64)
    d = dump_rollouts(str(tmp_path), 0, samples, ["g0"])
    with safe_open(os.path.join(d, "rollouts.safetensors"), "pt") as f:
        keys = {re.sub(r"^routing\.\d+$", "routing.{i}", k) for k in f.keys()}
    assert "routing.{i}" in keys and "teacher_logp" in keys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "docs", "formats.md")) as f:
        table = set(re.findall(r"^\| `([^`]+)` \|", f.read(), re.M))
    assert keys <= table, sorted(keys - table)
