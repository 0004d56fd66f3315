"""Parameters of policy stages: default, what each accepts, and the error a bad value gets.

Every stage declares its parameters as a mapping ``name → Param``; the stage checks the
values it is built with (:meth:`~kvevict.policies.base.Stage.__init__`), so a bad value is
refused when the policy is made, naming the stage, the parameter and what it expects:
``snapkv: parameter 'window' expects an integer >= 1, got 'abc'``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType


@dataclass(frozen=True)
class Param:
    """One parameter of a stage.

    ``expects`` says in words what ``accepts`` allows (it is the error message); ``unset``,
    when given, allows ``None`` and says what it stands for (a default computed from the
    budget or the model). ``convert`` normalises an accepted value (e.g. a list to a tuple).
    """

    default: object
    expects: str
    accepts: Callable[[object], bool]
    unset: str | None = None
    convert: Callable[[object], object] | None = None

    def check(self, owner: str, name: str, value: object) -> object:
        """The value, checked (and converted); a ``ValueError`` naming ``owner`` otherwise."""
        if value is None and self.unset is not None:
            return None
        if not self.accepts(value):
            allowed = self.expects if self.unset is None else f"{self.expects}, or None ({self.unset})"
            raise ValueError(f"{owner}: parameter {name!r} expects {allowed}, got {value!r}")
        return value if self.convert is None else self.convert(value)


def declare(**params: Param) -> Mapping[str, Param]:
    """A stage's parameters, in the order they are listed (read-only)."""
    return MappingProxyType(params)


def is_integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def integer(default: int | None, *, low: int = 0, odd: bool = False, unset: str | None = None) -> Param:
    """An integer ``>= low`` (odd if ``odd``)."""
    return Param(
        default,
        f"{'an odd' if odd else 'an'} integer >= {low}",
        lambda v: is_integer(v) and v >= low and (not odd or v % 2 == 1),
        unset,
    )


RECENT_WINDOW = integer(None, unset="min(128, budget // 4)")
"""A recent window kept by methods that evict while decoding: None means ``min(128, budget // 4)``
(DESIGN §3), so the tokens a sequence just wrote are read before they can go."""

WRITTEN_WINDOW = integer(16)
"""The recent window of a score that reads no query (``keydiff``, ``qfilters``), which would otherwise
evict a token as soon as it is written: 16 tokens, the smallest screened that keeps needle answers
whole; ``min(128, B/4)`` also protects the context's last tokens, at the needles' expense
(docs/measurements.md)."""


def number(
    default: float | None,
    low: float,
    high: float | None = None,
    *,
    open_low: bool = False,
    open_high: bool = False,
    unset: str | None = None,
) -> Param:
    """A finite number in ``[low, high]`` (``open_*``: that end excluded; ``high=None``: no upper end)."""
    if high is None:
        expects = f"a number {'>' if open_low else '>='} {low:g}"
    else:
        expects = f"a number in {'(' if open_low else '['}{low:g}, {high:g}{')' if open_high else ']'}"

    def accepts(v: object) -> bool:
        if not is_number(v):
            return False
        above = v > low if open_low else v >= low
        below = high is None or (v < high if open_high else v <= high)
        return above and below

    return Param(default, expects, accepts, unset, float)


def choice(default: object, *options: object, unset: str | None = None) -> Param:
    """One of ``options``."""
    return Param(default, "one of " + ", ".join(map(repr, options)), lambda v: v in options, unset)


def flag(default: bool) -> Param:
    """``True`` or ``False`` (``true``/``false`` in a spec)."""
    return Param(default, "true or false", lambda v: isinstance(v, bool))


def layer_indices(count: int | None = None) -> Param:
    """``count`` decoder layer indices (any number if None); None: scaled from the model's depth."""
    shape = f"{count} layer indices" if count else "a list of layer indices"

    def accepts(v: object) -> bool:
        return (
            isinstance(v, (tuple, list))
            and bool(v)
            and (count is None or len(v) == count)
            and all(is_integer(i) and i >= 0 for i in v)
        )

    return Param(None, f"{shape} (integers >= 0)", accepts, "scaled from the model's depth", tuple)
