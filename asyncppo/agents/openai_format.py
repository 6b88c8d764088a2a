"""The Chat Completions wire format: a request checked field by field, and the reply built from a model turn.

Why strict: an agent framework sends many optional fields, and a field the endpoint silently ignored (a logit bias,
a JSON response format) would make the agent behave differently in training than against the
model it was written for, with no trace. So every field is either honoured, accepted as a no-op that cannot change
the reply (``model``, ``user``, ``metadata``, ``store``, ``parallel_tool_calls``, a ``temperature``/``top_p``/
``seed`` that the run's own sampling settings replace; docs/agents.md says why), or refused with a 400 that names
it. Nothing here does I/O: :mod:`asyncppo.agents.server` calls it.
"""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from asyncppo.envs.tools import declared_tool_names, parse_tool_calls


class RequestError(ValueError):
    """A refused request: ``status`` (400, 401, 404, 409, 410, 413) and the reason, which names the field."""

    def __init__(self, status: int, reason: str, kind: str = "invalid_request"):
        super().__init__(reason)
        self.status, self.reason, self.kind = status, reason, kind


#: Fields accepted and not acted on (they cannot change the reply of one model turn).
NO_OP = ("model", "user", "metadata", "store", "parallel_tool_calls", "service_tier", "prompt_cache_key",
         "safety_identifier")
#: Fields honoured.
HONOURED = ("messages", "tools", "tool_choice", "n", "max_tokens", "max_completion_tokens", "stop", "logprobs",
            "top_logprobs", "stream", "stream_options", "temperature", "top_p", "seed", "frequency_penalty",
            "presence_penalty", "logit_bias", "response_format")
ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass
class ChatRequest:
    """One checked call: the conversation (messages with text content), the tools, and the per-call limits."""

    messages: list
    tools: Optional[list] = None
    parse_tools: bool = True  # tool_choice "none": the reply's text is not read for calls
    max_tokens: Optional[int] = None
    stop: list = field(default_factory=list)
    logprobs: bool = False
    sampling: dict = field(default_factory=dict)  # temperature / top_p / seed as sent (replaced by the run's)
    stream: bool = False  # the reply as server-sent events (stream_chunks)
    stream_usage: bool = False  # stream_options.include_usage: a last chunk with the usage


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, None (an assistant turn of tool calls only), or text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text", "output_text") \
                    or not isinstance(part.get("text"), str):
                raise RequestError(400, f"{where}.content[{j}]: only text parts are supported, got {str(part)[:80]}")
            out.append(part["text"])
        return "".join(out)
    raise RequestError(400, f"{where}.content must be a string, null or a list of text parts")


def _tool_call_ids(calls: Any, where: str) -> tuple:
    if calls in (None, []):
        return ()
    if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
        raise RequestError(400, f"{where}.tool_calls must be a list of objects")
    return tuple(str(c.get("id", "")) for c in calls)


def template_tool_calls(calls: Any) -> list:
    """An assistant message's calls as chat templates render them: ``{"type": "function", "function": {"name",
    "arguments"}}`` with the arguments an object (OpenAI clients send a JSON string; templates write the object)."""
    out = []
    for c in calls or []:
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not fn.get("name"):
            continue  # nothing a template could write
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass  # the text as sent: a template writes it as it is
        out.append({"type": "function", "function": {"name": str(fn.get("name", "")), "arguments": args}})
    return out


def normalize_message(m: Any, i: int) -> dict:
    """``{"role", "content", ...}`` with text content; an assistant turn keeps its tool-call ids (how the session
    recognises its own replies), a tool turn its ``tool_call_id``."""
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise RequestError(400, f"{where} must be an object")
    role = m.get("role")
    if role not in ROLES:
        raise RequestError(400, f"{where}.role={str(role)[:40]!r}: allowed: {', '.join(ROLES)}")
    out = {"role": "system" if role == "developer" else role, "content": _text(m.get("content"), where)}
    if role == "assistant":
        out["tool_call_ids"] = _tool_call_ids(m.get("tool_calls"), where)
        out["tool_calls"] = template_tool_calls(m.get("tool_calls"))  # rendered when a branch re-renders the past
    if role == "tool":
        out["tool_call_id"] = str(m.get("tool_call_id", ""))
    return out


