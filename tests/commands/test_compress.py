"""``kvevict compress`` (kvevict.commands.compress) on the embedded model: a document compressed
once into a file (quantized: a fraction of the size); bad input refused in one line. Answering
from the file: tests/commands/test_ask.py."""

from __future__ import annotations

import re

import pytest

import kvevict
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


@pytest.mark.parametrize("policy", ["adakv+snapkv", "global+snapkv"])
def test_a_head_varying_policy_reports_the_share_it_kept_not_its_longest_head(
    policy, document, tmp_path, capsys, smollm2
) -> None:
    out = tmp_path / "doc.kv"
    assert main(["compress", str(document), "--policy", policy, "--keep", "0.1", "--out", str(out)]) == 0
    summary = capsys.readouterr().out
    share, mean, longest, shortest = re.search(
        r"kept ([\d.]+)% of the entries \(mean ([\d.]+) per KV head, longest (\d+), shortest (\d+)\)", summary
    ).groups()
    cache = kvevict.EvictionCache.load(out, smollm2[0])
    config = smollm2[0].config
    tokens = cache.get_seq_length()
    full_bytes = tokens * config.num_hidden_layers * config.num_key_value_heads * 2 * config.head_dim * 4  # fp32
    assert abs(float(share) - 100 * cache.retained_bytes() / full_bytes) < 1.0
    assert float(share) < 20 and int(shortest) < float(mean) < int(longest)
    assert f"{tokens} tokens compressed" in summary


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
