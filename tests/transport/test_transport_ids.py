"""Group / trajectory ids: one format, written and read by transport.ids only."""

import pathlib

from megatron_tsync.transport.ids import group_id, group_ids, parse_traj_id, traj_id, traj_ids

ROOT = pathlib.Path(__file__).resolve().parents[2] / "megatron_tsync"


def test_format_and_round_trip() -> None:
    assert group_ids(3, 2) == ["s3g0", "s3g1"] == [group_id(3, 0), group_id(3, 1)]
    assert traj_id("s3g1", 4) == "s3g1t4"
    assert traj_ids(2, 2, 3) == ["s2g0t0", "s2g0t1", "s2g0t2", "s2g1t0", "s2g1t1", "s2g1t2"]
    ids = traj_ids(7, 3, 4)
    assert [parse_traj_id(t) for t in ids] == [(7, g, i) for g in range(3) for i in range(4)]
    assert parse_traj_id("s10g11t12") == (10, 11, 12)
    for bad in ("traj-0", "s1g2", "s1g2t", "xs1g2t3", "s1g2t3x", ""):
        assert parse_traj_id(bad) is None, bad


def test_no_other_module_spells_the_format() -> None:
    """The f-strings of the format live in transport/ids.py only (the worker and the fleet ask it)."""
    spelled = ('f"s{', 'g{g}"', '}t{i}"', "}t{m[", "}t{index}")
    offenders = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py")
                 if p.name != "ids.py" and any(s in p.read_text() for s in spelled)]
    assert not offenders, offenders
