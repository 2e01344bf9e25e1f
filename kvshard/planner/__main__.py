"""`python -m kvshard.planner`: the `plan` command on its own."""

import sys

from kvshard.planner.cli import main

sys.exit(main())
