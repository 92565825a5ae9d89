"""``specd-scheduler``: a long-running scheduler daemon with its own front door is issue #5
(operations). Today the scheduler runs inside ``specd run`` and the ``Engine`` API."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    print(
        "specd-scheduler: the standalone scheduler daemon is not built yet (issue #5). Use "
        "`specd run` (or scheduler_client.Engine), which runs the scheduler beside a worker.",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
