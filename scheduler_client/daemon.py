"""``specd-scheduler``: the scheduler daemon (issue #4). Until it exists it says so and fails."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    print("specd-scheduler: not built yet (issue #4: the scheduler).", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
