"""The result cache: a model answer is paid for once, whatever Flink replays.

Exactly-once output does not mean exactly-once calls: after a restart Flink replays every
record since the last completed checkpoint and each would be sent to the model again. So
`InferenceClient` looks a request up here before calling, and stores the answer the moment
a call succeeds, before the result enters Flink and outside its checkpointed state: an
answer computed after the last checkpoint survives a crash, and the replay finds it.

The key is the sha256 of a canonical JSON of everything that decides the answer: the api
and the request body `prompts.build_payload` made (model, messages / prompt / input and
every parameter). Never the record id, so identical requests share one call.

Two backends behind `ResultCache` (`get`, `put`, `close`):

- `LocalCache`: SQLite in WAL mode in one file (default: the job's state directory), shared
  by every subtask and process on the machine; bounded by entries and bytes, oldest first.
- `RedisCache`: Redis/Valkey through `redis.asyncio`, shared by several machines; entries
  expire after `cache.ttl_s` and the server's own `maxmemory` policy bounds it.

`GuardedCache` wraps either: a cache outage never fails a record. It is logged once per
outage (and once when the cache is back), counted in `cache_errors`, and the model is
called; while out, the cache is tried again at most every `RETRY_AFTER_S`, so a dead server
does not add a connect timeout to every record.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

from udfs import secret_refs
from udfs.config import CacheConfig, JobConfig
from udfs.errors import ConfigError
from udfs.metrics import InferenceMetrics

log = logging.getLogger(__name__)

KEY_VERSION = "llmstream-result-v1"
RETRY_AFTER_S = 2.0
REDIS_TIMEOUT_S = 1.0
CACHE_FILE = "result-cache.sqlite"


def cache_key(api: str, payload: dict[str, Any]) -> str:
    """The sha256 (hex) of a canonical JSON of the api and the request body.

    Canonical: keys sorted, no whitespace, UTF-8, so the same request always gives the same
    key, in any process; any change of model, input or parameter gives another.
    """
    canonical = json.dumps({"v": KEY_VERSION, "api": api, "payload": payload}, sort_keys=True,
                           separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def is_deterministic(api: str, payload: dict[str, Any]) -> bool:
    """Whether the request asks for a reproducible answer: embeddings always; chat and
    completions with temperature 0 or a fixed seed. Anything else is sampled, and a cached
    answer would replace the variety the caller asked for with one frozen sample."""
    if api == "embeddings":
        return True
    return payload.get("temperature") == 0 or payload.get("seed") is not None


def cacheable(config: CacheConfig, api: str, payload: dict[str, Any]) -> bool:
    return config.backend != "none" and (not config.only_deterministic or is_deterministic(api, payload))


class ResultCache(Protocol):
    """Stored answers by key; values are small JSON-able dicts. Errors propagate (see `GuardedCache`)."""

    async def get(self, key: str) -> dict[str, Any] | None: ...

    async def put(self, key: str, value: dict[str, Any]) -> None: ...

    async def close(self) -> None: ...


class LocalCache:
    """SQLite in WAL mode: readers never block the writer, several processes share the file.

    Writes use `synchronous=NORMAL`: a committed answer survives the process being killed
    (the fault this cache is for), not necessarily a power cut. Bounds are checked after
    every tenth of them written by this process (at most 256 puts): the oldest entries are
    evicted down to 90% of `max_entries` / `max_bytes`, expired ones first. So the store
    overshoots a bound by at most a tenth of it per writing process. Calls are short local I/O and run on the caller's loop.
    """

    def __init__(self, path: str | os.PathLike[str], *, ttl_s: float | None = None,
                 max_entries: int = 1_000_000, max_bytes: int = 1 << 30) -> None:
        self.path = Path(path)
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._db: sqlite3.Connection | None = None
        self._lock = threading.Lock()
        self._puts_since_check = 0
        self._bytes_since_check = 0
        self._pending: list[tuple[tuple[str, bytes, int, float, float | None], asyncio.Future[None]]] = []
        self._flush_scheduled = False
        self._check_every = max(1, min(256, max_entries // 10))

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, timeout=10.0, isolation_level=None, check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute("PRAGMA busy_timeout=10000")
            db.execute("CREATE TABLE IF NOT EXISTS results (key TEXT PRIMARY KEY, value BLOB NOT NULL, "
                       "size INTEGER NOT NULL, created REAL NOT NULL, expires REAL)")
            db.execute("CREATE INDEX IF NOT EXISTS results_created ON results (created)")
            self._db = db
        return self._db

    async def get(self, key: str) -> dict[str, Any] | None:
        return self.get_now(key)

    async def put(self, key: str, value: dict[str, Any]) -> None:
        """Stores the answer; returns once it is committed. Puts made in the same turn of the
        event loop are committed in one transaction (group commit): a transaction per answer
        cost several times the CPU, and held the calls' event loop far longer (the figures: the
        cache's cost in docs/cost.md)."""
        row = self._row(key, value)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append((row, done))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)
        await done

    def _flush(self) -> None:
        self._flush_scheduled = False
        batch, self._pending = self._pending, []
        try:
            self._write([row for row, _ in batch])
        except Exception as err:  # noqa: BLE001 - handed to every waiting put (GuardedCache logs it)
            for _, done in batch:
                if not done.done():
                    done.set_exception(err)
            return
        for _, done in batch:
            if not done.done():
                done.set_result(None)

    def get_now(self, key: str) -> dict[str, Any] | None:
        with self._lock:
            row = self._conn().execute("SELECT value, expires FROM results WHERE key = ?", (key,)).fetchone()
        if row is None or (row[1] is not None and row[1] <= time.time()):
            return None
        value: dict[str, Any] = json.loads(row[0])
        return value

    def put_now(self, key: str, value: dict[str, Any]) -> None:
        """`put` without an event loop: one transaction."""
        self._write([self._row(key, value)])

    def _row(self, key: str, value: dict[str, Any]) -> tuple[str, bytes, int, float, float | None]:
        blob = json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        now = time.time()
        return key, blob, len(blob) + len(key), now, (now + self.ttl_s if self.ttl_s is not None else None)

    def _write(self, rows: list[tuple[str, bytes, int, float, float | None]]) -> None:
        with self._lock:
            db = self._conn()
            db.execute("BEGIN IMMEDIATE")
            try:
                db.executemany("INSERT OR REPLACE INTO results (key, value, size, created, expires) "
                               "VALUES (?, ?, ?, ?, ?)", rows)
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")
            self._puts_since_check += len(rows)
            self._bytes_since_check += sum(row[2] for row in rows)
            if self._puts_since_check >= self._check_every or self._bytes_since_check >= self.max_bytes // 10:
                self._puts_since_check = self._bytes_since_check = 0
                self._enforce_bounds()

    def _enforce_bounds(self) -> None:
        db = self._conn()
        db.execute("DELETE FROM results WHERE expires IS NOT NULL AND expires <= ?", (time.time(),))
        count, size = db.execute("SELECT count(*), coalesce(sum(size), 0) FROM results").fetchone()
        if count <= self.max_entries and size <= self.max_bytes:
            return
        keep = min(int(self.max_entries * 0.9), count)
        if size > self.max_bytes and size > 0:
            keep = min(keep, int(count * self.max_bytes * 0.9 / size))
        db.execute("DELETE FROM results WHERE key IN (SELECT key FROM results ORDER BY created LIMIT ?)",
                   (max(0, count - keep),))
        log.debug("result cache %s: evicted %d of %d entries", self.path, count - keep, count)

    def stats(self) -> tuple[int, int]:
        """Entries and bytes stored now."""
        with self._lock:
            count, size = self._conn().execute("SELECT count(*), coalesce(sum(size), 0) FROM results").fetchone()
        return int(count), int(size)

    async def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None