def _positive_int(body: dict, key: str) -> Optional[int]:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise RequestError(400, f"{key}={v!r}: must be an integer >= 1")
    return v


def _number(body: dict, key: str) -> Optional[float]:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(float(v)):
        raise RequestError(400, f"{key}={v!r}: must be a finite number")
    return float(v)


def _refuse_off_policy(body: dict) -> None:
    """400 for the fields that would make the sampled tokens differ from the policy's distribution."""
    for key in ("frequency_penalty", "presence_penalty"):
        if _number(body, key) not in (None, 0.0):
            raise RequestError(400, f"{key}={body[key]!r}: penalties are not supported (they would make the "
                                    "sampled tokens' log-probs differ from the policy's)")
    if body.get("logit_bias"):
        raise RequestError(400, "logit_bias is not supported (it would make the sampled tokens off-policy)")


def _stop_ids(body: dict, stop_token_id: Callable[[str], Optional[int]]) -> list:
    """``stop`` as token ids: up to 4 strings, each one token of the vocabulary (the engine stops on ids)."""
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(x, str) for x in stop) or len(stop) > 4:
        raise RequestError(400, "stop must be a string or a list of at most 4 strings")
    ids = [stop_token_id(x) for x in stop]
    for x, tid in zip(stop, ids):
        if tid is None:
            raise RequestError(400, f"stop={x!r}: only stop strings that are one token of the model's vocabulary "
                                    "are supported (the engine stops on token ids)")
    return ids


def _sampling(body: dict) -> dict:
    """``temperature`` / ``top_p`` / ``seed`` as sent (checked; the run's own sampling replaces them)."""
    sampling = {k: _number(body, k) for k in ("temperature", "top_p") if body.get(k) is not None}
    if body.get("seed") is not None:
        sampling["seed"] = body["seed"]
    return sampling


def parse_chat_request(body: Any, *, stop_token_id: Callable[[str], Optional[int]]) -> ChatRequest:
    """A :class:`ChatRequest`, or :class:`RequestError` (400) naming the first field it cannot honour.
    ``stop_token_id``: the token id of a stop string that is one token of the vocabulary, else None."""
    if not isinstance(body, dict):
        raise RequestError(400, "the body must be a JSON object")
    unknown = sorted(set(body) - set(NO_OP) - set(HONOURED))
    if unknown:
        raise RequestError(400, f"unsupported field {unknown[0]!r} (supported: {', '.join(HONOURED + NO_OP)})")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise RequestError(400, f"stream={str(stream)[:40]!r}: must be a bool")
    options = body.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict)
                                or set(options) - {"include_usage", "include_obfuscation"}
                                or not all(isinstance(v, bool) for v in options.values())):
        raise RequestError(400, f"stream_options={str(options)[:80]}: an object of include_usage (and "
                                "include_obfuscation, a no-op) booleans, with stream=true")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RequestError(400, "messages must be a non-empty list")
    messages = [normalize_message(m, i) for i, m in enumerate(msgs)]
    n = body.get("n", 1)
    if n not in (None, 1):
        raise RequestError(400, f"n={n!r}: a session is one episode, one reply per call (the run's "
                                "rollout.num_return_sequences_in_group makes the group of episodes)")
    _refuse_off_policy(body)
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise RequestError(400, f"response_format={str(fmt)[:80]}: only {{'type': 'text'}} is supported")
    top = body.get("top_logprobs")
    if top not in (None, 0):
        raise RequestError(400, f"top_logprobs={top!r}: only the sampled tokens' log-probs are returned (0)")
    logprobs = body.get("logprobs") or False
    if not isinstance(logprobs, bool):
        raise RequestError(400, f"logprobs={logprobs!r}: must be a bool")
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise RequestError(400, "tools must be a list of objects (the function format)")
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise RequestError(400, f"tool_choice={str(choice)[:80]}: only 'auto' and 'none' are supported (the engine "
                                "does not constrain what the model writes)")
    a, b = _positive_int(body, "max_tokens"), _positive_int(body, "max_completion_tokens")
    stop_ids, sampling = _stop_ids(body, stop_token_id), _sampling(body)
    return ChatRequest(messages=messages, tools=tools or None, parse_tools=choice != "none",
                       max_tokens=min(x for x in (a, b) if x is not None) if (a or b) else None,
                       stop=stop_ids, logprobs=logprobs, sampling=sampling, stream=stream,
                       stream_usage=bool((options or {}).get("include_usage")))


