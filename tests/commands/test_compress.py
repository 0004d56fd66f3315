"""``kvevict compress`` and ``kvevict ask`` on the embedded model: a document compressed once
into a file, answered later from it; bad input refused in one line."""

from __future__ import annotations

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


def test_a_compressed_document_answers_from_its_file(document, tmp_path, capsys) -> None:
    out = tmp_path / "doc.kv"
    assert main(["compress", str(document), "--policy", "snapkv", "--keep", "0.5", "--out", str(out)]) == 0
    summary = capsys.readouterr().out
    assert "compressed by snapkv (keep=0.5)" in summary and out.is_file()
    question = "What is the secret passcode for the vault?"
    assert main(["ask", str(out), question, "Who wrote the text?", "--max-new-tokens", "20"]) == 0
    answers = capsys.readouterr().out.strip().splitlines()
    assert [line[:4] for line in answers] == ["[1] ", "[2] "]
    assert main(["ask", str(out), question, "--max-new-tokens", "20"]) == 0
    assert capsys.readouterr().out.strip() == answers[0][4:]  # each question from its own copy


def test_a_document_compressed_into_quantized_storage_answers_from_its_file(document, tmp_path, capsys) -> None:
    out = tmp_path / "doc-int4.kv"
    argv = ["compress", str(document), "--policy", "snapkv", "--keep", "0.5", "--quant", "int4", "--out", str(out)]
    assert main([*argv, "--residual", "16"]) == 0
    summary = capsys.readouterr().out
    plain = tmp_path / "doc.kv"
    assert main(["compress", str(document), "--policy", "snapkv", "--keep", "0.5", "--out", str(plain)]) == 0
    capsys.readouterr()
    assert out.stat().st_size < plain.stat().st_size / 3  # codes, scales and zero points, not fp32 entries
    assert "resident KV" in summary
    assert main(["ask", str(out), "What is the secret passcode for the vault?", "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out.strip()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["compress", "/no/such/doc.txt", "--keep", "0.1", "--out", "x.kv"], "cannot read the document"),
        (["compress", "DOC", "--policy", "snapkv", "--out", "x.kv"], "give --keep"),
        (["compress", "DOC", "--policy", "kvzipp", "--keep", "0.1", "--out", "x.kv"], "unknown policy 'kvzipp'"),
        (["ask", "/no/such/doc.kv", "why?"], "no such file"),
        (["ask", "BAD", "why?"], "is not a readable kvevict cache"),
        (["ask", "DOC", "why?", "--max-new-tokens", "0"], "--max-new-tokens must be a positive"),
        (["compress", "DOC", "--keep", "0.1", "--residual", "16", "--out", "x.kv"], "need --quant"),
    ],
)
def test_bad_input_is_refused_in_one_line(argv, message: str, document, tmp_path, capsys) -> None:
    bad = tmp_path / "bad.kv"
    bad.write_bytes(b"not a cache")
    argv = [str(document) if a == "DOC" else str(bad) if a == "BAD" else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