class RedisCache:
    """Redis or Valkey through `redis.asyncio`; one connection pool per event loop.

    Short socket timeouts on purpose: a cache that does not answer within a second is
    treated as out (`GuardedCache`), and the model is called instead.
    """

    def __init__(self, url: str, *, ttl_s: float | None = None, key_prefix: str = "llmstream:result:") -> None:
        self.url = url
        self.ttl_s = ttl_s
        self.key_prefix = key_prefix
        self._client: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _redis(self) -> Any:
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:
            import redis.asyncio as redis

            self._client = redis.Redis.from_url(self.url, socket_timeout=REDIS_TIMEOUT_S,
                                                socket_connect_timeout=REDIS_TIMEOUT_S, retry_on_timeout=False)
            self._loop = loop
        return self._client

    async def get(self, key: str) -> dict[str, Any] | None:
        raw = await self._redis().get(self.key_prefix + key)
        if raw is None:
            return None
        value: dict[str, Any] = json.loads(raw)
        return value

    async def put(self, key: str, value: dict[str, Any]) -> None:
        blob = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
        ttl = None if self.ttl_s is None else max(1, int(self.ttl_s))
        await self._redis().set(self.key_prefix + key, blob, ex=ttl)

    async def close(self) -> None:
        client, loop = self._client, self._loop
        self._client = self._loop = None
        if client is None:
            return
        try:
            if loop is asyncio.get_running_loop():
                await client.aclose()
            elif loop is not None and loop.is_running():
                done = asyncio.run_coroutine_threadsafe(client.aclose(), loop)
                await asyncio.wait_for(asyncio.wrap_future(done), timeout=5.0)
        except Exception as err:  # noqa: BLE001 - closing a cache must never fail the stage's close
            log.debug("closing the redis cache: %s", err)


