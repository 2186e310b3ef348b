"""`python -m specmesh serve ...` / `python -m specmesh profile ...`: the `specmesh` command (specmesh.cli)."""

import sys

from specmesh.cli import main

if __name__ == "__main__":
    sys.exit(main())
