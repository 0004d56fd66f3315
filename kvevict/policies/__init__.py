"""The policy registry: every eviction method under one name.

Adding a method: write its :class:`~kvevict.policies.base.Policy` subclass in a file of
this package and add the class to ``_CLASSES`` below.
"""

from __future__ import annotations

from kvevict.policies.base import Policy, Requirements, Signals, group_reduce
from kvevict.policies.h2o import H2O
from kvevict.policies.lazyeviction import LazyEviction
from kvevict.policies.momentkv import MomentKV, MomentNC
from kvevict.policies.raas import RaaS
from kvevict.policies.rkv import RKV
from kvevict.policies.simple import Full, KNorm, Random, StreamingLLM
from kvevict.policies.snapkv import SnapKV
from kvevict.policies.tova import TOVA
from kvevict.policies.wrapper import PolicyWrapper

_CLASSES: tuple[type[Policy], ...] = (Full, Random, KNorm, StreamingLLM, TOVA, H2O, SnapKV, LazyEviction, RaaS, RKV)
_CLASSES += (MomentKV,)
POLICIES: dict[str, type[Policy]] = {cls.name: cls for cls in _CLASSES}
WRAPPERS: dict[str, type[PolicyWrapper]] = {cls.prefix: cls for cls in (MomentNC,)}
"""Wrappers built by name as ``"<prefix>+<policy>"``."""


def list_policies() -> list[str]:
    """Names of every registered policy."""
    return list(POLICIES)


def describe_policies() -> list[tuple[str, str]]:
    """``(name, one-line summary)`` of every registered policy."""
    return [(name, cls.summary) for name, cls in POLICIES.items()]


def make_policy(name: str, **params: object) -> Policy:
    """Build a registered policy by name, e.g. ``make_policy("snapkv", window=16)``, or a
    wrapped one, e.g. ``make_policy("moment-nc+h2o", order=0, sinks=2)`` (the wrapper's own
    parameters go to the wrapper, the rest to the inner policy)."""
    prefix, plus, inner = name.partition("+")
    if plus and prefix in WRAPPERS:
        wrapper = WRAPPERS[prefix]
        own = {key: params.pop(key) for key in wrapper.own_params if key in params}
        return wrapper(make_policy(inner, **params), **own)
    try:
        cls = POLICIES[name]
    except KeyError:
        wrappers = ", ".join(f"{prefix}+<policy>" for prefix in WRAPPERS)
        raise ValueError(
            f"unknown policy {name!r}; known policies: {', '.join(POLICIES)}; wrappers: {wrappers}"
        ) from None
    try:
        return cls(**params)
    except TypeError as err:
        raise ValueError(f"bad parameters for policy {name!r}: {err}") from None


__all__ = [
    "POLICIES",
    "Policy",
    "Requirements",
    "Signals",
    "describe_policies",
    "group_reduce",
    "list_policies",
    "make_policy",
]
