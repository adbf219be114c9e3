"""Crontab fields as Celery's ``crontab`` accepts them, expanded to sets of ints."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final, TypeAlias

__all__ = ["FIELDS", "Cronspec", "FieldRange", "parse_field"]

# What one crontab field may be: 5, "*/15", "mon-fri", "1,2,10-12", or an iterable of ints.
Cronspec: TypeAlias = "int | str | Iterable[int]"


@dataclass(frozen=True)
class FieldRange:
    """The values a field takes: ``*`` expands to ``low..high``; ``alias_high`` is accepted as well.

    day_of_week accepts 7 for Sunday (cron's convention; Celery itself stops at 6), folded to 0.
    """

    name: str
    low: int
    high: int
    names: tuple[str, ...] = ()  # full English names; names[i] has the value low + i
    alias_high: int | None = None


_DAY_NAMES = ("sunday", "monday", "tuesday", "wednesday", "thursday", "friday", "saturday")
_MONTH_NAMES = (
    "january", "february", "march", "april", "may", "june",
    "july", "august", "september", "october", "november", "december",
)  # fmt: skip

FIELDS: Final = {
    "minute": FieldRange("minute", 0, 59),
    "hour": FieldRange("hour", 0, 23),
    "day_of_week": FieldRange("day_of_week", 0, 6, _DAY_NAMES, alias_high=7),
    "day_of_month": FieldRange("day_of_month", 1, 31),
    "month_of_year": FieldRange("month_of_year", 1, 12, _MONTH_NAMES),
}


def parse_field(field: str, spec: Cronspec) -> frozenset[int]:
    """Expand one field's spec to the set of values it matches.

    Args:
        field: one of ``FIELDS`` (``"minute"``, ``"hour"``, ``"day_of_week"``, ...).
        spec: an int, a string (``"*"``, ``"*/15"``, ``"1-5"``, ``"1,2,10-12"``, ``"0-59/10"``,
            ``"mon-fri"``, ``"jan-mar"``; a range whose end is below its start wraps round, as in
            Celery: hour ``"22-2"`` is 22, 23, 0, 1, 2), or an iterable of ints.

    Returns:
        The matching values; for day_of_week 0 is Sunday and 7 is folded into 0.

    Raises:
        ValueError: a value out of range, an unknown name, a bad step or an empty spec; the message
            names the field.
        TypeError: a spec of another type (a float, None, an iterable of non-ints).
    """
    rng = FIELDS[field]
    if isinstance(spec, bool):
        raise TypeError(f"crontab {field}: {spec!r} is a bool; give an int, a string or a list of ints")
    if isinstance(spec, int):
        values = {_checked(rng, spec, spec)}
    elif isinstance(spec, str):
        values = _parse_text(rng, spec)
    elif isinstance(spec, Iterable):
        values = set()
        for item in spec:
            if isinstance(item, bool) or not isinstance(item, int):
                raise TypeError(f"crontab {field}: {item!r} in {spec!r} is not an int")
            values.add(_checked(rng, item, spec))
    else:
        raise TypeError(
            f"crontab {field}: {spec!r} ({type(spec).__name__}) is not an int, a string or a list of ints"
        )
    if not values:
        raise ValueError(f"crontab {field}: {spec!r} matches nothing; use '*' for every {field}")
    if rng.alias_high is not None and rng.alias_high in values:
        values.discard(rng.alias_high)
        values.add(rng.low)
    return frozenset(values)


def _checked(rng: FieldRange, value: int, spec: object) -> int:
    top = rng.alias_high if rng.alias_high is not None else rng.high
    if not rng.low <= value <= top:
        raise ValueError(f"crontab {rng.name}: {value} in {spec!r} is out of range {rng.low}-{top}")
    return value


def _parse_text(rng: FieldRange, spec: str) -> set[int]:
    values: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        if not part:
            raise ValueError(f"crontab {rng.name}: {spec!r} has an empty part between commas")
        values.update(_parse_part(rng, part, spec))
    return values


def _parse_part(rng: FieldRange, part: str, spec: str) -> list[int]:
    """``*``, ``*/n``, ``a``, ``a-b`` or ``a-b/n`` (``a/n`` alone is not Celery's: say ``a-max/n``)."""
    base, slash, step_text = part.partition("/")
    step = 1
    if slash:
        step = _step(rng, step_text, spec)
    if base == "*":
        values = list(range(rng.low, rng.high + 1))
    elif "-" in base.lstrip("-"):
        first_text, _, last_text = base.partition("-")
        values = _range(rng, _number(rng, first_text, spec), _number(rng, last_text, spec))
    elif slash:
        top = rng.alias_high if rng.alias_high is not None else rng.high
        raise ValueError(
            f"crontab {rng.name}: {part!r} in {spec!r} steps from a single value; "
            f"write a range such as '{base}-{top}/{step_text}' or '*/{step_text}'"
        )
    else:
        values = [_number(rng, base, spec)]
    return values[::step]


def _step(rng: FieldRange, text: str, spec: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise ValueError(f"crontab {rng.name}: step {text!r} in {spec!r} must be a whole number from 1")
    return int(text)


def _range(rng: FieldRange, first: int, last: int) -> list[int]:
    if last >= first:
        return list(range(first, last + 1))
    # Celery wraps round: hour "22-2" is 22, 23, 0, 1, 2; day_of_week "fri-mon" is 5, 6, 0, 1.
    return list(range(first, rng.high + 1)) + list(range(rng.low, last + 1))


def _number(rng: FieldRange, text: str, spec: str) -> int:
    text = text.strip()
    if text.isdigit():
        return _checked(rng, int(text), spec)
    lowered = text.lower()
    if rng.names and len(lowered) >= 3:
        # "mon", "monday", "tues", "thurs", "sept": a prefix of the full name, three letters or more.
        for index, name in enumerate(rng.names):
            if name.startswith(lowered):
                return rng.low + index
    if rng.names:
        examples = ", ".join(name[:3] for name in rng.names[:3])
        hint = f"a number or a name ({examples}, ...)"
    else:
        hint = f"a number {rng.low}-{rng.high}"
    raise ValueError(f"crontab {rng.name}: {text!r} in {spec!r} is not {hint}")
