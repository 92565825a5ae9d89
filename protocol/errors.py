"""The one error type of the wire layer."""

from __future__ import annotations


class ProtocolError(ValueError):
    """A message could not be encoded or decoded. ``code`` is stable and machine-readable:

    ``truncated_frame``, ``missing_frame``, ``unknown_tag``, ``bad_field``, ``oversize``, ``version``,
    ``bad_array``, ``timeout``, ``closed``.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.detail = message
