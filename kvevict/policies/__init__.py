"""The policy registry: every eviction method under one name, and the stages that can be
named over any of them.

A policy is assembled from stages (:mod:`kvevict.policies.base`): a registered method
(``_METHODS``) brings its scorer, its protector and whatever else it has of its own; a
prefix (``_PREFIXES``) fills one more slot: ``critical`` and ``chunk`` the selector, ``adakv``,
``pyramidkv``, ``headkv``, ``global`` the allocator, ``moment-nc`` the corrector. So
``critical+adakv+snapkv`` and ``adakv+critical+snapkv`` are the same policy, and a spelling
whose stages clash is refused by :func:`make_policy` (:class:`~kvevict.policies.pipeline.Policy`).

Adding a method: write its :class:`~kvevict.policies.base.Method` subclass (a ``score``
function, its parameters) in a file of this package and add the class to ``_METHODS``.
"""

from __future__ import annotations

import ast

from kvevict.policies.allocation import AdaKV, GlobalBudget, HeadKV, PyramidKV
from kvevict.policies.base import Method, Stage
from kvevict.policies.chunkkv import ChunkKV
from kvevict.policies.critical import Critical
from kvevict.policies.duoattention import DuoAttention
from kvevict.policies.epikv import AttnXHS, BandAdaptive, EpiKV, HSVariance
from kvevict.policies.expected_attention import ExpectedAttention
from kvevict.policies.fastkvzip import FastKVzip
from kvevict.policies.h2o import H2O, ObservedAttention
from kvevict.policies.kvvar import KVKeyVariance, KVValueVariance, LagKV, LagKVDecode
from kvevict.policies.kvzip import KVzip
from kvevict.policies.lazyeviction import LazyEviction
from kvevict.policies.momentkv import MomentKV, MomentNC
from kvevict.policies.pipeline import Policy
from kvevict.policies.qfilters import QFilters
from kvevict.policies.raas import RaaS
from kvevict.policies.rerotate import Rerotate
from kvevict.policies.rkv import RKV
from kvevict.policies.simple import Full, KeyDiff, KNorm, Random, StreamingLLM
from kvevict.policies.snapkv import SnapKV
from kvevict.policies.think import Think
from kvevict.policies.thinkv import SegmentHS, ThinKV
from kvevict.policies.tova import TOVA
from kvevict.signals import Requirements, Signals, group_reduce

_METHODS: tuple[type[Method], ...] = (
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
    KVzip,
    ExpectedAttention,
    FastKVzip,
    KeyDiff,
    ObservedAttention,
    QFilters,
    DuoAttention,
)
POLICIES: dict[str, type[Method]] = {cls.name: cls for cls in _METHODS}
_PREFIXES: tuple[type[Stage], ...] = (
    Critical,
    AdaKV,
    PyramidKV,
    HeadKV,
    MomentNC,
    GlobalBudget,
    ChunkKV,
    Rerotate,
    Think,
)
PREFIXES: dict[str, type[Stage]] = {cls.name: cls for cls in _PREFIXES}
"""Stages named over a policy (``prefix+policy``), by name."""
ALIASES = {"pyramidkv": "pyramidkv+snapkv", "headkv": "headkv+snapkv", "think": "think+full"}
"""Methods known by one name that are a stage over another policy (an allocator over their paper's
scorer; ThinK's channel pruning over the full cache)."""
COMPOSED = (
    "adakv+snapkv",
    "pyramidkv",
    "headkv",
    "critical+snapkv",
    "critical+adakv+snapkv",
    "critical+h2o",
    "moment-nc+h2o",
    "moment-nc+streamingllm",
    "global+snapkv",
    "global+expected-attention",
    "chunk+snapkv",
    "think",
    "think+snapkv",
)
"""The compositions the papers evaluate (listed and tested like every policy; any other
``prefix+...+policy`` whose stages do not clash works too)."""

KVPRESS = {
    "random": "RandomPress",
    "knorm": "KnormPress",
    "streamingllm": "StreamingLLMPress",
    "tova": "TOVAPress",
    "snapkv": "SnapKVPress",
    "observed-attention": "ObservedAttentionPress",
    "keydiff": "KeyDiffPress",
    "qfilters": "QFilterPress",
    "lagkv": "LagKVPress",
    "expected-attention": "ExpectedAttentionPress",
    "kvzip": "KVzipPress",
    "pyramidkv": "PyramidKVPress",
    "adakv+<policy>": "AdaKVPress",
    "critical+<policy>": "CriticalKVPress",
    "critical+adakv+snapkv": "CriticalAdaKVPress",
    "chunk+<policy>": "ChunkKVPress",
    "duoattention": "DuoAttentionPress",
    "rerotate+<policy>": "KeyRerotationPress",
    "think": "ThinKPress",
    "think+<policy>": "ThinKPress",
}
"""kvpress's name of the policies it also has (kvpress 0.5), for users who come from it."""


