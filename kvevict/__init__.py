"""kvevict: KV-cache eviction for Hugging Face transformers.

Public API::

    model, tokenizer = kvevict.load_model("smollm2")
    cache = kvevict.EvictionCache(model, "snapkv", budget=256)
    text = kvevict.answer(model, tokenizer, context, question, policy="h2o", budget=256)
"""

from kvevict.budgets import Budget
from kvevict.cache import EvictionCache, EvictionLayer
from kvevict.generation import answer
from kvevict.models import load_model
from kvevict.policies import Policy, describe_policies, list_policies, make_policy

__version__ = "0.1.0"

__all__ = [
    "Budget",
    "EvictionCache",
    "EvictionLayer",
    "Policy",
    "answer",
    "describe_policies",
    "list_policies",
    "load_model",
    "make_policy",
]
