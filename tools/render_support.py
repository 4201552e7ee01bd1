"""Renders the support matrices (docs/support/*.csv) into the markdown pages that show them.

Each CSV is data kept in the repo; a page shows it between `<!-- support:NAME:begin -->` and
`<!-- support:NAME:end -->` markers. `python tools/render_support.py` rewrites those blocks;
`--check` exits 1 when a page differs from its CSV (tests/test_support_matrix.py runs the check).
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUPPORT = ROOT / "docs" / "support"
PAGES = {"features": ROOT / "README.md", "models": ROOT / "docs" / "models.md"}  # matrix -> the page showing it


def read_matrix(name: str) -> list[dict[str, str]]:
    with open(SUPPORT / f"{name}.csv", newline="") as f:
        return list(csv.DictReader(f))


def markdown_table(rows: list[dict[str, str]]) -> str:
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "| " + " | ".join("---" for _ in columns) + " |"]
    lines += ["| " + " | ".join(row[c].replace("|", "\\|") for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def rendered(name: str, page: str) -> str:
    """`page` with the matrix's block replaced by the table of its CSV."""
    pattern = re.compile(rf"(<!-- support:{name}:begin -->\n).*?(<!-- support:{name}:end -->)", re.S)
    if not pattern.search(page):
        raise ValueError(f"the page lacks the markers <!-- support:{name}:begin/end -->")
    table = markdown_table(read_matrix(name))
    return pattern.sub(lambda m: m.group(1) + table + "\n" + m.group(2), page)


def stale_pages() -> list[str]:
    """The pages whose matrix block differs from its CSV."""
    return [f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name} ({name})"
            for name, path in PAGES.items() if rendered(name, path.read_text()) != path.read_text()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a page differs from its CSV")
    args = parser.parse_args()
    if args.check:
        stale = stale_pages()
        for page in stale:
            print(f"stale: {page}; run python tools/render_support.py", file=sys.stderr)
        return 1 if stale else 0
    for name, path in PAGES.items():
        path.write_text(rendered(name, path.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
