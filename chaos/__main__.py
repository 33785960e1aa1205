"""`python -m chaos run ...` (one chaos run) and `python -m chaos check HISTORY ...`."""

from __future__ import annotations

import sys

USAGE = "usage: python -m chaos {run,check} ...  (run: a chaos run; check: check a history)"


def main(argv: list[str]) -> int:
    """Dispatches to the runner or the checker (imported only when asked for)."""
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "run":
        from chaos.run import main as run_main

        return run_main(rest)
    if command == "check":
        from chaos.checker import main as check_main

        status: int = check_main(rest)
        return status
    print(f"chaos: unknown command {command!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
