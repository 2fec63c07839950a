"""``ConfigError`` and the plain-dict round trip every section shares (``to_dict`` / ``from_dict``, JSON and YAML).

Torch dtypes become their names (``"float32"``) and non-finite floats the strings ``"inf"`` / ``"-inf"``. The sections
owned by torch-importing modules (:data:`_FOREIGN`) are loaded on first use, so importing this package does not
import torch. Standard library only.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import re
import types
import typing
from typing import Any, Mapping

class ConfigError(ValueError):
    """An invalid configuration. ``fields`` are the dotted paths (in ``TrainConfig``) of the values at fault."""

    def __init__(self, message: str, *fields: str):
        super().__init__(message)
        self.fields = tuple(fields)


def _check(ok: bool, message: str, *fields: str) -> None:
    if not ok:
        raise ConfigError(message, *fields)


# Sections owned by modules that import torch: loaded on first use.
_FOREIGN = {
    "PrecisionConfig": "megatron_tsync.model.builder",
    "OptimConfig": "megatron_tsync.training.optimizer",
    "LearnerConfig": "megatron_tsync.training.learner",
    "LossConfig": "megatron_tsync.training.stream_fb",
    "PolicyLossConfig": "megatron_tsync.algorithms.policy_loss",
    "RewardSpec": "megatron_tsync.algorithms.streamability",
}


def _foreign(name: str) -> type:
    return getattr(importlib.import_module(_FOREIGN[name]), name)


def _to_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # "inf", "-inf", "nan"
    if isinstance(value, (list, tuple)):
        return [_to_plain(v) for v in value]
    if type(value).__name__ == "dtype" and type(value).__module__ == "torch":
        return str(value).removeprefix("torch.")
    return value


def _type_hints(cls: type) -> dict[str, Any]:
    """The field types of ``cls``; the lazily loaded sections (``TrainConfig``'s precision, optim, learner) are
    imported only when its annotations name them, so a rollout worker's ``RolloutConfig.from_dict`` stays torch-free."""
    try:
        return typing.get_type_hints(cls)
    except NameError:
        return typing.get_type_hints(cls, localns={name: _foreign(name) for name in _FOREIGN})


def _from_plain(cls: type, data: Any, path: str) -> Any:
    where = path or "config"
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where} must be a mapping, got {type(data).__name__}", *([path] if path else []))
    hints = _type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in names:
            raise ConfigError(f"unknown key {_join(path, str(key))!r} in {where} (known: {', '.join(names)})")
    kwargs = {k: _coerce(v, hints[k], _join(path, k)) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:  # a reused section's own validation: name its fields mentioned
        msg = str(e)
        mentioned = [_join(path, n) for n in names if re.search(rf"\b{re.escape(n)}\b", msg)]
        raise ConfigError(msg, *(mentioned or [path])) from e


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Convert a plain value to the field type ``tp`` (dataclass, dtype, float, tuple); type-check scalars."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        non_none = [t for t in options if t is not type(None)]
        tp = non_none[0] if len(non_none) == 1 else tp
    if dataclasses.is_dataclass(tp):
        return _from_plain(tp, value, path)
    if getattr(tp, "__module__", "") == "torch" and getattr(tp, "__name__", "") == "dtype":
        import torch

        dtype = getattr(torch, str(value).removeprefix("torch."), None) if isinstance(value, str) else value
        _check(isinstance(dtype, torch.dtype), f"{path} must name a torch dtype, got {value!r}", path)
        return dtype
    if tp is float:
        if isinstance(value, str) and value.strip().lower() in ("inf", "-inf", "+inf", "nan"):
            return float(value)
        _check(isinstance(value, (int, float)) and not isinstance(value, bool),
               f"{path} must be a number, got {value!r}", path)
        return float(value)
    if tp is int:
        _check(isinstance(value, int) and not isinstance(value, bool), f"{path} must be an integer, got {value!r}",
               path)
    elif tp is bool:
        _check(isinstance(value, bool), f"{path} must be true or false, got {value!r}", path)
    elif tp is str:
        _check(isinstance(value, str), f"{path} must be a string, got {value!r}", path)
    elif typing.get_origin(tp) is tuple and isinstance(value, list):
        return tuple(value)
    return value
