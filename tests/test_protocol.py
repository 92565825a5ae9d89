"""The wire protocol: round trips, schema evolution and every kind of bad input."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import numpy as np
import pytest

from protocol import Codec, ProtocolError
from protocol import messages as m
from tests.wire_samples import all_messages, draft_ids, sched_output


def assert_same(a: object, b: object) -> None:
    assert type(a) is type(b)
    if isinstance(a, msgspec.Struct):
        for f in a.__struct_fields__:
            assert_same(getattr(a, f), getattr(b, f))
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray)
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("msg", all_messages(), ids=lambda x: type(x).__name__)
def test_round_trip(msg: m.Message) -> None:
    codec = Codec()
    frames = codec.encode(msg)
    assert_same(codec.decode([bytes(f) for f in frames]), msg)


def test_arrays_travel_as_frames_not_lists() -> None:
    msg = sched_output(64)
    frames = Codec().encode(msg)
    # header + num_scheduled + num_draft + draft ids + cu rows + bitmask
    assert len(frames) == 6
    assert len(frames[0]) < 2_000, "arrays leaked into the msgpack header"
    assert msg.grammar_bitmask is not None
    assert len(frames[-1]) == msg.grammar_bitmask.nbytes


def test_old_decoder_reads_new_trailing_field() -> None:
    class DraftTokenIdsV2(msgspec.Struct, tag="drafts", array_like=True, gc=False):
        step_id: int
        req_ids: list[str]
        num_draft_tokens: np.ndarray
        draft_token_ids: np.ndarray
        num_committed_tokens: np.ndarray
        draft_probs_available: bool = True  # a field this side does not know

    old = draft_ids(2)
    new = DraftTokenIdsV2(
        old.step_id,
        old.req_ids,
        old.num_draft_tokens,
        old.draft_token_ids,
        old.num_committed_tokens,
    )
    codec = Codec()
    # Encode with a newer minor version: the old side must accept it.
    frames = codec.encode_versioned(new, m.PROTOCOL_MAJOR, m.PROTOCOL_MINOR + 1)
    got = codec.decode([bytes(f) for f in frames])
    assert_same(got, old)


def _header(major: int, body: object) -> bytes:
    return msgspec.msgpack.encode((major, 0, body))


def expect(code: str, frames: list[bytes], codec: Codec | None = None) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        (codec or Codec()).decode(frames)
    assert info.value.code == code, info.value
    return info.value


def test_truncated_header_frame() -> None:
    frames = [bytes(f) for f in Codec().encode(sched_output(2))]
    err = expect("truncated_frame", [frames[0][:-7], *frames[1:]])
    assert str(err) == "truncated_frame: header frame is not a message: Input data was truncated"


def test_truncated_array_frame() -> None:
    frames = [bytes(f) for f in Codec().encode(sched_output(2))]
    frames[-1] = frames[-1][:-4]
    err = expect("truncated_frame", frames)
    assert "bytes" in str(err)


def test_unknown_tag() -> None:
    err = expect("unknown_tag", [_header(m.PROTOCOL_MAJOR, ["no-such-message", 1])])
    assert "no-such-message" in str(err)


def test_wrong_field_type() -> None:
    err = expect("bad_field", [_header(m.PROTOCOL_MAJOR, ["ping", "not-an-int"])])
    assert "int" in str(err)


def test_array_field_given_a_list() -> None:
    body = ["drafts", 1, ["a"], [1], [2], [3]]
    err = expect("bad_field", [_header(m.PROTOCOL_MAJOR, body)])
    assert "array" in str(err).lower()


def test_missing_array_frame() -> None:
    frames = [bytes(f) for f in Codec().encode(draft_ids(3))]
    err = expect("missing_frame", frames[:-1])
    assert "frame 3" in str(err)


def test_oversize_message() -> None:
    frames = [bytes(f) for f in Codec().encode(sched_output(8))]
    small = Codec(max_message_bytes=1_000)
    err = expect("oversize", frames, small)
    assert "limit of 1000" in str(err)
    with pytest.raises(ProtocolError) as info:
        small.encode(sched_output(8))
    assert info.value.code == "oversize" and "SchedulerOutput" in str(info.value)


def test_newer_protocol_version() -> None:
    err = expect("version", [_header(m.PROTOCOL_MAJOR + 1, ["ping", 1])])
    assert f"{m.PROTOCOL_MAJOR + 1}.0" in str(err)


def test_not_msgpack_at_all() -> None:
    expect("truncated_frame", [b"\xc1\xc1\xc1"])
    expect("truncated_frame", [])


def test_bad_dtype_is_refused_on_encode() -> None:
    msg = m.Ping(seq=1)
    bad = m.DraftTokenIds(
        step_id=1,
        req_ids=[],
        num_draft_tokens=np.zeros(0, np.complex64),
        draft_token_ids=np.zeros(0, np.int32),
        num_committed_tokens=np.zeros(0, np.int32),
    )
    # the same codec encodes a message without arrays: one frame, which decodes back
    codec = Codec()
    (frame,) = codec.encode(msg)
    assert codec.decode([bytes(frame)]) == msg
    with pytest.raises(ProtocolError, match="dtype complex64 cannot travel on the wire") as info:
        codec.encode(bad)
    assert info.value.code == "bad_array"


@pytest.mark.parametrize("module", ["protocol", "scheduler_client"])
def test_scheduler_side_never_imports_torch(module: str) -> None:
    code = (
        f"import sys, importlib, pkgutil; import {module} as p\n"
        "for info in pkgutil.walk_packages(p.__path__, p.__name__ + '.'):\n"
        "    importlib.import_module(info.name)\n"
        "assert 'torch' not in sys.modules, sorted(k for k in sys.modules if 'torch' in k)[:5]\n"
        "print('clean')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "clean" in out.stdout


def test_a_minor_0_decoder_reads_a_minor_1_scheduler_output() -> None:
    """Overlap scheduling added two trailing fields to SchedulerOutput (minor 1); a decoder that
    knows only minor 0's fields reads such a step (as a sync step) without error."""

    class SchedulerOutputV0(msgspec.Struct, tag="sched", array_like=True, gc=False):
        step_id: int
        new_requests: list[object]
        req_ids: list[str]
        num_scheduled_tokens: object  # array references: an extension type on the wire
        num_draft_tokens: object
        draft_token_ids: object
        finished_req_ids: list[str]
        aborted_req_ids: list[str]
        structured_req_ids: list[str]
        cu_bitmask_rows: object = None
        grammar_bitmask: object = None
        pending_structured_output_tokens: bool = False

    new = msgspec.structs.replace(
        sched_output(3), draft_widths_are_caps=True, deferred_req_ids=["r0"]
    )
    header = Codec().encode(new)[0]
    _major, minor, body = msgspec.msgpack.decode(bytes(header), type=tuple[int, int, msgspec.Raw])
    assert minor == m.PROTOCOL_MINOR >= 1
    old = msgspec.msgpack.Decoder(SchedulerOutputV0).decode(body)
    assert old.step_id == new.step_id and old.req_ids == new.req_ids
    assert old.structured_req_ids == new.structured_req_ids


