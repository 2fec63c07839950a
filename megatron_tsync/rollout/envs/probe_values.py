"""One probe value on the wire: the untrusted child's encoder and the trusted side's bounded decoder.

The child (``probes.PROBE_RUNTIME``) encodes a plain-data value (exact types ``None bool int float str bytes list
tuple set dict``) as JSON: scalars as themselves or as a string behind a one-letter tag, containers as a list behind
one::

    None, True, False                null, true, false
    "text" / 12 / 1.5 / b"\x01"      "stext" / "i12" / "f1.5" / "b01"
    list / tuple / set               ["l", x, ...] / ["t", x, ...] / ["s", x, ...]
    dict                             ["d", k1, v1, k2, v2, ...]

The trusted side (:func:`decode`) parses it in one pass, linear in its size: JSON numbers and constants other than
null / true / false are refused before any conversion; at most :data:`MAX_DEPTH` levels; at most a shared element
budget per report; ints of at most :data:`MAX_INT_DIGITS` digits; finite floats only. It returns built-in data, except
that a **set element or dict key is its key text** (:func:`key`): a str made of a secret per-process salt and a
canonical text of the value. Python's int hash is not randomised (every multiple of 2**61 - 1 hashes to 0), so a set
of such ints costs quadratic time to build: ``ast.literal_eval`` of a 1 MiB set literal took ~28 s of the worker's
CPU. A key is hashed with the process's keyed str hash, behind a salt the child never sees: nothing it can aim at.

Equality is unchanged: two plain values are equal under Python's ``==`` exactly when their key texts are (``True``,
``1`` and ``1.0`` share one; ``0.5`` and ``1`` do not), so sets, dict keys and the comparisons in
``probes.Expect.holds`` behave as they did on Python sets and dicts of the values; :func:`canon` brings a trusted value
(a test's literal, a generator's expected value) into the same form before it is compared. The salt is this
process's: a decoded value is never sent to another process (none is: the spec cache is per process).
Standard library only.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

__all__ = ["ENCODER_SRC", "Budget", "canon", "decode", "encode", "key", "MAX_DEPTH", "MAX_INT_DIGITS"]

MAX_DEPTH = 32
"""Levels of nesting decoded (the child refuses values nested deeper than 31)."""
MAX_INT_DIGITS = 4300
"""CPython's default ``sys.get_int_max_str_digits()``: the child's ``str()`` of a longer int fails (as its ``repr``
did before), and the decoder never converts a longer digit string whatever this process's own limit is."""

# The child's side, exec'd in the child as part of PROBE_RUNTIME (json imported there) and here for `encode`.
ENCODER_SRC = r'''
_TAGS = {list: "l", tuple: "t", set: "s"}


def _enc(v, depth=0):
    if depth > 30:
        raise ValueError("too deep")
    t = type(v)
    if v is None or t is bool:
        return v
    if t is str:
        return "s" + v
    if t is int:
        return "i" + str(v)
    if t is float:
        return "f" + repr(v)
    if t is bytes:
        return "b" + v.hex()
    if t in _TAGS:
        return [_TAGS[t]] + [_enc(x, depth + 1) for x in v]
    if t is dict:
        out = ["d"]
        for k, x in v.items():
            out += [_enc(k, depth + 1), _enc(x, depth + 1)]
        return out
    raise TypeError(t.__name__)


def _encode(v):
    return json.dumps(_enc(v), separators=(",", ":"))
'''
_ns: dict = {"json": json}
exec(ENCODER_SRC, _ns)  # our own constant source: one encoder for the child and for this process's tests


def encode(value: Any) -> str:
    """The child's encoding of `value` (TypeError / ValueError for anything that is not plain data)."""
    return _ns["_encode"](value)


_SALT = secrets.token_hex(16)
_NUMERIC = frozenset("0123456789+-.e")


def _refuse(s: str) -> Any:
    raise ValueError("not a probe value")


_loads = json.JSONDecoder(parse_int=_refuse, parse_float=_refuse, parse_constant=_refuse).decode


