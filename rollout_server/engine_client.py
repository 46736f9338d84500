"""Async client of an engine's native HTTP API: the embedded engine, or SGLang >= 0.5.6.

Everything else in rollwave talks to engines only through this class. It smooths over the SGLang
versions: the weight version is read from ``/model_info`` (0.5.23, embedded) or ``/get_weight_version``
(0.5.6); replies always carry ``meta_info.weight_versions``. A server that predates per-token spans
(0.5.6) gets one span labelled with the version current when the request started (the version this client
last saw the server serve), and ``meta_info.weight_versions_approximate``: a swap during the request makes
that label older than the tokens after it, never newer. ``update_weights_from_tensor`` opens the 0.5.23
weight-update session when the server has one. Connection errors are retried with bounded exponential
backoff and a connection dropped without an answer is replayed once (``DROPPED``); any other failure raises
``EngineError`` with the server's status and message (None and the transport's error for a timeout, or for a
connection dropped again).

The transport is aiohttp: httpx's connection pool, and that of its fork httpx2, probes idle connections on every
request, and with a batch's worth of requests in flight that was a third to a half of a rollout server's CPU, on
the core it shares with the engine (``bench/http_client.py``, ``bench/RESULTS.md``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import aiohttp

log = logging.getLogger(__name__)
T = TypeVar("T")
RETRYABLE = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
# A kept-alive connection the server closed just as the request went out (its keep-alive ended while this
# process was too busy to send) fails before any answer. Every call here may be sent twice (a reload of the same
# weights, a fresh sample), so such a failure is replayed once on a fresh connection; a timeout is not (the
# server may still be working on it). Connection errors (RETRYABLE) are caught first: they are OS errors too.
DROPPED = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)
# Idle connections are dropped before the server's keep-alive (uvicorn's 5 s, the embedded engine's and
# SGLang's) ends them, and while the engines are released for training (colocated placement) every connection
# sits idle for the whole step.
KEEPALIVE_EXPIRY_S = 2.0


# /health answers that waiting cannot change (a starting engine answers 503, or refuses the connection), with why
FINAL_HEALTH = {
    401: "the engine refused this server's key (engine.api_key)",
    403: "the engine refused this server's key (engine.api_key)",
    404: "no /health here: is this the base URL of an SGLang engine (no path)?",
}


class EngineError(RuntimeError):
    """A failed engine call: ``status`` is the HTTP status (None when the server was unreachable)."""

    def __init__(self, status: int | None, message: str, path: str) -> None:
        super().__init__(f"{path}: {message}" if status is None else f"{path}: HTTP {status}: {message}")
        self.status = status
        self.message = message
        self.path = path


class EngineClient:
    """One engine at ``base_url``; use ``async with`` or call ``aclose``."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 600.0,
        retries: int = 5,
        backoff_s: float = 0.1,
        api_key: str | None = None,
    ) -> None:
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = base_url.rstrip("/")
        self._timeout = aiohttp.ClientTimeout(sock_connect=timeout_s, sock_read=timeout_s)
        self._http: aiohttp.ClientSession | None = None  # opened on first use, in the loop that uses it
        self._retries = retries
        self._backoff_s = backoff_s
        self._has_session: bool | None = None  # 0.5.23's begin/end_weight_update, probed on first use
        self._session_lock = asyncio.Lock()  # one weight-update session at a time from this client
        self.version: str | None = None  # the weight version this client last saw the server serve
        self.lora_path: str | None = None  # the adapter every generate request names (None: the base model)

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None:
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_EXPIRY_S)
            self._http = aiohttp.ClientSession(connector=connector, headers=self._headers, timeout=self._timeout)
        return self._http

    # ---- generation ----------------------------------------------------------------------------

    async def generate(
        self,
        input_ids: list[int] | list[list[int]],
        sampling_params: dict[str, Any] | None = None,
        return_logprob: bool = True,
        rid: str | list[str] | None = None,
    ) -> Any:
        """SGLang's ``/generate`` reply: a dict, or a list of dicts for a 2-D ``input_ids``."""
        body: dict[str, Any] = {
            "input_ids": input_ids,
            "sampling_params": sampling_params or {},
            "return_logprob": return_logprob,
        }
        if rid is not None:
            body["rid"] = rid
        if self.lora_path is not None:
            body["lora_path"] = self.lora_path
        started = self.version if self.version is not None else await self.weight_version()
        reply = (await self._call("POST", "/generate", body)).json()
        for item in reply if isinstance(reply, list) else [reply]:
            _normalise(item, started)
            self.version = item["meta_info"].get("weight_version", self.version)
        return reply

    async def abort(self, rid: str | None = None) -> None:
        """Abort requests whose rid starts with ``rid``, or all of them."""
        await self._call("POST", "/abort_request", {"abort_all": True} if rid is None else {"rid": rid})

    # ---- pause and weights ---------------------------------------------------------------------

    async def pause(self, mode: str = "retract") -> None:
        await self._call("POST", "/pause_generation", {"mode": mode})

    async def resume(self, torch_empty_cache: bool = False) -> None:
        """``continue_generation``; SGLang empties the CUDA cache only when asked (its default, for ``{}``,
        is to empty it at every continue)."""
        await self._call("POST", "/continue_generation", {"torch_empty_cache": torch_empty_cache})

    async def release_memory(self, tags: list[str] | None = None) -> None:
        """``/release_memory_occupation`` of ``tags`` (None: weights, KV cache and CUDA graphs); pause first."""
        await self._call("POST", "/release_memory_occupation", {"tags": tags})

    async def resume_memory(self, tags: list[str] | None = None) -> None:
        """``/resume_memory_occupation``; resumed weights must be updated before generation continues."""
        await self._call("POST", "/resume_memory_occupation", {"tags": tags})

    async def prepare_weights_from_disk(self, model_path: str, prefill_running: bool = False) -> bool:
        """Have the engine read ``model_path`` into spare parameters now, while it generates, so the next
        ``update_weights_from_disk`` of it only swaps them in inside the pause (the embedded engine's own route);
        with ``prefill_running`` it also computes the running requests' KV under them, for a load that retracts
        them. False from an engine without it (SGLang), which reads the directory inside the load instead."""
        body = {"model_path": model_path, "prefill_running": prefill_running}
        try:
            _checked(await self._call("POST", "/prepare_weights_from_disk", body), "/prepare_weights_from_disk")
        except EngineError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    async def update_weights_from_disk(
        self, model_path: str, weight_version: str | None = None, flush_cache: bool = True
    ) -> dict[str, Any]:
        body = {"model_path": model_path, "weight_version": weight_version, "flush_cache": flush_cache}
        reply = _checked(await self._call("POST", "/update_weights_from_disk", body), "/update_weights_from_disk")
        self.version = weight_version if weight_version is not None else self.version
        return reply

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict[str, Any]:
        """Load (SGLang) or load and replace (the embedded engine) the peft adapter directory ``lora_path``."""
        return _checked(await self._call("POST", "/load_lora_adapter",
                                              {"lora_name": lora_name, "lora_path": lora_path}), "/load_lora_adapter")

    async def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        return _checked(await self._call("POST", "/unload_lora_adapter", {"lora_name": lora_name}),
                             "/unload_lora_adapter")

    async def update_weight_version(self, version: str) -> None:
        """Label what is served from now on ``version``; requests in flight go on (SGLang aborts them by default)."""
        await self._call("POST", "/update_weight_version", {"new_version": version, "abort_all_requests": False})
        self.version = version

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: list[str],
        weight_version: str | None = None,
        flush_cache: bool = True,
        load_format: str | None = None,
    ) -> dict[str, Any]:
        """Send serialized tensors, one element per TP rank, in the engine's own format (SGLang:
        ``MultiprocessingSerializer.serialize(..., output_str=True)``; the embedded engine: docs/engine.md)."""
        body = {
            "serialized_named_tensors": serialized_named_tensors,
            "weight_version": weight_version,
            "flush_cache": flush_cache,
            "load_format": load_format,
        }
        async with self._session_lock:
            opened = await self._begin_session()
            try:
                reply = await self._call("POST", "/update_weights_from_tensor", body)
            finally:
                if opened:
                    await self._call("POST", "/end_weight_update", {})
        checked = _checked(reply, "/update_weights_from_tensor")
        self.version = weight_version if weight_version is not None else self.version
        return checked

    async def _begin_session(self) -> bool:
        if self._has_session is False:
            return False
        try:
            await self._call("POST", "/begin_weight_update", {"selector": "all"})
        except EngineError as exc:
            if exc.status != 404:
                raise
            self._has_session = False
            return False
        self._has_session = True
        return True

    async def weight_version(self) -> str | None:
        """The version being served; None when the server cannot say (SGLang < 0.5.6)."""
        for path in ("/model_info", "/get_weight_version"):
            try:
                info = (await self._call("GET", path)).json()
            except EngineError as exc:
                if exc.status == 404:
                    continue
                raise
            if "weight_version" in info:
                self.version = info["weight_version"]
                return self.version
        return None

    async def model_info(self) -> dict[str, Any]:
        try:
            return (await self._call("GET", "/model_info")).json()
        except EngineError as exc:
            if exc.status != 404:
                raise
            return (await self._call("GET", "/get_model_info")).json()

    async def flush_cache(self) -> None:
        await self._call("POST", "/flush_cache")

    # ---- liveness ------------------------------------------------------------------------------

    async def health(self) -> bool:
        """One probe, no retries: True when ``/health`` answers 200."""
        try:
            return await self._unhealthy(30.0) is None
        except EngineError:  # refused, or no engine there: not healthy either
            return False

    async def _unhealthy(self, timeout_s: float) -> str | None:
        """One probe of ``/health`` bounded by ``timeout_s``: None when it answers 200, else why not. EngineError for
        an answer no wait can change: the key refused (401, 403), no such route (404: not an engine's URL)."""
        try:
            async with self._session().get(self.base_url + "/health",
                                           timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                if resp.status in FINAL_HEALTH:
                    raise EngineError(resp.status, FINAL_HEALTH[resp.status], self.base_url + "/health")
                return None if resp.status == 200 else f"HTTP {resp.status}"
        except TimeoutError:
            return f"no answer within {timeout_s:.3g}s"
        except aiohttp.ClientError as exc:
            return f"{type(exc).__name__}: {exc}"

    async def wait_ready(self, timeout_s: float = 3600.0, log_every_s: float = 30.0) -> None:
        """Poll ``/health`` until it answers 200, logging every ``log_every_s`` that it still waits (a big model
        takes minutes to load); raises EngineError after ``timeout_s``, saying what the last probe got, and at once
        for an answer waiting cannot change (``FINAL_HEALTH``: a wrong key waited out the hour). No probe outlasts
        the time left: an engine that accepts and never answers used to hold one for 30 s past it."""
        start = time.monotonic()
        next_log = start + log_every_s
        while (why := await self._unhealthy(max(0.1, min(30.0, start + timeout_s - time.monotonic())))) is not None:
            now = time.monotonic()
            if now >= start + timeout_s:
                raise EngineError(None, f"not healthy after {timeout_s:.0f}s (last probe: {why})",
                                  self.base_url + "/health")
            if now >= next_log:
                log.info("waiting for the engine at %s to be healthy: %.0f s of %.0f s (%s)", self.base_url,
                         now - start, timeout_s, why)
                next_log += log_every_s
            await asyncio.sleep(0.1)

    # ---- transport -----------------------------------------------------------------------------

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Reply:
        refused = 0
        replayed = False
        while True:
            try:
                async with self._session().request(method, self.base_url + path, json=body) as resp:
                    reply = Reply(resp.status, resp.reason or "", await resp.read())
                break
            except RETRYABLE as exc:
                if refused == self._retries:
                    raise EngineError(None, f"cannot connect to {self.base_url} ({exc!r})", path) from exc
                await asyncio.sleep(self._backoff_s * 2**refused)
                refused += 1
            except DROPPED as exc:
                if replayed:
                    raise EngineError(None, f"{self.base_url}: {type(exc).__name__}: {exc}", path) from exc
                replayed = True
                log.info("%s%s: the connection dropped without an answer (%s); replaying it on a fresh one",
                         self.base_url, path, type(exc).__name__)
            except TimeoutError as exc:
                waited = self._timeout.sock_read
                raise EngineError(None, f"{self.base_url}: no answer within {waited:g} s", path) from exc
            except aiohttp.ClientError as exc:
                raise EngineError(None, f"{self.base_url}: {type(exc).__name__}: {exc}", path) from exc
        if reply.status >= 400:
            raise EngineError(reply.status, _message(reply), path)
        return reply


@dataclass(frozen=True)
class Reply:
    """An engine's answer, read whole."""

    status: int
    reason: str
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def text(self) -> str:
        return self.body.decode(errors="replace")


def _message(resp: Reply) -> str:
    """The server's message from any of SGLang's error shapes (or the raw text)."""
    try:
        body = resp.json()
    except ValueError:
        return resp.text.strip() or resp.reason
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        for value in (err, body.get("message"), body.get("error_message"), body.get("detail")):
            if value:
                return str(value)
    return str(body)


def _checked(resp: Reply, path: str) -> dict[str, Any]:
    """A ``{success, message}`` (or the LoRA routes' ``{success, error_message}``) reply, raised when not a success."""
    try:
        body = resp.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):  # a proxy's page, say: the call's effect is unknown, so it failed
        raise EngineError(resp.status, f"reply is not a JSON object: {resp.text[:200]!r}", path)
    if not body.get("success", False):
        raise EngineError(resp.status, str(body.get("message") or body.get("error_message")), path)
    return body


