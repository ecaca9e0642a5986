"""``python3 -m launcher``: see launcher.cli."""

import sys

from runtime.user_errors import exit_without_package


def _main() -> int:
    try:
        from launcher.cli import main
    except ModuleNotFoundError as exc:  # a stock python3 instead of the venv's: one line, not a traceback
        exit_without_package(exc, "launcher")
    return main()


if __name__ == "__main__":
    sys.exit(_main())
