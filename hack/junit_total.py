"""Prints one closing line with the totals of several pytest JUnit XML reports."""

import sys
import xml.etree.ElementTree as ET

totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
for path in sys.argv[1:]:
    root = ET.parse(path).getroot()
    for suite in ([root] if root.tag == "testsuite" else root.iter("testsuite")):
        for key in totals:
            totals[key] += int(suite.get(key, 0))
failed = totals["failures"] + totals["errors"]
passed = totals["tests"] - failed - totals["skipped"]
print(f"total: {passed} passed, {failed} failed, {totals['skipped']} skipped")
sys.exit(1 if failed or not totals["tests"] else 0)
