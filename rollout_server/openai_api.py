"""An OpenAI-compatible ``/v1/chat/completions`` on the rollout server that records token-exact episodes.

Agents written against the ``openai`` client train unchanged: each sample gets an episode, and the
agent's base URL is ``http://host:port/episodes/<id>/v1`` with the episode's key as its API key (or the
plain ``/v1`` with the ``X-Episode-Id`` header). The first call renders the prompt with the chat template;
every assistant turn appends the engine's ``output_ids`` with their behaviour logprobs and versions
(``core.trajectory``, as the built-in agent loop does). When the agent re-sends its history, the
messages already recorded must come back unchanged; only the new ones (tool results, user turns) are
rendered, as a template delta after the recorded tokens. So the trainer sees exactly the tokens the
engine saw. An agent that edited its history is still answered, but its episode is marked
``history_mismatch``, counted, and never trained. An engine abort is answered 503 ``engine_aborted`` and
fails the episode (``abort``, never trained); an unexpected failure is a 500 ``internal_error`` that fails it
too. A turn is cut off (``length``; ``max_total_tokens`` at the context
budget) only when it lacks its end token, and an episode whose next request no longer fits the context (400
``context_length_exceeded``) ends ``max_total_tokens``: both count as truncated. A first request that does not fit
gets the same 400 but ends the episode ``prompt_too_long``: the worker dead-letters the task, as the built-in loop
does with a prompt that leaves no room to generate.

Sampling (temperature, top_p, top_k, the max_new_tokens cap) is the job's, so behaviour logprobs match what the trainer
assumes: a request asking for other values, penalties, ``min_tokens``, a ``seed``, ``logit_bias`` or constrained
generation (a ``response_format`` other than text; vLLM's and SGLang's ``guided_*``, ``structured_outputs``, ``regex``,
``ebnf``, ``allowed_token_ids``, ``bad_words``; beam search, ``best_of``) is refused (400 naming the field), neither
sampled nor silently ignored. ``max_tokens`` (or ``max_completion_tokens``, which wins when both are sent, as in vLLM
and SGLang) below the job's cap lowers it for the turn. One above the cap, or above the room left in
``max_total_tokens``, is lowered to it rather than refused, as OpenAI, vLLM and SGLang refuse one beyond the model's
limit: agents send a generous max_tokens by default and cannot know a job's cap, and a cap changes no sampling
distribution, only where a turn may be cut. The lowering is not silent: it is counted
(``rollwave_rollout_openai_max_tokens_lowered_total``, by the limit that lowered it), and a turn cut there ends
``finish_reason="length"`` (the sample truncated), as one cut at the agent's own max_tokens. A message the chat template
refuses is a 400 too, as is a string that is no Unicode text (a lone surrogate, which JSON's escapes allow), naming
where it is. ``stop`` sequences end the turn (the tokens through the match are recorded; the content ends before it, as
OpenAI's). ``logprobs=true`` returns the recorded behaviour logprobs (``top_logprobs`` is refused: the engines give
none). ``tool_choice``: ``auto`` parses the calls the model writes; ``none`` parses none (a call the model writes anyway
is content, verbatim) and, on the request that renders the prompt, leaves the tools out of it, as SGLang does;
``required`` and a named function are honoured by prefilling the call opening the chat template writes
(``<tool_call>\\n``, through ``"arguments":`` for a named one) after the assistant header. Those tokens are recorded as
template tokens (loss_mask 0, no behaviour logprob; prompt tokens in ``usage``, none in ``logprobs``): the policy did
not sample them, and what it samples after them is conditioned on them exactly as the engine saw. The call's body is the
model's: one that does not parse comes back as content, as under ``auto``. A template that writes calls otherwise makes
them a 400. A tool marked ``strict`` is not enforced by constraining generation (the behaviour logprobs would no longer
be the policy's sampling distribution the trainer assumes); its calls' arguments are validated against its
``parameters`` instead (a schema that is no JSON Schema is a 400 naming it), and a turn with a call that breaks its
schema comes back whole as content, finish ``stop``, as a call that does not parse: the agent never gets a strict call
OpenAI would not have given (the client's ``parse`` helper would raise on it). Each such call is counted
(``rollwave_rollout_tool_calls_total``, outcome ``parse_error``) and recorded on the sample as a failed call. As the
prompt is rendered once, by the episode's first request, and later turns are template deltas, a later request's
``tool_choice`` changes what is prefilled and parsed, never the tools the prompt shows. Where SGLang, which renders each
request anew, differs: a named function leaves every tool in the prompt (SGLang shows only that one; vLLM all): the
named turn samples only the arguments, and the episode's later turns, once the agent sets ``auto`` again (the
openai-agents SDK does after the first call), need the others; a later ``none`` leaves the prompt's tools in it; and a
request that lets the model call tools when the prompt was rendered under ``none`` is a history mismatch (answered from
a prompt rendered anew with them, as SGLang would, and never trained: a policy must not learn to call tools its prompt
does not show). ``parallel_tool_calls=false`` adds the call's closing tag (``</tool_call>``) to the stop strings: the
turn ends after the first call, whose tokens are the policy's; the end token that follows is a template token. The
legacy ``functions``/``function_call``, audio output, ``web_search_options``, ``moderation``, ``reasoning_effort``,
``verbosity``, ``ignore_eos``, the agent's own ``chat_template`` or ``chat_template_kwargs``, and vLLM's and SGLang's
extensions that would change the prompt or the reply (``continue_final_message``, ``add_generation_prompt=false``,
``echo``, ``input_ids``, ``lora_path``, ``stop_token_ids``, ``include_stop_str_in_output``, ``no_stop_trim``) are
refused (400 naming the field); other fields the endpoint does not act on, which change nothing the agent gets
(``user``, ``metadata``, ``store``, ``prediction``, ``service_tier``, ...), are ignored, and a null is taken as the
field's absence, as OpenAI takes it (a tool's ``parameters`` too). Streaming sends the finished turn as OpenAI-shaped
chunks (the engine client has no token stream).

A retried request is idempotent: a request equal (messages and parameters) to the episode's last answered one gets
that answer again, same id, without generating or touching the episode (``outcome="replayed"``). The openai client
retries after a timeout or a connection error, when the first attempt may have been answered already (its re-sent
history then lacks that turn, which would otherwise be a history mismatch); other clients retry too, so equality
decides, not the client's ``x-stainless-retry-count``, except that a request the openai client marks as its first
attempt (``0``) is never a retry: an agent that asks again on purpose (a resample loop, calls at once) gets a new
sample, its episode then an edited history as before. A retry that comes while the first attempt is generating waits
for it (the episode's lock), then gets its answer. Refusals tell the client not to retry (``x-should-retry: false``):
the same request would be refused again, and after an engine failure, which ends the episode, a retry would only hide
the 503 behind a 409.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import uvicorn
from fastapi import Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from jinja2 import TemplateError
from jsonschema.exceptions import SchemaError, best_match
from jsonschema.protocols import Validator
from jsonschema.validators import validator_for
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
)
from pydantic_core import PydanticCustomError
from referencing import Registry
from referencing.exceptions import Unresolvable
from referencing.jsonschema import specification_with
from starlette.exceptions import HTTPException as StarletteHTTPException

from buffer.schema import Sample, ToolCallRecord
from core.config import RolloutConfig
from core.net import guarded_http, http_url
from core.rewards import RewardComputer
from core.text_files import json_path, lone_surrogate_at
from core.trajectory import ChatRenderer, TrajectoryBuilder, model_stop_ids
from rollout_server.agent_loop import EngineReplyError, PromptTooLong, ends_turn, turn_from_reply
from rollout_server.engine_client import EngineClient, EngineError
from rollout_server.metrics import RolloutMetrics
from rollout_server.tool_parser import BOT_TOKEN, EOT_TOKEN, parse_tool_calls
from rollout_server.tools.base import FUNCTION_NAME

log = logging.getLogger(__name__)
FIRST_ATTEMPT = "0"  # x-stainless-retry-count of the openai client's first try at a request

FAILED_REASONS = ("history_mismatch", "agent_error", "agent_timeout", "error")


class APIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, code: str, type_: str = "invalid_request_error",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.type, self.param = status, message, code, type_, param

    def response(self) -> JSONResponse:
        body = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return JSONResponse({"error": body}, status_code=self.status, headers={"x-should-retry": "false"})


class _Server(uvicorn.Server):
    """uvicorn without its SIGINT/SIGTERM handlers: the rollout server owns the signals (graceful drain)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class FunctionDef(BaseModel):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=dict)
    strict: bool | None = None  # checked on the calls, generation not constrained (_strict_validators)

    @field_validator("parameters", mode="before")
    @classmethod
    def _null_parameters(cls, value: Any) -> Any:
        """``null`` is taken as absent, as elsewhere: a function without parameters, rendered as one left out."""
        return {} if value is None else value


