"""``kvevict compress`` (kvevict.commands.compress) on the embedded model: a document compressed
once into a file (quantized: a fraction of the size); bad input refused in one line. Answering
from the file: tests/commands/test_ask.py."""

from __future__ import annotations

import pytest

from kvevict.cli import main


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
        (["compress", "DOC", "--keep", "0.1", "--residual", "16", "--out", "x.kv"], "need --quant"),
    ],
)
def test_bad_input_is_refused_in_one_line(argv, message: str, refused) -> None:
    assert message in refused(argv)
