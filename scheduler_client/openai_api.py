"""The OpenAI-compatible request and response shapes of ``specd-scheduler``.

Requests become keyword arguments of ``Engine.add_request``; finished requests become the JSON the
OpenAI clients read. Defaults follow OpenAI (``temperature`` 1, completions ``max_tokens`` 16);
the extensions vLLM users know are accepted too: ``top_k``, ``seed``, ``ignore_eos``,
``stop_token_ids``, ``guided_json``/``guided_regex``/``guided_choice``/``guided_grammar`` or
``structured_outputs``, and specd's own ``num_speculative_tokens``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import msgspec

from scheduler_client.engine_loop import Finished
from scheduler_client.http import models as m
from scheduler_client.http.errors import ApiError, from_validation

UNSUPPORTED = ("logprobs", "top_logprobs", "echo", "best_of", "suffix", "tools", "functions")
GUIDED = (
    ("guided_json", "json"),
    ("guided_regex", "regex"),
    ("guided_choice", "choice"),
    ("guided_grammar", "grammar"),
)
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "ebnf")


def parse(body: Any, *, chat: bool) -> m.CompletionRequest | m.ChatRequest:
    """``body`` (decoded JSON) as its typed request; ``ApiError`` (400, with ``param``) names
    the first field that is wrong."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        if chat:
            return msgspec.convert(body, m.ChatRequest)
        return msgspec.convert(body, m.CompletionRequest)
    except msgspec.ValidationError as e:
        raise from_validation(e) from None


def _structured(r: m.CompletionRequest | m.ChatRequest) -> dict[str, Any] | None:
    """At most one of response_format (json_object / json_schema), guided_*, structured_outputs."""
    found: list[dict[str, Any]] = []
    rf = r.response_format
    if rf is not None:
        if rf.type == "json_object":
            found.append({"json": {"type": "object"}})
        elif rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema is None:
                raise ApiError(
                    400,
                    "response_format.json_schema.schema must be a JSON schema object",
                    param="response_format.json_schema.schema",
                )
            found.append({"json": rf.json_schema.schema})
        elif rf.type != "text":
            raise ApiError(
                400,
                f"response_format type {rf.type!r} is not json_object, json_schema or text",
                param="response_format.type",
            )
    for key, kind in GUIDED:
        if getattr(r, key) is not None:
            found.append({kind: getattr(r, key)})
    so = r.structured_outputs
    if so is not None:
        if len(so) != 1 or next(iter(so)) not in STRUCTURED_KINDS:
            raise ApiError(
                400,
                "structured_outputs must have one of json, regex, choice, grammar",
                param="structured_outputs",
            )
        found.append(dict(so))
    if len(found) > 1:
        raise ApiError(400, "give one structured-output constraint, not several")
    if found and m.depth(found[0]) > m.MAX_JSON_DEPTH:
        raise ApiError(
            400, f"the structured-output constraint nests deeper than {m.MAX_JSON_DEPTH} levels"
        )
    return found[0] if found else None


def _prompt(prompt: str | list[Any], vocab_size: int) -> str | list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return prompt
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise ApiError(
            400, "prompt must be a string or a list of token ids (one prompt)", param="prompt"
        )
    for i, t in enumerate(prompt):
        if not 0 <= t < vocab_size:
            raise ApiError(
                400, f"prompt[{i}] = {t} is not a token id (0..{vocab_size - 1})", param="prompt"
            )
    return list(prompt)


def engine_request(
    body: Any, *, chat: bool, max_model_len: int, vocab_size: int = m.INT32_MAX
) -> dict[str, Any]:
    """``Engine.add_request`` arguments for one OpenAI request body; ``ApiError`` names what is
    wrong (and, for a field, its ``param``)."""
    r = parse(body, chat=chat)
    for key in UNSUPPORTED:
        if getattr(r, key) not in (None, False, 0, []):
            raise ApiError(400, f"{key} is not supported by specd", param=key)
    if r.n not in (None, 1):
        raise ApiError(400, "n must be 1 (one choice per request)", param="n")
    if r.min_p not in (None, 0.0):
        raise ApiError(400, "min_p is not supported by specd (send 0 or leave it out)", "min_p")
    if r.logit_bias:
        for key in r.logit_bias:
            if not (key.isdigit() and int(key) < vocab_size):
                raise ApiError(400, f"logit_bias key {key!r} is not a token id", param="logit_bias")
        raise ApiError(400, "logit_bias is not supported by specd", param="logit_bias")
    out: dict[str, Any] = {}
    if isinstance(r, m.ChatRequest):
        out["messages"] = [_message(i, msg) for i, msg in enumerate(r.messages)]
        out["max_tokens"] = r.max_tokens or r.max_completion_tokens or max_model_len
    else:
        out["prompt"] = _prompt(r.prompt, vocab_size)
        out["max_tokens"] = r.max_tokens or 16
    out["temperature"] = 1.0 if r.temperature is None else float(r.temperature)
    out["top_p"] = 1.0 if r.top_p is None else float(r.top_p)
    out["top_k"] = max(r.top_k or 0, 0)  # vLLM spells "no top-k" -1
    out["seed"] = r.seed
    out["stop"] = [r.stop] if isinstance(r.stop, str) else list(r.stop or [])
    stop_ids = list(r.stop_token_ids or [])
    for i, t in enumerate(stop_ids):
        if t >= vocab_size:
            raise ApiError(
                400, f"stop_token_ids[{i}] = {t} is not a token id", param=f"stop_token_ids[{i}]"
            )
    out["stop_token_ids"] = stop_ids
    out["ignore_eos"] = bool(r.ignore_eos)
    out["num_speculative_tokens"] = r.num_speculative_tokens
    out["structured"] = _structured(r)
    return out


def _message(i: int, msg: m.Message) -> dict[str, str]:
    content = msg.content
    if isinstance(content, list):  # the parts form: keep the text parts
        parts = []
        for j, part in enumerate(content):
            if part.type != "text":
                raise ApiError(
                    400,
                    f"messages[{i}]: only text content parts are supported",
                    param=f"messages[{i}].content[{j}].type",
                )
            parts.append(part.text)
        content = "".join(parts)
    return {"role": msg.role, "content": content or ""}


def usage(req: Finished) -> dict[str, int]:
    n_out = len(req.output_ids)
    n_in = req.num_prompt_tokens
    return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}


def response(req: Finished, *, chat: bool, model: str, created: int) -> dict[str, Any]:
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
        "spec_decode": req.spec_decode,
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


_HOLE = "\x00text\x00"  # no detokenized text holds a NUL; json.dumps writes it \u0000text\u0000


def text_chunks(req_id: str, *, chat: bool, model: str, created: int) -> Callable[[str], bytes]:
    """The encoder of one stream's middle events, ``chunk(..., text=t)`` as a server-sent event:
    the JSON around the text is encoded once, each event encodes only its text. The bytes are
    those of ``json.dumps(chunk(...), ensure_ascii=False)``."""
    hole = json.dumps(_HOLE)
    around = json.dumps(
        chunk(req_id, chat=chat, model=model, created=created, text=_HOLE), ensure_ascii=False
    )
    head, _, tail = around.rpartition(hole)  # the text comes last, after id and model
    head_b, tail_b = b"data: " + head.encode(), tail.encode() + b"\n\n"

    def encode(text: str) -> bytes:
        return head_b + json.dumps(text, ensure_ascii=False).encode() + tail_b

    return encode


def now() -> int:
    return int(time.time())
