"""Tool-latency profiles: how long each tool call of each trajectory takes, for real rollouts and for the benchmark.

A profile maps the coordinates of one tool call to seconds::

    p = get_latency_profile("swe-like", scale=0.05, seed=0)
    p.sample(group_index, traj_index, turn)        # seconds (≥ 0), already multiplied by p.scale
    trajectory_latencies(p, num_groups=8, group_size=8, calls_per_traj=3)   # (8, 8) per-trajectory totals

Determinism: with ``rng=None`` a draw is a pure function of ``(seed, group_index, traj_index, turn)``, so it does not
depend on the order in which concurrent tool calls happen. With ``rng`` (a ``random.Random``) the *per-call* noise is
drawn from it instead; the shared group factor always comes from ``(seed, group_index)``.

Built-ins (median 1 s at ``scale=1``; pass ``scale`` to fit the workload, e.g. 0.05 for the CPU quickstart):

=============  ======================================================================================================
``none``       0 s.
``uniform``    U[a, b], a = 0.5, b = 1.5, independent per call.
``swe-like``   heavy tail with strong within-group correlation (slow repositories are slow for every attempt):
               lognormal, mu = 0, sigma = 1, group_corr = 0.8 (correlation of the log-latencies of two calls of one
               group); mean 1.65 s, p99 ≈ 10 s.
``independent`` the same lognormal marginal, independent per call (group_corr = 0).
=============  ======================================================================================================

Lognormal model: ``log L = mu + sigma · (√ρ · Z_group + √(1-ρ) · (√τ · Z_traj + √(1-τ) · Z_call))`` with independent
standard normals, ρ = ``group_corr`` and τ = ``traj_corr`` (the extra correlation of the calls of one trajectory;
default 0). Every call has the marginal ``lognormal(mu, sigma)``; two calls of different trajectories of one group have
log-correlation ρ, two calls of one trajectory ρ + (1-ρ)τ.

JSON (``--latency-profile FILE.json``; :func:`load_latency_profile` also takes a built-in name). Either a
distribution::

    {"kind": "lognormal", "mu": 0.0, "sigma": 1.0, "group_corr": 0.8, "traj_corr": 0.0, "scale": 1.0}
    {"kind": "uniform", "a": 0.5, "b": 1.5}
    {"kind": "constant", "seconds": 0.2}
    {"kind": "none"}                       # or {"kind": "swe-like"} / {"kind": "independent"} (built-ins)

or a recorded trace (seconds per tool call)::

    [0.8, 1.2, 30.5, ...]                                  # a bare list = {"kind": "trace", "latencies": [...]}
    {"kind": "trace", "latencies": [0.8, 1.2, ...]}        # each call draws one entry (seeded bootstrap)
    {"kind": "trace", "groups": {"repo-a": [3.1, 2.9], "repo-b": [0.2, 0.4, 0.3]}}
        # group g replays key number g mod K (keys in file order); a flat list is bootstrapped within the group,
    {"kind": "trace", "groups": {"repo-a": [[3.1, 2.9], [4.0]], ...}}
        # a list of lists is replayed exactly: trajectory i of the group uses row i mod R, call t entry t mod len

Optional ``"scale"`` in the JSON multiplies the profile; the ``scale`` argument multiplies on top.
This module imports only the standard library (and, lazily, ``rollout.agent_loop`` for :class:`LatencyTools`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
from typing import Any, Sequence

__all__ = [
    "LatencyProfile", "NoLatency", "ConstantLatency", "UniformLatency", "LognormalLatency", "TraceLatency",
    "BUILTIN_PROFILES", "get_latency_profile", "load_latency_profile", "profile_from_spec", "trajectory_latencies",
    "LatencyTools", "load_profile", "call_coordinates", "profile_delay_fn",
]

_U64 = (1 << 64) - 1
_GROUP, _TRAJ, _CALL = 1, 2, 3  # stream tags of the counter-based draws


def _mix(*parts: int) -> int:
    """A 63-bit seed from integer coordinates (splitmix64; the same mixer as ``rollout.engine.derive_seed``)."""
    x = 0
    for p in parts:
        x = (x + 0x9E3779B97F4A7C15 + (int(p) & _U64)) & _U64
        x ^= x >> 30
        x = (x * 0xBF58476D1CE4E5B9) & _U64
        x ^= x >> 27
        x = (x * 0x94D049BB133111EB) & _U64
        x ^= x >> 31
    return x >> 1


def _rng_at(*parts: int) -> random.Random:
    return random.Random(_mix(*parts))


@dataclasses.dataclass(frozen=True)
class LatencyProfile:
    """Base of all profiles: ``sample`` = ``scale`` × the kind's draw (see the module docstring)."""

    scale: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not (self.scale >= 0 and math.isfinite(self.scale)):
            raise ValueError(f"scale must be a finite number >= 0, got {self.scale}")

    def sample(self, group_index: int, traj_index: int, turn: int, rng: random.Random | None = None) -> float:
        """Seconds of tool call ``turn`` of trajectory ``traj_index`` in group ``group_index``."""
        if self.scale == 0:
            return 0.0
        return self.scale * max(0.0, float(self._draw(int(group_index), int(traj_index), int(turn), rng)))

    def _call_rng(self, g: int, i: int, t: int, rng: random.Random | None) -> random.Random:
        return rng if rng is not None else _rng_at(self.seed, _CALL, g, i, t)

    def _draw(self, g: int, i: int, t: int, rng: random.Random | None) -> float:  # pragma: no cover - abstract
        raise NotImplementedError

    def with_scale(self, scale: float) -> "LatencyProfile":
        return dataclasses.replace(self, scale=self.scale * scale)

    def for_step(self, step: int) -> "LatencyProfile":
        """The same profile with fresh draws for training step ``step`` (group factors included): use it when group
        indices restart at 0 every step, so group 0 is not the same slow group in every step."""
        return dataclasses.replace(self, seed=_mix(self.seed, 0x57E9, step))