class ToolDef(BaseModel):
    type: Literal["function"]
    function: FunctionDef


class TextPart(BaseModel):
    """A content part: only text, as the chat template takes text (an image part would silently vanish)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """A chat message as the template renders it, checked before any of it is recorded; other OpenAI
    fields (``refusal``, ``audio``, ...) are accepted and ignored."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]  # developer: OpenAI's newer name for system
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="wrap")
    @classmethod
    def _content(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        """One clear message instead of one error per member of the union."""
        try:
            return handler(value)
        except ValidationError:
            if not isinstance(value, list):
                raise PydanticCustomError("content", "expected a string, null or a list of text parts") from None
            i = next(i for i, part in enumerate(value) if not _is_text_part(part))
            raise PydanticCustomError(
                "content", "part {index} is not a text part (type 'text' with a string 'text'; only text is supported)",
                {"index": i}) from None

    @field_validator("tool_calls")
    @classmethod
    def _only_assistant_calls(cls, value: list[ToolCall] | None, info: ValidationInfo) -> list[ToolCall] | None:
        if value and info.data.get("role", "assistant") != "assistant":
            raise ValueError(f"only assistant messages carry tool calls, not {info.data['role']} messages")
        return value


_DATA_KEYWORDS = {"enum", "const", "default", "examples"}  # their values are data, not schemas: a "$ref" there is none
_SCHEMA_MAPS = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}  # name -> schema


def _refs(schema: Any) -> Iterator[str]:
    """Every ``$ref`` in a JSON Schema (one in data, or a property named ``enum``, is told apart)."""
    if isinstance(schema, list):
        for value in schema:
            yield from _refs(value)
    if not isinstance(schema, dict):
        return
    if isinstance(schema.get("$ref"), str):
        yield schema["$ref"]
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            for sub in value.values():
                yield from _refs(sub)
        elif key not in _DATA_KEYWORDS:
            yield from _refs(value)


def _strict_validator(schema: dict[str, Any]) -> Validator | str:
    """A validator of the arguments of a ``strict`` tool's calls, or why its ``parameters`` cannot be one: no JSON
    Schema, or one that refers to what it does not hold (nothing is fetched), which would fail once a call reaches
    it."""
    try:
        cls = validator_for(schema)
        cls.check_schema(schema)
        root = Registry().resolver_with_root(specification_with(cls.META_SCHEMA["$schema"]).create_resource(schema))
        for ref in _refs(schema):
            root.lookup(ref)
    except SchemaError as exc:
        return exc.message
    except Unresolvable as exc:
        return f"unresolvable $ref: {exc}"
    except (TypeError, AttributeError):  # validator_for, on a $schema that is no string
        return "$schema must be the URI of a JSON Schema draft"
    except RecursionError:
        return "nested too deep to check"
    return cls(schema)


def _strict_validators(tools: list[ToolDef] | None) -> dict[str, Validator]:
    """The validators of the ``strict`` tools, by name; a strict schema that cannot be checked is a 400 naming it,
    before anything is generated (OpenAI refuses it too)."""
    validators: dict[str, Validator] = {}
    for i, tool in enumerate(tools or []):
        if tool.function.strict:
            checked = _strict_validator(tool.function.parameters)
            if isinstance(checked, str):
                raise _field_error(("tools", i, "function", "parameters"),
                                   f"not a JSON Schema strict can be checked against: {checked}")
            validators[tool.function.name] = checked
    return validators


