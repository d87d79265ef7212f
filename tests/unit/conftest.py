"""Hypothesis profiles: `ci` (what hack/test.sh selects) draws the same examples every run, so a
CI verdict depends on the code alone; plain pytest keeps exploring new examples."""

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
