"""Every message between the specd worker and its scheduler.

Wire rules (read before you touch a Struct here):

* Each message is a ``msgspec.Struct`` with a ``tag``, ``array_like=True`` and ``gc=False``; together
  they form the tagged union ``Message``. The codec (``protocol.codec``) encodes one union value per
  ZeroMQ message: frame 0 holds ``[major, minor, message]`` in msgpack, every ``numpy.ndarray`` field
  travels as a raw buffer in a frame of its own (frames 1..n), referenced from frame 0 by a msgpack
  extension that names its frame, dtype and shape.
* Evolution: never reorder, rename, retype or remove a field; never reuse a tag. A new field goes last
  and has a default; adding one bumps ``PROTOCOL_MINOR``. An older peer ignores trailing fields it does
  not know (``forbid_unknown_fields`` stays off), so old reads new. Anything else is a breaking change
  and bumps ``PROTOCOL_MAJOR``; peers refuse a different major version at the handshake and on every
  message.
* Sentinels: ``-1`` in a draft-token array means "the worker keeps this draft on its device" (a width
  placeholder) and nothing else. Grammar-invalid drafts are never marked: the width shrinks.
* Token-id arrays are int32, bitmasks are int32 with ``ceil(vocab_size / 32)`` words per row (bit
  ``t % 32`` of word ``t // 32`` set means token ``t`` is allowed).
"""

from __future__ import annotations

import msgspec
import numpy as np

PROTOCOL_MAJOR = 1
# 1: overlap scheduling (draft_widths_are_caps, deferred_req_ids, StepBitmask)
# 2: WorkerReady.max_num_batched_tokens
# 3: WorkerError.field
# 4: WorkerReady.num_kv_blocks, WorkerReady.kv_block_size (the paged KV cache)
# 5: SchedulerOutput.max_draft_proposals
# 6: ModelRunnerOutput.drafts_follow (a worker leaves out a DraftTokenIds without drafts for a
#    scheduler of minor 6 or later)
# 7: WorkerReady.pipeline_steps (the worker leaves steps without drafts open: a scheduler left to
#    choose runs overlap scheduling with three steps in flight)
# 8: ModelRunnerOutput.held (the output went out after the next step was launched)
PROTOCOL_MINOR = 8
PROTOCOL_VERSION = (PROTOCOL_MAJOR, PROTOCOL_MINOR)

# numpy arrays appear in Struct fields; msgspec sees them as a custom type that the codec handles.
Array = np.ndarray


class _Msg(msgspec.Struct, tag=True, array_like=True, gc=False, frozen=True):
    """Base of every wire message: tagged by class name, encoded as an array."""


