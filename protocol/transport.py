"""ZeroMQ sockets that carry ``Message`` values: bounded sends, receives with timeouts, LINGER set.

The worker binds a ROUTER (it learns each scheduler's identity from its hello); a scheduler connects
a DEALER. ``Channel`` pairs one socket with one ``Codec``. Addresses always come from config.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from protocol.codec import DEFAULT_MAX_MESSAGE_BYTES, Buffer, Codec
from protocol.errors import ProtocolError
from protocol.messages import Message


@dataclass(frozen=True, kw_only=True)
class TransportConfig:
    """Socket limits shared by both ends, and CURVE keys (required for ``tcp://``).

    ``curve_secret_file``: this side's certificate from ``specd keygen`` (the ``.key_secret``
    file). The worker (server) also takes ``curve_authorized_dir``: only clients whose public
    certificate (``.key``) is in that folder are let in; others are refused and logged. A scheduler
    (client) also takes ``curve_server_public_file``: the worker's public certificate.
    """

    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    send_timeout_ms: int = 5_000
    linger_ms: int = 0
    high_water_mark: int = 10_000
    curve_secret_file: str | None = None
    curve_authorized_dir: str | None = None
    curve_server_public_file: str | None = None

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
        self.authenticator: ThreadAuthenticator | None = None
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

    def close(self, linger_ms: int | None = None) -> None:
        """Close the socket; ``linger_ms`` (default: the config's) bounds how long messages still
        queued may take to leave."""
        self.sock.close(linger=self.config.linger_ms if linger_ms is None else linger_ms)
        if self.authenticator is not None:
            self.authenticator.stop()
            self.authenticator = None


def _configure(sock: zmq.Socket[bytes], config: TransportConfig) -> None:
    sock.setsockopt(zmq.LINGER, config.linger_ms)
    sock.setsockopt(zmq.SNDTIMEO, config.send_timeout_ms)
    sock.setsockopt(zmq.SNDHWM, config.high_water_mark)
    sock.setsockopt(zmq.RCVHWM, config.high_water_mark)
    # Per-frame backstop; the codec checks the sum of all frames and names the message.
    sock.setsockopt(zmq.MAXMSGSIZE, config.max_message_bytes)


class _RefusalsAsWarnings(logging.LoggerAdapter):  # type: ignore[type-arg]
    """pyzmq's authenticator logs refusals at debug level; an operator must see them."""

    def debug(self, msg: object, *args: object, **kwargs: object) -> None:
        text = str(msg) % args if args else str(msg)
        if text.startswith("DENIED"):
            self.logger.warning("refused a peer: %s", text)
        else:
            self.logger.debug("%s", text)


def check_security(addr: str, config: TransportConfig, *, server: bool) -> bool:
    """True when CURVE is configured; tcp:// without it is refused with what to do."""
    has = config.curve_secret_file is not None
    peer = config.curve_authorized_dir if server else config.curve_server_public_file
    if has != (peer is not None):
        what = "--curve-authorized DIR" if server else "--curve-server-public FILE"
        raise ValueError(f"CURVE needs both --curve-secret FILE and {what}")
    if addr.startswith("tcp://") and not has:
        raise ValueError(
            f"{addr} is tcp://: it needs CURVE keys (make them with `specd keygen DIR NAME`, then "
            "pass --curve-secret and the peer's key); use ipc:// on one node"
        )
    return has


def _load_secret(path: str) -> tuple[bytes, bytes]:
    public, secret = zmq.auth.load_certificate(path)
    if secret is None:
        raise ValueError(f"{path} holds no secret key: pass the .key_secret file")
    return public, secret


def bind_router(ctx: zmq.Context[zmq.Socket[bytes]], addr: str, config: TransportConfig) -> Channel:
    """The worker's socket. An ``ipc://`` path is made owner-only; tcp:// requires CURVE."""
    validate_address(addr)
    curve = check_security(addr, config, server=True)
    authenticator = None
    if curve:
        assert config.curve_secret_file and config.curve_authorized_dir
        public, secret = _load_secret(config.curve_secret_file)
        auth_log = _RefusalsAsWarnings(logging.getLogger("specd.auth"), {})
        authenticator = ThreadAuthenticator(ctx, log=auth_log)
        authenticator.start()
        authenticator.configure_curve(domain="*", location=config.curve_authorized_dir)
    sock = ctx.socket(zmq.ROUTER)
    _configure(sock, config)
    # A send to a scheduler that went away raises instead of vanishing silently.
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    if curve:
        sock.curve_publickey = public
        sock.curve_secretkey = secret
        sock.curve_server = True
    try:
        sock.bind(addr)
    except zmq.ZMQError:
        # the caller gets nothing to close: this socket and the authenticator's thread go here
        sock.close(linger=0)
        if authenticator is not None:
            authenticator.stop()
        raise
    if addr.startswith("ipc://"):
        os.chmod(addr[len("ipc://") :], 0o600)
    chan = Channel(sock, config, routed=True)
    chan.authenticator = authenticator
    return chan


def connect_dealer(
    ctx: zmq.Context[zmq.Socket[bytes]], addr: str, config: TransportConfig
) -> Channel:
    """A scheduler's socket to one worker; tcp:// requires CURVE."""
    validate_address(addr)
    curve = check_security(addr, config, server=False)
    sock = ctx.socket(zmq.DEALER)
    _configure(sock, config)
    if curve:
        assert config.curve_secret_file and config.curve_server_public_file
        public, secret = _load_secret(config.curve_secret_file)
        server_public, _ = zmq.auth.load_certificate(config.curve_server_public_file)
        sock.curve_publickey = public
        sock.curve_secretkey = secret
        sock.curve_serverkey = server_public
    sock.connect(addr)
    return Channel(sock, config, routed=False)


def keygen(directory: str, name: str) -> tuple[str, str]:
    """Write a CURVE certificate pair ``NAME.key`` (public) and ``NAME.key_secret`` (owner-only)."""
    os.makedirs(directory, exist_ok=True)
    public, secret = zmq.auth.create_certificates(directory, name)
    os.chmod(secret, 0o600)
    return str(public), str(secret)