def list_policies() -> list[str]:
    """Names of every registered policy and of the papers' compositions."""
    return [*POLICIES, *COMPOSED]


def describe_policies() -> list[tuple[str, str]]:
    """``(name, one-line summary)`` of every registered policy, composition and prefix."""
    return [
        *((name, cls.summary) for name, cls in POLICIES.items()),
        *((name, make_policy(name).summary) for name in COMPOSED),
        *((f"{prefix}+<policy>", cls.summary) for prefix, cls in PREFIXES.items()),
    ]


def split_names(text: str) -> tuple[str, ...]:
    """Split a comma-separated list of policy specs, leaving commas inside ``[...]`` alone:
    ``"h2o,lazyeviction[window=22,alpha=1e-4]"`` → ``("h2o", "lazyeviction[window=22,alpha=1e-4]")``."""
    names, depth, start = [], 0, 0
    for i, char in enumerate(text + ","):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            names.append(text[start:i].strip())
            start = i + 1
    return tuple(name for name in names if name)


def _value(text: str) -> object:
    """A parameter value: a Python literal (``22``, ``1e-4``, ``None``, ``True``), ``true``/``false``,
    or else the text itself (``pool=avg``, ``profile=heads.json``)."""
    lowered = text.lower()
    if lowered in ("true", "false", "none"):
        return {"true": True, "false": False, "none": None}[lowered]
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def parse_spec(spec: str) -> tuple[str, dict[str, object]]:
    """``"name[key=value,...]"`` → ``(name, params)``; a prefix's parameter is written
    ``prefix.key=value`` and lands in a dict under its prefix (what :func:`make_policy` takes):
    ``"critical+snapkv[critical.alpha=0,window=16]"`` → ``("critical+snapkv",
    {"critical": {"alpha": 0}, "window": 16})``. A name without brackets has no parameters."""
    name, bracket, rest = spec.partition("[")
    if not bracket:
        return spec, {}
    if not rest.endswith("]") or "[" in rest[:-1] or "]" in rest[:-1]:
        raise ValueError(f"bad policy spec {spec!r}: write name[key=value,...] with one pair of brackets")
    params: dict[str, object] = {}
    for item in split_names(rest[:-1]):
        key, equals, value = (part.strip() for part in item.partition("="))
        if not equals or not key or not value:
            raise ValueError(f"bad parameter {item!r} in policy spec {spec!r}: write key=value")
        prefix, dot, field = key.rpartition(".")
        target = params.setdefault(prefix, {}) if dot else params
        if not isinstance(target, dict) or field in target:
            raise ValueError(f"parameter {key!r} given twice in policy spec {spec!r}")
        target[field] = _value(value)
    return name.strip(), params


def make_policy(name: str, **params: object) -> Policy:
    """Build a policy by name: ``make_policy("snapkv", window=16)``, or a composition whose
    prefixes take their parameters as a dict under their name:
    ``make_policy("critical+adakv+snapkv", critical={"alpha": 0.0}, window=16)``. The name may
    carry parameters itself, as on the command line (:func:`parse_spec`):
    ``make_policy("critical+adakv+snapkv[critical.alpha=0,window=16]")``.

    Every parameter is checked here, and a composition whose stages clash (two allocators,
    two selectors, CriticalKV over a scorer that is not attention, ...) is refused here, with
    a ``ValueError`` saying what is allowed; a policy this returns does what its name says.
    """
    name, spec_params = parse_spec(name)
    if both := sorted(set(spec_params) & set(params)):
        raise ValueError(f"parameters {', '.join(both)} of policy {name!r} given both in its name and as arguments")
    params = {**spec_params, **params}
    *prefixes, base = ALIASES.get(name, name).split("+")
    unknown = [prefix for prefix in prefixes if prefix not in PREFIXES]
    if unknown or base not in POLICIES:
        raise ValueError(
            f"unknown policy {name!r}; known policies: {', '.join(POLICIES)}; prefixes (as 'prefix+policy'): "
            f"{', '.join(PREFIXES)}; aliases: {', '.join(ALIASES)}"
        )
    if name in ALIASES and base == "full":  # (``think[ratio=0.5]``) a stage over the full cache takes the parameters
        params = {prefixes[0]: {**(params.pop(prefixes[0], None) or {}), **params}}
    named = []
    for prefix in prefixes:
        own = params.pop(prefix, None) or {}
        if not isinstance(own, dict):  # bad input, also from a spec ("critical=5"): a ValueError like the rest
            message = f"parameters of {prefix} go in a dict: make_policy({name!r}, {prefix}={{...}})"
            raise ValueError(message)  # noqa: TRY004
        named.append(PREFIXES[prefix](**own))
    return Policy(POLICIES[base](**params), named)


__all__ = [
    "KVPRESS",
    "POLICIES",
    "PREFIXES",
    "Method",
    "Policy",
    "Requirements",
    "Signals",
    "Stage",
    "describe_policies",
    "group_reduce",
    "list_policies",
    "make_policy",
    "parse_spec",
    "split_names",
]