#: ``/v1/completions`` fields honoured (the rest of :data:`NO_OP` too); anything else is refused by name.
TEXT_HONOURED = ("prompt", "max_tokens", "stop", "logprobs", "temperature", "top_p", "seed", "n", "stream", "echo",
                 "best_of", "frequency_penalty", "presence_penalty", "logit_bias", "suffix")


@dataclass
class TextRequest:
    """One checked ``/v1/completions`` call: the prompt as text or as token ids, and the per-call limits. A session
    of these continues its text (or its ids) the way a chat session continues its messages (agents/session.py)."""

    prompt_text: Optional[str]
    prompt_ids: Optional[list]
    max_tokens: Optional[int] = None
    stop: list = field(default_factory=list)
    logprobs: bool = False
    sampling: dict = field(default_factory=dict)
    tools: Optional[list] = None  # a completion has none: the same shape as ChatRequest for the episode
    parse_tools: bool = False
    stream: bool = False


def parse_completion_request(body: Any, *, stop_token_id: Callable[[str], Optional[int]],
                             vocab_size: int) -> TextRequest:
    """A :class:`TextRequest`, or :class:`RequestError` (400) naming the first field it cannot honour. ``prompt``:
    one string, or one list of token ids (each below ``vocab_size``); ``logprobs`` 0 or 1: the sampled tokens'
    log-probs (1 would add the most likely alternative, which is not returned: ``top_logprobs`` is null)."""
    if not isinstance(body, dict):
        raise RequestError(400, "the body must be a JSON object")
    unknown = sorted(set(body) - set(NO_OP) - set(TEXT_HONOURED))
    if unknown:
        raise RequestError(400, f"unsupported field {unknown[0]!r} (supported: {', '.join(TEXT_HONOURED + NO_OP)})")
    prompt = body.get("prompt")
    text = ids = None
    if isinstance(prompt, str) and prompt:
        text = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < vocab_size for t in prompt):
            raise RequestError(400, f"prompt: token ids must be in 0..{vocab_size - 1}")
        ids = list(prompt)
    else:
        raise RequestError(400, "prompt must be one non-empty string or one non-empty list of token ids (a session is "
                                "one episode: no batch of prompts)")
    if body.get("stream"):
        raise RequestError(400, "stream=true is not supported on /v1/completions (it is on /v1/chat/completions)")
    for key, ok in (("echo", False), ("suffix", None)):
        if body.get(key) not in (None, ok):
            raise RequestError(400, f"{key}={str(body[key])[:40]!r} is not supported")
    for key in ("n", "best_of"):
        if body.get(key) not in (None, 1):
            raise RequestError(400, f"{key}={body[key]!r}: a session is one episode, one completion per call")
    _refuse_off_policy(body)
    lp = body.get("logprobs")
    if lp not in (None, 0, 1) or isinstance(lp, bool):
        raise RequestError(400, f"logprobs={lp!r}: 0 or 1 (only the sampled tokens' log-probs are returned)")
    return TextRequest(prompt_text=text, prompt_ids=ids, max_tokens=_positive_int(body, "max_tokens"),
                       stop=_stop_ids(body, stop_token_id), logprobs=lp is not None, sampling=_sampling(body))


