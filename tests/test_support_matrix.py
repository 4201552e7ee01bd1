"""The support matrices are data (docs/support/*.csv) and the pages show exactly that data; every
cell of a row that is built is filled, and every test a row names exists."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import render_support  # noqa: E402


def test_the_pages_show_what_the_csvs_hold():
    assert render_support.stale_pages() == []


def test_a_changed_csv_makes_its_page_stale(tmp_path, monkeypatch):
    page = tmp_path / "page.md"
    page.write_text("<!-- support:models:begin -->\n| old |\n<!-- support:models:end -->\n")
    monkeypatch.setattr(render_support, "PAGES", {"models": page})
    assert render_support.stale_pages() == ["page.md (models)"]
    page.write_text(render_support.rendered("models", page.read_text()))
    assert render_support.stale_pages() == []


def test_every_row_is_complete_and_names_real_tests():
    for path in sorted((ROOT / "docs" / "support").glob("*.csv")):
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
        assert rows, path.name
        for row in rows:
            built = not (row.get("cpu") or "").startswith("not yet built")  # a planned row names no tests yet
            empty = [column for column, cell in row.items() if not (cell or "").strip()]
            assert not built or empty == [], f"{path.name}: {row} lacks {empty}"
            for test in (row.get("tested_by") or "").split():
                assert (ROOT / test).is_file(), f"{path.name}: {test} does not exist"
            if row.get("docs"):
                assert (ROOT / "docs" / row["docs"]).is_file(), f"{path.name}: docs/{row['docs']} does not exist"
