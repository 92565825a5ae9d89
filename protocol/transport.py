"""ZeroMQ sockets that carry ``Message`` values: bounded sends, receives with timeouts, LINGER set.

The worker binds a ROUTER (it learns each scheduler's identity from its hello); a scheduler connects
a DEALER. ``Channel`` pairs one socket with one ``Codec``. Addresses always come from config.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import zmq

from protocol.codec import DEFAULT_MAX_MESSAGE_BYTES, Buffer, Codec
from protocol.errors import ProtocolError
from protocol.messages import Message


@dataclass(frozen=True, kw_only=True)
class TransportConfig:
    """Socket limits shared by both ends."""

    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    send_timeout_ms: int = 5_000
    linger_ms: int = 0
    high_water_mark: int = 10_000

    def __post_init__(self) -> None:
        if self.max_message_bytes <= 0:
            raise ValueError("max_message_bytes must be positive")
        if self.send_timeout_ms <= 0:
            raise ValueError("send_timeout_ms must be positive: every send is bounded")
        if self.linger_ms < 0:
            raise ValueError("linger_ms must be >= 0")


def validate_address(addr: str) -> str:
    """``ipc://PATH`` or ``tcp://HOST:PORT``; anything else is refused with what to write instead."""
    if addr.startswith("ipc://") and len(addr) > len("ipc://"):
        return addr
    if addr.startswith("tcp://") and ":" in addr[len("tcp://") :]:
        return addr
    raise ValueError(f"address {addr!r} must be ipc://PATH or tcp://HOST:PORT")


_ZERO_COPY_BYTES = 64 * 1024


class Channel:
    """One socket plus its codec. ``routed`` sockets (ROUTER) prefix every message with the peer's
    identity frame. Not thread-safe: one owner, as with the socket itself."""

    def __init__(self, sock: zmq.Socket[bytes], config: TransportConfig, *, routed: bool) -> None:
        self.sock = sock
        self.config = config
        self.routed = routed
        self.codec = Codec(config.max_message_bytes)
        self._poller = zmq.Poller()
        self._poller.register(sock, zmq.POLLIN)

    def send(self, msg: Message, identity: bytes | None = None) -> None:
        """Send ``msg``; raises ``ProtocolError('timeout')`` when the peer does not take it in time."""
        frames: list[Buffer] = self.codec.encode(msg)
        if self.routed:
            if identity is None:
                raise ValueError("a ROUTER channel needs the peer identity to send")
            frames = [identity, *frames]
        try:
            # Zero copy pays off only for large frames (bitmasks); small ones are cheaper copied.
            self.sock.send_multipart(frames, copy=max(map(len, frames)) < _ZERO_COPY_BYTES)
        except zmq.Again:
            raise ProtocolError(
                "timeout",
                f"peer did not take {type(msg).__name__} within {self.config.send_timeout_ms} ms",
            ) from None
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                raise ProtocolError("closed", "the peer is gone (unknown identity)") from None
            raise

    def poll(self, timeout_ms: int) -> bool:
        return bool(self._poller.poll(timeout_ms))

    def recv_frames(self, timeout_ms: int) -> list[zmq.Frame] | None:
        """Raw frames of the next message, or None on timeout."""
        if not self._poller.poll(timeout_ms):
            return None
        return self.sock.recv_multipart(copy=False)

    def recv(self, timeout_ms: int) -> tuple[bytes | None, Message] | None:
        """``(identity, message)``, or None when nothing arrived within ``timeout_ms``.

        Raises ``ProtocolError`` for a message that does not decode; the message is consumed.
        """
        frames = self.recv_frames(timeout_ms)
        if frames is None:
            return None
        identity = None
        if self.routed:
            identity = frames[0].bytes
            frames = frames[1:]
        return identity, self.codec.decode([f.buffer for f in frames])

    def close(self) -> None:
        self.sock.close(linger=self.config.linger_ms)


def _configure(sock: zmq.Socket[bytes], config: TransportConfig) -> None:
    sock.setsockopt(zmq.LINGER, config.linger_ms)
    sock.setsockopt(zmq.SNDTIMEO, config.send_timeout_ms)
    sock.setsockopt(zmq.SNDHWM, config.high_water_mark)
    sock.setsockopt(zmq.RCVHWM, config.high_water_mark)
    # Per-frame backstop; the codec checks the sum of all frames and names the message.
    sock.setsockopt(zmq.MAXMSGSIZE, config.max_message_bytes)


def bind_router(ctx: zmq.Context[zmq.Socket[bytes]], addr: str, config: TransportConfig) -> Channel:
    """The worker's socket. An ``ipc://`` path is made owner-only."""
    sock = ctx.socket(zmq.ROUTER)
    _configure(sock, config)
    # A send to a scheduler that went away raises instead of vanishing silently.
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.bind(validate_address(addr))
    if addr.startswith("ipc://"):
        os.chmod(addr[len("ipc://") :], 0o600)
    return Channel(sock, config, routed=True)


def connect_dealer(
    ctx: zmq.Context[zmq.Socket[bytes]], addr: str, config: TransportConfig
) -> Channel:
    """A scheduler's socket to one worker."""
    sock = ctx.socket(zmq.DEALER)
    _configure(sock, config)
    sock.connect(validate_address(addr))
    return Channel(sock, config, routed=False)
