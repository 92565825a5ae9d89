"""The door's one error type: an answer other than 200 in OpenAI's error shape."""

from __future__ import annotations

import re
from typing import Any

import msgspec


class ApiError(Exception):
    """An answer other than 200: ``status``, an OpenAI error ``kind``, a message and, for a bad
    field, its ``param`` (the field's path: ``messages[0].content``)."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.param = param

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": str(self),
                "type": self.kind,
                "param": self.param,
                "code": self.status,
            }
        }


# msgspec ends a validation message with " - at `$.path[0].field`"
_AT = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")


def from_validation(e: msgspec.ValidationError) -> ApiError:
    """A 400 naming the field msgspec rejected and what it expected."""
    text = str(e)
    m = _AT.search(text)
    param = m.group("path") if m else None
    what = text[: m.start()] if m else text
    if param and what == "Expected `array` of length >= 1":
        return ApiError(400, f"{param} must be a non-empty list", param=param)
    if param:
        kind = (
            "has the wrong type"
            if what.startswith("Expected `") and " got `" in what
            else "is out of range"
        )
        if what.startswith("Object missing required field"):
            kind = "is incomplete"
        return ApiError(400, f"{param} {kind}: {what}", param=param)
    return ApiError(400, f"the request body is invalid: {what}")
