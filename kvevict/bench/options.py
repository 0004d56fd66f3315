"""Command-line value types shared by ``kvevict bench`` and its subcommands."""

from __future__ import annotations

import argparse
from collections.abc import Callable

_KINDS = {int: "integers", float: "numbers"}


def comma_separated(kind: type[int | float], low: float | None = None) -> Callable[[str], tuple]:
    """An argparse ``type``: a non-empty comma-separated list of ``kind`` values, each ``>= low``
    (``"1,8"`` → ``(1, 8)``). A bad list is refused with what is allowed (argparse exits 2)."""

    def parse(text: str) -> tuple:
        try:
            values = tuple(kind(value) for value in text.split(",") if value.strip())
        except ValueError:
            values = ()
        if not values or (low is not None and min(values) < low):
            allowed = _KINDS[kind] + ("" if low is None else f" >= {low:g}")
            raise argparse.ArgumentTypeError(f"expected comma-separated {allowed}, got {text!r}")
        return values

    return parse


def quant_list(text: str) -> tuple[str | None, ...]:
    """An argparse ``type``: comma-separated ``quant=`` options of ``kvevict.quant.BITS``, ``none``
    for full precision (``"none,int4"`` → ``(None, "int4")``)."""
    from kvevict.quant import BITS

    values = tuple(None if value.strip() == "none" else value.strip() for value in text.split(",") if value.strip())
    if not values or any(value is not None and value not in BITS for value in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated {', '.join(BITS)} or none, got {text!r}")
    return values


def device_option(parser: argparse.ArgumentParser) -> None:
    """``--device``: where the model is placed (:func:`kvevict.load_model`, which refuses a device torch cannot
    use here before the model loads)."""
    parser.add_argument("--device", default=None, help="e.g. cpu, cuda (default: where the model loads)")
