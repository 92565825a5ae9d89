"""What both daemons share at start-up: options from a TOML file (flags win) and log setup.

It lives beside the wire code because it is the one package both processes import; it needs
nothing beyond the standard library.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tomllib
from collections.abc import Sequence


def parse_with_config(
    ap: argparse.ArgumentParser, argv: Sequence[str] | None
) -> argparse.Namespace:
    """Parse ``argv``; when it names ``--config FILE``, the file's options become the defaults, so
    a flag given on the command line still wins."""
    first = ap.parse_args(argv)
    if getattr(first, "config", None):
        ap.set_defaults(**load_toml(first.config, ap))
    return ap.parse_args(argv)


def load_toml(path: str, ap: argparse.ArgumentParser) -> dict[str, object]:
    """Options from a TOML file, checked as their flags are: an unknown key, a value of the wrong
    TOML type, a value the flag's type or choices reject: each is a ``ValueError`` naming the key.
    Keys are flag names with ``-`` or ``_``."""
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"cannot read config {path}: {e}") from None
    actions = {a.dest: a for a in ap._actions}
    out: dict[str, object] = {}
    for key, value in raw.items():
        dest = key.replace("-", "_")
        if dest not in actions or dest in ("help", "config"):
            raise ValueError(f"config {path}: unknown option {key!r}")
        out[dest] = _typed(f"config {path}: {key}", actions[dest], value)
    return out


def _typed(where: str, action: argparse.Action, value: object) -> object:
    """``value`` as the flag's parser would produce it, or a ``ValueError`` saying why not."""
    if isinstance(
        action,
        (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse.BooleanOptionalAction),
    ):
        if not isinstance(value, bool):
            raise ValueError(f"{where} must be true or false, got {value!r}")
        return value
    kind = action.type
    if kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        want = "an integer"
    elif kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        want = "a number"
    else:
        own = kind not in (None, str)  # a parser of its own (a count or a word, say)
        if own and isinstance(value, int) and not isinstance(value, bool):
            value = str(value)  # ... given the text the flag would be
        ok = isinstance(value, str)
        want = "a string or an integer" if own else "a string"
    if not ok:
        raise ValueError(f"{where} must be {want}, got {value!r}")
    if kind is not None:
        try:
            value = kind(value)  # type: ignore[arg-type,operator]  # checked above
        except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
            raise ValueError(f"{where}: {e}") from None
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise ValueError(f"{where} must be one of {choices}, got {value!r}")
    return value


def add_log_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    ap.add_argument(
        "--log-format",
        default="text",
        choices=("text", "json"),
        help="text lines, or one JSON object per line",
    )


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(record.created, 3),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup_logging(level: str, fmt: str) -> None:
    """One stderr handler: text, or JSON lines (``fmt == "json"``)."""
    if fmt not in ("text", "json"):
        raise ValueError("--log-format must be text or json")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonFormatter()
        if fmt == "json"
        else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
