"""``--load-format dummy``: seeded random weights from a bare config.json, served end to end."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from scheduler_client import Engine, EngineConfig, SchedulerConfig
from scheduler_client.tokenizer import TokenizerInfo
from tests.models import greedy_reference, reference_copy, save_byte_model, tiny_config
from worker.byte_tokenizer import EOS_ID
from worker.dummy_weights import DUMMY_SEED, random_model
from worker.model_loader import eos_token_ids, load_model

VOCAB = 300  # above the byte-level tokenizer's 259 ids: the fallback fits


def bare_config(directory: Path, vocab: int = VOCAB) -> Path:
    """A model directory holding only config.json (no weights, no tokenizer)."""
    tiny_config("llama", vocab=vocab).save_pretrained(str(directory))
    assert [p.name for p in directory.iterdir()] == ["config.json"]
    return directory


def test_dummy_weights_are_seeded_and_in_the_dtype(tmp_path: Path) -> None:
    model_dir = bare_config(tmp_path / "m")
    cpu = torch.device("cpu")
    a = load_model(
        str(model_dir),
        device=cpu,
        dtype=torch.bfloat16,
        load_format="dummy",
        cache_root=tmp_path / "cache",
    )
    b = load_model(
        str(model_dir),
        device=cpu,
        dtype=torch.bfloat16,
        load_format="dummy",
        cache_root=tmp_path / "cache",
    )
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert {t.dtype for t in sa.values()} == {torch.bfloat16}
    assert all(torch.equal(sa[k], sb[k]) for k in sa), "same config and seed, other weights"
    assert not all(torch.equal(t, torch.zeros_like(t)) for t in sa.values())
    # no tokenizer with the model: the byte-level one, under the cache folder, with its EOS
    assert Path(a.tokenizer_directory, "tokenizer.json").is_file()
    assert Path(a.tokenizer_directory).parent == tmp_path / "cache"
    assert eos_token_ids(a.model) == (EOS_ID,)
    # every id the model can emit decodes to text: the stream has an event per token
    tok = TokenizerInfo(a.tokenizer_directory)
    assert tok.tokenizer.get_vocab_size() == VOCAB
    assert tok.decode([VOCAB - 1]) == f"<|t{VOCAB - 1}|>"


def test_a_tokenizer_beside_the_config_is_kept(tmp_path: Path) -> None:
    model_dir = save_byte_model("llama", 5, tmp_path / "m")
    for weights in model_dir.glob("*.safetensors"):
        weights.unlink()  # dummy never reads them
    got = load_model(
        str(model_dir),
        device=torch.device("cpu"),
        load_format="dummy",
        cache_root=tmp_path / "cache",
    )
    assert got.tokenizer_directory == str(model_dir)
    assert not (tmp_path / "cache").exists()


def test_a_vocabulary_too_small_for_the_fallback_is_refused(tmp_path: Path) -> None:
    model_dir = bare_config(tmp_path / "m", vocab=128)
    with pytest.raises(ValueError, match=r"vocabulary \(128\) is too small.*add a tokenizer.json"):
        load_model(
            str(model_dir),
            device=torch.device("cpu"),
            load_format="dummy",
            cache_root=tmp_path / "cache",
        )


def test_a_dummy_worker_serves_through_the_engine(tmp_path: Path) -> None:
    """A worker launched with --load-format dummy on a bare config serves text prompts and chats
    through the scheduler, and its greedy tokens are those of the same seeded random model."""
    model_dir = bare_config(tmp_path / "m")
    ref = reference_copy(
        random_model(
            tiny_config("llama", vocab=VOCAB),
            device=torch.device("cpu"),
            dtype=torch.float32,
            seed=DUMMY_SEED,
        )
    )
    config = EngineConfig(
        model=str(model_dir),
        drafter="ngram",
        device="cpu",
        max_model_len=256,
        worker_args=("--load-format", "dummy"),
        worker_env=(("SPECD_CACHE_DIR", str(tmp_path / "cache")),),
        scheduler=SchedulerConfig(),
        step_timeout_s=60,
        max_worker_restarts=0,
    )
    with Engine(config) as engine:
        assert engine.ready.model_name == "m-dummy"
        assert engine.ready.eos_token_ids == (EOS_ID,)
        prompt = engine.add_request("hello dummy", max_tokens=12, ignore_eos=True)
        chat = engine.add_request(
            messages=[{"role": "user", "content": "hi"}], max_tokens=4, ignore_eos=True
        )
        engine.run_until_done()
        assert engine.tokenizer is not None
        assert engine.tokenizer.decode(prompt.prompt_ids) == "hello dummy"
    assert prompt.error is None and chat.error is None
    assert len(prompt.prompt_ids) == len("hello dummy")  # one token per byte
    assert prompt.output_ids == greedy_reference(ref, prompt.prompt_ids, 12)
    assert len(chat.output_ids) == 4