class WorkerReadyV1(msgspec.Struct, tag="ready", array_like=True, gc=False):
    """``WorkerReady`` as minor 1 knew it (no ``max_num_batched_tokens``)."""

    protocol_major: int
    protocol_minor: int
    model_name: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    drafter: str
    max_num_speculative_tokens: int
    kv_capacity_tokens: int
    max_num_seqs: int
    tokenizer_path: str = ""


def ready_v2() -> m.WorkerReady:
    return m.WorkerReady(
        protocol_major=1,
        protocol_minor=2,
        model_name="tiny",
        vocab_size=512,
        eos_token_ids=(2,),
        max_model_len=256,
        drafter="ngram",
        max_num_speculative_tokens=4,
        kv_capacity_tokens=24 * 256,
        max_num_seqs=24,
        tokenizer_path="/tmp/tok",
        max_num_batched_tokens=999,
    )


def test_a_minor_1_scheduler_reads_a_minor_2_worker_ready() -> None:
    """Minor 2 added WorkerReady.max_num_batched_tokens last: a minor-1 scheduler reads every
    field it knows and ignores the new one."""
    new = ready_v2()
    header = Codec().encode(new)[0]
    _major, minor, body = msgspec.msgpack.decode(bytes(header), type=tuple[int, int, msgspec.Raw])
    assert minor == m.PROTOCOL_MINOR >= 2
    old = msgspec.msgpack.Decoder(WorkerReadyV1).decode(body)
    for f in WorkerReadyV1.__struct_fields__:
        assert getattr(old, f) == getattr(new, f), f


