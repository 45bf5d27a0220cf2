"""Progress of a long stage (loading, compiling, fetching) on stderr, for the CLI and the
server."""

from __future__ import annotations

import sys


def progress_printer(label: str):
    """A progress callback: a bar on a terminal, a few plain lines in a log."""
    tty = sys.stderr.isatty()
    last = [-1]

    def show(done: int, total: int) -> None:
        pct = 100 * done // max(total, 1)
        if tty:
            bar = "#" * (pct // 4)
            print(f"\r{label} [{bar:<25}] {pct:3d}%", end="" if done < total else "\n",
                  file=sys.stderr, flush=True)
        elif pct // 25 != last[0] // 25 or done == total:
            print(f"{label}: {pct}%", file=sys.stderr, flush=True)
        last[0] = pct
    return show
