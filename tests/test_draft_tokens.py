"""DraftTokensHandler (CPU path here, CUDA path under the gpu marker) and the seed's helpers."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from worker.draft_tokens import DraftTokensHandler
from worker.spec_utils import (
    LoadConfig,
    get_drafter_hidden_states,
    get_parallel_drafting_token_id,
    get_pp_safe_draft_load_config,
)


def set_three(h: DraftTokensHandler, structured: list[bool], device: str = "cpu") -> None:
    drafts = torch.tensor([[10, 11, 12], [20, 21, 22], [30, 31, 32]], device=device)
    h.set_draft_tokens(
        ["a", "b", "c"], drafts, np.array([3, 2, 0]), np.array([5, 6, 7]), np.array(structured)
    )


def test_placeholders_when_no_request_is_structured() -> None:
    h = DraftTokensHandler(torch.device("cpu"))
    h.begin_step(4)
    set_three(h, [False, False, False])
    assert h._draft_np is None, "an unstructured batch must not copy drafts to the host"
    msg = h.get_draft_tokens()
    assert msg is not None and msg.step_id == 4
    assert msg.req_ids == ["a", "b", "c"]
    assert msg.num_draft_tokens.tolist() == [3, 2, 0]
    assert msg.draft_token_ids.tolist() == [-1] * 5
    assert msg.num_committed_tokens.tolist() == [5, 6, 7]
    assert h.get_draft_tokens() is None, "a step's drafts are handed over once"


def test_structured_rows_carry_real_ids_and_others_placeholders() -> None:
    h = DraftTokensHandler(torch.device("cpu"))
    h.begin_step(1)
    set_three(h, [False, True, False])
    msg = h.get_draft_tokens()
    assert msg is not None
    assert msg.draft_token_ids.tolist() == [-1, -1, -1, 20, 21]


def test_discard_drops_finished_requests() -> None:
    h = DraftTokensHandler(torch.device("cpu"))
    h.begin_step(2)
    set_three(h, [True, True, False])
    h.discard(["a", "zzz"])
    msg = h.get_draft_tokens()
    assert msg is not None and msg.req_ids == ["b", "c"]
    assert msg.draft_token_ids.tolist() == [20, 21]
    assert msg.num_committed_tokens.tolist() == [6, 7]


def test_deferred_requests_are_left_out() -> None:
    h = DraftTokensHandler(torch.device("cpu"))
    h.begin_step(3, deferred_req_ids=frozenset({"b"}))
    set_three(h, [True, True, True])
    msg = h.get_draft_tokens()
    assert msg is not None and msg.req_ids == ["a", "c"]
    assert msg.draft_token_ids.tolist() == [10, 11, 12]


def test_ordering_a_new_step_replaces_the_old() -> None:
    h = DraftTokensHandler(torch.device("cpu"))
    h.begin_step(5)
    set_three(h, [True, False, False])
    h.begin_step(6)  # the step-5 drafts were never taken: they must not leak into step 6
    assert h.get_draft_tokens() is None
    set_three(h, [False, False, False])
    msg = h.get_draft_tokens()
    assert msg is not None and msg.step_id == 6


@pytest.mark.gpu
def test_cuda_copy_path_matches_cpu() -> None:
    dev = torch.device("cuda")
    h = DraftTokensHandler(dev)
    assert h.copy_stream is not None
    h.begin_step(9)
    set_three(h, [True, True, True], device="cuda")
    msg = h.get_draft_tokens()
    assert msg is not None
    assert msg.draft_token_ids.tolist() == [10, 11, 12, 20, 21]


def test_drafter_hidden_states_prefers_mtp_states() -> None:
    hidden = torch.ones(2, 3)
    assert get_drafter_hidden_states(object(), hidden) is hidden
    mtp = torch.zeros(2, 3)
    model = types.SimpleNamespace(get_mtp_target_hidden_states=lambda: mtp)
    assert get_drafter_hidden_states(model, hidden) is mtp
    none_model = types.SimpleNamespace(get_mtp_target_hidden_states=lambda: None)
    assert get_drafter_hidden_states(none_model, hidden) is hidden


@pytest.mark.parametrize(
    ("fields", "want"),
    [
        ({"dflash_config": {"mask_token_id": 7}, "mask_token_id": 8, "pard_token": 9}, 7),
        ({"mask_token_id": 8, "dspark_noise_token_id": 1, "pard_token": 9}, 8),
        ({"mask_token_id": None, "dspark_noise_token_id": 1, "pard_token": 9}, 1),
        ({"pard_token": 9, "ptd_token_id": 3}, 9),
        ({"ptd_token_id": 3}, 3),
        ({"dflash_config": {}, "ptd_token_id": 4}, 4),
    ],
)
def test_parallel_drafting_token_id_order(fields: dict[str, object], want: int) -> None:
    assert get_parallel_drafting_token_id(types.SimpleNamespace(**fields)) == want


def test_parallel_drafting_token_id_missing() -> None:
    with pytest.raises(ValueError, match=r"`dflash_config\.mask_token_id`, `mask_token_id`"):
        get_parallel_drafting_token_id(types.SimpleNamespace(mask_token_id=None))


def test_pp_safe_draft_load_config() -> None:
    fast = LoadConfig(load_format="fastsafetensors", pipeline_parallel_size=2)
    assert get_pp_safe_draft_load_config(fast).load_format == "auto"
    single = LoadConfig(load_format="fastsafetensors", pipeline_parallel_size=1)
    assert get_pp_safe_draft_load_config(single) is single
    plain = LoadConfig(load_format="safetensors", pipeline_parallel_size=4)
    assert get_pp_safe_draft_load_config(plain) is plain
    with pytest.raises(ValueError):
        LoadConfig(load_format="pickle")
