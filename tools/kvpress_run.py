"""Run samples exported by ``kvevict tasks --export`` through NVIDIA's kvpress, in kvpress's own
environment (kvpress 0.5.5 pins ``transformers < 5.3``; kvevict needs 5.x), and write records
``kvevict report`` reads beside kvevict's own: the same prompts, compressed context-only by a
kvpress press, then answered greedily.

    python -m venv kvp && kvp/bin/pip install torch kvpress==0.5.5 'transformers<5.3'
    kvevict tasks niah_single_1,niah_single_2 --length 2048 --samples 4 --export samples.jsonl
    kvp/bin/python tools/kvpress_run.py samples.jsonl CHECKPOINT_DIR --presses snapkv,keydiff --keep 0.25,0.1 --out DIR
    kvevict report DIR

``CHECKPOINT_DIR``: the model as ``from_pretrained`` reads it (the embedded SmolLM2's converted
checkpoint: ``python -c 'import kvevict.models as m; print(m.smollm2_checkpoint())'``). Each press
is configured as kvevict's policy of the same method is by default (SnapKV's window 32 and kernel
7; kvpress pools by the mean only: compare with ``snapkv[pool=avg]``). A record is written as each
sample finishes; a rerun skips the finished ones. Resident bytes are not recorded: kvpress keeps
masked entries of some presses, and its DynamicCache is not kvevict's to walk.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """RULER's metric as kvevict scores it: the share of references found, case-insensitively."""
    text = re.sub(r"[\x00-\x1f]", "\n", prediction.strip()).strip().lower()
    return sum(reference.lower() in text for reference in references) / len(references)


def presses(kvpress: Any) -> dict[str, Callable[[float], Any]]:
    """kvevict's policy name → a kvpress press keeping the share ``keep`` of the context."""
    snap = lambda keep: kvpress.SnapKVPress(compression_ratio=1 - keep, window_size=32, kernel_size=7)
    return {
        "snapkv[pool=avg]": snap,
        "keydiff": lambda keep: kvpress.KeyDiffPress(compression_ratio=1 - keep),
        "knorm": lambda keep: kvpress.KnormPress(compression_ratio=1 - keep),
        "observed-attention": lambda keep: kvpress.ObservedAttentionPress(compression_ratio=1 - keep),
        "chunk+snapkv[pool=avg]": lambda keep: kvpress.ChunkKVPress(press=snap(keep), chunk_length=10),
        "think+snapkv[pool=avg]": lambda keep: kvpress.ComposedPress(
            [snap(keep), kvpress.ThinKPress(key_channel_compression_ratio=0.4, window_size=32)]
        ),
    }


def record(sample: dict[str, Any], policy: str, keep: float, prediction: str) -> dict[str, Any]:
    """The result of one sample, as ``kvevict bench`` writes its own (score × 1, no resident bytes)."""
    return {
        **{key: sample[key] for key in ("task", "index", "length", "seed", "model")},
        "policy": f"kvpress:{policy}",
        "budget": None,
        "keep": keep,
        "query_aware": sample.get("query_aware", False),
        "metric": sample["metric"],
        "score": string_match_all(prediction, sample["answers"]),
        "prediction": prediction,
        "answers": sample["answers"],
        "kv_bytes_final": 0,
        "fidelity": None,
    }


def answer(model: Any, press: Any, sample: dict[str, Any], eos: set[int]) -> list[int]:
    """Compress the context under ``press``, then feed the rest and decode greedily (positions go on
    from the whole context, as kvpress's pipeline does)."""
    import torch
    from transformers import DynamicCache

    context = torch.tensor([sample["context_ids"]])
    rest = torch.tensor([sample["rest_ids"]])
    cache = DynamicCache()
    with torch.no_grad(), press(model):
        model(input_ids=context, past_key_values=cache, use_cache=True, logits_to_keep=1)
    position = context.shape[1]
    tokens, step = [], rest
    with torch.no_grad():
        for _ in range(sample["max_new_tokens"]):
            positions = torch.arange(position, position + step.shape[1])[None]
            logits = model(
                input_ids=step, past_key_values=cache, position_ids=positions, cache_position=positions[0]
            ).logits[:, -1]
            position += step.shape[1]
            token = int(logits.argmax(-1))
            if token in eos:
                break
            tokens.append(token)
            step = torch.tensor([[token]])
    return tokens


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("samples", type=Path, help="a file written by `kvevict tasks ... --export`")
    parser.add_argument("checkpoint", help="the model, as from_pretrained reads it")
    parser.add_argument("--presses", required=True, help="comma-separated kvevict policy names of kvpress presses")
    parser.add_argument("--keep", required=True, help="comma-separated shares of the context to keep")
    parser.add_argument("--out", type=Path, required=True, help="results directory (results.jsonl; resumed)")
    args = parser.parse_args(argv)

    import kvpress
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    known = presses(kvpress)
    chosen = [name.strip() for name in args.presses.split(",")]
    if unknown := [name for name in chosen if name not in known]:
        parser.error(f"unknown press {unknown[0]!r}; known: {', '.join(known)}")
    keeps = [float(keep) for keep in args.keep.split(",")]
    samples = [json.loads(line) for line in args.samples.read_text().splitlines()]
    args.out.mkdir(parents=True, exist_ok=True)
    results = args.out / "results.jsonl"
    done = set()
    if results.exists():
        done = {
            (r["task"], r["index"], r["policy"], r["keep"]) for r in map(json.loads, results.read_text().splitlines())
        }
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    eos = {tokenizer.eos_token_id} | set(getattr(tokenizer, "additional_special_tokens_ids", []) or [])
    with results.open("a", encoding="utf-8") as out:
        for name in chosen:
            attn = "eager" if name == "observed-attention" else "sdpa"  # (ObservedAttention reads the weights)
            model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32, attn_implementation=attn)
            model.eval()
            for keep in keeps:
                for sample in samples:
                    if (sample["task"], sample["index"], f"kvpress:{name}", keep) in done:
                        continue
                    tokens = answer(model, known[name](keep), sample, eos)
                    prediction = tokenizer.decode(tokens, skip_special_tokens=True)
                    out.write(json.dumps(record(sample, name, keep, prediction)) + "\n")
                    out.flush()
                    print(f"{name} keep {keep} {sample['task']} {sample['index']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