class GuardedCache:
    """A `ResultCache` whose failures become misses: logged once per outage, counted, retried later."""

    def __init__(self, inner: ResultCache, metrics: InferenceMetrics, *, name: str,
                 retry_after_s: float = RETRY_AFTER_S) -> None:
        self.inner = inner
        self.metrics = metrics
        self.name = name
        self.retry_after_s = retry_after_s
        self._out_since: float | None = None
        self._next_try = 0.0

    @property
    def out(self) -> bool:
        return self._out_since is not None

    def _skip(self) -> bool:
        return self._out_since is not None and time.monotonic() < self._next_try

    def _failed(self, op: str, err: BaseException) -> None:
        self.metrics.cache_errors.inc()
        self._next_try = time.monotonic() + self.retry_after_s
        if self._out_since is None:
            self._out_since = time.monotonic()
            log.warning("result cache %s unavailable (%s on %s: %s); calling the model without it until it is back",
                        self.name, type(err).__name__, op, str(err)[:200])

    def _ok(self) -> None:
        if self._out_since is not None:
            log.warning("result cache %s is back after %.1f s", self.name, time.monotonic() - self._out_since)
            self._out_since = None

    async def get(self, key: str) -> dict[str, Any] | None:
        if self._skip():
            return None
        try:
            value = await self.inner.get(key)
        except Exception as err:  # noqa: BLE001 - any cache failure is a miss, never a failed record
            self._failed("get", err)
            return None
        self._ok()
        return value

    async def put(self, key: str, value: dict[str, Any]) -> None:
        if self._skip():
            return
        try:
            await self.inner.put(key, value)
        except Exception as err:  # noqa: BLE001 - any cache failure is a miss, never a failed record
            self._failed("put", err)
            return
        self._ok()

    async def close(self) -> None:
        try:
            await self.inner.close()
        except Exception as err:  # noqa: BLE001 - closing a cache must never fail the stage's close
            log.debug("closing result cache %s: %s", self.name, err)


def open_cache(config: JobConfig, metrics: InferenceMetrics, local_file: str | None = None) -> GuardedCache | None:
    """The configured cache, guarded; `None` for `cache.backend: none`. Opens nothing yet:
    both backends connect on first use, in the calls' event loop.

    `local_file`: the local store's file as the job's launch decided it
    (`jobs.launch.plan.result_cache_file`); without one, `cache.path`. A `ConfigError` naming
    `cache.path` when the backend is local and neither is given."""
    cache = config.cache
    if cache.backend == "none":
        return None
    inner: ResultCache
    if cache.backend == "local":
        chosen = local_file or cache.path
        if not chosen:
            raise ConfigError("cache.path", "the local result cache has no file: give cache.path, or launch the job "
                                            "with `llmstream run` or `submit`, which put it in the job's state directory")
        path = Path(chosen).expanduser()
        inner = LocalCache(path, ttl_s=cache.ttl_s, max_entries=cache.max_entries, max_bytes=cache.max_bytes)
        name = str(path)
    else:
        url = secret_refs.resolve(cache.redis_url, "cache.redis_url")
        inner = RedisCache(url, ttl_s=cache.ttl_s, key_prefix=cache.key_prefix)
        name = _without_password(url)
    return GuardedCache(inner, metrics, name=name)


def _without_password(url: str) -> str:
    parsed = urlparse(url)
    if parsed.password:
        return url.replace(f":{parsed.password}@", ":***@")
    return url
