"""The OpenAI-compatible request and response shapes of ``specd-scheduler``.

Requests become keyword arguments of ``Engine.add_request``; finished requests become the JSON the
OpenAI clients read. Defaults follow OpenAI (``temperature`` 1, completions ``max_tokens`` 16);
the extensions vLLM users know are accepted too: ``top_k``, ``seed``, ``ignore_eos``,
``stop_token_ids``, ``guided_json``/``guided_regex``/``guided_choice``/``guided_grammar`` or
``structured_outputs``, and specd's own ``num_speculative_tokens``.
"""

from __future__ import annotations

import time
from typing import Any

from scheduler_client.request import Request


class ApiError(Exception):
    """An answer other than 200: ``status``, an OpenAI error ``kind`` and a message."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "code": self.status}}


UNSUPPORTED = ("logprobs", "top_logprobs", "echo", "best_of", "suffix", "tools", "functions")


def _get(body: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) and kind in (int, float, (int, float)):
        raise ApiError(400, f"{key} must be a number, got {value!r}")
    if not isinstance(value, kind):
        raise ApiError(400, f"{key} has the wrong type: got {type(value).__name__}")
    return value


def _structured(body: dict[str, Any]) -> dict[str, Any] | None:
    """At most one of response_format (json_object / json_schema), guided_*, structured_outputs."""
    found: list[dict[str, Any]] = []
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict) or "type" not in rf:
            raise ApiError(400, 'response_format must be an object with a "type"')
        if rf["type"] == "json_object":
            found.append({"json": {"type": "object"}})
        elif rf["type"] == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
                raise ApiError(
                    400, "response_format.json_schema.schema must be a JSON schema object"
                )
            found.append({"json": js["schema"]})
        elif rf["type"] != "text":
            raise ApiError(
                400, f"response_format type {rf['type']!r} is not json_object, json_schema or text"
            )
    for key, kind in (
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ):
        if body.get(key) is not None:
            found.append({kind: body[key]})
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict) or len(so) != 1:
            raise ApiError(400, "structured_outputs must have one of json, regex, choice, grammar")
        found.append(dict(so))
    if len(found) > 1:
        raise ApiError(400, "give one structured-output constraint, not several")
    return found[0] if found else None


def engine_request(body: Any, *, chat: bool, max_model_len: int) -> dict[str, Any]:
    """``Engine.add_request`` arguments for one OpenAI request body; ``ApiError`` names what is
    wrong."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for key in UNSUPPORTED:
        if body.get(key) not in (None, False, 0, []):
            raise ApiError(400, f"{key} is not supported by specd")
    if _get(body, "n", int, 1) != 1:
        raise ApiError(400, "n must be 1 (one choice per request)")
    out: dict[str, Any] = {}
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "messages must be a non-empty list")
        out["messages"] = [_message(i, m) for i, m in enumerate(messages)]
        limit = _get(body, "max_completion_tokens", int, None)
        out["max_tokens"] = _get(body, "max_tokens", int, limit or max_model_len)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if (
            isinstance(prompt, list)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ) or isinstance(prompt, str):
            out["prompt"] = prompt
        else:
            raise ApiError(400, "prompt must be a string or a list of token ids (one prompt)")
        out["max_tokens"] = _get(body, "max_tokens", int, 16)
    out["temperature"] = float(_get(body, "temperature", (int, float), 1.0))
    out["top_p"] = float(_get(body, "top_p", (int, float), 1.0))
    top_k = _get(body, "top_k", int, 0)
    out["top_k"] = 0 if top_k < 0 else top_k  # vLLM spells "no top-k" -1
    out["seed"] = _get(body, "seed", int, None)
    stop = _get(body, "stop", (str, list), [])
    out["stop"] = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) for s in out["stop"]):
        raise ApiError(400, "stop must be a string or a list of strings")
    out["stop_token_ids"] = _get(body, "stop_token_ids", list, [])
    out["ignore_eos"] = bool(_get(body, "ignore_eos", bool, False))
    out["num_speculative_tokens"] = _get(body, "num_speculative_tokens", int, None)
    out["structured"] = _structured(body)
    return out


def _message(i: int, m: Any) -> dict[str, str]:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise ApiError(400, f"messages[{i}] must be an object with a role")
    content = m.get("content", "")
    if isinstance(content, list):  # the parts form: keep the text parts
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise ApiError(400, f"messages[{i}]: only text content parts are supported")
            parts.append(str(part.get("text", "")))
        content = "".join(parts)
    if not isinstance(content, str):
        raise ApiError(400, f"messages[{i}].content must be a string or text parts")
    return {"role": m["role"], "content": content}


def usage(req: Request) -> dict[str, int]:
    n_out = len(req.output_ids)
    n_in = len(req.prompt_ids)
    return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}


def response(req: Request, *, chat: bool, model: str, created: int) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "finish_reason": req.finish_reason, "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": req.text}
    else:
        choice["text"] = req.text
    return {
        "id": req.req_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage(req),
        "spec_decode": req.metrics.summary(),
    }


def chunk(
    req_id: str,
    *,
    chat: bool,
    model: str,
    created: int,
    text: str | None,
    finish_reason: str | None = None,
    first: bool = False,
) -> dict[str, Any]:
    """One streamed event (``text`` None: the closing chunk that carries the finish reason)."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
    if chat:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    return {
        "id": req_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }


def now() -> int:
    return int(time.time())