def _strict_error(validator: Validator, arguments: dict[str, Any]) -> str | None:
    """Why a strict tool's call does not conform to its schema, or None when it does."""
    try:
        error = best_match(validator.iter_errors(arguments))
    except RecursionError:  # a schema that refers to itself, and arguments nested past Python's limit
        return "arguments nested too deep to check against the strict schema"
    return None if error is None else f"arguments break the strict schema at {error.json_path}: {error.message}"


def _is_text_part(part: Any) -> bool:
    try:
        TextPart.model_validate(part)
    except ValidationError:
        return False
    return True


def _closed(episode_id: str) -> APIError:
    return APIError(404, f"episode {episode_id!r} does not exist or is closed", "episode_not_found")


def _field_error(loc: tuple[int | str, ...], message: str) -> APIError:
    """A 400 naming the field at ``loc`` (its path as ``param``), coded by the part of the body it is in; an empty
    ``loc`` is the body itself."""
    if not loc:
        return APIError(400, f"the body: {message}", "invalid_request")
    code = {"tools": "invalid_tools", "messages": "invalid_messages"}.get(str(loc[0]), "invalid_request")
    where = json_path(loc)
    return APIError(400, f"{where}: {message}", code, param=where)


MAX_STOP = 32  # SGLang's limit (OpenAI documents 4; vLLM has none): more would fail the episode at the engine
_EXPECTED = {
    "tool_choice": 'expected "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
    "stop": "expected a string, a list of strings or null",
}
# Fields asking for output this endpoint cannot give: ignored, the agent would get something else than it asked for (a
# call written as content, no audio, no search, the default reasoning, unconstrained text), so each is refused naming
# it; (asked?, why)
_UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "functions": (bool, "it is the legacy function-calling API (send tools)"),
    "function_call": (lambda v: v is not None, "it is the legacy function-calling API (send tool_choice)"),
    "modalities": (lambda v: v not in (None, [], ["text"]), "only text is generated"),
    "audio": (lambda v: v is not None, "only text is generated"),
    "web_search_options": (lambda v: v is not None, "the model does not search the web"),
    "moderation": (lambda v: v is not None, "no moderation is run"),
    "reasoning_effort": (lambda v: v is not None, "the policy reasons as it samples; it has no effort setting"),
    "verbosity": (lambda v: v is not None, "the policy answers at the length it samples"),
    # vLLM's and SGLang's extensions, which agents send as extra_body: another prompt, or constrained generation
    "chat_template": (bool, "the job's chat template renders the episode"),
    "chat_template_kwargs": (bool, "the job's chat template renders the episode, without arguments"),
    "ignore_eos": (bool, "the turn ends at the model's end token"),
    "stop_token_ids": (bool, "the turn ends at the model's end tokens or a stop string (send stop)"),
    "include_stop_str_in_output": (bool, "the content ends before the matched stop sequence, as OpenAI's"),
    "no_stop_trim": (bool, "the content ends before the matched stop sequence, as OpenAI's"),
    "continue_final_message": (bool, "each request is answered by a new assistant turn"),
    "add_generation_prompt": (lambda v: v is False, "each request is answered by a new assistant turn"),
    "echo": (bool, "the reply is the new turn only"),
    "input_ids": (lambda v: v is not None, "the episode's tokens are rendered from messages"),
    "lora_path": (bool, "the episode samples the job's policy"),
    "use_beam_search": (bool, "the policy is sampled, one sample a request"),
    "best_of": (lambda v: v not in (None, 1), "the policy is sampled, one sample a request"),
} | {name: (bool, "generation is not constrained") for name in (
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs", "regex", "ebnf",
    "allowed_token_ids", "bad_words")}


class StreamOptions(BaseModel):
    """Checked with the body: one that is not an object is a 400, not an error once the stream has begun."""

    model_config = ConfigDict(extra="allow")

    include_usage: bool | None = None


class ChatRequest(BaseModel):
    """The fields we act on or refuse; other OpenAI fields (``user``, ``metadata``, ...) are accepted and ignored,
    those in ``_UNSUPPORTED`` refused."""

    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1, le=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    parallel_tool_calls: bool | None = None
    # sampling: checked against the job's (``EpisodeStore._refuse_sampling``), never silently ignored
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("tool_choice", "stop", mode="wrap")
    @classmethod
    def _one_error(cls, value: Any, handler: ValidatorFunctionWrapHandler, info: ValidationInfo) -> Any:
        """One message naming the field, not one per member of its union (whose tags would land in ``param``);
        a named ``tool_choice`` must name its function."""
        try:
            out = handler(value)
        except ValidationError:
            raise PydanticCustomError("invalid", _EXPECTED[info.field_name]) from None
        if isinstance(out, dict):  # a named tool_choice
            function = out.get("function")
            if out.get("type") != "function" or not isinstance(function, dict) or not isinstance(
                    function.get("name"), str):
                raise PydanticCustomError("invalid", _EXPECTED[info.field_name])
        return out

    def stop_sequences(self) -> list[str]:
        """``stop`` as the engine takes it: a list of non-empty strings."""
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return [s for s in stops if s]

    def engine_stops(self, names: set[str]) -> list[str]:
        """What ends the turn at the engine: the ``stop`` sequences, and with ``parallel_tool_calls=false`` (at most
        one call, as OpenAI's) the first call's closing tag when calls are parsed. The tokens through a match are
        the policy's either way; only the agent's own stop sequences are cut from the content."""
        stops = self.stop_sequences()
        if self.parallel_tool_calls is False and names and EOT_TOKEN not in stops:
            stops.append(EOT_TOKEN)
        if len(stops) > MAX_STOP:
            ours = " (one is the call's closing tag, for parallel_tool_calls=false)" if EOT_TOKEN in stops else ""
            raise APIError(400, f"stop: at most {MAX_STOP} stop sequences{ours}, got {len(stops)}",
                           "invalid_request", param="stop")
        return stops