def test_a_minor_2_scheduler_reads_a_minor_1_worker_ready() -> None:
    """A minor-1 worker sends no token budget: the field reads as 0 ("the worker did not say"),
    and the scheduler falls back to its own default."""
    old = msgspec.structs.replace(ready_v2(), protocol_minor=1)
    fields = [getattr(old, f) for f in WorkerReadyV1.__struct_fields__]
    body = msgspec.msgpack.encode(WorkerReadyV1(*fields))
    got = msgspec.msgpack.Decoder(m.Message).decode(body)
    assert isinstance(got, m.WorkerReady)
    assert got.max_num_seqs == 24 and got.tokenizer_path == "/tmp/tok"
    assert got.max_num_batched_tokens == 0


class WorkerErrorV1(msgspec.Struct, tag="error", array_like=True, gc=False):
    """WorkerError as a minor-2 peer knows it (before ``field``)."""

    code: str
    message: str
    step_id: int | None = None
    req_id: str | None = None
    fatal: bool = False


def test_a_minor_2_peer_and_a_minor_3_peer_read_each_others_worker_errors() -> None:
    """Minor 3 added ``WorkerError.field`` last: an old scheduler reads a new worker's error (the
    field is ignored), and a new scheduler reads an old worker's error (``field`` is None)."""
    assert m.PROTOCOL_MINOR >= 3
    new = m.WorkerError(code="bad_step", message="m", step_id=9, field="num_draft_tokens[1]")
    header = Codec().encode(new)[0]
    _major, _minor, body = msgspec.msgpack.decode(bytes(header), type=tuple[int, int, msgspec.Raw])
    old = msgspec.msgpack.Decoder(WorkerErrorV1).decode(body)
    assert (old.code, old.message, old.step_id, old.req_id) == ("bad_step", "m", 9, None)

    codec = Codec()
    frames = codec.encode_versioned(WorkerErrorV1("bad_step", "m", 9, "r"), m.PROTOCOL_MAJOR, 2)
    got = codec.decode([bytes(f) for f in frames])
    assert isinstance(got, m.WorkerError)
    assert got.step_id == 9 and got.req_id == "r" and got.field is None


class WorkerReadyV3(WorkerReadyV1, tag="ready"):
    """``WorkerReady`` as minors 2 and 3 knew it (no KV block fields)."""

    max_num_batched_tokens: int = 0


def ready_both_ways(
    old_type: type[msgspec.Struct], new: m.WorkerReady, minor: int
) -> m.WorkerReady:
    """An old scheduler (``old_type``: ``WorkerReady`` as protocol ``minor`` knew it) reads
    every field it knows of a new worker's handshake ``new``; returns what a new scheduler reads
    of an old worker's handshake of the same values."""
    header = Codec().encode(new)[0]
    _major, _minor, body = msgspec.msgpack.decode(bytes(header), type=tuple[int, int, msgspec.Raw])
    old = msgspec.msgpack.Decoder(old_type).decode(body)
    for f in old_type.__struct_fields__:
        assert getattr(old, f) == getattr(new, f), f
    fields = [getattr(new, f) for f in old_type.__struct_fields__]
    codec = Codec()
    frames = codec.encode_versioned(old_type(*fields), m.PROTOCOL_MAJOR, minor)
    got = codec.decode([bytes(f) for f in frames])
    assert isinstance(got, m.WorkerReady)
    return got