def _normalise(item: dict[str, Any], started: str | None) -> None:
    """Give every reply ``weight_versions`` and ``num_retractions``, whatever the SGLang version; without the
    server's spans, one span of ``started`` (the version when the request started), marked approximate."""
    meta = item.setdefault("meta_info", {})
    if "weight_versions" not in meta:
        version = started if started is not None else meta.get("weight_version")
        end = meta.get("completion_tokens", len(item.get("output_ids", [])))
        spans = [{"version": version, "start": 0, "end": end}] if end else []
        meta["weight_versions"] = None if version is None else spans
        meta["weight_versions_approximate"] = True
    if "num_retractions" not in meta:
        meta["num_retractions"] = meta.get("total_retractions", 0)


class EngineGroup:
    """All engines of one rollout server driven together, so a weight swap pauses and loads them at once."""

    def __init__(self, engines: list[EngineClient]) -> None:
        if not engines:
            raise ValueError("EngineGroup needs at least one engine")
        self.engines = engines

    async def _each(self, call: Callable[[EngineClient], Awaitable[T]]) -> list[T]:
        """``call`` on every engine at once, returning or raising only once each has answered: a caller that
        acts on a failure (a continue after a failed pause) must not race a call still in flight on another.
        The failure raised is the first engine's (in ``engine.urls`` order), named by its URL."""
        results = await asyncio.gather(*(call(e) for e in self.engines), return_exceptions=True)
        for engine, result in zip(self.engines, results, strict=True):
            if isinstance(result, EngineError) and len(self.engines) > 1:
                raise EngineError(result.status, f"engine {engine.base_url}: {result.message}",
                                  result.path) from result
            if isinstance(result, BaseException):
                raise result
        return cast("list[T]", results)

    async def pause(self, mode: str = "retract") -> None:
        await self._each(lambda e: e.pause(mode))

    async def resume(self, torch_empty_cache: bool = False) -> None:
        await self._each(lambda e: e.resume(torch_empty_cache))

    async def release_memory(self, tags: list[str] | None = None) -> None:
        await self._each(lambda e: e.release_memory(tags))

    async def resume_memory(self, tags: list[str] | None = None) -> None:
        await self._each(lambda e: e.resume_memory(tags))

    async def prepare_weights_from_disk(self, model_path: str, prefill_running: bool = False) -> bool:
        """True when every engine prepared ``model_path``."""
        return all(await self._each(lambda e: e.prepare_weights_from_disk(model_path, prefill_running)))

    async def update_weights_from_disk(
        self, model_path: str, weight_version: str | None = None, flush_cache: bool = True
    ) -> list[dict[str, Any]]:
        return await self._each(lambda e: e.update_weights_from_disk(model_path, weight_version, flush_cache))

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> list[dict[str, Any]]:
        return await self._each(lambda e: e.load_lora_adapter(lora_name, lora_path))

    async def unload_lora_adapter(self, lora_name: str) -> None:
        await self._each(lambda e: e.unload_lora_adapter(lora_name))

    async def update_weight_version(self, version: str) -> None:
        await self._each(lambda e: e.update_weight_version(version))
