"""The chart's PrometheusRule under promtool (Debian's `prometheus` package, hack/install-deps.sh):
`promtool check rules` on its groups in every rule-affecting variant, and `promtool test rules`
with tests/prometheus/alerts_test.yaml, where every alert fires on a series that should fire it
and stays quiet on its near-misses."""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest
import yaml

from vlm_testbed.chart import template
from vlm_testbed.prometheus import rule_groups

ROOT = pathlib.Path(__file__).resolve().parents[3]
ALERT_TESTS = ROOT / "tests" / "prometheus" / "alerts_test.yaml"
RULES = ["--set", "metrics.prometheusRule.enabled=true"]


@pytest.fixture(scope="module")
def promtool() -> str:
    found = shutil.which("promtool")
    assert found, "promtool is missing: run hack/install-deps.sh (Debian's prometheus package)"
    return found


def write_rules(directory: pathlib.Path, *args: str, release: str = "rel") -> pathlib.Path:
    path = directory / "rules.yaml"
    path.write_text(yaml.safe_dump(rule_groups(template(*RULES, *args, release=release))))
    return path


def promtool_run(promtool: str, *args: str, cwd: pathlib.Path) -> str:
    result = subprocess.run([promtool, *args], cwd=cwd, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.mark.parametrize("release,values", [
    ("rel", []),
    ("rel", ["--set", "metrics.prometheusRule.remediationStormPerHour=3,"
                      "metrics.prometheusRule.degradedFor=1h30m,"
                      "metrics.prometheusRule.unpatchedFor=2h"]),
    ("vlm-operator", []),
], ids=["defaults", "tuned", "release-named-like-the-chart"])
def test_promtool_checks_the_rules(promtool, tmp_path, release, values):
    rules = write_rules(tmp_path, *values, release=release)
    out = promtool_run(promtool, "check", "rules", str(rules), cwd=tmp_path)
    assert "SUCCESS: 8 rules found" in out


def test_promtool_unit_tests_pass(promtool, tmp_path):
    """The rules as the chart renders them by default (release `rel`)."""
    write_rules(tmp_path)
    shutil.copy(ALERT_TESTS, tmp_path)
    out = promtool_run(promtool, "test", "rules", ALERT_TESTS.name, cwd=tmp_path)
    assert "SUCCESS" in out


def test_every_alert_has_a_firing_case_and_a_quiet_case():
    (group,) = rule_groups(template(*RULES))["groups"]
    alerts = {r["alert"] for r in group["rules"]}
    cases = [c for t in yaml.safe_load(ALERT_TESTS.read_text())["tests"]
             for c in t["alert_rule_test"]]
    firing = {c["alertname"] for c in cases if c["exp_alerts"]}
    quiet = {c["alertname"] for c in cases if not c["exp_alerts"]}
    assert firing == alerts and quiet == alerts
