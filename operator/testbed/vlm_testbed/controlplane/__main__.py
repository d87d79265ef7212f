"""`python -m vlm_testbed.controlplane`: see vlm_testbed.controlplane.cli."""

import sys

from .cli import main

sys.exit(main())
