"""``specd``: the harness CLI. Subcommands land with their issues; until then they say so."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    name = args[0] if args else "(none)"
    print(
        f"specd {name}: not built yet. The scheduler, `specd run` and `make run` are issue #4; "
        "see docs/operations.md for what works today.",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
