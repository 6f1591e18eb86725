"""Prefix-cache counters."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrefixCacheStats:
    """Prefix-cache counters since the manager was built (tokens, not blocks).

    Attributes
    ----------
    num_queries : int
        Admissions looked up (new and resumed requests).
    num_query_tokens : int
        Their prompt tokens.
    num_hit_tokens : int
        Tokens served from the cache (either tier).
    num_host_hit_tokens : int
        Of those, tokens whose block (in some group) was restored from the host tier.
    """

    num_queries: int = 0
    num_query_tokens: int = 0
    num_hit_tokens: int = 0
    num_host_hit_tokens: int = 0

    @property
    def num_device_hit_tokens(self) -> int:
        """Hit tokens served by blocks already on the device."""
        return self.num_hit_tokens - self.num_host_hit_tokens

    @property
    def hit_rate(self) -> float:
        """``num_hit_tokens / num_query_tokens`` (0.0 before the first query)."""
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0
