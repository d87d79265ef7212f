"""`python -m vlm_testbed.vllmsim`: see vlm_testbed.vllmsim.cli."""

from .cli import main

main()
