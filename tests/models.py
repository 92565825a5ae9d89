"""Tiny random-weight models (fp32, seeded) and the references the worker must match."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, Qwen2Config

from worker.attention import ATTN_IMPLEMENTATION
from worker.byte_tokenizer import BYTE_VOCAB, EOS_ID, save_byte_tokenizer

VOCAB = 128


def tiny_config(arch: str, *, layers: int = 2, vocab: int = VOCAB) -> PretrainedConfig:
    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":
        return Qwen2Config(**common)
    raise ValueError(arch)


def tiny_model(arch: str, seed: int, *, layers: int = 2, vocab: int = VOCAB) -> torch.nn.Module:
    """A seeded random model using the specd attention."""
    torch.manual_seed(seed)
    cfg = tiny_config(arch, layers=layers, vocab=vocab)
    model = AutoModelForCausalLM.from_config(
        cfg, dtype=torch.float32, attn_implementation=ATTN_IMPLEMENTATION
    )
    # Larger weights than the default init make logits peaked, so greedy has clear winners.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    return model.eval()


def save_tiny(arch: str, seed: int, directory: Path, **kw: int) -> Path:
    model = tiny_model(arch, seed, **kw)
    model.save_pretrained(str(directory))
    return directory


def reference_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The same weights with transformers' own sdpa attention."""
    cfg = copy.deepcopy(model.config)
    cfg._attn_implementation = "sdpa"
    ref = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    ref.load_state_dict(model.state_dict())
    return ref.eval()


@torch.no_grad()
def greedy_reference(ref: torch.nn.Module, prompt: list[int], max_tokens: int) -> list[int]:
    """Target-only greedy decoding, one full forward per token (no cache): the plainest oracle."""
    ids = list(prompt)
    for _ in range(max_tokens):
        logits = ref(torch.tensor([ids])).logits[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


def min_greedy_gap(ref: torch.nn.Module, prompt: list[int], max_tokens: int) -> float:
    """The smallest gap between the two largest logits along the greedy path of ``prompt`` (EOS
    ignored). Under a few ulps (random weights make such ties), a token computed in a prefill (a
    replay, a recompute after preemption) and the same token computed in a decode step may round
    to different argmaxes: exact comparisons across those paths need prompts clear of ties."""
    ids, past, gap = torch.tensor([prompt]), None, float("inf")
    with torch.no_grad():
        for _ in range(max_tokens):
            out = ref(ids, past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[0, -1]
            top = logits.topk(2).values
            gap = min(gap, float(top[0] - top[1]))
            ids = logits.argmax().view(1, 1)
    return gap


BYTE_MODEL_SEED = 31  # the byte-level target of the two-process tests (conftest.py)


def save_byte_model(arch: str, seed: int, directory: Path, *, layers: int = 2) -> Path:
    """A tiny random model whose vocabulary is a byte-level tokenizer (one token per byte), saved
    with ``tokenizer.json`` and a chat template: enough for grammars and detokenization."""
    model = tiny_model(arch, seed, layers=layers, vocab=BYTE_VOCAB)
    model.config.eos_token_id = EOS_ID
    model.generation_config.eos_token_id = EOS_ID
    model.save_pretrained(str(directory))
    save_byte_tokenizer(directory)
    return directory


NEAR_DRAFT_NOISE = 0.1  # greedy acceptance of about 30-70% on these tiny models


def near_copy(
    model: torch.nn.Module, seed: int, *, noise: float = NEAR_DRAFT_NOISE
) -> torch.nn.Module:
    """A draft derived from ``model``: its weights plus seeded Gaussian noise of ``noise`` times
    each tensor's standard deviation. Its greedy drafts agree with the target often but not
    always, so verification accepts some drafts and rejects others (partial acceptance); an
    unrelated random draft is almost always rejected at its first draft."""
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * (noise * float(p.std())))
    return draft.eval()


def save_near_draft(target: Path, seed: int, directory: Path) -> Path:
    """``near_copy`` of the saved model at ``target``, saved for a launched worker's --draft-model."""
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32)
    near_copy(model, seed).save_pretrained(str(directory))
    return directory