@dataclasses.dataclass(frozen=True)
class NoLatency(LatencyProfile):
    def _draw(self, g, i, t, rng):
        return 0.0


@dataclasses.dataclass(frozen=True)
class ConstantLatency(LatencyProfile):
    seconds: float = 0.0

    def _draw(self, g, i, t, rng):
        return self.seconds


@dataclasses.dataclass(frozen=True)
class UniformLatency(LatencyProfile):
    """U[a, b] per call, independent."""

    a: float = 0.5
    b: float = 1.5

    def __post_init__(self):
        super().__post_init__()
        if not 0 <= self.a <= self.b:
            raise ValueError(f"uniform latency needs 0 <= a <= b, got a={self.a}, b={self.b}")

    def _draw(self, g, i, t, rng):
        return self._call_rng(g, i, t, rng).uniform(self.a, self.b)


@dataclasses.dataclass(frozen=True)
class LognormalLatency(LatencyProfile):
    """Lognormal per call with a shared group factor (``group_corr``) and trajectory factor (``traj_corr``)."""

    mu: float = 0.0
    sigma: float = 1.0
    group_corr: float = 0.0
    traj_corr: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        if self.sigma < 0:
            raise ValueError(f"sigma must be >= 0, got {self.sigma}")
        for k in ("group_corr", "traj_corr"):
            if not 0.0 <= getattr(self, k) <= 1.0:
                raise ValueError(f"{k} must be in [0, 1], got {getattr(self, k)}")

    def _draw(self, g, i, t, rng):
        rho, tau = self.group_corr, self.traj_corr
        z_group = _rng_at(self.seed, _GROUP, g).gauss(0.0, 1.0) if rho > 0 else 0.0
        z_traj = _rng_at(self.seed, _TRAJ, g, i).gauss(0.0, 1.0) if tau > 0 else 0.0
        z_call = self._call_rng(g, i, t, rng).gauss(0.0, 1.0)
        z = math.sqrt(rho) * z_group + math.sqrt(1 - rho) * (math.sqrt(tau) * z_traj + math.sqrt(1 - tau) * z_call)
        return math.exp(self.mu + self.sigma * z)

    @property
    def mean(self) -> float:
        return self.scale * math.exp(self.mu + self.sigma**2 / 2)

    def quantile(self, q: float) -> float:
        return self.scale * math.exp(self.mu + self.sigma * _norm_ppf(q))


