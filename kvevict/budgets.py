"""How many entries each KV head of each layer may keep (DESIGN §2)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Budget:
    """A retention budget: ``tokens`` per KV head per layer, or ``keep``, a fraction of
    the prompt (resolved once the prompt length is known). Never both."""

    tokens: int | None = None
    keep: float | None = None

    def __post_init__(self) -> None:
        if self.tokens is not None and self.keep is not None:
            raise ValueError(
                f"give either budget= (tokens per KV head per layer) or keep= (fraction of the prompt), "
                f"not both (got budget={self.tokens}, keep={self.keep})"
            )
        if self.tokens is not None and (
            isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or self.tokens < 1
        ):
            raise ValueError(f"budget must be a positive integer number of tokens, got {self.tokens!r}")
        if self.keep is not None and not 0 < self.keep <= 1:
            raise ValueError(f"keep must be a fraction of the prompt in (0, 1], got {self.keep!r}")

    @property
    def given(self) -> bool:
        return self.tokens is not None or self.keep is not None

    def resolve(self, prompt_length: int) -> int | None:
        """Tokens per KV head for a prompt of ``prompt_length`` tokens (None: unlimited)."""
        if self.keep is not None:
            return max(1, math.ceil(self.keep * prompt_length))
        return self.tokens

    def __str__(self) -> str:
        if self.tokens is not None:
            return f"budget={self.tokens}"
        return f"keep={self.keep}" if self.keep is not None else "unlimited"
