"""A byte-level tokenizer for a model directory that ships none (``--load-format dummy`` on a bare
``config.json``): one token per byte (ids 0..255, in the order of the byte-level alphabet), then ``<|endoftext|>`` (256, the EOS),
``<|im_start|>`` and ``<|im_end|>``, with a ChatML template. It needs no model files, so the
scheduler can tokenize prompts, render chats, run grammars and detokenize; ids the model emits
above 258 decode to nothing (their tokens still count)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

BYTE_VOCAB = 259  # 256 byte tokens + <|endoftext|> (EOS) + <|im_start|> + <|im_end|>
EOS_ID = 256
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}<|im_start|>assistant\n"
)


def byte_tokenizer() -> Tokenizer:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    assert tok.get_vocab_size() == BYTE_VOCAB
    return tok


def save_byte_tokenizer(directory: Path) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` (EOS, chat template) into
    ``directory``, created if missing. Whole or not at all: written beside, then renamed, so
    workers sharing a cache folder never read half a file."""
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory.with_name(directory.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    byte_tokenizer().save(str(tmp / "tokenizer.json"))
    config = {"eos_token": "<|endoftext|>", "bos_token": None, "chat_template": CHAT_TEMPLATE}
    (tmp / "tokenizer_config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        os.replace(tmp / name, directory / name)
    shutil.rmtree(tmp, ignore_errors=True)
    return directory