class SamplingParams(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """Per-request sampling. temperature 0 is greedy; top_k 0 and top_p 1.0 disable those filters."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()


class NewRequest(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """A request the worker has not seen. ``prompt_token_ids`` is int32 [num_prompt_tokens]; on a
    replay after a worker restart it holds prompt plus committed output tokens."""

    req_id: str
    prompt_token_ids: Array
    sampling: SamplingParams
    num_speculative_tokens: int
    structured: bool = False


class SchedulerHello(_Msg, tag="hello", frozen=True):
    """First message from a scheduler; the worker answers ``WorkerReady`` or ``WorkerError``."""

    protocol_major: int
    protocol_minor: int
    scheduler_id: str


class WorkerReady(_Msg, tag="ready", frozen=True):
    """The worker's identity and limits, sent once its models are loaded. The scheduler runs at
    most ``max_num_seqs`` requests and ``max_num_batched_tokens`` tokens per step unless its user
    sets lower caps; ``max_num_batched_tokens`` 0 (minor < 2) means the worker did not say.
    The target's KV cache is ``num_kv_blocks`` blocks of ``kv_block_size`` tokens; a request holds
    ``ceil(tokens / kv_block_size)`` of them, and the scheduler admits and preempts by that count
    (0, minor < 4: the worker did not say; the scheduler counts only ``max_num_seqs``).
    ``pipeline_steps`` (minor 7): the worker leaves a step without drafts open and launches the
    next one behind it (``--pipeline-steps``, on by default on CUDA); a scheduler whose user did
    not choose its mode then runs overlap scheduling with three steps in flight (False, minor <
    7: sync, or two steps in flight with ``--async-scheduling``)."""

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
    max_num_batched_tokens: int = 0  # minor 2
    num_kv_blocks: int = 0  # minor 4
    kv_block_size: int = 0  # minor 4
    pipeline_steps: bool = False  # minor 7


class SchedulerOutput(_Msg, tag="sched", frozen=True):
    """One step. ``req_ids`` is the batch order; every per-request array below follows it.

    * ``num_scheduled_tokens`` int32 [num_reqs]: tokens the worker runs for each request this step,
      a prefill chunk or ``1 + num_draft_tokens[i]`` when decoding.
    * ``num_draft_tokens`` int32 [num_reqs]: the draft width scheduled for each request (after grammar
      validation; 0 for none). The worker's own width must agree: a mismatch is an error.
    * ``draft_token_ids`` int32 [sum(num_draft_tokens)]: per request its drafts, -1 where the worker
      keeps the draft on its device, a real id where the scheduler supplies it (grammar-forced).
    * ``grammar_bitmask`` int32 [num_rows, ceil(vocab/32)] or None; ``structured_req_ids`` name the
      requests that own rows and ``cu_bitmask_rows`` int32 [num_structured + 1] their row ranges. A
      request's rows are ``1 + num_draft_tokens``: row i is the grammar state after drafts 0..i-1.
    * ``draft_widths_are_caps`` (overlap scheduling, minor 1): the scheduler sent this step before it
      saw the drafts, so a request's placeholder width is a cap: the worker runs
      ``min(width, drafts it proposed)`` of its own drafts and reports the width it used.
    * ``deferred_req_ids`` (minor 1): structured requests whose bitmask rows come later in a
      ``StepBitmask`` for this step (their previous tokens were still pending when it was sent).
    * ``max_draft_proposals`` (minor 5): the most drafts the worker proposes for each request after
      this step, for the next step to verify (``-1``: each request's ``num_speculative_tokens``;
      ``0``: the drafter does no work). The scheduler's speculation tuner sets it, so a width of
      zero saves the drafting too, not only the verification.
    """

    step_id: int
    new_requests: list[NewRequest]
    req_ids: list[str]
    num_scheduled_tokens: Array
    num_draft_tokens: Array
    draft_token_ids: Array
    finished_req_ids: list[str]
    aborted_req_ids: list[str]
    structured_req_ids: list[str]
    cu_bitmask_rows: Array | None = None
    grammar_bitmask: Array | None = None
    pending_structured_output_tokens: bool = False
    draft_widths_are_caps: bool = False
    deferred_req_ids: list[str] = msgspec.field(default_factory=list)
    max_draft_proposals: int = -1


class StepBitmask(_Msg, tag="bitmask", frozen=True):
    """The deferred grammar rows of step ``step_id`` (overlap scheduling, minor 1), sent once the
    scheduler has committed the previous step's tokens and validated the drafts the worker proposed
    after it. Per request of ``req_ids`` (the step's ``deferred_req_ids``, same order):
    ``num_valid_drafts`` int32 — how many of the drafts the worker verifies this step are valid under
    the grammar (0 when the scheduler never saw them: fail closed) — and ``num_valid_drafts + 1``
    rows in ``grammar_bitmask`` (range ``cu_bitmask_rows[i] .. cu_bitmask_rows[i + 1]``): row j is the
    grammar state after valid drafts 0..j-1. The worker accepts at most ``num_valid_drafts`` drafts.
    """

    step_id: int
    req_ids: list[str]
    num_valid_drafts: Array
    cu_bitmask_rows: Array
    grammar_bitmask: Array


class ModelRunnerOutput(_Msg, tag="out", frozen=True):
    """Results of one step, in the step's batch order.

    ``sampled_token_ids`` int32 [sum(num_sampled)]: accepted drafts then one bonus or corrected token
    per request (none for a request whose prefill is not finished). ``num_draft_tokens`` counts the
    drafts verified, ``num_accepted`` the drafts accepted. ``logprobs`` float32 [sum(num_sampled)] or
    None.

    ``drafts_follow`` (minor 6): a ``DraftTokenIds`` for this step follows the output. A worker
    sets it False, and sends none, when its drafter is asked for no draft: no request that
    sampled has a width (no drafter, the scheduler's ``max_draft_proposals`` at zero, or no room
    left). The output is sent before the drafter runs, so a lookup that finds nothing still
    sends its message, with widths of zero. It does so only for a scheduler that said minor 6
    or later in its hello; an older one waits for a ``DraftTokenIds`` after every output that
    sampled, and gets one. Without the message the scheduler clears the drafts of every request
    that sampled, as a message of zero widths would have.

    ``held`` (minor 8): the worker left the step open and sent its output only after it had
    launched the next step behind it (``--pipeline-steps``): the time from the output before to
    this one holds part of the next step's, whose own comes short by as much.
    """

    step_id: int
    req_ids: list[str]
    num_sampled: Array
    sampled_token_ids: Array
    num_draft_tokens: Array
    num_accepted: Array
    logprobs: Array | None = None
    drafts_follow: bool = True
    held: bool = False  # minor 8


class DraftTokenIds(_Msg, tag="drafts", frozen=True):
    """The drafts proposed after ``step_id``, for the next step.

    ``num_draft_tokens`` int32 [num_reqs]; ``draft_token_ids`` int32 [sum(num_draft_tokens)], real ids
    for structured requests and -1 placeholders otherwise; ``num_committed_tokens`` int32 [num_reqs]:
    the sequence length (prompt + output) the drafts extend. Drafts that do not match the step and
    lengths the scheduler expects are discarded by it.
    """

    step_id: int
    req_ids: list[str]
    num_draft_tokens: Array
    draft_token_ids: Array
    num_committed_tokens: Array


class Ping(_Msg, tag="ping", frozen=True):
    seq: int


class Pong(_Msg, tag="pong", frozen=True):
    """``num_steps`` counts the steps the worker's loop has executed; the pong is sent from that loop."""

    seq: int
    num_steps: int


class WorkerError(_Msg, tag="error", frozen=True):
    """An error the worker reports. ``fatal`` means the worker is exiting. ``field`` (minor 2) names
    the field of the refused message at fault, with its index where it has one
    (``num_draft_tokens[2]``, ``new_requests[0].prompt_token_ids``, ``StepBitmask.cu_bitmask_rows``);
    None when no single field is (a timeout, a decode error)."""

    code: str
    message: str
    step_id: int | None = None
    req_id: str | None = None
    fatal: bool = False
    field: str | None = None


class Shutdown(_Msg, tag="shutdown", frozen=True):
    reason: str = ""


Message = (
    SchedulerHello
    | WorkerReady
    | SchedulerOutput
    | StepBitmask
    | ModelRunnerOutput
    | DraftTokenIds
    | Ping
    | Pong
    | WorkerError
    | Shutdown
)