def test_a_minor_3_scheduler_and_a_minor_4_worker_read_each_others_ready() -> None:
    """Minor 4 added ``num_kv_blocks`` and ``kv_block_size`` last: an old scheduler reads a new
    worker's handshake (the block fields are ignored), and a new scheduler reads an old worker's
    (both read 0: "the worker did not say")."""
    assert m.PROTOCOL_MINOR >= 4
    new = msgspec.structs.replace(ready_v2(), num_kv_blocks=384, kv_block_size=16)
    got = ready_both_ways(WorkerReadyV3, new, 3)
    assert got.max_num_batched_tokens == 999 and got.max_num_seqs == 24
    assert (got.num_kv_blocks, got.kv_block_size) == (0, 0)


class WorkerReadyV6(WorkerReadyV3, tag="ready"):
    """``WorkerReady`` as minors 4 to 6 knew it (no ``pipeline_steps``)."""

    num_kv_blocks: int = 0
    kv_block_size: int = 0


def test_a_minor_6_scheduler_and_a_minor_7_worker_read_each_others_ready() -> None:
    """Minor 7 added ``pipeline_steps`` last: an old scheduler reads a new worker's handshake
    (the flag is ignored: it schedules as its user said), and a new scheduler reads an old
    worker's as one that leaves no step open (its mode left to the worker: sync)."""
    assert m.PROTOCOL_MINOR >= 7
    new = msgspec.structs.replace(
        ready_v2(), num_kv_blocks=384, kv_block_size=16, pipeline_steps=True
    )
    got = ready_both_ways(WorkerReadyV6, new, 6)
    assert (got.num_kv_blocks, got.kv_block_size) == (384, 16)
    assert got.pipeline_steps is False


class SchedulerOutputV4(msgspec.Struct, tag="sched", array_like=True, gc=False):
    """SchedulerOutput as minors 3 and 4 knew it (before ``max_draft_proposals``)."""

    step_id: int
    new_requests: list[m.NewRequest]
    req_ids: list[str]
    num_scheduled_tokens: m.Array
    num_draft_tokens: m.Array
    draft_token_ids: m.Array
    finished_req_ids: list[str]
    aborted_req_ids: list[str]
    structured_req_ids: list[str]
    cu_bitmask_rows: m.Array | None = None
    grammar_bitmask: m.Array | None = None
    pending_structured_output_tokens: bool = False
    draft_widths_are_caps: bool = False
    deferred_req_ids: list[str] = msgspec.field(default_factory=list)


def test_a_minor_4_peer_and_a_minor_5_peer_read_each_others_steps() -> None:
    """Minor 5 added ``SchedulerOutput.max_draft_proposals`` last: an old worker reads a new
    scheduler's step (the cap is ignored: it drafts its own widths), and a new worker reads an
    old scheduler's step as uncapped (-1)."""
    assert m.PROTOCOL_MINOR >= 5
    new = msgspec.structs.replace(sched_output(3), max_draft_proposals=0)
    frames = Codec().encode(new)
    _major, _minor, body = msgspec.msgpack.decode(
        bytes(frames[0]), type=tuple[int, int, msgspec.Raw]
    )
    assert _minor == m.PROTOCOL_MINOR
    fields = msgspec.msgpack.decode(body)  # the array-like struct: tag, then fields in order
    assert fields[0] == "sched" and fields[-1] == 0
    assert len(fields) == 1 + len(SchedulerOutputV4.__struct_fields__) + 1

    codec = Codec()
    old = SchedulerOutputV4(
        **{f: getattr(new, f) for f in SchedulerOutputV4.__struct_fields__}  # type: ignore[arg-type]
    )
    got = codec.decode([bytes(f) for f in codec.encode_versioned(old, m.PROTOCOL_MAJOR, 4)])
    assert isinstance(got, m.SchedulerOutput)
    assert got.max_draft_proposals == -1 and got.req_ids == new.req_ids
    assert np.array_equal(got.num_scheduled_tokens, new.num_scheduled_tokens)