class RewardRequest(BaseModel):
    reward: float = Field(allow_inf_nan=False)  # NaN or inf would poison the group's advantages
    info: dict[str, Any] = Field(default_factory=dict)


@dataclass
class Completion:
    """An answered turn as the agent got it, kept so that a retry of its request gets the same answer (same id)."""

    id: str
    created: int
    message: dict[str, Any]
    finish: str
    usage: dict[str, int]
    logprobs: dict[str, Any] | None


@dataclass
class AgentEpisode:
    """One sample's record while an external agent drives it."""

    episode_id: str
    key: str
    task: Any
    sample_index: int
    config: RolloutConfig
    engine: EngineClient
    reward_fn: RewardComputer
    queued: float
    builder: TrajectoryBuilder | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None  # the requests' tools, as sent (a change is an edited history)
    shown: list[dict[str, Any]] | None = None  # the tools the recorded prompt holds (EpisodeStore._shown_tools)
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    num_turns: int = 0
    final_text: str = ""
    last_reason: str = "stop"
    reward: tuple[float, dict[str, Any]] | None = None
    failure: tuple[str, str] | None = None  # (finish_reason, message)
    started: float = field(default_factory=time.time)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last: tuple[bytes, Completion] | None = None  # the last answered request's digest and its answer


def _text(content: Any) -> str:
    """Message content as text: a string, None, or OpenAI content parts, joined by a space as SGLang flattens them
    for a chat template that takes a string (joined by nothing, "Hello" and "world" became "Helloworld")."""
    if content is None:
        return ""
    if isinstance(content, list):
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def recorded(message: dict[str, Any]) -> dict[str, Any]:
    """A client message as the episode keeps it: content parts as their text, so the sample's messages (which a
    reward function reads) hold text content, as the built-in loop's do."""
    if isinstance(message.get("content"), list):
        return {**message, "content": _text(message["content"])}
    return dict(message)


