"""`python -m vlm_testbed.realnode prepare`: make the real nodes' image base ahead
(imagebuild.prepare_bases), as the test command does beside its unit tests."""

import sys

from vlm_testbed.controlplane.build import ControlPlaneError

from .imagebuild import prepare_bases

if sys.argv[1:] != ["prepare"]:
    raise SystemExit("usage: python -m vlm_testbed.realnode prepare")
try:
    prepare_bases()
except ControlPlaneError as exc:
    raise SystemExit(str(exc)) from exc
