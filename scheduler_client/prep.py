"""Request preparation off the engine thread: limits, chat template, tokenizing, grammar.

The engine thread only schedules; everything a request's size can make slow happens here first,
and the request joins the scheduler once it is ready (``EngineLoop`` hands it over). Where each
piece runs follows from whether its library releases the GIL (measured, docs/performance.md):

- HF ``tokenizers`` holds the GIL for a whole ``encode`` (16.6 s for 10 MB of text on the 2-core
  machine), and even ``encode_batch``, which releases it, holds it 0.45-0.7 s to build the result.
  So the chat template and tokenizing run in a pool of *processes* (spawned; each loads the
  tokenizer once) that send back only the ids, and only when they fit ``max_model_len``.
- llguidance releases the GIL while it compiles and builds a matcher (the engine thread's largest
  stall was 35-56 ms while a 5,000-branch anyOf schema compiled for 0.7-1.3 s). A matcher must
  live in this process, so grammars compile in a pool of *threads*.

The limits (``InputLimits``) are checked first, in the thread, before either.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from jinja2 import TemplateError

from scheduler_client.grammar import GrammarBackend, parse_spec
from scheduler_client.limits import InputLimits
from scheduler_client.tokenizer import TokenizerInfo


class Preparer:
    """Owns the two pools. ``submit`` may be called from any thread; ``close`` once, at the end."""

    def __init__(
        self,
        *,
        tokenizer_dir: str | None,
        grammar: GrammarBackend | None,
        limits: InputLimits,
        max_model_len: int,
        num_threads: int = 4,
        num_processes: int = 2,
    ) -> None:
        if num_threads < 1 or num_processes < 1:
            raise ValueError("--prep-threads and --prep-processes must be >= 1")
        self.tokenizer_dir = tokenizer_dir
        self.grammar = grammar
        self.limits = limits
        self.max_model_len = max_model_len
        self.num_processes = num_processes
        self._threads = ThreadPoolExecutor(num_threads, thread_name_prefix="prep")
        self._procs = self._start_processes()

    def _start_processes(self) -> ProcessPoolExecutor | None:
        if self.tokenizer_dir is None:
            return None
        procs = ProcessPoolExecutor(
            self.num_processes,
            # spawn, not fork: the parent has threads (HTTP, engine), and a forked child would
            # inherit their locks
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_load_tokenizer,
            initargs=(self.tokenizer_dir, os.getpid()),
        )
        procs.submit(_tokenize, "", None, self.max_model_len)  # start them now, not on a request
        return procs

    def submit(self, request: dict[str, Any]) -> Future[dict[str, Any]]:
        """Prepare ``request`` (``Engine.add_request`` keyword arguments): the future's result is
        the same arguments with the prompt as token ids and the grammar's ``matcher``. It fails
        with a ``ValueError`` (a ``LimitError`` for a limit) whose message is for the client."""
        return self._threads.submit(self._prepare, dict(request))

    def _prepare(self, request: dict[str, Any]) -> dict[str, Any]:
        prompt = request.pop("prompt", None)
        messages = request.pop("messages", None)
        if (prompt is None) == (messages is None):
            raise ValueError("give exactly one of prompt and messages")
        spec = parse_spec(request.get("structured"))
        self.limits.check_prompt(prompt, messages)
        if spec is not None:
            self.limits.check_spec(spec)
        request["prompt"] = self._token_ids(prompt, messages)
        if spec is not None:
            if self.grammar is None:
                raise ValueError("structured outputs need a tokenizer and a grammar backend")
            request["structured"] = spec
            request["matcher"] = self.grammar.matcher(spec)
        return request

    def _token_ids(self, prompt: str | list[int] | None, messages: Any) -> list[int]:
        if isinstance(prompt, list):
            return [int(t) for t in prompt]
        procs = self._procs
        if procs is None:
            raise ValueError("this worker reported no tokenizer: send token ids")
        try:
            ids: list[int] = procs.submit(_tokenize, prompt, messages, self.max_model_len).result()
        except BrokenProcessPool:
            # a tokenizer process died (out of memory on a huge prompt?): a new pool for the next
            self._procs = self._start_processes()
            procs.shutdown(wait=False, cancel_futures=True)
            raise ValueError("the tokenizer process died while preparing this request") from None
        return ids

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
        if self._procs is not None:
            self._procs.shutdown(wait=True, cancel_futures=True)


# -- in the tokenizer processes ----------------------------------------------------------------
PARENT_POLL_S = 0.5
_TOKENIZER: TokenizerInfo | None = None


def _load_tokenizer(directory: str, parent_pid: int) -> None:
    global _TOKENIZER
    _TOKENIZER = TokenizerInfo(directory)
    # A killed scheduler cannot shut its pool down, and the pool's queue never reports it (this
    # process holds both ends of its pipe): leave once the parent is gone.
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()


def _exit_with_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_S)
    os._exit(0)


def _tokenize(
    prompt: str | None, messages: list[dict[str, str]] | None, max_model_len: int
) -> list[int]:
    """The prompt's ids; a prompt too long for the model sends back only the error (a 10 MB
    prompt's ids would cost the parent its GIL to unpickle)."""
    tok = _TOKENIZER
    assert tok is not None, "the tokenizer process was not initialized"
    try:
        text = prompt if prompt is not None else tok.apply_chat_template(messages or [])
    except TemplateError as e:
        raise ValueError(f"the chat template failed on these messages: {e}") from None
    enc = tok.tokenizer.encode(text, add_special_tokens=False)
    if len(enc) >= max_model_len:
        raise ValueError(
            f"prompt of {len(enc)} tokens is too long: the model takes at most "
            f"{max_model_len - 1} prompt tokens (max_model_len {max_model_len})"
        )
    return list(enc.ids)
