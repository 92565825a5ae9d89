"""Limits on untrusted request input, checked before any expensive work (tokenizing, rendering a
chat template, compiling a grammar).

Each check costs at most the size of its limit, not the size of the input: the schema walk stops
at the first node past ``max_schema_nodes`` or the first level past ``max_schema_depth``. An input
over a limit raises ``LimitError`` naming the limit and its flag; the HTTP door answers 400.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

from scheduler_client.grammar import StructuredSpec


class LimitError(ValueError):
    """The request is over one of the ``InputLimits``; the message names the flag."""


@dataclass(frozen=True, kw_only=True)
class InputLimits:
    """Each a count; over it, the request is refused before its expensive work starts."""

    # a prompt's characters (chat: the sum over the messages' contents)
    max_prompt_chars: int = 1_000_000
    # the text of a structured-output spec: JSON schema, Lark or GBNF grammar, or the choices
    max_grammar_bytes: int = 512 * 1024
    # JSON values (objects, arrays, scalars) in a schema: anyOf/oneOf branches, enum values, ...
    max_schema_nodes: int = 10_000
    max_schema_depth: int = 32  # nesting of objects and arrays in a schema
    max_regex_chars: int = 16_384

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")

    def check_prompt(
        self, prompt: str | list[int] | None, messages: list[dict[str, str]] | None
    ) -> None:
        if isinstance(prompt, str):
            num_chars = len(prompt)
        elif messages is not None:
            num_chars = sum(len(m.get("content", "")) for m in messages)
        else:
            return  # token ids: the scheduler checks their count against max_model_len
        if num_chars > self.max_prompt_chars:
            raise LimitError(
                f"the prompt has {num_chars} characters, over the limit of "
                f"{self.max_prompt_chars} (--max-prompt-chars)"
            )

    def check_spec(self, spec: StructuredSpec) -> None:
        value = spec.value
        if spec.kind == "regex" and isinstance(value, str):
            if len(value) > self.max_regex_chars:
                raise LimitError(
                    f"the regex has {len(value)} characters, over the limit of "
                    f"{self.max_regex_chars} (--max-regex-chars)"
                )
            return
        if isinstance(value, str):  # Lark or GBNF text, or a JSON schema as text
            self._check_bytes(len(value.encode()), spec.kind)
            if spec.kind == "json":
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as e:
                    raise LimitError(f"the JSON schema is not valid JSON: {e}") from None
        if spec.kind in ("json", "choice"):
            self._check_tree(value)
            if not isinstance(spec.value, str):
                # the walk bounded the node count, so this costs at most the strings' length
                self._check_bytes(len(json.dumps(value).encode()), spec.kind)

    def _check_bytes(self, num_bytes: int, kind: str) -> None:
        if num_bytes > self.max_grammar_bytes:
            raise LimitError(
                f"the {kind} spec has {num_bytes} bytes, over the limit of "
                f"{self.max_grammar_bytes} (--max-grammar-bytes)"
            )

    def _check_tree(self, value: Any) -> None:
        """Count the JSON values and the nesting of ``value``, stopping at the first excess."""
        num_nodes = 0
        stack: list[tuple[Any, int]] = [(value, 1)]  # (value, its depth)
        while stack:
            node, depth = stack.pop()
            num_nodes += 1
            if num_nodes > self.max_schema_nodes:
                raise LimitError(
                    f"the schema has more than {self.max_schema_nodes} values (anyOf/oneOf "
                    "branches, enum values, properties, ...), over the limit "
                    "(--max-schema-nodes)"
                )
            if isinstance(node, (dict, list)):
                if depth > self.max_schema_depth:
                    raise LimitError(
                        f"the schema nests deeper than {self.max_schema_depth} levels, over the "
                        "limit (--max-schema-depth)"
                    )
                children = node.values() if isinstance(node, dict) else node
                stack.extend((c, depth + 1) for c in children)


def add_limit_args(ap: argparse.ArgumentParser) -> None:
    d = InputLimits()
    ap.add_argument(
        "--max-prompt-chars",
        type=int,
        default=d.max_prompt_chars,
        help="the most characters in a prompt (chat: all message contents); checked before "
        "tokenizing",
    )
    ap.add_argument(
        "--max-grammar-bytes",
        type=int,
        default=d.max_grammar_bytes,
        help="the largest structured-output spec (JSON schema, Lark/GBNF grammar, choices) in "
        "bytes; checked before compiling",
    )
    ap.add_argument(
        "--max-schema-nodes",
        type=int,
        default=d.max_schema_nodes,
        help="the most JSON values in a schema or choice list (each anyOf branch, enum value, "
        "property, ... counts)",
    )
    ap.add_argument(
        "--max-schema-depth",
        type=int,
        default=d.max_schema_depth,
        help="the deepest nesting of objects and arrays in a schema",
    )
    ap.add_argument(
        "--max-regex-chars",
        type=int,
        default=d.max_regex_chars,
        help="the longest regex a request may constrain its output with",
    )


def input_limits(a: argparse.Namespace) -> InputLimits:
    return InputLimits(
        max_prompt_chars=a.max_prompt_chars,
        max_grammar_bytes=a.max_grammar_bytes,
        max_schema_nodes=a.max_schema_nodes,
        max_schema_depth=a.max_schema_depth,
        max_regex_chars=a.max_regex_chars,
    )
