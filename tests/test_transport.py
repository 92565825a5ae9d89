"""Real sockets between real processes over ipc://."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest
import zmq

from protocol import Codec, Ping, Pong, ProtocolError, Shutdown, TransportConfig, bind_router
from protocol.transport import Channel, connect_dealer, validate_address
from tests.procs import reap
from tests.test_protocol import assert_same
from tests.wire_samples import all_messages, draft_ids


@pytest.fixture
def router(ipc_addr: str) -> Iterator[Channel]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    chan = bind_router(ctx, ipc_addr, TransportConfig(send_timeout_ms=2_000))
    yield chan
    chan.close()
    ctx.term()


def start_echo(addr: str, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "protocol.echo", addr, *args])


def hello_from(chan: Channel) -> bytes:
    got = chan.recv(timeout_ms=30_000)
    assert got is not None, "echo peer never connected"
    identity, msg = got
    assert isinstance(msg, Ping) and msg.seq == -1
    assert identity is not None
    return identity


def test_ipc_socket_is_owner_only(router: Channel, ipc_addr: str) -> None:
    mode = os.stat(ipc_addr[len("ipc://") :]).st_mode
    assert stat.S_IMODE(mode) == 0o600


def test_every_message_crosses_processes(router: Channel, ipc_addr: str) -> None:
    proc = start_echo(ipc_addr)
    try:
        peer = hello_from(router)
        for msg in all_messages():
            if isinstance(msg, Shutdown):
                continue
            router.send(msg, peer)
            got = router.recv(timeout_ms=10_000)
            assert got is not None, f"no echo for {type(msg).__name__}"
            assert_same(got[1], msg)
        router.send(Shutdown(reason="done"), peer)
        assert proc.wait(timeout=30) == 0
    finally:
        reap(proc)


def test_ten_thousand_messages_none_lost_or_reordered(router: Channel, ipc_addr: str) -> None:
    proc = start_echo(ipc_addr)
    try:
        peer = hello_from(router)
        total, window, sent, seen = 10_000, 256, 0, 0
        while seen < total:
            while sent < total and sent - seen < window:
                msg = draft_ids(3, step_id=sent)
                router.send(msg, peer)
                sent += 1
            got = router.recv(timeout_ms=10_000)
            assert got is not None, f"lost message after {seen}"
            msg = got[1]
            assert getattr(msg, "step_id", None) == seen, f"expected step {seen}, got {msg}"
            np.testing.assert_array_equal(msg.draft_token_ids, np.arange(12, dtype=np.int32))
            seen += 1
        router.send(Shutdown(), peer)
        assert proc.wait(timeout=30) == 0
    finally:
        reap(proc)


def test_receive_times_out_instead_of_blocking(router: Channel) -> None:
    assert router.recv(timeout_ms=50) is None


def test_send_to_a_vanished_peer_is_an_error(router: Channel) -> None:
    with pytest.raises(ProtocolError) as info:
        router.send(Ping(seq=1), b"nobody")
    assert info.value.code == "closed"


def test_bounded_send_when_nobody_reads(ipc_addr: str) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    cfg = TransportConfig(send_timeout_ms=100, high_water_mark=1)
    chan = connect_dealer(ctx, ipc_addr, cfg)  # nobody bound: DEALER blocks on the first send
    try:
        with pytest.raises(ProtocolError) as info:
            for i in range(10):
                chan.send(Pong(seq=i, num_steps=0))
        assert info.value.code == "timeout" and "100 ms" in str(info.value)
    finally:
        chan.close()
        ctx.term()


def test_garbage_from_a_peer_is_a_typed_error(router: Channel, ipc_addr: str) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(ipc_addr)
    try:
        # a version header around a string where the message should be
        raw.send_multipart([b"\x93\x01\x00\xa3bad"])
        with pytest.raises(ProtocolError, match="Expected `array`, got `str`") as info:
            router.recv(timeout_ms=5_000)
        assert info.value.code == "bad_field"
        raw.send_multipart([b"\xc1"])  # not msgpack: 0xc1 is never used
        with pytest.raises(ProtocolError, match="invalid opcode") as info:
            router.recv(timeout_ms=5_000)
        assert info.value.code == "truncated_frame"
        # the socket still works: a good message after the bad ones arrives intact
        raw.send_multipart([bytes(f) for f in Codec().encode(Ping(seq=7))])
        got = router.recv(timeout_ms=5_000)
        assert got is not None and got[1] == Ping(seq=7)
    finally:
        raw.close()
        ctx.term()


@pytest.mark.parametrize("addr", ["", "ipc://", "http://x", "tcp://nohostport", "/tmp/sock"])
def test_bad_addresses_are_refused(addr: str) -> None:
    with pytest.raises(ValueError, match="ipc://PATH or tcp://HOST:PORT"):
        validate_address(addr)