class Budget:
    """Elements left to decode in one report (every value, container and item counts one)."""

    def __init__(self, elements: int):
        self.left = elements


def _key_parts(v: Any, out: list[str]) -> None:
    t = type(v)
    if v is None:
        out.append("N")
    elif t is bool or t is int:
        out.append(f"i{int(v):x};")
    elif t is float:
        out.append(f"i{int(v):x};" if v.is_integer() else f"f{v.hex()};")
    elif t is str:
        out.append("s%d:" % len(v))  # %-format: an f-string here would spell the trajectory-id format (test_transport_ids)
        out.append(v)
    elif t is bytes:
        out.append(f"b{len(v)}:{v.hex()}")
    elif t is tuple:
        out.append(f"t{len(v)}:")
        for x in v:
            _key_parts(x, out)
    elif t is frozenset:  # (a set looked up in a set is looked up as one)
        texts = sorted(key(x) for x in v)
        out.append(f"S{len(texts)}:")
        out.extend(texts)
    else:
        raise TypeError(f"unhashable type: '{t.__name__}'")


def key(value: Any) -> str:
    """The key text of a hashable plain value (see the module docstring); a key text is its own key. TypeError for
    an unhashable value (list, set, dict), as a Python set would raise. Linear in the size of `value`."""
    t = type(value)
    if t is int:  # the common cases, inline
        return f"{_SALT}i{value:x};"
    if t is str:
        return value if value.startswith(_SALT) else f"{_SALT}s{len(value)}:{value}"
    out = [_SALT]
    _key_parts(value, out)
    return "".join(out)


def canon(x: Any) -> Any:
    """`x` with every set / frozenset a set of :func:`key` texts and every dict keyed by them (recursively through
    lists, tuples and dict values); anything else as it is. Idempotent; linear in the size of `x`."""
    t = type(x)
    if t is list or t is tuple:
        return t(canon(v) for v in x)
    if t is set or t is frozenset:
        return {key(v) for v in x}
    if t is dict:
        return {key(k): canon(v) for k, v in x.items()}
    return x


def _scalar(node: str) -> Any:
    tag, s = node[:1], node[1:]
    if tag == "s":
        return s
    try:
        if tag == "i" and len(s) <= MAX_INT_DIGITS + 1:
            return int(s)
        if tag == "f" and len(s) <= 40 and _NUMERIC.issuperset(s):
            f = float(s)
            if f - f == 0.0:  # finite: the old repr route never parsed 'inf' / 'nan' either
                return f
        if tag == "b":
            return bytes.fromhex(s)
    except ValueError:
        pass
    raise ValueError("malformed probe value")


def _dec(node: Any, depth: int, budget: Budget) -> Any:
    budget.left -= 1
    if budget.left < 0:
        raise ValueError("over the report's element budget")
    t = type(node)
    if t is str:
        return node[1:] if node[:1] == "s" else _scalar(node)
    if node is None or node is True or node is False:
        return node
    if t is not list or not node or depth >= MAX_DEPTH:
        raise ValueError("malformed probe value")
    tag = node[0]
    items = [_dec(node[i], depth + 1, budget) for i in range(1, len(node))]
    if tag == "l":
        return items
    if tag == "t":
        return tuple(items)
    if tag == "s":
        return {key(v) for v in items}
    if tag == "d" and len(items) % 2 == 0:
        return {key(items[i]): items[i + 1] for i in range(0, len(items), 2)}
    raise ValueError("malformed probe value")


def decode(text: str, budget: Budget) -> Any:
    """The value the child encoded in `text` (see the module docstring); ValueError for anything else, for nesting
    past :data:`MAX_DEPTH` and past `budget`. Linear in ``len(text)``."""
    try:
        node = _loads(text)
    except RecursionError:
        raise ValueError("probe value nested too deep") from None
    try:
        return _dec(node, 0, budget)
    except TypeError as e:  # an unhashable set element / dict key (a forged one: the child's own set cannot hold it)
        raise ValueError(f"malformed probe value ({e})") from None