def text_completion_body(text: str, finish: str, *, call_id: str, model: str, created: int, prompt_tokens: int,
                         token_ids: list, logprobs: Optional[list], token_texts: Optional[list],
                         versions: list, text_offset: int = 0) -> dict:
    """The JSON of a text completion, with the same ``asyncppo`` extension as a chat completion's. ``text_offset``:
    where the completion starts in prompt + completion (the log-probs' ``text_offset`` count from the prompt's start,
    as OpenAI's do)."""
    lp = None
    if logprobs is not None:
        offsets, at = [], text_offset
        for t in token_texts or []:
            offsets.append(at)
            at += len(t)
        lp = {"tokens": list(token_texts or []), "token_logprobs": [float(x) for x in logprobs],
              "top_logprobs": None, "text_offset": offsets}
    return {"id": call_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": lp}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(token_ids),
                      "total_tokens": prompt_tokens + len(token_ids)},
            "asyncppo": {"token_ids": [int(t) for t in token_ids], "versions": [int(v) for v in versions]}}


@dataclass
class Reply:
    """The assistant message of one model turn, and what the session keeps of it."""

    content: Optional[str]
    tool_calls: list
    finish_reason: str

    @property
    def tool_call_ids(self) -> tuple:
        return tuple(c["id"] for c in self.tool_calls)


def make_reply(text: str, finish: str, request: ChatRequest, call_id: str) -> Reply:
    """The model's text as an assistant message: calls in the template's syntax become ``tool_calls`` (ids
    ``<call_id>-<j>``), the text outside them the content; ``finish`` is the engine's (``stop`` / ``length``)."""
    if request.parse_tools and request.tools and "<tool_call>" in text:
        parsed = parse_tool_calls(text, declared_tool_names(request.tools) or None)
        if parsed.calls:
            calls = [{"id": f"{call_id}-{j}", "type": "function",
                      "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                     for j, c in enumerate(parsed.calls)]
            return Reply(parsed.text or None, calls, "tool_calls" if finish == "stop" else finish)
    return Reply(text, [], finish)


def completion_body(reply: Reply, *, call_id: str, model: str, created: int, prompt_tokens: int, token_ids: list,
                    logprobs: Optional[list], token_texts: Optional[list], versions: list) -> dict:
    """The JSON of a chat completion. ``asyncppo`` (an extension field the OpenAI client keeps) carries the sampled
    ids and their policy versions: what the learner trains for this turn."""
    message: dict = {"role": "assistant", "content": reply.content}
    if reply.tool_calls:
        message["tool_calls"] = reply.tool_calls
    lp = None
    if logprobs is not None:
        lp = {"content": [{"token": t, "logprob": float(x), "bytes": list(t.encode("utf-8")), "top_logprobs": []}
                          for t, x in zip(token_texts or [], logprobs)]}
    return {"id": call_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": reply.finish_reason, "logprobs": lp}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(token_ids),
                      "total_tokens": prompt_tokens + len(token_ids)},
            "asyncppo": {"token_ids": [int(t) for t in token_ids], "versions": [int(v) for v in versions]}}


def stream_chunks(body: dict, include_usage: bool) -> list[dict]:
    """A completion (:func:`completion_body`) as the chunks of a streamed reply: the whole turn in one delta (the
    engine samples it before the call returns, so there is nothing to gain from splitting it, and one chunk keeps the
    reply's text exactly the sampled ids' text), then the finish reason with the ``asyncppo`` extension, then the
    usage when asked. Tool calls carry their ``index``, as streamed calls do."""
    choice = body["choices"][0]
    message = choice["message"]
    delta: dict = {"role": "assistant", "content": message["content"]}
    if message.get("tool_calls"):
        delta["tool_calls"] = [{"index": j, **c} for j, c in enumerate(message["tool_calls"])]
    head = {k: body[k] for k in ("id", "created", "model")}
    chunk = {**head, "object": "chat.completion.chunk"}
    out = [{**chunk, "choices": [{"index": 0, "delta": delta, "finish_reason": None, "logprobs": choice["logprobs"]}]},
           {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"],
                                  "logprobs": None}], "asyncppo": body["asyncppo"]}]
    if include_usage:
        out.append({**chunk, "choices": [], "usage": body["usage"]})
    return out


def error_body(err: RequestError) -> dict:
    return {"error": {"message": err.reason, "type": err.kind, "code": err.status}}
