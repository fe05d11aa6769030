"""Per-key token buckets: ``rate`` tokens per second refill up to ``burst``; one request costs one.

``RateLimiter`` keeps the buckets in this process; ``RedisRateLimiter`` keeps them in Redis, so every
server process (replica) draws from the same bucket. Both answer ``await take(key)``: ``None`` if
allowed, else the seconds until a token is available.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol


class Limiter(Protocol):
    async def take(self, key: str) -> float | None: ...


@dataclass
class _Bucket:
    tokens: float
    updated: float


def _check(rate: float, burst: int) -> None:
    if rate <= 0 or burst < 1:
        raise ValueError(f"rate must be > 0 and burst >= 1, got {rate}/s burst {burst}")


class RateLimiter:
    def __init__(self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        _check(rate, burst)
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._buckets: dict[str, _Bucket] = {}
        self._lock = threading.Lock()

    def acquire(self, key: str) -> float | None:
        """Take one token for ``key``; ``None`` if allowed, else the seconds until one is available."""
        now = self._clock()
        with self._lock:
            bucket = self._buckets.get(key)
            if bucket is None:
                bucket = self._buckets[key] = _Bucket(float(self.burst), now)
            bucket.tokens = min(float(self.burst), bucket.tokens + (now - bucket.updated) * self.rate)
            bucket.updated = now
            if bucket.tokens >= 1.0:
                bucket.tokens -= 1.0
                return None
            return (1.0 - bucket.tokens) / self.rate

    async def take(self, key: str) -> float | None:
        return self.acquire(key)


# The bucket update runs inside Redis (one script = one atomic step), on Redis's own clock, so
# replicas with skewed clocks still share one refill rate. Idle buckets expire once full again.
_TOKEN_BUCKET = """
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local state = redis.call('HMGET', KEYS[1], 'tokens', 'updated')
local tokens = tonumber(state[1]) or burst
local updated = tonumber(state[2]) or now
tokens = math.min(burst, tokens + math.max(0, now - updated) * rate)
local wait = 0
if tokens >= 1 then tokens = tokens - 1 else wait = (1 - tokens) / rate end
redis.call('HSET', KEYS[1], 'tokens', string.format('%.6f', tokens), 'updated', string.format('%.6f', now))
redis.call('EXPIRE', KEYS[1], math.ceil(burst / rate) + 1)
return string.format('%.6f', wait)
"""


class RedisRateLimiter:
    def __init__(self, redis: Any, rate: float, burst: int, namespace: str = "verbatim-ratelimit") -> None:
        _check(rate, burst)
        self.rate = rate
        self.burst = burst
        self.namespace = namespace
        self._script = redis.register_script(_TOKEN_BUCKET)

    async def take(self, key: str) -> float | None:
        raw = await self._script(keys=[f"{self.namespace}:{key}"], args=[repr(self.rate), str(self.burst)])
        wait = float(raw.decode() if isinstance(raw, bytes) else raw)
        return None if wait == 0 else wait
