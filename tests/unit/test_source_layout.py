"""The source stays in modules a reader can hold: none under operator/ is over 400 lines (a
table that grows, such as the log signatures, is split by what it matches)."""

from pathlib import Path

SOURCE = Path(__file__).resolve().parents[2] / "operator"
LIMIT = 400


def test_no_module_under_operator_is_over_400_lines():
    sizes = {p.relative_to(SOURCE): len(p.read_text().splitlines()) for p in SOURCE.rglob("*.py")}
    assert len(sizes) > 50, f"found only {len(sizes)} modules under {SOURCE}"
    over = {str(p): n for p, n in sizes.items() if n > LIMIT}
    assert not over, f"modules over {LIMIT} lines: {over}"