@dataclasses.dataclass(frozen=True)
class TraceLatency(LatencyProfile):
    """Replay of recorded latencies: a flat pool, or per-group pools / exact per-trajectory rows."""

    latencies: tuple[float, ...] = ()
    groups: tuple[tuple[str, Any], ...] = ()  # (key, flat tuple | tuple of per-trajectory tuples)

    def __post_init__(self):
        super().__post_init__()
        if bool(self.latencies) == bool(self.groups):
            raise ValueError("a trace needs exactly one of 'latencies' (a non-empty list) or 'groups'")
        for key, v in self.groups:
            if not v or (isinstance(v[0], tuple) and not all(v)):
                raise ValueError(f"trace group {key!r} is empty")

    def _draw(self, g, i, t, rng):
        if self.latencies:
            pool = self.latencies
        else:
            _, pool = self.groups[g % len(self.groups)]
            if isinstance(pool[0], tuple):  # exact replay: row = trajectory, column = call
                row = pool[i % len(pool)]
                return row[t % len(row)]
        return pool[self._call_rng(g, i, t, rng).randrange(len(pool))]


def _norm_ppf(q: float) -> float:
    """Standard normal quantile (bisection on erf; accurate to ~1e-12, plenty for tests and docs)."""
    if not 0 < q < 1:
        raise ValueError(f"quantile level must be in (0, 1), got {q}")
    lo, hi = -40.0, 40.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if 0.5 * (1 + math.erf(mid / math.sqrt(2))) < q:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


BUILTIN_PROFILES: dict[str, dict] = {
    "none": {"kind": "none"},
    "uniform": {"kind": "uniform", "a": 0.5, "b": 1.5},
    "swe-like": {"kind": "lognormal", "mu": 0.0, "sigma": 1.0, "group_corr": 0.8},
    "independent": {"kind": "lognormal", "mu": 0.0, "sigma": 1.0, "group_corr": 0.0},
}


def _floats(xs, where: str) -> tuple[float, ...]:
    out = tuple(float(x) for x in xs)
    if not all(math.isfinite(x) and x >= 0 for x in out):
        raise ValueError(f"{where}: latencies must be finite numbers >= 0")
    return out


def profile_from_spec(spec: Any, *, scale: float = 1.0, seed: int = 0) -> LatencyProfile:
    """A profile from a parsed JSON spec (dict or bare list, see the module docstring)."""
    if isinstance(spec, list):
        spec = {"kind": "trace", "latencies": spec}
    if not isinstance(spec, dict) or "kind" not in spec:
        raise ValueError(f"a latency spec is a list or an object with 'kind', got {type(spec).__name__}")
    spec = dict(spec)
    kind = spec.pop("kind")
    if kind in ("swe-like", "independent"):  # built-in names as kinds: their parameters, overridable
        spec = {**BUILTIN_PROFILES[kind], **spec}
        kind = spec.pop("kind")
    scale = float(spec.pop("scale", 1.0)) * scale
    seed = int(spec.pop("seed", seed))
    allowed = {
        "none": (), "constant": ("seconds",), "uniform": ("a", "b"),
        "lognormal": ("mu", "sigma", "group_corr", "traj_corr"), "trace": ("latencies", "groups"),
    }
    if kind not in allowed:
        raise ValueError(f"unknown latency kind {kind!r}; known: {sorted(allowed) + sorted(BUILTIN_PROFILES)}")
    extra = set(spec) - set(allowed[kind])
    if extra:
        raise ValueError(f"latency kind {kind!r} does not take {sorted(extra)}")
    if kind == "none":
        return NoLatency(scale=scale, seed=seed)
    if kind == "constant":
        return ConstantLatency(scale=scale, seed=seed, seconds=float(spec.get("seconds", 0.0)))
    if kind == "uniform":
        return UniformLatency(scale=scale, seed=seed, **{k: float(v) for k, v in spec.items()})
    if kind == "lognormal":
        return LognormalLatency(scale=scale, seed=seed, **{k: float(v) for k, v in spec.items()})
    if "groups" in spec:
        if not isinstance(spec["groups"], dict) or not spec["groups"]:
            raise ValueError("trace 'groups' must be a non-empty object {key: [latencies]}")
        groups = []
        for key, v in spec["groups"].items():
            nested = bool(v) and isinstance(v[0], (list, tuple))
            val = tuple(_floats(r, f"group {key!r}") for r in v) if nested else _floats(v, f"group {key!r}")
            groups.append((str(key), val))
        return TraceLatency(scale=scale, seed=seed, groups=tuple(groups))
    return TraceLatency(scale=scale, seed=seed, latencies=_floats(spec.get("latencies", ()), "trace"))


