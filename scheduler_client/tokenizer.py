"""The scheduler's tokenizer: HF ``tokenizers`` (Rust, no torch), the chat template, and
incremental detokenization."""

from __future__ import annotations

import json
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


@dataclass
class IncrementalDetokenizer:
    """Text deltas from a growing list of token ids. A delta is held back while it ends in an
    incomplete UTF-8 sequence (U+FFFD), then released whole."""

    tokenizer: TokenizerInfo
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0
    text: str = ""

    def add(self, new_ids: list[int], final: bool = False) -> str:
        """The new text; ``final``: the request ends here, so nothing is held back (an
        incomplete UTF-8 sequence comes out as U+FFFD, as the full decode would show it)."""
        self.ids.extend(new_ids)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if (full.endswith("\ufffd") and not final) or len(full) <= len(prefix):
            return ""
        delta = full[len(prefix) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.text += delta
        return delta