def _arguments(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw
    return raw


def canonical(message: dict[str, Any]) -> dict[str, Any]:
    """What of a message the recorded tokens depend on (ids and names the client adds are ignored)."""
    calls = [(c.get("function", {}).get("name"), _arguments(c.get("function", {}).get("arguments")))
             for c in message.get("tool_calls") or []]
    return {"role": message.get("role"), "content": _text(message.get("content")).strip(), "tool_calls": calls}


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A client message as the chat template takes it (text content, parsed call arguments)."""
    role = "system" if message.get("role") == "developer" else message.get("role")  # chat templates know system
    out: dict[str, Any] = {"role": role, "content": _text(message.get("content"))}
    if message.get("tool_calls"):
        out["tool_calls"] = [{"type": "function", "function": {"name": c["function"]["name"],
                                                               "arguments": _arguments(c["function"]["arguments"])}}
                             for c in message["tool_calls"]]
    if message.get("name"):
        out["name"] = message["name"]
    return out


class EpisodeStore:
    """Open episodes, the HTTP app that serves them, and closing them into Samples."""

    def __init__(self, tokenizer: Any, model_name: str, metrics: RolloutMetrics | None = None) -> None:
        self.renderer = ChatRenderer(tokenizer)
        self.stop_ids = model_stop_ids(tokenizer)
        self.model_name = model_name
        self.metrics = metrics if metrics is not None else RolloutMetrics()
        self.episodes: dict[str, AgentEpisode] = {}
        self.url = ""  # http://host:port, set once the server is bound
        self.app = self._build_app()

    @contextlib.asynccontextmanager
    async def serving(self, host: str, port: int, timeout_s: float = 30.0) -> AsyncIterator[str]:
        """Serve the endpoint on ``host:port`` (0: any free port) in this event loop; yields its URL."""
        server = _Server(uvicorn.Config(self.app, host=host, port=port, log_level="warning", lifespan="off",
                                        server_header=False, http=guarded_http(self._refused_http)))
        task = asyncio.create_task(server.serve())
        deadline = time.monotonic() + timeout_s
        while not server.started:
            if task.done() or time.monotonic() > deadline:
                task.cancel()
                raise RuntimeError(f"episode endpoint: could not listen on {host}:{port} within {timeout_s:.0f}s")
            await asyncio.sleep(0.01)
        bound = server.servers[0].sockets[0].getsockname()
        self.url = http_url(host, bound[1])
        try:
            yield self.url
        finally:
            server.should_exit = True
            await task

    def _refused_http(self, client: tuple[str, int] | None, reason: str, detail: str) -> None:
        """A request uvicorn refuses before the endpoint sees it (``guarded_http``): counted and logged."""
        self.metrics.openai_requests.labels(outcome=reason).inc()
        log.warning("refused a request from %s (400 %s): %s", client[0] if client else "?", reason, detail)

    # ---- lifecycle -----------------------------------------------------------------------------

    def open(self, task: Any, sample_index: int, config: RolloutConfig, engine: EngineClient,
             reward_fn: RewardComputer, queued: float | None = None) -> AgentEpisode:
        ep = AgentEpisode(
            episode_id=uuid.uuid4().hex, key="ep-" + secrets.token_urlsafe(24), task=task,
            sample_index=sample_index, config=config, engine=engine, reward_fn=reward_fn,
            queued=time.time() if queued is None else queued,
        )
        self.episodes[ep.episode_id] = ep
        self.metrics.inflight_requests.inc()
        return ep

    def base_url(self, ep: AgentEpisode) -> str:
        """What the agent passes as the openai client's ``base_url``."""
        return f"{self.url}/episodes/{ep.episode_id}/v1"

    def fail(self, ep: AgentEpisode, reason: str, message: str) -> None:
        """Mark the episode failed (it will not be trained); the first failure wins."""
        if ep.failure is None:
            ep.failure = (reason, message)

    def discard(self, ep: AgentEpisode) -> None:
        """End the episode without a Sample (its run was cancelled); later requests, and those still waiting
        for the episode, get 404."""
        if self.episodes.pop(ep.episode_id, None) is not None:
            self.metrics.inflight_requests.dec()

    async def close(self, ep: AgentEpisode) -> Sample:
        """The episode as a Sample; the reward is the posted one, else the job's reward function."""
        self.discard(ep)
        async with ep.lock:  # a request still in flight finishes first
            if ep.builder is None:
                self.fail(ep, "agent_error", "the agent made no request")
            builder = ep.builder or TrajectoryBuilder(self.renderer.prompt_ids(ep.task.messages, None))
            if ep.failure is not None:
                reason, message = ep.failure
                reward, info = 0.0, {"error": message}
            else:
                reason = ep.last_reason
                if ep.reward is not None:
                    reward, info = ep.reward
                else:
                    reward, info = await ep.reward_fn.score(ep.task, ep.messages, ep.final_text, [])
        self.metrics.finish_reasons.labels(reason=reason).inc()
        self.metrics.episode_turns.observe(ep.num_turns)
        if ep.failure is not None:  # as the built-in loop: a failed episode has no reward to observe
            self.metrics.failed.labels(reason=reason).inc()
        else:
            self.metrics.reward.observe(reward)
        return Sample(
            sample_index=ep.sample_index, prompt_len=builder.prompt_len, **builder.arrays(),
            versions_approximate=builder.versions_approximate, reward=reward, reward_info=info, finish_reason=reason,
            num_turns=ep.num_turns, tool_calls=ep.tool_calls, messages=ep.messages, queued=ep.queued,
            started=ep.started, finished=time.time(),
        )

    # ---- HTTP ----------------------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="rollwave episode endpoint", docs_url=None, redoc_url=None)

        @app.exception_handler(APIError)
        async def _api_error(request: Request, exc: APIError) -> JSONResponse:
            self.metrics.openai_requests.labels(outcome=exc.code).inc()
            log.warning("refused %s %s (%d %s): %s", request.method, request.url.path, exc.status, exc.code,
                        exc.message)
            return exc.response()

        @app.exception_handler(StarletteHTTPException)
        async def _unknown_url(request: Request, exc: StarletteHTTPException) -> JSONResponse:
            """A path or method not served (``/v1/completions``, ``/v1/responses``, ...), in OpenAI's shape; FastAPI's
            400 for a body its JSON parser cannot take (not UTF-8, nested past the recursion limit) is no such URL."""
            if exc.status_code == 400:
                return await _api_error(request, APIError(
                    400, f"the body cannot be read: {exc.detail} (send it as UTF-8 JSON)", "invalid_request"))
            return await _api_error(request, APIError(
                exc.status_code, f"Invalid URL ({request.method} {request.url.path}): {exc.detail}; this endpoint "
                "serves POST .../v1/chat/completions and GET .../v1/models", "unknown_url"))

        @app.exception_handler(RequestValidationError)
        async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
            first = exc.errors()[0] if exc.errors() else {}
            if first.get("type") == "json_invalid":  # its loc is a character position, not a field
                error = (first.get("ctx") or {}).get("error", first.get("msg", ""))
                return await _api_error(_request, APIError(400, f"the body is not valid JSON: {error}",
                                                           "invalid_request"))
            loc = first.get("loc", ())[1:]  # after "body"
            if not loc:
                return await _api_error(_request, APIError(
                    400, f"the body must be a JSON object with model and messages: {first.get('msg', 'invalid')}",
                    "invalid_request"))
            return await _api_error(_request, _field_error(tuple(loc), first.get("msg", "invalid")))

        # Dependencies, so the episode and its key are checked before the body is validated: a caller without
        # the key learns nothing of what a valid body looks like.
        def in_path(episode_id: str, authorization: str | None = Header(None)) -> AgentEpisode:
            return self._episode(episode_id, authorization)

        def in_header(authorization: str | None = Header(None),
                      x_episode_id: str | None = Header(None)) -> AgentEpisode:
            if not x_episode_id:
                raise APIError(404, "no episode: use the base URL /episodes/<id>/v1 or the X-Episode-Id header",
                               "episode_not_found")
            return self._episode(x_episode_id, authorization)

        # as defaults: under postponed annotations FastAPI cannot resolve a local Annotated alias
        episode, episode_in_header = Depends(in_path), Depends(in_header)
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "rollwave"}

        # the same API under both base URLs: the episode's, and the plain one with the X-Episode-Id header
        for base, found in (("/episodes/{episode_id}/v1", episode), ("/v1", episode_in_header)):
            # x-stainless-retry-count: the openai client's attempt number, for the log (equality decides a replay)
            @app.post(f"{base}/chat/completions")
            async def _chat(body: ChatRequest, ep: AgentEpisode = found,
                            x_stainless_retry_count: str | None = Header(None)) -> Any:
                return await self.chat(ep, body, x_stainless_retry_count)

            @app.get(f"{base}/models")
            async def _models(ep: AgentEpisode = found) -> dict[str, Any]:
                return {"object": "list", "data": [model]}

            @app.get(f"{base}/models/{{name:path}}")
            async def _model(name: str, ep: AgentEpisode = found) -> dict[str, Any]:
                if name != self.model_name:
                    raise APIError(404, f"the model {name!r} does not exist (this server serves "
                                        f"{self.model_name!r})", "model_not_found", param="model")
                return model

        @app.post("/episodes/{episode_id}/reward")
        async def _reward(body: RewardRequest, ep: AgentEpisode = episode) -> dict[str, Any]:
            ep.reward = (body.reward, dict(body.info))
            return {"ok": True}

        return app

    def _episode(self, episode_id: str, authorization: str | None) -> AgentEpisode:
        ep = self.episodes.get(episode_id)
        if ep is None:
            raise _closed(episode_id)
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.encode(), ep.key.encode()):
            raise APIError(401, "invalid API key for this episode", "invalid_api_key", "authentication_error")
        return ep

    async def chat(self, ep: AgentEpisode, req: ChatRequest, retry: str | None = None) -> Any:
        """Answer one request: a new turn, or the last answer again when ``req`` repeats the last answered request
        (a retry whose first attempt was answered, or is being: the lock makes it wait). ``retry``: the client's
        own attempt number, if it sends one."""
        if req.model != self.model_name:
            raise APIError(404, f"the model {req.model!r} does not exist (this server serves "
                                f"{self.model_name!r})", "model_not_found", param="model")
        # python mode: the body is JSON data already; JSON mode fails (a 500) on a key holding a lone surrogate, and
        # past 400 levels of nesting, which the JSON parser takes to near 1000
        body = req.model_dump(exclude_unset=True)
        unencodable = lone_surrogate_at(body)
        if unencodable is not None:
            raise _field_error(unencodable, "not valid Unicode text (a lone UTF-16 surrogate, half of a pair)")
        self._refuse_sampling(ep.config, req)
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        strict = _strict_validators(req.tools)
        names = self._tool_names(req, tools)
        forced = self._forced(req, tools)
        stops = req.engine_stops(names)
        dumped = json.dumps(body, sort_keys=True)
        sent = hashlib.sha256(dumped.encode()).digest()  # kept per episode: a digest, not a copy of the history
        if ep.lock.locked():  # an agent awaits each answer: a retry whose first attempt is generating, or calls at once
            log.info("episode %s: a request waits for the one in flight (client retry %s)", ep.episode_id,
                     retry or "not said")
        async with ep.lock:
            if self.episodes.get(ep.episode_id) is not ep:  # it ended (cancelled, closed) while this request waited
                raise _closed(ep.episode_id)
            if ep.failure is not None and ep.failure[0] != "history_mismatch":
                raise APIError(409, f"episode {ep.episode_id} has ended: {ep.failure[1]}", "episode_closed")
            if ep.last is not None and ep.last[0] == sent and retry != FIRST_ATTEMPT:
                self.metrics.openai_requests.labels(outcome="replayed").inc()
                log.info("episode %s: the request repeats the last answered one (client retry %s): answered %s again",
                         ep.episode_id, retry or "not said", ep.last[1].id)
                return self._respond(ep.last[1], req)
            try:
                done = await self._turn(ep, req, tools, names, forced, stops, strict)
            except APIError:
                raise
            except Exception as exc:  # our bug, or an engine reply of a shape nothing checks: the episode may be
                # half-updated, so it ends (never trained), and the agent gets a 500 it is told not to retry
                log.exception("episode %s: the request failed", ep.episode_id)
                self.fail(ep, "error", f"internal error: {type(exc).__name__}: {exc}")
                raise APIError(500, f"internal error: {type(exc).__name__}: {exc}; the episode has ended",
                               "internal_error", "server_error") from exc
            ep.last = (sent, done)
        self.metrics.openai_requests.labels(outcome="ok").inc()
        return self._respond(done, req)

    async def _turn(self, ep: AgentEpisode, req: ChatRequest, tools: list[dict[str, Any]] | None, names: set[str],
                    forced: list[int], stops: list[str], strict: dict[str, Validator]) -> Completion:
        """One new turn: the request's new messages rendered onto the episode, then the engine's answer recorded."""
        try:
            self._extend(ep, [m.model_dump(exclude_unset=True) for m in req.messages], tools,
                         self._shown_tools(req, tools), len(forced))
        except (TemplateError, ValueError) as exc:  # the template refused them ("roles must alternate", ...)
            raise APIError(400, f"messages: the chat template cannot render them: {exc}", "invalid_messages",
                           param="messages") from exc
        reply = await self._generate(ep, req, forced, stops)
        message, finish = self._record(ep, reply, names, forced, req.stop_sequences(), strict)
        ids = reply["output_ids"]
        assert ep.builder is not None
        usage = {"prompt_tokens": len(ep.builder) - len(ids), "completion_tokens": len(ids),
                 "total_tokens": len(ep.builder)}
        return Completion("chatcmpl-" + uuid.uuid4().hex, int(time.time()), message, finish, usage,
                          self._logprobs(ep, reply) if req.logprobs else None)

    def _respond(self, done: Completion, req: ChatRequest) -> Any:
        if req.stream:
            return StreamingResponse(self._chunks(done, req), media_type="text/event-stream")
        return {"id": done.id, "object": "chat.completion", "created": done.created, "model": self.model_name,
                "usage": done.usage,
                "choices": [{"index": 0, "message": done.message, "finish_reason": done.finish,
                             "logprobs": done.logprobs}]}

    @staticmethod
    def _refuse_sampling(cfg: RolloutConfig, req: ChatRequest) -> None:
        """Refuse (400 naming the field) what would sample otherwise than the job does: the trainer assumes the
        job's distribution, so honouring another would train off-policy and ignoring it would answer the agent
        with something it did not ask for. ``top_k``, ``min_p``, ``repetition_penalty`` and ``min_tokens`` are
        SGLang's and vLLM's names, which agents send as ``extra_body``. Output this endpoint cannot give is refused
        too."""
        job = {"temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k}
        engine = {"min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
                  "min_tokens": 0}
        for name, allowed in (job | engine).items():
            asked = getattr(req, name, None)  # top_k, min_p, repetition_penalty, min_tokens: extra fields
            if asked is not None and asked != allowed:
                why = (f"this job samples at {name}={allowed} (rollout.{name} or the job's override), as the trainer "
                       "assumes" if name in job else "the rollout engine samples without it")
                raise APIError(400, f"Unsupported value: {name}={asked!r}; {why}. Omit {name} or send {allowed}.",
                               "unsupported_value", param=name)
        refused = {
            "seed": (req.seed is not None, "the samples of a group must differ, so the server seeds sampling itself"),
            "logit_bias": (bool(req.logit_bias), "it would change the distribution the trainer assumes"),
            "response_format": ((req.response_format or {}).get("type", "text") != "text",
                                "generation is not constrained (only {\"type\": \"text\"})"),
            "top_logprobs": (bool(req.top_logprobs), "the engines return the sampled token's logprob only "
                                                     "(use logprobs=true)"),
        } | {name: (asked(getattr(req, name, None)), why) for name, (asked, why) in _UNSUPPORTED.items()}
        for name, (asked, why) in refused.items():
            if asked:
                raise APIError(400, f"{name} is not supported: {why}", "unsupported_parameter", param=name)

    def _logprobs(self, ep: AgentEpisode, reply: dict[str, Any]) -> dict[str, Any]:
        """OpenAI's ``logprobs``: the recorded behaviour logprob of each generated token of ``reply``, the token that
        closed the turn excepted (it is not in the content: the template's end token, or another of the model's,
        ``ends_turn``); no top logprobs (refused), no bytes (a byte-level token may be part of a character)."""
        assert ep.builder is not None
        ids = reply["output_ids"]
        recorded = ep.builder.logprobs[len(ep.builder) - len(ids):]
        n = len(ids) - 1 if ends_turn(ids, reply, self.renderer.eos_id, self.stop_ids) else len(ids)
        return {"content": [{"token": self.renderer.decode([t]), "logprob": lp, "bytes": None, "top_logprobs": []}
                            for t, lp in zip(ids[:n], recorded[:n], strict=True)]}

    def _tool_names(self, req: ChatRequest, tools: list[dict[str, Any]] | None) -> set[str]:
        """The tool names whose calls are parsed: none for ``tool_choice="none"``, one for a named choice."""
        names = {t["function"]["name"] for t in tools or []}
        choice = req.tool_choice
        if isinstance(choice, dict):  # its shape is checked (ChatRequest._one_error)
            name = choice["function"]["name"]
            if name not in names:
                raise APIError(400, f"tool_choice names a function that is not in tools: {name!r}",
                               "invalid_tool_choice", param="tool_choice")
            return {name}
        if choice in ("required",) and not names:
            raise APIError(400, "tool_choice=required needs tools", "invalid_tool_choice", param="tool_choice")
        return set() if choice == "none" else names

    @staticmethod
    def _shown_tools(req: ChatRequest, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        """The tools a prompt rendered for ``req`` holds: none for ``tool_choice="none"``, as SGLang renders it (the
        model is not invited to write calls that would come back as content); every one otherwise, a named choice
        included, unlike SGLang (only that tool): the prompt is rendered once per episode, and its later turns, once
        an agent sets ``auto`` again (the openai-agents SDK does after the first call), need the others."""
        return None if req.tool_choice == "none" else tools

    def _forced(self, req: ChatRequest, tools: list[dict[str, Any]] | None) -> list[int]:
        """The tokens that honour ``tool_choice`` (``required``: the call opening; a named function: through
        ``"arguments":``), prefilled after the assistant header; none for ``auto`` and ``none``. Only when the chat
        template writes a call with exactly these tokens (else a 400): the policy would have emitted them itself."""
        choice = req.tool_choice
        if choice != "required" and not isinstance(choice, dict):
            return []
        assert tools  # _tool_names refused a choice that names no tool
        name = choice["function"]["name"] if isinstance(choice, dict) else tools[0]["function"]["name"]
        text = BOT_TOKEN + (f'{{"name": {json.dumps(name)}, "arguments":' if isinstance(choice, dict) else "")
        ids: list[int] = self.renderer.tokenizer.encode(text, add_special_tokens=False)
        call = {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": name, "arguments": {}}}]}
        try:
            written = self.renderer.assistant_turn_ids(call)
        except (TemplateError, ValueError):
            written = []
        if written[: len(ids)] != ids:
            shown = choice if isinstance(choice, str) else json.dumps(choice)
            raise APIError(400, f"tool_choice={shown} is not supported with this model: its chat template does not "
                                f"write a call as {text!r}, so the call opening cannot be prefilled (use \"auto\")",
                           "unsupported_value", param="tool_choice")
        return ids

    def _extend(self, ep: AgentEpisode, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                shown: list[dict[str, Any]] | None, forced: int) -> None:
        """Grow the recorded tokens by the request's new messages, or mark a history mismatch; the context must
        leave room for the ``forced`` (prefilled) tokens and one generated token. ``shown``: the tools a prompt
        rendered for this request holds (``_shown_tools``); a prompt already recorded without tools the request
        lets the model call cannot take them in, so that too is a mismatch (SGLang's prompt changes there too)."""
        limit = ep.config.max_total_tokens
        if ep.builder is None:
            ids = self.renderer.prompt_ids([template_message(m) for m in messages], shown)
            try:
                self._check_context(len(ids) + forced, limit)
            except APIError:  # the prompt leaves no room: the task fails, as in the built-in loop (never retried)
                self.fail(ep, "prompt_too_long", str(PromptTooLong.of(ep.task.task_id, len(ids), limit)))
                raise
            ep.builder, ep.tools, ep.shown = TrajectoryBuilder(ids), tools, shown
            ep.messages = [recorded(m) for m in messages]
            return
        n = len(ep.messages)
        same = tools == ep.tools and [canonical(m) for m in messages[:n]] == [canonical(m) for m in ep.messages]
        widens = bool(shown) and not ep.shown  # the request lets the model call tools the prompt does not show
        new = messages[n:]
        if same and new and not widens:
            ids = [] if ep.builder.token_ids[-1] == self.renderer.eos_id else [self.renderer.eos_id]
            ids += self.renderer.turn_end_suffix + self.renderer.tool_turn_ids([template_message(m) for m in new])
            try:
                self._check_context(len(ep.builder) + len(ids) + forced, limit)
            except APIError:
                ep.last_reason = "max_total_tokens"  # the context cut the episode off, as in the built-in loop
                raise
            ep.builder.add_template(ids)
            ep.messages += [recorded(m) for m in new]
            return
        if ep.failure is None:
            self.metrics.history_mismatches.inc()
            why = ("tool_choice lets the model call tools the recorded prompt (rendered under tool_choice=none) does "
                   "not show" if same and new else "the agent edited its history")
            log.warning("episode %s: %s; it will not be trained", ep.episode_id, why)
            self.fail(ep, "history_mismatch", f"{why}; the recorded tokens no longer apply")
        ids = self.renderer.prompt_ids([template_message(m) for m in messages], shown)
        self._check_context(len(ids) + forced, limit)
        ep.builder, ep.tools, ep.shown = TrajectoryBuilder(ids), tools, shown
        ep.messages = [recorded(m) for m in messages]

    @staticmethod
    def _check_context(n: int, limit: int) -> None:
        if n >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, your messages "
                                f"resulted in {n} tokens.", "context_length_exceeded", param="messages")

    async def _generate(self, ep: AgentEpisode, req: ChatRequest, forced: list[int],
                        stops: list[str]) -> dict[str, Any]:
        """One engine reply continuing the recorded tokens and the ``forced`` ones, which are recorded with it
        (as template tokens), ended early by ``stops``: the episode changes only once the engine has answered."""
        cfg = ep.config
        assert ep.builder is not None
        asked = req.max_completion_tokens or req.max_tokens
        room = cfg.max_total_tokens - len(ep.builder) - len(forced)
        max_new = min(asked or cfg.max_new_tokens, cfg.max_new_tokens, room)
        if asked is not None and max_new < asked:  # lowered, not refused (module docstring): counted
            limit = "max_new_tokens" if max_new == cfg.max_new_tokens else "context"
            self.metrics.openai_max_tokens_lowered.labels(limit=limit).inc()
        params: dict[str, Any] = {"max_new_tokens": max_new, "temperature": cfg.temperature, "top_p": cfg.top_p,
                                  "top_k": cfg.top_k}
        if stops:  # ends the turn early; the distribution of the tokens it keeps is the job's
            params["stop"] = stops
        try:
            reply = await ep.engine.generate(ep.builder.token_ids + forced, params, return_logprob=True,
                                             rid=f"{ep.episode_id}-{ep.num_turns}")
            turn = turn_from_reply(reply)
        except (EngineError, EngineReplyError) as exc:
            self.fail(ep, "error", f"engine: {type(exc).__name__}: {exc}")
            raise APIError(503, f"the engine failed: {exc}", "engine_error", "server_error") from exc
        ep.builder.add_template(forced)
        ep.builder.add_generated(turn)
        ep.num_turns += 1
        self.metrics.generated_tokens.inc(len(turn.output_ids))
        return reply

    def _record(self, ep: AgentEpisode, reply: dict[str, Any], names: set[str], forced: list[int],
                trimmed: list[str], strict: dict[str, Validator]) -> tuple[dict[str, Any], str]:
        """The assistant message (OpenAI shape) and finish reason of a reply after the ``forced`` tokens (their
        text opens it), its content ending before a match of one of the agent's stop sequences (``trimmed``), its
        calls only if each conforms to its tool's ``strict`` schema; recorded on the episode."""
        ids = reply["output_ids"]
        finish_reason = reply.get("meta_info", {}).get("finish_reason") or {}
        reason, matched = finish_reason.get("type", "stop"), finish_reason.get("matched")
        closed = ends_turn(ids, reply, self.renderer.eos_id, self.stop_ids)
        text = self.renderer.decode(ids[:-1] if closed else ids)
        if reason == "stop" and matched in trimmed and matched in text:  # OpenAI's content ends before it
            text = text[: text.index(matched)]
        text = self.renderer.decode(forced) + text
        if reason == "abort":  # no outcome: the sample fails (never trained), the agent gets the engine's error
            ep.messages.append({"role": "assistant", "content": text})
            self.fail(ep, "abort", "the engine aborted the request")
            raise APIError(503, "the engine aborted the request", "engine_aborted", "server_error")
        # the end token decides: SGLang reports a turn whose end token is the last allowed one as length
        truncated = reason == "length" and not closed
        normal_text, calls, _errors = (text, [], []) if truncated else parse_tool_calls(text, names)
        broken = [(c.name, _strict_error(strict[c.name], c.arguments)) for c in calls if c.name in strict]
        broken = [(name, why) for name, why in broken if why is not None]
        if broken:  # a strict call OpenAI would not give: the turn is the model's text, as a call that does not parse
            for name, why in broken:
                self.metrics.tool_calls.labels(tool=name, outcome="parse_error").inc()
                ep.tool_calls.append(ToolCallRecord(name=name, ok=False, error=why))
                log.warning("episode %s: a call of the strict tool %r answered as content: %s", ep.episode_id, name,
                            why)
            calls = []
        message: dict[str, Any] = {"role": "assistant", "content": text}
        finish = "length" if truncated else "stop"
        if calls:
            message["content"] = normal_text or None
            message["tool_calls"] = [  # arguments as SGLang writes them: text as text, not \u escapes
                {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                 "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
                for c in calls]
            ep.tool_calls += [ToolCallRecord(name=c.name, ok=True) for c in calls]
            finish = "tool_calls"
        ep.messages.append(message)
        ep.final_text = text
        ep.last_reason = "length" if truncated else "stop"
        if truncated and len(ep.builder or []) >= ep.config.max_total_tokens:
            ep.last_reason = "max_total_tokens"
        return message, finish

    async def _chunks(self, done: Completion, req: ChatRequest) -> AsyncIterator[str]:
        """The finished turn as chunks; ``logprobs`` ride on the content chunk, or on the last one without it. A turn
        that is only calls opens with ``content: null``, so that it accumulates to the message a plain request gets."""
        base = {"id": done.id, "object": "chat.completion.chunk", "created": done.created, "model": self.model_name}
        message, logprobs = done.message, done.logprobs

        def chunk(delta: dict[str, Any], finish_reason: str | None = None, lp: dict[str, Any] | None = None) -> str:
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": lp}
            return "data: " + json.dumps({**base, "choices": [choice]}) + "\n\n"

        yield chunk({"role": "assistant", "content": None if message["content"] is None else ""})
        if message.get("content"):
            yield chunk({"content": message["content"]}, lp=logprobs)
        for i, call in enumerate(message.get("tool_calls") or []):
            yield chunk({"tool_calls": [{"index": i, **call}]})
        yield chunk({}, done.finish, None if message.get("content") else logprobs)
        if req.stream_options and req.stream_options.include_usage:
            yield "data: " + json.dumps({**base, "choices": [], "usage": done.usage}) + "\n\n"
        yield "data: [DONE]\n\n"
