"""streaming.ready_queue.DataParallelAssigner: the one owner of which DP rank trains a trajectory."""

import pytest

from megatron_tsync.streaming.ready_queue import DataParallelAssigner


def test_arrival_order_round_robin_and_sticky():
    a = DataParallelAssigner(3)
    assert [a.assign(t) for t in ("s0g1t2", "s0g0t0", "s0g1t0", "s0g0t1")] == [0, 1, 2, 0]
    assert a.assign("s0g0t0") == 1  # a later chunk of the same trajectory (turn-level OPD) keeps its rank
    assert a.rank_of("s0g1t0") == 2 and a.rank_of("never", default=7) == 7
    assert a.assign("s0g1t1") == 1  # the sticky repeat did not advance the counter


def test_every_rank_replays_the_same_assignment():
    order = [f"s0g{g}t{i}" for i in range(4) for g in range(3)]
    ranks = []
    for _ in range(2):  # two ranks, each with its own assigner, fed the same broadcast arrival order
        a = DataParallelAssigner(2)
        ranks.append([a.assign(t) for t in order])
    assert ranks[0] == ranks[1] and ranks[0].count(0) == ranks[0].count(1) == 6


def test_bad_size():
    with pytest.raises(ValueError, match="data-parallel size"):
        DataParallelAssigner(0)


def test_by_group_keeps_a_group_on_the_least_loaded_rank():
    """--dp-assignment group: every member of a group on one rank, the one with the fewest tokens assigned when the
    group's first member lands; a later group of long trajectories does not pile onto a loaded rank."""
    a = DataParallelAssigner(2, by_group=True)
    got = [a.assign(t, g, n) for t, g, n in [("g0t0", "g0", 100), ("g1t0", "g1", 10), ("g0t1", "g0", 100),
                                             ("g2t0", "g2", 5), ("g1t1", "g1", 10), ("g3t0", "g3", 1)]]
    assert got == [0, 1, 0, 1, 1, 1]  # g2 to rank 1 (10 < 200 tokens), g3 too (25 < 200)
    assert a.tokens == [200, 26]
    assert a.assign("g0t0", "g0", 999) == 0 and a.tokens == [200, 26]  # sticky: a repeat adds nothing
    with pytest.raises(ValueError, match="needs its group id"):
        a.assign("x", None)


def test_by_group_lowers_open_groups_per_rank_and_balances():
    """Interleaved arrivals of 7 groups × 4: round-robin spreads every group over both ranks (each rank opens a
    bucket for all 7), by group each rank sees 3 or 4; token loads stay within one group's tokens."""
    order = [(f"g{g}t{i}", f"g{g}", 10 + g) for i in range(4) for g in range(7)]
    rr, bg = DataParallelAssigner(2), DataParallelAssigner(2, by_group=True)
    groups = {"rr": [set(), set()], "bg": [set(), set()]}
    for t, g, n in order:
        groups["rr"][rr.assign(t, g, n)].add(g)
        groups["bg"][bg.assign(t, g, n)].add(g)
    assert [len(s) for s in groups["rr"]] == [7, 7] and sorted(len(s) for s in groups["bg"]) == [3, 4]
    assert groups["bg"][0].isdisjoint(groups["bg"][1]) and abs(bg.tokens[0] - bg.tokens[1]) <= 4 * 16


def test_balanced_places_groups_by_predicted_work():
    """--dp-assignment balanced: a group counts as its landed members' mean tokens × its size, so a rank whose group
    has only begun to land is not taken for an idle one. Groups of 4 × 100 tokens: g0 lands whole on rank 0, then the
    first members of g1, g2, g3. By landed tokens (``group``) rank 1 looks lighter every time and takes g1, g2 and g3
    (1,200 tokens against 400); by predicted work g2 goes to rank 0 and the ranks end with 800 each."""
    order = [(f"g0t{i}", "g0", 100) for i in range(4)] + [(f"g{g}t0", f"g{g}", 100) for g in (1, 2, 3)]
    order += [(f"g{g}t{i}", f"g{g}", 100) for i in (1, 2, 3) for g in (1, 2, 3)]
    got = {}
    for how in ("group", "balanced"):
        a = DataParallelAssigner(2, by_group=True, balanced=how == "balanced")
        got[how] = {g: a.assign(t, g, n, 4) for t, g, n in order}
        got[how, "tokens"] = a.tokens
    assert got["group"] == {"g0": 0, "g1": 1, "g2": 1, "g3": 1} and got["group", "tokens"] == [400, 1200]
    assert got["balanced"] == {"g0": 0, "g1": 1, "g2": 0, "g3": 1} and got["balanced", "tokens"] == [800, 800]
    a = DataParallelAssigner(2, balanced=True)  # the prediction follows the landed mean: 10 then 30 → 20 × 4
    a.assign("g0t0", "g0", 10, 4), a.assign("g0t1", "g0", 30, 4)
    assert a.by_group and a.predicted == [80.0, 0.0]
    a.assign("g0t1", "g0", 999, 4)  # sticky: a repeat changes nothing
    assert a.predicted == [80.0, 0.0] and a.tokens == [40, 0]


