"""Small helpers from the seed: drafter hidden states, the parallel-drafting mask token, and a
pipeline-safe load config for draft models."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)


def get_drafter_hidden_states(model: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    """The hidden states a drafter that reads the target's (EAGLE-style heads, MTP) should see.

    A model may expose ``get_mtp_target_hidden_states()`` (e.g. the states before its final norm, or a
    concatenation of auxiliary layers); when it returns a tensor that wins, otherwise the target's
    last hidden states are used as they are.
    """
    getter = getattr(model, "get_mtp_target_hidden_states", None)
    if callable(getter):
        mtp = getter()
        if mtp is not None:
            return mtp
    return hidden_states


def get_parallel_drafting_token_id(hf_config: Any) -> int:
    """The mask token id used for parallel drafting slots.

    Checks (in order): ``dflash_config.mask_token_id``, top-level ``mask_token_id``,
    ``dspark_noise_token_id``, ``pard_token``, ``ptd_token_id``. Raises ValueError if none is present.
    """
    dflash_config = getattr(hf_config, "dflash_config", None) or {}
    if "mask_token_id" in dflash_config:
        return int(dflash_config["mask_token_id"])
    if getattr(hf_config, "mask_token_id", None) is not None:
        return int(hf_config.mask_token_id)
    for name in ("dspark_noise_token_id", "pard_token", "ptd_token_id"):
        if hasattr(hf_config, name):
            return int(getattr(hf_config, name))
    raise ValueError(
        "Model config must specify `dflash_config.mask_token_id`, `mask_token_id`, "
        "`dspark_noise_token_id`, `pard_token`, or `ptd_token_id` for parallel drafting."
    )


@dataclass(frozen=True, kw_only=True)
class LoadConfig:
    """How weights are read. ``fastsafetensors`` loads with collectives that span every rank of the
    pipeline group; ``auto`` reads each rank's files on its own."""

    load_format: str = "auto"
    pipeline_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.load_format not in ("auto", "safetensors", "fastsafetensors", "gguf"):
            raise ValueError(f"unknown load_format {self.load_format!r}")
        if self.pipeline_parallel_size < 1:
            raise ValueError("pipeline_parallel_size must be >= 1")


def get_pp_safe_draft_load_config(load_config: LoadConfig) -> LoadConfig:
    """Avoid collectives that include pipeline ranks without a draft model.

    A draft model lives on one pipeline stage only; a loader whose collectives span all ranks would
    wait forever for ranks that never load it, so the draft falls back to the standard loader while
    the target keeps ``fastsafetensors``.
    """
    if load_config.pipeline_parallel_size > 1 and load_config.load_format == "fastsafetensors":
        log.warning(
            "fastsafetensors cannot load a draft model instantiated on only one pipeline stage; "
            "falling back to the standard safetensors loader for the draft model. The target "
            "model still uses fastsafetensors."
        )
        return dataclasses.replace(load_config, load_format="auto")
    return load_config
