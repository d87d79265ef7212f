"""`python -m vlm_testbed.nodesim`: see vlm_testbed.nodesim.cli."""

import sys

from .cli import main

sys.exit(main())