def test_balanced_evens_uneven_groups_better_than_landed_tokens():
    """16 groups × 8 of very uneven length (log-normal, log-sd 1) landing in random order, DP 4, 20 seeds: every group
    stays on one rank and both rules replay identically, and the most-loaded rank (what the barrier waits for) carries
    fewer tokens under the predicted-work rule than under landed tokens, summed over the seeds and in most of them
    (here 14 of 20 better, 3 equal)."""
    import random
    worst = {"group": [], "balanced": []}
    for seed in range(20):
        rng = random.Random(seed)
        length = {g: int(rng.lognormvariate(7, 1.0)) for g in range(16)}
        order = [(f"g{g}t{i}", f"g{g}", length[g] + rng.randint(0, 50)) for i in range(8) for g in range(16)]
        rng.shuffle(order)
        for how in worst:
            runs = []
            for _ in range(2):
                a = DataParallelAssigner(4, by_group=True, balanced=how == "balanced")
                runs.append([a.assign(t, g, n, 8) for t, g, n in order])
            assert runs[0] == runs[1]
            assert all(len({r for (_, g, _), r in zip(order, runs[0]) if g == f"g{k}"}) == 1 for k in length)
            worst[how].append(max(a.tokens))
    better = sum(b < g for b, g in zip(worst["balanced"], worst["group"]))
    assert sum(worst["balanced"]) < 0.95 * sum(worst["group"]) and better >= 12, (worst, better)


def test_deterministic_group_order_wins_over_by_group():
    a = DataParallelAssigner(2, group_order=["g0", "g1"], by_group=True)
    assert [a.assign("g1t0", "g1", 5), a.assign("g0t0", "g0", 5)] == [1, 0]


def test_flag_reaches_the_trainers_assigner(capsys):
    """--dp-assignment group → runtime.grpo.dp_assigner by group (least-loaded rank); --deterministic keeps its
    batch-order rule; the default (auto) is spill in GRPO stream-trajectory (with or without a bound on the bucket
    memory) and round-robin by arrival otherwise. OPD refuses group / balanced / spill (no group buckets there)."""
    from megatron_tsync.arguments import parse_args
    from megatron_tsync.runtime.grpo import dp_assigner

    base = ["--model", "m", "--train-iters", "1"]
    groups = ["g0", "g1", "g2"]
    order = [("g2t0", "g2", 5), ("g2t1", "g2", 5), ("g0t0", "g0", 5), ("g1t0", "g1", 5)]
    got = {}
    for name, extra in (("default", []), ("capped", ["--max-open-groups", "4"]),
                        ("host", ["--accumulate-on-host"]), ("resident", ["--max-device-buckets", "4"]),
                        ("capped-sync", ["--max-open-groups", "4", "--rl-mode", "sync"]),
                        ("group", ["--dp-assignment", "group"]), ("det", ["--deterministic"]),
                        ("balanced", ["--dp-assignment", "balanced"]), ("sync", ["--rl-mode", "sync"]),
                        ("arrival", ["--dp-assignment", "arrival"]), ("spill", ["--dp-assignment", "spill"])):
        a = dp_assigner(parse_args(base + extra), 2, groups, 6)  # 6 trajectories: spill's threshold tapers over them
        assert a.spill == (name in ("default", "capped", "host", "resident", "spill")) and a.total == 6
        got[name] = [a.assign(*x) for x in order]
        if name == "balanced":
            assert a.balanced and a.predicted == [10.0, 10.0]  # no group size given: the landed tokens
    # the default (auto): spill in stream-trajectory (GRPO's default mode), arrival order in sync; spill keeps g2 on
    # rank 0 (10 tokens <= 0 + 5 × (1 + 2 × 5/6)), where arrival order splits it
    assert got == {"default": [0, 0, 1, 1], "capped": [0, 0, 1, 1], "host": [0, 0, 1, 1], "resident": [0, 0, 1, 1],
                   "capped-sync": [0, 1, 0, 1], "group": [0, 0, 1, 1], "det": [0, 0, 0, 1], "balanced": [0, 0, 1, 1],
                   "sync": [0, 1, 0, 1], "arrival": [0, 1, 0, 1], "spill": [0, 0, 1, 1]}
    for how in ("group", "spill"):
        with pytest.raises(SystemExit):
            parse_args(base + ["--dp-assignment", how, "--rl-algorithm", "opd", "--teacher-model", "t"])
        assert "OPD has no group buckets" in capsys.readouterr().err


