"""Your own Python around the model: `model.preprocess` and `output.postprocess` (docs/user-functions.md).

A user function is named by reference, ``"package.module:function"``, and is plain Python that
needs no Flink to be tested:

- ``preprocess(record: dict) -> str | list | dict | None``: the decoded input record (a JSON
  object, or an Avro record as fastavro reads it) becomes the call: a string is the prompt, a list
  the chat messages, a dict ``{"prompt" | "messages", "params"?, "id"?}``; ``None`` skips the call
  (`model.skipped`: the record leaves nothing, or goes to the output topic as it came).
- ``postprocess(record: dict, result: dict | None) -> dict | None``: the input record and the
  result the record contract would write (docs/record-contract.md; ``None`` for a record the
  preprocess skipped under ``model.skipped: forward``) become the output value, a dict the output
  format writes (with Avro, under `output.schema`); ``None`` writes nothing.

Both run on daemon threads of their own, not on the call loop: a function that blocks holds its
thread, never the other calls, a checkpoint or the worker's exit, and one that has not returned
after `async.record_deadline_s` is given up. Whatever goes wrong in a user function (it raises,
returns the wrong type or shape, or is too slow) is a `UserFunctionError`: the record becomes a
`user_function_error` dead letter naming the setting, the function and what happened.

`load_function` is also what the launch's preflight calls (`jobs/launch/preflight.py`), so a
module or function that cannot be found is a one-line config error at start, naming the key.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import logging
import queue
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from udfs.errors import BadInput, ConfigError, UserFunctionError
from udfs.records import Request
from udfs.records.json_format import (
    checked_messages,
    checked_params,
    checked_text,
    lone_surrogate,
)

if TYPE_CHECKING:
    from udfs.config import JobConfig, LimitsConfig

log = logging.getLogger("llmstream.udfs")

PREPROCESS_KEY = "model.preprocess"
POSTPROCESS_KEY = "output.postprocess"
REQUEST_KEYS = frozenset({"prompt", "messages", "params", "id"})
"""What a dict returned by a preprocess may hold."""

THREADS = 4
"""Threads that run user functions per worker (Python holds the GIL while it computes, so more
would only help functions that wait on I/O)."""
SPARE_THREADS = 16
"""Threads started in place of ones held by a function that did not return in time; past that,
records wait for a thread (and are given up at their deadline)."""


def references(config: JobConfig) -> list[tuple[str, str]]:
    """(setting, reference) of each user function the job names."""
    named = ((PREPROCESS_KEY, config.model.preprocess), (POSTPROCESS_KEY, config.output.postprocess))
    return [(key, ref) for key, ref in named if ref is not None]


def load_function(ref: str, key: str) -> Callable[..., Any]:
    """The function ``"module:attribute"`` names, imported; `ConfigError(key, ...)` in one line when
    the module is not found, raises on import, lacks the attribute, or it is not callable."""
    module_name, _, attribute = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name is not None and (module_name == err.name or module_name.startswith(err.name + ".")):
            raise ConfigError(key, f"no module named {err.name!r} (looked in the current directory, python.path "
                                   f"and the installed packages)") from None
        raise ConfigError(key, f"importing {module_name!r} failed: {type(err).__name__}: {err}"[:500]) from None
    except Exception as err:  # noqa: BLE001 - a user module may raise anything on import
        raise ConfigError(key, f"importing {module_name!r} raised {type(err).__name__}: {err}"[:500]) from None
    function = getattr(module, attribute, None)
    if function is None:
        raise ConfigError(key, f"module {module_name!r} has no {attribute!r}")
    if not callable(function):
        raise ConfigError(key, f"{ref} is a {type(function).__name__}, not a function")
    return function  # type: ignore[no-any-return]


def search_path(config: JobConfig, base: Path | None = None) -> list[Path]:
    """Where the launch looks for user modules before sys.path: `python.path` (relative to `base`,
    the current directory by default), then the current directory itself."""
    base = base or Path.cwd()
    return [(base / p).resolve() for p in config.python.path or []] + [base.resolve()]


def shipped_paths(config: JobConfig) -> list[Path]:
    """What a job with user functions ships to its workers (PyFlink's `add_python_file`): the
    top-level module or package of each function, unless it is installed (under sys.prefix,
    where a worker of the same image has it too). Call after `load_function` found them."""
    found: dict[Path, None] = {}
    prefixes = tuple(Path(p).resolve() for p in {sys.prefix, sys.base_prefix})
    for _key, ref in references(config):
        top = sys.modules.get(ref.partition(":")[0].split(".")[0])
        origin = getattr(top, "__file__", None)
        if origin is None:
            continue
        path = Path(origin).resolve()
        if path.name == "__init__.py":
            path = path.parent
        if any(path.is_relative_to(prefix) for prefix in prefixes):
            continue
        found[path] = None
    return list(found)


def _function_name(ref: str, key: str) -> str:
    return f"{key} {ref}"


class _Threads:
    """Daemon threads for user functions: a call is put on a queue and its answer set on the asyncio
    future of the loop that waits for it (if that still waits)."""

    def __init__(self, size: int) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...], asyncio.AbstractEventLoop,
                                             asyncio.Future[Any]] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._started = 0
        self._size = size
        self._spares = 0

    def _start(self) -> None:
        self._started += 1
        threading.Thread(target=self._serve, name=f"llmstream-user-function-{self._started}", daemon=True).start()

    def _serve(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            function, args, loop, future = job
            if future.done():  # given up (its deadline passed, or the stage is closing)
                continue
            try:
                result: Any = function(*args)
                error: BaseException | None = None
            except BaseException as err:  # noqa: BLE001 - the user's exception is the record's answer
                result, error = None, err
            try:
                loop.call_soon_threadsafe(_settle, future, result, error)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass

    async def run(self, function: Callable[..., Any], args: tuple[Any, ...], timeout_s: float) -> Any:
        """`function(*args)` on one of the threads; `TimeoutError` after `timeout_s`."""
        with self._lock:
            if self._started < self._size:
                self._start()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._queue.put((function, args, loop, future))
        try:
            return await asyncio.wait_for(future, timeout_s)
        except TimeoutError:
            with self._lock:  # the thread it runs on (if it started) is held: let another take its place
                if self._spares < SPARE_THREADS:
                    self._spares += 1
                    self._start()
            raise

    def close(self) -> None:
        for _ in range(self._started):
            self._queue.put(None)


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def provisional_id(record: dict[str, Any], key: bytes | None, handle: str, id_field: str | None) -> str:
    """A record's id before its preprocess answers (which may give another): `input.id_field`, else
    the Kafka key as UTF-8, else the record's coordinates (`topic:partition:offset`)."""
    if id_field is not None:
        found = record.get(id_field)
        if isinstance(found, (str, int)) and not isinstance(found, bool) and str(found).strip():
            return str(found)
    if key:
        return key.decode("utf-8", errors="replace")
    return handle


class UserFunctions:
    """A worker's user functions, loaded at open (the launch checked that they load)."""

    def __init__(self, config: JobConfig) -> None:
        self._config = config
        self._deadline_s = config.async_.record_deadline_s
        self.preprocess = load_function(config.model.preprocess, PREPROCESS_KEY) if config.model.preprocess else None
        self.postprocess = (load_function(config.output.postprocess, POSTPROCESS_KEY)
                            if config.output.postprocess else None)
        self._threads = _Threads(THREADS)

    @property
    def count(self) -> int:
        return (self.preprocess is not None) + (self.postprocess is not None)

    def close(self) -> None:
        self._threads.close()

    async def _run(self, key: str, ref: str, function: Callable[..., Any], args: tuple[Any, ...],
                   attempts: int) -> Any:
        try:
            return await self._threads.run(function, args, self._deadline_s)
        except TimeoutError:
            raise UserFunctionError(f"{_function_name(ref, key)} did not return within async.record_deadline_s "
                                    f"({self._deadline_s:g} s)", attempts=attempts) from None
        except asyncio.CancelledError:
            raise
        except Exception as err:  # noqa: BLE001 - the user's own exception, named in the dead letter
            raise UserFunctionError(f"{_function_name(ref, key)} raised {type(err).__name__}: {err}",
                                    attempts=attempts) from None

    async def request(self, request: Request, limits: LimitsConfig) -> Request | None:
        """`request` (the decoded record, no prompt yet) as the preprocess shapes it, or None to skip."""
        assert self.preprocess is not None and self._config.model.preprocess is not None
        ref = self._config.model.preprocess
        shaped = await self._run(PREPROCESS_KEY, ref, self.preprocess, (request.fields,), 0)
        if shaped is None:
            return None
        try:
            return _shaped_request(request, shaped, limits)
        except BadInput as err:
            raise UserFunctionError(f"{_function_name(ref, PREPROCESS_KEY)} returned {err.detail}") from None

    async def output(self, record: dict[str, Any], result: dict[str, Any] | None, attempts: int) -> dict[str, Any] | None:
        """The output value the postprocess makes of `record` and its `result`, or None for none."""
        assert self.postprocess is not None and self._config.output.postprocess is not None
        ref = self._config.output.postprocess
        value = await self._run(POSTPROCESS_KEY, ref, self.postprocess, (record, result), attempts)
        if value is not None and not isinstance(value, dict):
            raise UserFunctionError(f"{_function_name(ref, POSTPROCESS_KEY)} returned a {type(value).__name__}; "
                                    "expected a dict (the output value) or None (no output)", attempts=attempts)
        return value


def _shaped_request(request: Request, shaped: Any, limits: LimitsConfig) -> Request:
    """`request` with the prompt, messages, params and id a preprocess returned; `BadInput` naming
    what is wrong (the caller turns it into a `UserFunctionError`)."""
    if isinstance(shaped, str):
        shaped = {"prompt": shaped}
    elif isinstance(shaped, list):
        shaped = {"messages": shaped}
    if not isinstance(shaped, dict):
        raise BadInput("wrong_type", f"a {type(shaped).__name__}; expected a prompt (str), chat messages (list), "
                                     "a dict with 'prompt' or 'messages' (and 'params', 'id'), or None to skip")
    if lone_surrogate(shaped):  # Python strings may; no request body (UTF-8) can carry one
        raise BadInput("wrong_type", "a string with a lone surrogate (\\ud800-\\udfff), which is not Unicode text")
    unknown = sorted(set(shaped) - REQUEST_KEYS)
    if unknown:
        raise BadInput("wrong_type", f"a dict with {', '.join(map(repr, unknown))}; expected only "
                                      f"{', '.join(sorted(REQUEST_KEYS))}")
    if ("prompt" in shaped) == ("messages" in shaped):
        raise BadInput("wrong_type", "a dict without exactly one of 'prompt' and 'messages'")
    prompt = messages = None
    if "prompt" in shaped:
        prompt = checked_text(shaped, "prompt", max_chars=limits.max_prompt_chars, reason_empty="empty_prompt")
    else:
        messages = checked_messages(shaped["messages"], limits)
    request_id = request.id
    if "id" in shaped:
        request_id = checked_text(shaped, "id", max_chars=limits.max_id_chars, reason_empty="empty_id")
    return dataclasses.replace(request, id=request_id, prompt=prompt, messages=messages,
                               params=checked_params(shaped.get("params")))
