"""What the command tests share: a document with a needle, and a command line that must be refused."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvevict.bench.haystack import essays
from kvevict.cli import main

NEEDLE = " The secret passcode for the vault is 7310452. "


@pytest.fixture(scope="module")
def document(tmp_path_factory):
    text = essays()[:1200]
    path = tmp_path_factory.mktemp("doc") / "doc.txt"
    path.write_text(text[:600] + NEEDLE + text[600:], encoding="utf-8")
    return path


@pytest.fixture
def refused(document, tmp_path, capsys) -> Callable[[list[str]], str]:
    """Run a command line that must exit 2 with one line on standard error, and return that line;
    ``DOC`` in it stands for :func:`document`, ``BAD`` for a file that is not a kvevict cache."""
    bad = tmp_path / "bad.kv"
    bad.write_bytes(b"not a cache")

    def run(argv: list[str]) -> str:
        argv = [str(document) if a == "DOC" else str(bad) if a == "BAD" else a for a in argv]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1
        return err

    return run
