"""Encode and decode ``protocol.messages.Message`` to and from multipart ZeroMQ frames.

Frame 0 is msgpack ``[major, minor, message]``; each ``numpy.ndarray`` inside the message becomes one
extra frame holding its raw bytes (zero copy on send), referenced by a msgpack extension
``(frame_index, dtype, shape)``. One ``Codec`` per socket: it is not thread-safe, because decoding
resolves extensions against the frames of the message being decoded.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from protocol.errors import ProtocolError
from protocol.messages import PROTOCOL_MAJOR, PROTOCOL_MINOR, Message

_ARRAY_EXT = 1
# Only these dtypes cross the wire; anything else is a sender bug.
_DTYPES = {np.dtype(t).str: np.dtype(t) for t in ("<i4", "<i8", "<u4", "<f4", "<f2", "|u1", "|b1")}
_DTYPE_CODES = {dtype: code for code, dtype in _DTYPES.items()}
DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024

Buffer = bytes | memoryview


class _ArrayRef(msgspec.Struct, array_like=True):
    frame: int
    dtype: str
    shape: tuple[int, ...]


_ref_encoder = msgspec.msgpack.Encoder()
_ref_decoder = msgspec.msgpack.Decoder(_ArrayRef)
_header_decoder = msgspec.msgpack.Decoder(tuple[int, int, msgspec.Raw])


class Codec:
    """Turns a message into frames and back. ``max_message_bytes`` bounds the sum of all frames."""

    def __init__(self, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        self.max_message_bytes = max_message_bytes
        self._out: list[Buffer] = []
        self._in: Sequence[Buffer] = ()
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._decoder = msgspec.msgpack.Decoder(
            Message, ext_hook=self._ext_hook, dec_hook=self._dec_hook
        )

    # -- encode ---------------------------------------------------------------------------------
    def encode(self, msg: Message) -> list[Buffer]:
        """Frames for ``msg``: the header frame, then one frame per array."""
        return self.encode_versioned(msg, PROTOCOL_MAJOR, PROTOCOL_MINOR)

    def encode_versioned(self, msg: Any, major: int, minor: int) -> list[Buffer]:
        """``encode`` with an explicit version stamp; tests use it to play a newer peer."""
        self._out = [b""]
        try:
            self._out[0] = self._encoder.encode((major, minor, msg))
            frames = self._out
        except (TypeError, OverflowError) as e:
            raise ProtocolError(
                "bad_field", f"{type(msg).__name__} cannot be encoded: {e}"
            ) from None
        finally:
            self._out = []
        size = sum(len(f) for f in frames)
        if size > self.max_message_bytes:
            raise ProtocolError(
                "oversize",
                f"{type(msg).__name__} is {size} bytes, over the limit of {self.max_message_bytes}",
            )
        return frames

    def _enc_hook(self, obj: Any) -> Any:
        if not isinstance(obj, np.ndarray):
            raise TypeError(f"cannot encode {type(obj).__name__}")
        code = _DTYPE_CODES.get(obj.dtype)
        if code is None:
            raise ProtocolError("bad_array", f"dtype {obj.dtype} cannot travel on the wire")
        if not obj.flags.c_contiguous:
            obj = np.ascontiguousarray(obj)
        self._out.append(obj.data.cast("B") if obj.size else b"")
        ref = _ref_encoder.encode((len(self._out) - 1, code, obj.shape))
        return msgspec.msgpack.Ext(_ARRAY_EXT, ref)

    # -- decode ---------------------------------------------------------------------------------
    def decode(self, frames: Sequence[Buffer]) -> Message:
        """The message in ``frames``; raises ``ProtocolError`` naming what was wrong."""
        if not frames:
            raise ProtocolError("truncated_frame", "empty multipart message")
        size = sum(len(f) for f in frames)
        if size > self.max_message_bytes:
            raise ProtocolError(
                "oversize", f"message of {size} bytes is over the limit of {self.max_message_bytes}"
            )
        try:
            major, minor, body = _header_decoder.decode(frames[0])
        except msgspec.DecodeError as e:
            raise ProtocolError("truncated_frame", f"header frame is not a message: {e}") from None
        except msgspec.ValidationError as e:
            raise ProtocolError(
                "bad_field", f"header is not [major, minor, message]: {e}"
            ) from None
        if major != PROTOCOL_MAJOR:
            raise ProtocolError(
                "version",
                f"peer speaks protocol {major}.{minor}, this side speaks "
                f"{PROTOCOL_MAJOR}.{PROTOCOL_MINOR}; upgrade the older side",
            )
        self._in = frames
        try:
            msg = self._decoder.decode(body)
        except ProtocolError:
            raise
        except msgspec.ValidationError as e:
            text = str(e)
            code = "unknown_tag" if "Invalid value" in text and "$[0]" in text else "bad_field"
            raise ProtocolError(code, text) from None
        except msgspec.DecodeError as e:
            raise ProtocolError("truncated_frame", str(e)) from None
        finally:
            self._in = ()
        return msg

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code != _ARRAY_EXT:
            raise ProtocolError("bad_field", f"unknown msgpack extension {code}")
        try:
            ref = _ref_decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise ProtocolError("bad_array", f"array reference is malformed: {e}") from None
        dtype = _DTYPES.get(ref.dtype)
        if dtype is None:
            raise ProtocolError("bad_array", f"dtype {ref.dtype!r} is not allowed on the wire")
        if not 1 <= ref.frame < len(self._in):
            raise ProtocolError(
                "missing_frame",
                f"array refers to frame {ref.frame} but the message has {len(self._in)} frames",
            )
        if any(d < 0 for d in ref.shape):
            raise ProtocolError("bad_array", f"negative array shape {ref.shape}")
        buf = self._in[ref.frame]
        expected = math.prod(ref.shape) * dtype.itemsize
        if len(buf) != expected:
            raise ProtocolError(
                "truncated_frame",
                f"frame {ref.frame} holds {len(buf)} bytes, array "
                f"{ref.dtype}{list(ref.shape)} needs {expected}",
            )
        return np.frombuffer(buf, dtype=dtype).reshape(ref.shape)

    @staticmethod
    def _dec_hook(typ: type, obj: Any) -> Any:
        if typ is np.ndarray and isinstance(obj, np.ndarray):
            return obj
        raise ProtocolError("bad_field", f"expected an array, got {type(obj).__name__}")