def get_latency_profile(name: str, *, scale: float = 1.0, seed: int = 0) -> LatencyProfile:
    """A built-in profile by name (``none``, ``uniform``, ``swe-like``, ``independent``)."""
    if name not in BUILTIN_PROFILES:
        raise KeyError(f"unknown latency profile {name!r}; built-ins: {', '.join(BUILTIN_PROFILES)} (or a .json file)")
    return profile_from_spec(BUILTIN_PROFILES[name], scale=scale, seed=seed)


def load_latency_profile(name_or_path: str, *, scale: float = 1.0, seed: int = 0) -> LatencyProfile:
    """``--latency-profile``: a built-in name or the path of a JSON file (schema in the module docstring)."""
    if name_or_path in BUILTIN_PROFILES:
        return get_latency_profile(name_or_path, scale=scale, seed=seed)
    if not os.path.exists(name_or_path):
        raise FileNotFoundError(
            f"--latency-profile {name_or_path!r} is neither a built-in ({', '.join(BUILTIN_PROFILES)}) nor a file")
    with open(name_or_path) as f:
        return profile_from_spec(json.load(f), scale=scale, seed=seed)


load_profile = load_latency_profile  # short alias (runtime.worker)


def trajectory_latencies(
    profile: LatencyProfile, num_groups: int, group_size: int, *, calls_per_traj: int | Sequence[int] = 1,
    group_offset: int = 0,
) -> list[list[float]]:
    """Total tool seconds of every trajectory: ``out[g][i] = Σ_t profile.sample(group_offset + g, i, t)``.

    ``calls_per_traj`` is one count for all trajectories or a flat list of ``num_groups · group_size`` counts (row
    major). ``group_offset`` shifts the group indices (e.g. ``step · num_groups`` for a fresh set each step).
    """
    n = num_groups * group_size
    counts = [calls_per_traj] * n if isinstance(calls_per_traj, int) else list(calls_per_traj)
    if len(counts) != n or min(counts, default=0) < 0:
        raise ValueError(f"calls_per_traj: need one count >= 0 or {n} of them")
    return [
        [sum(profile.sample(group_offset + g, i, t) for t in range(counts[g * group_size + i]))
         for i in range(group_size)]
        for g in range(num_groups)
    ]


# ------------------------------------------------------------------------------------------------ agent-loop tools
def call_coordinates(traj, turn: int, *, group_size: int = 1) -> tuple[int, int, int]:
    """(group_index, traj_index, turn) of a tool call: ``traj.metadata["group"]`` / ``["index"]`` when present,
    else ``divmod(traj.index, group_size)``."""
    md = getattr(traj, "metadata", None) or {}
    g0, i0 = divmod(int(traj.index), group_size)
    return int(md.get("group", g0)), int(md.get("index", i0)), int(turn)


def profile_delay_fn(profile: "LatencyProfile", group_size: int = 1):
    """``delay_fn(traj, turn) -> seconds`` for ``agent_loop.RegistryTools``."""
    return lambda traj, turn: profile.sample(*call_coordinates(traj, turn, group_size=group_size))


class LatencyTools:
    """Agent-loop tool executor: the sandboxed tool registry (``agent_loop.RegistryTools``) with a per-call real delay
    from a profile (it sleeps inside the sandboxed child, so it is real wall-clock latency), recording every delay.

    Coordinates of a call: :func:`call_coordinates` of the ``(trajectory, turn)`` the agent loop publishes in
    ``agent_loop.CURRENT_CALL``; outside a rollout there is no delay. Equivalent to
    ``RegistryTools(sandbox, delay_fn=profile_delay_fn(profile, group_size))`` plus the record in ``delays``.
    """

    def __init__(self, profile: LatencyProfile, *, group_size: int = 1, sandbox=None):
        from megatron_tsync.rollout.agent_loop import RegistryTools

        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        self.profile = profile
        self.group_size = group_size
        self.delays: list[tuple[int, int, int, float]] = []  # (group, traj, turn, seconds) of every call
        self._inner = RegistryTools(sandbox, delay_fn=self._delay)

    def _delay(self, traj, turn: int) -> float:
        g, i, t = call_coordinates(traj, turn, group_size=self.group_size)
        seconds = self.profile.sample(g, i, t)
        self.delays.append((g, i, t, seconds))
        return seconds

    async def __call__(self, turn_text: str):
        return await self._inner(turn_text)
