"""The policy registry: every eviction method under one name.

Adding a method: write its :class:`~kvevict.policies.base.Policy` subclass in a file of
this package and add the class to ``_CLASSES`` below.
"""

from __future__ import annotations

from kvevict.policies.base import Policy, Requirements, Signals, group_reduce
from kvevict.policies.epikv import AttnXHS, BandAdaptive, EpiKV, HSVariance
from kvevict.policies.h2o import H2O
from kvevict.policies.kvvar import KVKeyVariance, KVValueVariance, LagKV, LagKVDecode
from kvevict.policies.lazyeviction import LazyEviction
from kvevict.policies.raas import RaaS
from kvevict.policies.rkv import RKV
from kvevict.policies.simple import Full, KNorm, Random, StreamingLLM
from kvevict.policies.snapkv import SnapKV
from kvevict.policies.thinkv import SegmentHS, ThinKV
from kvevict.policies.tova import TOVA

_CLASSES: tuple[type[Policy], ...] = (
    Full,
    Random,
    KNorm,
    StreamingLLM,
    TOVA,
    H2O,
    SnapKV,
    LazyEviction,
    RaaS,
    RKV,
    HSVariance,
    EpiKV,
    BandAdaptive,
    KVKeyVariance,
    KVValueVariance,
    LagKVDecode,
    LagKV,
    ThinKV,
    AttnXHS,
    SegmentHS,
)
POLICIES: dict[str, type[Policy]] = {cls.name: cls for cls in _CLASSES}


def list_policies() -> list[str]:
    """Names of every registered policy."""
    return list(POLICIES)


def describe_policies() -> list[tuple[str, str]]:
    """``(name, one-line summary)`` of every registered policy."""
    return [(name, cls.summary) for name, cls in POLICIES.items()]


def make_policy(name: str, **params: object) -> Policy:
    """Build a registered policy by name, e.g. ``make_policy("snapkv", window=16)``."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known policies: {', '.join(POLICIES)}") from None
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
