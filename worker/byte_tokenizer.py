"""A byte-level tokenizer for a model directory that ships none (``--load-format dummy`` on a bare
``config.json``): one token per byte (ids 0..255, in the order of the byte-level alphabet), then ``<|endoftext|>`` (256, the EOS),
``<|im_start|>`` and ``<|im_end|>``, with a ChatML template; up to the model's vocabulary size the
rest are filler tokens ``<|tN|>``, so every id a random model emits decodes to text (a streamed
response then has one event per token, and time to first token is measurable). It needs no model
files: the scheduler can tokenize prompts, render chats, run grammars and detokenize."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

BYTE_VOCAB = 259  # 256 byte tokens + <|endoftext|> (EOS) + <|im_start|> + <|im_end|>
EOS_ID = 256
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}<|im_start|>assistant\n"
)


def byte_tokenizer(vocab_size: int = BYTE_VOCAB) -> Tokenizer:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    assert tok.get_vocab_size() == BYTE_VOCAB
    fill = [AddedToken(f"<|t{i}|>", normalized=False) for i in range(BYTE_VOCAB, vocab_size)]
    tok.add_tokens(fill)
    assert tok.get_vocab_size() == max(vocab_size, BYTE_VOCAB)
    return tok


def save_byte_tokenizer(directory: Path, vocab_size: int = BYTE_VOCAB) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` (EOS, chat template) into
    ``directory`` (created if missing) for a model of ``vocab_size`` ids. Whole or not at all: written beside, then renamed, so
    workers sharing a cache folder never read half a file."""
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory.with_name(directory.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    byte_tokenizer(vocab_size).save(str(tmp / "tokenizer.json"))
    config = {"eos_token": "<|endoftext|>", "bos_token": None, "chat_template": CHAT_TEMPLATE}
    (tmp / "tokenizer_config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        os.replace(tmp / name, directory / name)
    shutil.rmtree(tmp, ignore_errors=True)
    return directory
