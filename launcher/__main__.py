"""``python3 -m launcher``: see launcher.cli."""

import sys

from launcher.cli import main

if __name__ == "__main__":
    sys.exit(main())
