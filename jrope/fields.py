"""Config fields that declare their rules where they are declared.

A field's type is its annotation; `setting(...)` adds its range or choices and whether it defines
the result. `Declared` checks a section's fields against their declarations when it is built and
names every problem at once, a line each (`problems` checks plain values the same way):

    @dataclasses.dataclass(frozen=True)
    class OptimConfig(Declared):
        section = "opt"
        learning_rate: float = setting(gt=0)  # a finite number > 0
        warmup_steps: int = setting(0, ge=0)  # an integer in [0, 2**31 - 1]

Integers stay within int32 unless a bound says otherwise (steps, lengths and sizes become int32
arrays and array dimensions); floats must be finite; a Literal annotation lists its choices.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
import types
import typing
from collections.abc import Mapping
from typing import Any, ClassVar

INT32 = (-(2**31), 2**31 - 1)
# What a change of a field's value means to a saved run (jrope.train.checkpoints):
RESULT = "result"  # another task or model: refused on resume, in eval.py and in compare
PARAMETERS = "parameters"  # the saved parameters' shapes or meaning: refused even when accepted


def setting(
    default: Any = dataclasses.MISSING,
    *,
    ge: Any = None,
    gt: Any = None,
    le: Any = None,
    lt: Any = None,
    choices: tuple | None = None,
    distinct: bool = False,
    nonempty: bool = False,
    divides: str | None = None,
    defines: str | None = None,
) -> Any:
    """A dataclass field with its rules. A bound is a number or another field's name; a tuple's
    bounds hold for each item; `divides`: the field whose value this one divides; `defines`:
    RESULT or PARAMETERS."""
    rules = dict(ge=ge, gt=gt, le=le, lt=lt, choices=choices, divides=divides, defines=defines)
    rules = {key: value for key, value in rules.items() if value is not None}
    rules.update({key: True for key, on in (("distinct", distinct), ("nonempty", nonempty)) if on})
    return dataclasses.field(default=default, metadata=rules)


class Declared:
    """A frozen config section whose fields are checked against their declarations when built:
    ValueError with every problem, a line each naming `<section>.<key>`."""

    section: ClassVar[str] = ""

    def __post_init__(self):
        values = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        if found := problems(type(self), values):
            raise ValueError("\n".join(found))


def problems(cls: type, values: Mapping[str, Any]) -> list[str]:
    """A line per value in `values` that breaks its field's declaration in dataclass `cls`."""
    hints, prefix = typing.get_type_hints(cls), f"{cls.section}." if cls.section else ""
    found = []
    for field in dataclasses.fields(cls):
        if field.name in values:
            value, rules = values[field.name], dict(field.metadata)
            bounds = {k: values.get(v, v) if isinstance(v, str) else v for k, v in rules.items()
                      if k in ("ge", "gt", "le", "lt")}  # fmt: skip
            line = _problem(hints[field.name], value, {**rules, **bounds}, values)
            if line:
                found.append(f"{prefix}{field.name}{line}")
    return found


def defines(cls: type, key: str) -> str | None:
    """RESULT, PARAMETERS or None: what field `key` of dataclass `cls` declares it defines."""
    field = {f.name: f for f in dataclasses.fields(cls)}.get(key)
    return field and field.metadata.get("defines")


def did_you_mean(word: str, choices, prefix: str = "") -> str:
    """'; did you mean <prefix><the closest choice>?', or '' when none is close."""
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1)
    return f"; did you mean {prefix}{close[0]}?" if close else ""


def flat_keys(tree: Mapping[str, Any], prefix: str = "") -> list[str]:
    """The dotted keys of a nested dict's leaves."""
    keys = []
    for key, value in tree.items():
        if isinstance(value, Mapping):
            keys += flat_keys(value, f"{prefix}{key}.")
        else:
            keys.append(f"{prefix}{key}")
    return keys


def _problem(kind: Any, value: Any, rules: dict, values: Mapping[str, Any]) -> str | None:
    """' must be <what is allowed>, got <value>.' (or ' = <value> is not one of ...'), or None."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        kind = next(arg for arg in args if arg is not type(None))
        origin, args = typing.get_origin(kind), typing.get_args(kind)
    choices = args if origin is typing.Literal else rules.get("choices")
    if choices is not None:
        if any(type(value) is type(choice) and value == choice for choice in choices):
            return None
        return f" = {value!r} is not one of {tuple(choices)}{did_you_mean(value, choices)}."
    if origin is tuple:
        item_kind = args[0] if len(args) == 2 and args[1] is Ellipsis else Any
        allowed = f"a {'non-empty ' * ('nonempty' in rules)}tuple of " + (
            f"{'distinct ' * ('distinct' in rules)}{_allowed(item_kind, rules, plural=True)}"
        )
        holds = isinstance(value, tuple) and (value or "nonempty" not in rules)
        holds = holds and not any(_problem(item_kind, item, rules, values) for item in value)
        holds = holds and ("distinct" not in rules or len(set(value)) == len(value))
        return None if holds else f" must be {allowed}, got {value!r}."
    if kind in (int, float) and not _holds(kind, value, rules):
        return f" must be {_allowed(kind, rules)}, got {value!r}."
    if kind in (int, float) and "divides" in rules:
        other = values.get(rules["divides"])
        if isinstance(other, int) and other > 0 and other % value:  # else other's own problem
            return f" must divide {rules['divides']} = {other}, got {value!r}."
    if kind in (bool, str) and type(value) is not kind:
        return f" must be {_allowed(kind, rules)}, got {value!r}."
    return None


def _holds(kind: type, value: Any, rules: dict) -> bool:
    if kind is int and type(value) is not int:
        return False
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        return False
    low, high = INT32 if kind is int else (None, None)
    checks = [("ge", low, value.__ge__), ("gt", None, value.__gt__)]
    checks += [("le", high, value.__le__), ("lt", None, value.__lt__)]
    for name, implied, compare in checks:
        bound = rules.get(name, implied)
        if isinstance(bound, numbers.Real) and not compare(bound):
            return False
    return True


def _allowed(kind: Any, rules: dict, plural: bool = False) -> str:
    """What a value of `kind` under `rules` may be, e.g. 'an integer in [1, 2147483647]'."""
    if kind is bool:
        return "true or false"
    if kind is str:
        return "a string"
    if kind not in (int, float):
        return "values" if plural else "a value"
    low = rules.get("ge", rules.get("gt", INT32[0] if kind is int else None))
    high = rules.get("le", rules.get("lt", INT32[1] if kind is int else None))
    noun = ("integers" if plural else "an integer") if kind is int else (
        "finite numbers" if plural else "a finite number")  # fmt: skip
    if low is None and high is None:
        return noun
    if high is None:
        return f"{noun} {'>=' if 'ge' in rules or kind is int else '>'} {low}"
    if low is None:
        return f"{noun} {'<=' if 'le' in rules or kind is int else '<'} {high}"
    left = "[" if "ge" in rules or "gt" not in rules else "("
    right = "]" if "le" in rules or "lt" not in rules else ")"
    return f"{noun} in {left}{low}, {high}{right}"
