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
    """Options from a TOML file, checked against the parser's flags (an unknown key is an error
    that names it). Keys are flag names with ``-`` or ``_``."""
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"cannot read config {path}: {e}") from None
    known = {a.dest for a in ap._actions}
    out: dict[str, object] = {}
    for key, value in raw.items():
        dest = key.replace("-", "_")
        if dest not in known or dest in ("help", "config"):
            raise ValueError(f"config {path}: unknown option {key!r}")
        out[dest] = value
    return out


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
