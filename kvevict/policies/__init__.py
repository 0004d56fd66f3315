"""The policy registry: every eviction method under one name.

Adding a method: write its :class:`~kvevict.policies.base.Policy` subclass in a file of
this package and add the class to ``_CLASSES`` below; a wrapper (a
:class:`~kvevict.policies.base.Wrapper` that changes selection or budgets of any policy)
goes in ``_WRAPPERS`` and composes by name: ``critical+adakv+snapkv``.
"""

from __future__ import annotations

from kvevict.policies.allocation import AdaKV, HeadKV, PyramidKV
from kvevict.policies.base import Policy, Requirements, Signals, Wrapper, group_reduce
from kvevict.policies.critical import Critical
from kvevict.policies.epikv import AttnXHS, BandAdaptive, EpiKV, HSVariance
from kvevict.policies.h2o import H2O
from kvevict.policies.kvvar import KVKeyVariance, KVValueVariance, LagKV, LagKVDecode
from kvevict.policies.lazyeviction import LazyEviction
from kvevict.policies.momentkv import MomentKV, MomentNC
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
    MomentKV,
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
_WRAPPERS: tuple[type[Wrapper], ...] = (Critical, AdaKV, PyramidKV, HeadKV, MomentNC)
WRAPPERS: dict[str, type[Wrapper]] = {cls.prefix: cls for cls in _WRAPPERS}
ALIASES = {"pyramidkv": "pyramidkv+snapkv", "headkv": "headkv+snapkv"}
"""Methods known by one name that are a wrapper over their paper's scorer."""
COMPOSED = (
    "adakv+snapkv",
    "pyramidkv",
    "headkv",
    "critical+snapkv",
    "critical+adakv+snapkv",
    "critical+h2o",
    "moment-nc+h2o",
    "moment-nc+streamingllm",
)
"""The compositions the papers evaluate (listed and tested like every policy; any other
``wrapper+...+policy`` works too)."""


def list_policies() -> list[str]:
    """Names of every registered policy and of the papers' compositions."""
    return [*POLICIES, *COMPOSED]


def describe_policies() -> list[tuple[str, str]]:
    """``(name, one-line summary)`` of every registered policy, composition and wrapper."""
    return [
        *((name, cls.summary) for name, cls in POLICIES.items()),
        *((name, make_policy(name).summary) for name in COMPOSED),
        *((f"{prefix}+<policy>", cls.summary) for prefix, cls in WRAPPERS.items()),
    ]


def make_policy(name: str, **params: object) -> Policy:
    """Build a policy by name: ``make_policy("snapkv", window=16)``, or a composition whose
    wrappers take their parameters as a dict under their prefix:
    ``make_policy("critical+adakv+snapkv", critical={"alpha": 0.0}, window=16)``."""
    *prefixes, base = ALIASES.get(name, name).split("+")
    unknown = [prefix for prefix in prefixes if prefix not in WRAPPERS]
    if unknown or base not in POLICIES:
        raise ValueError(
            f"unknown policy {name!r}; known policies: {', '.join(POLICIES)}; wrappers (as 'wrapper+policy'): "
            f"{', '.join(WRAPPERS)}; aliases: {', '.join(ALIASES)}"
        )
    wrapper_params = {prefix: params.pop(prefix, None) or {} for prefix in prefixes}
    try:
        policy: Policy = POLICIES[base](**params)
        for prefix in reversed(prefixes):
            policy = WRAPPERS[prefix](policy, **wrapper_params[prefix])
    except TypeError as err:
        raise ValueError(f"bad parameters for policy {name!r}: {err}") from None
    return policy


__all__ = [
    "POLICIES",
    "Policy",
    "Requirements",
    "Signals",
    "Wrapper",
    "describe_policies",
    "group_reduce",
    "list_policies",
    "make_policy",
]
