"""``python -m phalanx.worker.exec CMD [ARGS...]``: run a command as one rank of a job.

Ties the command's life to the launcher's (see :mod:`phalanx.worker.lifeline`), then replaces this
process with the command, so the rank's pid, exit code and signals are the command's own.
"""

from __future__ import annotations

import os
import sys

from phalanx.worker.lifeline import die_with_parent

#: Exit code when the command cannot be found or executed (as a shell reports it).
EXIT_NOT_FOUND = 127


def main(argv: list[str]) -> int:
    """Exec ``argv``; returns only when that fails."""
    if not argv:
        sys.stderr.write("phalanx.worker.exec: no command given\n")
        return 2
    die_with_parent()
    try:
        os.execvp(argv[0], argv)
    except OSError as e:
        sys.stderr.write(f"phalanx: cannot run {argv[0]!r}: {e.strerror}\n")
    return EXIT_NOT_FOUND


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
