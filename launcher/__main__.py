"""``python3 -m launcher``: see launcher.cli."""

import sys


def _main() -> int:
    try:
        from launcher.cli import main
    except ModuleNotFoundError as exc:
        # Run by an interpreter without the project's packages (a stock python3 instead of the venv's):
        # one line that says which interpreter and how to get the right one, not an import traceback.
        if exc.name is None or exc.name.split(".")[0] in ("launcher", "runtime"):
            raise
        print(
            f"error: {sys.executable} lacks the package {exc.name.split('.')[0]!r} this launcher needs: run it with the project "
            "venv's python (`.venv/bin/python3 -m launcher ...`, or `source .venv/bin/activate` first); "
            "`tools/bootstrap` makes the venv",
            file=sys.stderr,
        )
        return 2
    return main()


if __name__ == "__main__":
    sys.exit(_main())
