"""Typed OpenAI request bodies: every field the door reads, with its type and range.

Integers are bounded by what the wire carries (``protocol.messages``): token ids and counts are
int32 on the worker, ``seed`` is a 64-bit generator seed, ``top_k`` at most ``2**31 - 1``.
Lists and strings are bounded so one request cannot make the scheduler do unbounded work
before it is refused. Unknown fields are ignored, as OpenAI does. What the types cannot say
(token ids below the model's vocabulary, at most one structured-output constraint) is checked in
``scheduler_client.openai_api``.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

INT32_MAX = 2**31 - 1
MAX_LIST = 4096  # stop strings, stop ids, choices, content parts, logit_bias entries
MAX_MESSAGES = 4096
MAX_STOP_CHARS = 4096
MAX_TEMPERATURE = 100.0  # softmax at T=100 is flat already; larger values are typos
MAX_JSON_DEPTH = 64  # a schema or structured_outputs nested deeper is refused
# A regex's or grammar's length is not capped here: --max-regex-chars and --max-grammar-bytes
# (scheduler_client/limits.py) bound it before it compiles, off the engine's thread (prep.py).

Count = Annotated[int, Meta(ge=1, le=INT32_MAX)]
TokenId = Annotated[int, Meta(ge=0, le=INT32_MAX)]  # below the vocabulary: openai_api
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]  # int64: msgpack and manual_seed carry it
TopK = Annotated[int, Meta(ge=-1, le=INT32_MAX)]  # -1 (vLLM) or 0: no top-k
Temperature = Annotated[float, Meta(ge=0.0, le=MAX_TEMPERATURE)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
MinP = Annotated[float, Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
Bias = Annotated[float, Meta(ge=-100.0, le=100.0)]
NumDrafts = Annotated[int, Meta(ge=0, le=INT32_MAX)]
StopText = Annotated[str, Meta(max_length=MAX_STOP_CHARS)]
GrammarText = str
Stop = StopText | Annotated[list[StopText], Meta(max_length=MAX_LIST)]


class ContentPart(msgspec.Struct):
    type: str
    text: str = ""


class Message(msgspec.Struct):
    role: str
    content: str | Annotated[list[ContentPart], Meta(max_length=MAX_LIST)] | None = None


class JsonSchema(msgspec.Struct):
    schema: dict[str, Any] | None = None


class ResponseFormat(msgspec.Struct):
    type: str
    json_schema: JsonSchema | None = None


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None


class _Common(msgspec.Struct, kw_only=True):
    """The fields completions and chat completions share. ``None`` everywhere means "not given"
    (OpenAI clients send explicit nulls)."""

    model: str | None = None
    max_tokens: Count | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    seed: Seed | None = None
    n: Count | None = None
    stop: Stop | None = None
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_LIST)] | None = None
    ignore_eos: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: Annotated[dict[str, Bias], Meta(max_length=MAX_LIST)] | None = None
    user: str | None = None
    num_speculative_tokens: NumDrafts | None = None
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: GrammarText | None = None
    guided_choice: Annotated[list[StopText], Meta(max_length=MAX_LIST)] | None = None
    guided_grammar: GrammarText | None = None
    structured_outputs: dict[str, Any] | None = None
    # refused when set (see openai_api.UNSUPPORTED)
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None
    tools: list[Any] | None = None
    functions: list[Any] | None = None


class CompletionRequest(_Common, kw_only=True):
    # a string, token ids, or a batch of one of either
    prompt: str | Annotated[list[Any], Meta(max_length=INT32_MAX)]


class ChatRequest(_Common, kw_only=True):
    messages: Annotated[list[Message], Meta(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: Count | None = None


def depth(value: Any, limit: int = MAX_JSON_DEPTH) -> int:
    """How deep ``value`` nests (1 for a scalar), counting no further than ``limit + 1``;
    iterative, so a hostile body cannot exhaust the stack here."""
    deepest = 0
    todo: list[tuple[Any, int]] = [(value, 1)]
    while todo:
        item, d = todo.pop()
        deepest = max(deepest, d)
        if d > limit:
            return d
        if isinstance(item, dict):
            todo.extend((v, d + 1) for v in item.values())
        elif isinstance(item, list):
            todo.extend((v, d + 1) for v in item)
    return deepest
