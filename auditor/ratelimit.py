"""Per-key token buckets: ``rate`` tokens per second refill up to ``burst``; one request costs one.

``RateLimiter`` keeps the buckets in this process; ``FileRateLimiter`` keeps them in a memory-mapped file that
every worker process of one ``serve`` shares (one host); ``RedisRateLimiter`` keeps them in Redis, so every
server process (replica, on any host) draws from the same bucket. Both answer ``await take(key)``: ``None`` if
allowed, else the seconds until a token is available.
"""

from __future__ import annotations

import fcntl
import hashlib
import mmap
import os
import struct
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


def _take(tokens: float, elapsed: float, rate: float, burst: int) -> tuple[float, float | None]:
    """One request against a bucket holding ``tokens`` ``elapsed`` seconds ago: the tokens left, and ``None`` if
    allowed, else the seconds until a token is available."""
    tokens = min(float(burst), tokens + max(0.0, elapsed) * rate)
    if tokens >= 1.0:
        return tokens - 1.0, None
    return tokens, (1.0 - tokens) / rate


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
            bucket.tokens, wait = _take(bucket.tokens, now - bucket.updated, self.rate, self.burst)
            bucket.updated = now
            return wait

    async def take(self, key: str) -> float | None:
        return self.acquire(key)


class FileRateLimiter:
    """Token buckets in a memory-mapped file shared by the processes of one host.

    The file is a hash table of ``SLOTS`` slots ``(key digest, tokens, updated)``, probed linearly from the
    key's digest; each update holds an exclusive ``flock`` on the file for a few microseconds. ``updated`` is
    ``time.monotonic()``, one clock for every process of the host. When the ``PROBES`` slots a key may use are
    all taken, the one idle longest is given to it (a bucket idle for ``burst / rate`` seconds is full anyway,
    so at the table's size a key only loses its state after it has been idle). ``reset`` empties the file: the
    process that starts the workers calls it once before they start."""

    SLOTS = 16384
    PROBES = 32
    _SLOT = struct.Struct("<8sdd")

    def __init__(self, path: os.PathLike[str] | str, rate: float, burst: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        _check(rate, burst)
        self.rate = rate
        self.burst = burst
        self._clock = clock
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        size = self.SLOTS * self._SLOT.size
        if os.fstat(fd).st_size < size:
            os.ftruncate(fd, size)
        self._fd = fd
        self._map = mmap.mmap(fd, size)

    @classmethod
    def reset(cls, path: os.PathLike[str] | str) -> None:
        with open(path, "wb") as f:
            f.truncate(cls.SLOTS * cls._SLOT.size)
        os.chmod(path, 0o600)

    def acquire(self, key: str) -> float | None:
        digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
        start = int.from_bytes(digest, "little") % self.SLOTS
        now = self._clock()
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            at, tokens, updated = self._slot(digest, start, float(self.burst), now)
            tokens, wait = _take(tokens, now - updated, self.rate, self.burst)
            self._SLOT.pack_into(self._map, at, digest, tokens, now)
            return wait
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _slot(self, digest: bytes, start: int, full: float, now: float) -> tuple[int, float, float]:
        """``(offset, tokens, updated)`` of the key's slot: its own, else the first free one or, when every slot
        it may probe is taken, the one idle longest (both as a full bucket)."""
        size, oldest_at, oldest_updated = self._SLOT.size, 0, float("inf")
        for probe in range(self.PROBES):
            at = ((start + probe) % self.SLOTS) * size
            held, tokens, updated = self._SLOT.unpack_from(self._map, at)
            if held == digest:
                return at, tokens, updated
            if held == bytes(8):
                return at, full, now
            if updated < oldest_updated:
                oldest_at, oldest_updated = at, updated
        return oldest_at, full, now

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
