"""One short lossless run on the embedded SmolLM2-135M (real weights, fp32, CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from tests.driver import Req, run
from tests.models import greedy_reference, reference_copy
from worker.drafters.ngram import NgramDrafter
from worker.model_executor import ModelExecutor
from worker.model_loader import EMBEDDED_MODEL, load_model
from worker.runner import ModelRunner

pytestmark = pytest.mark.slow

EDIT_PROMPT = (
    "<|im_start|>user\nFix the typo in this code and return all of it:\n"
    "def add(a, b):\n    retrun a + b\n\nprint(add(1, 2))<|im_end|>\n<|im_start|>assistant\n"
)
CHAT_PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def smollm2() -> tuple[torch.nn.Module, str]:
    loaded = load_model(EMBEDDED_MODEL, device=torch.device("cpu"))
    assert loaded.model.dtype == torch.float32
    return loaded.model, loaded.directory


def test_smollm2_ngram_greedy_equals_target_greedy(smollm2: tuple[torch.nn.Module, str]) -> None:
    model, directory = smollm2
    tok = Tokenizer.from_file(f"{directory}/tokenizer.json")
    prompts = [tok.encode(p).ids for p in (EDIT_PROMPT, CHAT_PROMPT)]
    runner = ModelRunner(
        ModelExecutor(model, max_num_seqs=2, max_model_len=256),
        NgramDrafter(min_n=1, max_n=4, max_num_tokens=4),
        max_num_seqs=2,
        max_model_len=256,
        max_num_draft_tokens=4,
    )
    reqs = [Req("edit", prompts[0], 24, k=4), Req("chat", prompts[1], 16, k=4, arrive=1)]
    got = run(runner, reqs)
    ref = reference_copy(model)
    for r, p in zip(reqs, prompts, strict=True):
        want = greedy_reference(ref, p, r.max_tokens)
        assert got[r.req_id] == want, (tok.decode(got[r.req_id]), tok.decode(want))
    edit = reqs[0]
    assert edit.verified > 0 and edit.accepted > 0, "the edit prompt should accept n-gram drafts"
    print(
        "edit acceptance", edit.accepted / edit.verified, tok.decode(np.array(got["edit"]).tolist())
    )


def test_shipped_eagle_head_is_lossless_and_accepted(smollm2: tuple[torch.nn.Module, str]) -> None:
    """The head distilled on the H200 for SmolLM2 (``--eagle-head embedded``), run in float32 on
    the CPU: output equal to target-only greedy, and its drafts accepted."""
    from worker.drafters.eagle import EagleDrafter

    model, directory = smollm2
    tok = Tokenizer.from_file(f"{directory}/tokenizer.json")
    drafter = EagleDrafter.from_files(
        "embedded", model, max_num_seqs=2, max_model_len=256, max_num_tokens=4
    )
    runner = ModelRunner(
        ModelExecutor(model, max_num_seqs=2, max_model_len=256, decode_width=5),
        drafter,
        max_num_seqs=2,
        max_model_len=256,
        max_num_draft_tokens=4,
    )
    prompts = [tok.encode(p).ids for p in (EDIT_PROMPT, CHAT_PROMPT)]
    reqs = [Req("edit", prompts[0], 20, k=4), Req("chat", prompts[1], 12, k=4)]
    got = run(runner, reqs)
    ref = reference_copy(model)
    for r, p in zip(reqs, prompts, strict=True):
        assert got[r.req_id] == greedy_reference(ref, p, r.max_tokens)
    # 0.073 of verified drafts on these two prompts (the head was distilled on 30k tokens of
    # stories, JSON and code edits; docs/performance.md has its held-out figures); a random
    # head's drafts are almost never accepted
    accepted = sum(r.accepted for r in reqs) / sum(r.verified for r in reqs)
    assert accepted > 0.05, accepted


def test_smollm2_text_streams_from_its_token_bytes(smollm2: tuple[torch.nn.Module, str]) -> None:
    """SmolLM2's tokenizer is byte-level: detokenizing joins each id's bytes. Text with
    characters of two to four bytes split across tokens comes out as the full decode, a whole
    character as soon as its last byte is in, never later than the decode of each step's
    window did."""
    from scheduler_client.tokenizer import IncrementalDetokenizer, TokenizerInfo

    tok = TokenizerInfo(smollm2[1])
    assert tok.token_bytes() is not None
    text = 'naïve café — 你好，世界 🙂🙃 日本語のテキスト👍🏽 Ελληνικά {"a": [1, "ü"]}\n\tdef f(x):'
    ids = tok.encode(text)
    fast, slow = IncrementalDetokenizer(tok), IncrementalDetokenizer(tok)
    slow._bytes = None  # the decode of each step's window, as for a tokenizer of another kind
    shown_fast = shown_slow = ""
    for i in range(0, len(ids), 2):
        shown_fast += fast.add(ids[i : i + 2])
        shown_slow += slow.add(ids[i : i + 2])
        assert text.startswith(shown_fast) and len(shown_fast) >= len(shown_slow)
    assert shown_fast + fast.add([], final=True) == text == tok.decode(ids)
