"""The scheduler's tokenizer: HF ``tokenizers`` (Rust, no torch), the chat template, and
incremental detokenization."""

from __future__ import annotations

import codecs
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jinja2 import Template
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer


class TokenizerInfo:
    """Loaded from a transformers model directory: ``tokenizer.json`` plus the chat template from
    ``chat_template.jinja`` or ``tokenizer_config.json``."""

    def __init__(self, directory: str) -> None:
        path = Path(directory)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"{tok_file} is missing: the scheduler needs the tokenizer")
        self.directory = str(path)
        self.json_text = tok_file.read_text()
        self.tokenizer = Tokenizer.from_str(self.json_text)
        config: dict[str, Any] = {}
        if (path / "tokenizer_config.json").is_file():
            config = json.loads((path / "tokenizer_config.json").read_text())
        template = config.get("chat_template")
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        self.chat_template: str | None = template if isinstance(template, str) else None
        self._template: Template | None = None
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self._token_bytes: list[bytes] | None = None
        self._token_bytes_checked = False

    def token_bytes(self) -> list[bytes] | None:
        """Each id's bytes, where decoding ids is decoding the UTF-8 of their bytes joined (a
        byte-level BPE whose decoder is ``ByteLevel`` alone, as SmolLM2's, Qwen2.5's and
        Llama 3's are), special tokens empty; None for any other tokenizer. Built on first use
        (0.2 s for SmolLM2's 49k ids on the 2-core CPU machine, more for larger vocabularies)
        and checked against ``decode``: every id alone and random
        runs of ids; a difference anywhere leaves it None, and detokenizing goes through
        ``decode``."""
        if not self._token_bytes_checked:
            self._token_bytes_checked = True
            self._token_bytes = _byte_table(self)
        return self._token_bytes

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        """The prompt text for ``messages``, ending with the assistant's turn opened."""
        if self.chat_template is None:
            raise ValueError(
                f"the tokenizer in {self.directory} has no chat template: send a prompt"
            )
        if self._template is None:  # compiled once: compiling costs milliseconds a request
            # Templates come with model files: render them sandboxed, as transformers does.
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            self._template = env.from_string(self.chat_template)
        return self._template.render(
            messages=messages,
            add_generation_prompt=True,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )


def _token_text(value: object) -> str | None:
    if isinstance(value, dict):
        content = value.get("content")
        return content if isinstance(content, str) else None
    return value if isinstance(value, str) else None


def _raise(message: str) -> None:
    raise ValueError(message)


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character that stands for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _byte_table(info: TokenizerInfo) -> list[bytes] | None:
    spec = json.loads(info.json_text)
    decoder = spec.get("decoder") or {}
    model = spec.get("model") or {}
    if decoder.get("type") != "ByteLevel" or model.get("type") != "BPE":
        return None
    if model.get("byte_fallback"):
        return None
    tok = info.tokenizer
    # ``ByteLevel`` decodes a token whose characters are all in the alphabet to the bytes they
    # stand for, and any other to its own UTF-8 (an added token's text): each character of the
    # alphabet to its byte as a Latin-1 character, every other one below 256 to one that Latin-1
    # cannot encode (the others cannot be either)
    alphabet = _byte_alphabet()
    to_bytes = str.maketrans(
        {**{chr(c): "\uffff" for c in range(256)}, **{c: chr(b) for c, b in alphabet.items()}}
    )
    special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
    vocab = tok.get_vocab(with_added_tokens=True)  # ids may leave gaps: the table spans them
    table = [b""] * (max(vocab.values(), default=-1) + 1)
    for token, i in vocab.items():
        if i in special:
            continue
        try:
            table[i] = token.translate(to_bytes).encode("latin-1")
        except UnicodeEncodeError:
            table[i] = token.encode()
    # the check: each id alone, and runs of ids (multi-byte characters split across tokens,
    # special tokens among them), decoded both ways
    rng = random.Random(0)
    runs = [[i] for i in range(len(table))]
    runs += [[rng.randrange(len(table)) for _ in range(rng.randrange(2, 9))] for _ in range(500)]
    for run, text in zip(runs, tok.decode_batch(runs, skip_special_tokens=True), strict=True):
        if b"".join(table[i] for i in run).decode("utf-8", "replace") != text:
            return None
    return table


@dataclass
class IncrementalDetokenizer:
    """Text deltas from a growing list of token ids. A delta is held back while it ends in an
    incomplete UTF-8 sequence (U+FFFD), then released whole."""

    tokenizer: TokenizerInfo
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0
    text: str = ""

    def __post_init__(self) -> None:
        # a byte-level tokenizer's ids are their bytes: joined and fed to an incremental UTF-8
        # decoder, which holds back an incomplete sequence at the end by itself (two decodes of
        # the window a step, as below, cost the engine thread 8-9% of its time at c=64)
        table = self.tokenizer.token_bytes()
        self._bytes = (table, codecs.getincrementaldecoder("utf-8")("replace")) if table else None

    def add(self, new_ids: list[int], final: bool = False) -> str:
        """The new text; ``final``: the request ends here, so nothing is held back (an
        incomplete UTF-8 sequence comes out as U+FFFD, as the full decode would show it)."""
        self.ids.extend(new_ids)
        if self._bytes is not None:
            table, utf8 = self._bytes
            n = len(table)
            delta = str(utf8.decode(b"".join([table[i] if i < n else b"" for i in new_ids]), final))
            self.text += delta
            return delta
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if (full.endswith("\ufffd") and not final) or len(full) <= len(prefix):
            return ""
        delta = full[len(prefix) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.text += delta
        return delta
