"""No import circles inside `jaxinfer/` and `serving/`, read from the code by grimp (import-linter's graph).

Every import counts, including those inside functions (a lazy import still ties the two modules
together); `if TYPE_CHECKING:` imports do not. `KNOWN_CIRCLES` is where a circle that cannot be
broken at once would be listed (none is): a new one fails, and one that is broken fails until it is
taken off the list, so the list only shrinks.
"""

from __future__ import annotations

import grimp

KNOWN_CIRCLES: set[tuple[str, str]] = set()  # (importer, imported) pairs whose imported module reaches back


def import_circles() -> set[tuple[str, str]]:
    """Each direct import A -> B for which B also reaches A, named once per pair (A < B)."""
    graph = grimp.build_graph("jaxinfer", "serving", exclude_type_checking_imports=True)
    circles = set()
    for importer in graph.modules:
        for imported in graph.find_modules_directly_imported_by(importer):
            if graph.chain_exists(importer=imported, imported=importer):
                circles.add(tuple(sorted((importer, imported))))
    return circles


def test_no_new_import_circles_and_the_known_ones_stay_listed_only_while_they_exist():
    circles = import_circles()
    assert circles - KNOWN_CIRCLES == set(), "new import circles"
    assert KNOWN_CIRCLES - circles == set(), "broken circles: take them off KNOWN_CIRCLES"