def test_spill_keeps_a_group_home_until_it_would_unbalance_the_ranks():
    """--dp-assignment spill: a member joins its group's rank unless that rank would then exceed the least-loaded one
    by more than T (the longest trajectory landed so far, without a step size to taper over); then it spills there,
    and the group has two holders, the later members going to the lighter of them."""
    a = DataParallelAssigner(2, spill=True)
    assert a.by_group and a.spill and not a.balanced
    got = [a.assign(t, g, n) for t, g, n in [("g0t0", "g0", 100), ("g1t0", "g1", 10), ("g0t1", "g0", 100),
                                             ("g0t2", "g0", 100), ("g0t3", "g0", 100), ("g1t1", "g1", 10)]]
    # g0t1: 100 + 100 > 10 + 100 → spills to rank 1 (110); g0t2: its lighter holder rank 0, 200 <= 100 + 100;
    # g0t3: rank 1, 210 <= 200 + 100; g1t1: g1's only holder rank 1, 220 <= 200 + 100
    assert got == [0, 1, 1, 0, 1, 1] and a.tokens == [200, 220] and a.longest == 100
    assert sorted(a._holders["g0"]) == [0, 1] and a._holders["g1"] == [1]
    assert a.assign("g0t0", "g0", 999) == 0 and a.tokens == [200, 220]  # sticky
    b = DataParallelAssigner(2, spill=True, step_trajectories=4)  # tapered: T = 100 × (1 + 2 × 2/4) at g0t1
    got = [b.assign(t, g, n) for t, g, n in [("g0t0", "g0", 100), ("g1t0", "g1", 10), ("g0t1", "g0", 100)]]
    assert got == [0, 1, 0] and b.tokens == [200, 10]  # g0 stays home: 200 <= 10 + 200


def _uneven_order(rng, groups=16, size=8):
    """Groups of very uneven length (log-normal, log-sd 1) landing in random order, short members first on average."""
    length = {g: int(rng.lognormvariate(7, 1.0)) for g in range(groups)}
    order = [(f"g{g}t{i}", f"g{g}", length[g] + rng.randint(0, length[g])) for i in range(size) for g in range(groups)]
    rng.shuffle(order)
    order.sort(key=lambda x: x[2] * rng.uniform(0.5, 1.5))
    return order


def test_spill_bounds_the_imbalance_with_fewer_open_groups():
    """Property over 30 seeds (16 uneven groups × 8, DP 2 and 4), tapered and not: after *every* landing the ranks'
    tokens differ by at most the largest threshold T so far (one longest trajectory untapered, at most three
    tapered); both replays agree; and a group sits on far fewer ranks (the buckets a rank opens) than under arrival
    order, which spreads nearly every group over every rank."""
    import random
    spread = {"arrival": 0, 0: 0, 128: 0}
    for seed in range(30):
        dp, order = 4 if seed % 2 else 2, _uneven_order(random.Random(seed))
        rr = DataParallelAssigner(dp)
        ranks = {"arrival": [rr.assign(t, g, n) for t, g, n in order]}
        for total in (0, 128):
            runs = []
            for _ in range(2):
                a, got, bound = DataParallelAssigner(dp, spill=True, step_trajectories=total), [], 0.0
                for t, g, n in order:
                    bound = max(bound, max(a.longest, n) * (1 + 2 * (1 - len(got) / total) if total else 1))
                    got.append(a.assign(t, g, n, 8))
                    assert max(a.tokens) - min(a.tokens) <= bound <= 3 * a.longest, (seed, total, a.tokens, bound)
                runs.append(got)
            assert runs[0] == runs[1]
            ranks[total] = runs[0]
        for how, got in ranks.items():
            spread[how] += sum(len({r for (_, g, _), r in zip(order, got) if g == f"g{k}"}) for k in range(16))
    # here 845 and 1,160 group-ranks against 1,374
    assert spread[128] < 0.65 * spread["arrival"] and spread[128] < spread[0] < 0.9 * spread["arrival"], spread
