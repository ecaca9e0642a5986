"""Records the recipe's walk in every Python process of a run (see ``python3 -m tools.room_walk``).

Python imports ``sitecustomize`` at start-up from its path: put this folder on PYTHONPATH together
with the repository root, and set ``DSPARK_RECIPE_WALK_DIR``. Without that variable it does nothing.
"""

import os

if os.environ.get("DSPARK_RECIPE_WALK_DIR"):
    from pathlib import Path

    from tools.room_walk import follow_recipe_in_this_process

    follow_recipe_in_this_process(Path(os.environ["DSPARK_RECIPE_WALK_DIR"]))