def output_as_older(
    new: m.ModelRunnerOutput, field: str, minor: int
) -> tuple[list[bytes], list, m.ModelRunnerOutput]:
    """``new``'s frames, its msgpack body, and what a new peer reads of the same output encoded
    by a worker of ``minor``, whose ``ModelRunnerOutput`` ended before ``field``."""
    codec = Codec()
    frames = [bytes(f) for f in codec.encode(new)]
    major, _minor, body = msgspec.msgpack.decode(frames[0])
    assert len(body) == 1 + len(m.ModelRunnerOutput.__struct_fields__)  # the tag, every field
    at = 1 + m.ModelRunnerOutput.__struct_fields__.index(field)
    got = codec.decode([msgspec.msgpack.encode((major, minor, body[:at])), *frames[1:]])
    assert isinstance(got, m.ModelRunnerOutput)
    return frames, body, got


def one_output(step_id: int, token: int, **kw: bool) -> m.ModelRunnerOutput:
    return m.ModelRunnerOutput(
        step_id=step_id,
        req_ids=["a"],
        num_sampled=np.array([1], np.int32),
        sampled_token_ids=np.array([token], np.int32),
        num_draft_tokens=np.zeros(1, np.int32),
        num_accepted=np.zeros(1, np.int32),
        **kw,
    )


def test_a_minor_6_scheduler_reads_a_minor_5_output_as_drafts_following() -> None:
    """Minor 6 added ``ModelRunnerOutput.drafts_follow`` last. An older worker's output has no such
    field: it reads as True, so the scheduler waits for the ``DraftTokenIds`` that worker sends
    after every output that samples (and an older scheduler ignores the field: old reads new)."""
    _, body, got = output_as_older(one_output(3, 7, drafts_follow=False), "drafts_follow", 5)
    assert body[-2] is False  # it came last, before minor 8's held
    assert got.drafts_follow is True
    assert got.step_id == 3 and got.sampled_token_ids.tolist() == [7]


class OutputV7(msgspec.Struct, tag="out", array_like=True, gc=False):
    """``ModelRunnerOutput`` as minors 6 and 7 knew it (no ``held``)."""

    step_id: int
    req_ids: list[str]
    num_sampled: m.Array
    sampled_token_ids: m.Array
    num_draft_tokens: m.Array
    num_accepted: m.Array
    logprobs: m.Array | None = None
    drafts_follow: bool = True


def test_a_minor_7_scheduler_and_a_minor_8_worker_read_each_others_outputs() -> None:
    """Minor 8 added ``ModelRunnerOutput.held`` last: an old scheduler reads a new worker's
    output (the flag is skipped), and a new scheduler reads an old worker's as not held."""
    new = one_output(4, 9, drafts_follow=False, held=True)
    frames, body, got = output_as_older(new, "held", 7)
    assert body[-1] is True  # held travels last
    assert got.held is False
    assert got.drafts_follow is False and got.sampled_token_ids.tolist() == [9]
    assert Codec().decode(frames).held is True  # type: ignore[union-attr]
    old = Codec()  # a minor-7 scheduler's decoder, arrays read as the codec reads them
    old._decoder = msgspec.msgpack.Decoder(  # type: ignore[assignment]
        OutputV7, ext_hook=old._ext_hook, dec_hook=old._dec_hook
    )
    read = old.decode(frames)
    assert isinstance(read, OutputV7) and read.drafts_follow is False
    assert read.step_id == 4 and read.sampled_token_ids.tolist() == [9]
