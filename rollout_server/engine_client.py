"""Async client of an engine's native HTTP API: the embedded engine, or SGLang >= 0.5.6.

Everything else in rollwave talks to engines only through this class. It smooths over the SGLang
versions: the weight version is read from ``/model_info`` (0.5.23, embedded) or ``/get_weight_version``
(0.5.6); replies always carry ``meta_info.weight_versions`` (synthesised from ``weight_version`` when the
server predates it); ``update_weights_from_tensor`` opens the 0.5.23 weight-update session when the server
has one. Connection errors are retried with bounded exponential backoff; any other failure raises
``EngineError`` with the server's status and message.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Iterable
from typing import Any

import httpx

RETRYABLE = (httpx.ConnectError, httpx.ConnectTimeout)


class EngineError(RuntimeError):
    """A failed engine call: ``status`` is the HTTP status (None when the server was unreachable)."""

    def __init__(self, status: int | None, message: str, path: str) -> None:
        super().__init__(f"{path}: {message}" if status is None else f"{path}: HTTP {status}: {message}")
        self.status = status
        self.message = message
        self.path = path


def encode_named_tensors(named_tensors: Iterable[tuple[str, Any]]) -> str:
    """One ``serialized_named_tensors`` element in the embedded engine's format (base64 safetensors)."""
    from safetensors.torch import save

    return base64.b64encode(save({name: t.contiguous() for name, t in named_tensors})).decode("ascii")


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
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self.base_url = base_url.rstrip("/")
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=timeout_s,
            headers=headers,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        )
        self._retries = retries
        self._backoff_s = backoff_s
        self._has_session: bool | None = None  # 0.5.23's begin/end_weight_update, probed on first use
        self._session_lock = asyncio.Lock()  # one weight-update session at a time from this client

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

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
        reply = (await self._call("POST", "/generate", body)).json()
        for item in reply if isinstance(reply, list) else [reply]:
            _normalise(item)
        return reply

    async def abort(self, rid: str | None = None) -> None:
        """Abort requests whose rid starts with ``rid``, or all of them."""
        await self._call("POST", "/abort_request", {"abort_all": True} if rid is None else {"rid": rid})

    # ---- pause and weights ---------------------------------------------------------------------

    async def pause(self, mode: str = "retract") -> None:
        await self._call("POST", "/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        await self._call("POST", "/continue_generation", {})

    async def update_weights_from_disk(
        self, model_path: str, weight_version: str | None = None, flush_cache: bool = True
    ) -> dict[str, Any]:
        body = {"model_path": model_path, "weight_version": weight_version, "flush_cache": flush_cache}
        return _checked(await self._call("POST", "/update_weights_from_disk", body), "/update_weights_from_disk")

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: list[str],
        weight_version: str | None = None,
        flush_cache: bool = True,
        load_format: str | None = None,
    ) -> dict[str, Any]:
        """Send serialized tensors (one element per TP rank; ``encode_named_tensors`` for the embedded
        engine, ``MultiprocessingSerializer.serialize(..., output_str=True)`` for SGLang)."""
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
        return _checked(reply, "/update_weights_from_tensor")

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
                return info["weight_version"]
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
            return (await self._http.get("/health", timeout=30.0)).status_code == 200
        except httpx.TransportError:
            return False

    async def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Poll ``/health`` until it answers 200; raises EngineError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not await self.health():
            if time.monotonic() > deadline:
                raise EngineError(None, f"not healthy after {timeout_s:.0f}s", self.base_url + "/health")
            await asyncio.sleep(0.1)

    # ---- transport -----------------------------------------------------------------------------

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
        delay = self._backoff_s
        for attempt in range(self._retries + 1):
            try:
                resp = await self._http.request(method, path, json=body)
                break
            except RETRYABLE as exc:
                if attempt == self._retries:
                    raise EngineError(None, f"cannot connect to {self.base_url} ({exc!r})", path) from exc
                await asyncio.sleep(delay)
                delay *= 2
        if resp.status_code >= 400:
            raise EngineError(resp.status_code, _message(resp), path)
        return resp


def _message(resp: httpx.Response) -> str:
    """The server's message from any of SGLang's error shapes (or the raw text)."""
    try:
        body = resp.json()
    except ValueError:
        return resp.text.strip() or resp.reason_phrase
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        for value in (err, body.get("message"), body.get("detail")):
            if value:
                return str(value)
    return str(body)


def _checked(resp: httpx.Response, path: str) -> dict[str, Any]:
    body = resp.json()
    if not body.get("success", False):
        raise EngineError(resp.status_code, str(body.get("message")), path)
    return body


def _normalise(item: dict[str, Any]) -> None:
    """Give every reply ``weight_versions`` and ``num_retractions``, whatever the SGLang version."""
    meta = item.get("meta_info", {})
    if "weight_versions" not in meta:
        version = meta.get("weight_version")
        end = meta.get("completion_tokens", len(item.get("output_ids", [])))
        spans = [{"version": version, "start": 0, "end": end}] if end else []
        meta["weight_versions"] = None if version is None else spans
    if "num_retractions" not in meta:
        meta["num_retractions"] = meta.get("total_retractions", 0)


class EngineGroup:
    """All engines of one rollout server driven together, so a weight swap pauses and loads them at once."""

    def __init__(self, engines: list[EngineClient]) -> None:
        if not engines:
            raise ValueError("EngineGroup needs at least one engine")
        self.engines = engines

    async def pause(self, mode: str = "retract") -> None:
        await asyncio.gather(*(e.pause(mode) for e in self.engines))

    async def resume(self) -> None:
        await asyncio.gather(*(e.resume() for e in self.engines))

    async def update_weights_from_disk(
        self, model_path: str, weight_version: str | None = None, flush_cache: bool = True
    ) -> list[dict[str, Any]]:
        return list(await asyncio.gather(
            *(e.update_weights_from_disk(model_path, weight_version, flush_cache) for e in self.engines)
        ))
