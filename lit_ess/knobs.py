"""One-line checks of numeric knobs where they are declared (a dataclass's __post_init__, an __init__).

    check("GRPO.clip_eps", 0.2, gt=0)            passes
    check("GRPO.clip_eps", -0.5, gt=0)           ValueError: GRPO.clip_eps must be > 0, got -0.5
    check("model.micro_batch.size", None, ge=1, integer=True, null=True)     passes (None has a meaning)

NaN and inf are refused everywhere, booleans too; `null=True` accepts None, which the knob's docstring
must give a meaning.
"""
from __future__ import annotations

import math
import numbers


def check(name: str, value, *, gt: float | None = None, ge: float | None = None, lt: float | None = None,
          le: float | None = None, integer: bool = False, null: bool = False, hint: str = "") -> None:
    """Raise ValueError("{name} must be {range}, got {value}{hint}") unless `value` is a finite number
    (an integer with `integer`) within the bounds given, or None with `null`."""
    if value is None and null:
        return
    number = isinstance(value, numbers.Real) and not isinstance(value, bool)
    finite = number and math.isfinite(value)
    if finite and (not integer or value == int(value)) and (gt is None or value > gt) and (ge is None or value >= ge) \
            and (lt is None or value < lt) and (le is None or value <= le):
        return
    raise ValueError(f"{name} must be {describe(gt, ge, lt, le, integer, finite or not number)}"
                     f"{' or null' if null else ''}, got {value!r}{hint}")


def describe(gt, ge, lt, le, integer: bool, finite: bool) -> str:
    """'> 0', 'in [0, 1)', 'an integer >= 1', 'a finite number > 0' (said to a NaN or inf)."""
    low = f"({gt}" if gt is not None else f"[{ge}" if ge is not None else None
    high = f"{lt})" if lt is not None else f"{le}]" if le is not None else None
    if low and high:
        bounds = f"in {low}, {high}"
    elif low:
        bounds = f"{'>' if gt is not None else '>='} {low[1:]}"
    elif high:
        bounds = f"{'<' if lt is not None else '<='} {high[:-1]}"
    else:
        bounds = ""
    kind = "an integer" if integer else "" if finite else "a finite number"
    return " ".join(part for part in (kind, bounds) if part) or "a finite number"


def plain(value):
    """`value` as plain values (numbers, strings, lists, dicts) that TensorBoard logs and a checkpoint's
    weights_only load reads: a dataclass as its fields, another object as its class path and attributes, a
    class or function by its path."""
    import dataclasses

    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, type) or callable(value) and hasattr(value, "__qualname__"):
        return f"{value.__module__}.{value.__qualname__}"
    path = f"{type(value).__module__}.{type(value).__qualname__}"
    if dataclasses.is_dataclass(value):
        return {"class_path": path, "init_args": {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    return {"class_path": path, "init_args": plain(dict(vars(value))) if hasattr(value, "__dict__") else repr(value)}
