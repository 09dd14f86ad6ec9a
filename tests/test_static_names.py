"""Every name a function reads from its module's globals is defined there (assigned, imported, a def / class) or is
a builtin, in every Python file of the repository.

Much of the code never runs in CI: the GPU tests skip without CUDA, the TileLang kernels and the benches need the
H200. A name left behind by a refactor (stop 22 split the sparse-attention tests into two files and one test kept
calling a helper that stayed in the other) would surface only in a GPU session. This is the check pyflakes makes
for undefined names, done with the standard library's symbol tables.
"""
import builtins
import symtable

from conftest import REPO

MODULE_NAMES = {"__file__", "__name__", "__doc__", "__spec__", "__builtins__", "__path__", "__loader__",
                "__package__", "__annotations__"}


def _sources():
    skip = {".venv", ".tl", ".git", "build", "runs", "out"}
    return sorted(p for p in REPO.rglob("*.py") if not skip & set(p.relative_to(REPO).parts))


def undefined_globals(src: str, name: str = "<src>") -> list[tuple[str, int, str]]:
    """(scope, line, name) of each read of a module-level name that the module never binds."""
    top = symtable.symtable(src, name, "exec")
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}
    bound |= set(dir(builtins)) | MODULE_NAMES
    bad = []

    def walk(table):        # the module's own unbound reads are global there too
        for s in table.get_symbols():
            if s.is_global() and s.is_referenced() and s.get_name() not in bound:
                bad.append((table.get_name(), table.get_lineno(), s.get_name()))
        for child in table.get_children():
            walk(child)
    walk(top)
    return bad


def test_the_check_finds_a_missing_helper():
    src = "import os\n\ndef helper():\n    return os.sep\n\ndef test_x():\n    return helper() + _gone()\n"
    assert undefined_globals(src) == [("test_x", 6, "_gone")]
    comp = "def f():\n    return len([x for x in range(3) if y])\n"      # inside a comprehension too
    assert [n for *_, n in undefined_globals(comp)] == ["y"]
    assert undefined_globals("def f():\n    return len([x for x in range(3)])\n") == []


def test_no_undefined_global_names():
    files = _sources()
    bad = {str(p.relative_to(REPO)): u for p in files if (u := undefined_globals(p.read_text(), str(p)))}
    assert len(files) > 80 and not bad, bad
