"""House rules of the package layout (DESIGN.md): no import cycles (the package root included:
only consumers such as the CLI may import it), no module over 500 lines,
one cache type that ``clear_caches()`` empties, ``errors.py`` imports nothing of ours."""

import ast
import pathlib
import re

import pytest
import torch

import cudnn_attn as ca
from cudnn_attn import caches

PACKAGE = pathlib.Path(ca.__file__).parent
MODULES = sorted(PACKAGE.rglob("*.py"))
MAX_LINES = 500


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


NAMES = {module_name(p): p for p in MODULES}


def imports_of(path: pathlib.Path) -> set[str]:
    """Every package module ``path`` imports, at any depth of the file (lazy imports count:
    a cycle hidden inside a function is still a cycle)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in NAMES else source
                       for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in NAMES and t != name)
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_cycle_finder_finds_a_planted_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    graph = {name: imports_of(path) for name, path in NAMES.items()}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_errors_module_imports_nothing_of_the_package():
    assert imports_of(PACKAGE / "errors.py") == set()


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_is_at_most_500_lines(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(PACKAGE)} has {lines} lines"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_caches_use_the_one_cache_type(path):
    if path.name == "caches.py":
        return
    text = path.read_text()
    found = re.findall(r"functools\.(?:lru_cache|cache)\b|@lru_cache|@cache\b|cupy\.memoize|"
                       r"OrderedDict\(", text)
    assert not found, f"{path.relative_to(PACKAGE)} keeps its own cache: {found}"


def test_lru_evicts_least_recently_used_and_clear_caches_empties_it():
    lru = caches.LRU("test.lru", maxsize=2)
    lru.put("a", 1)
    lru.put("b", 2)
    assert lru.get("a") == 1          # "a" is now the most recent
    lru.put("c", 3)                   # evicts "b"
    assert lru.keys() == ["a", "c"] and "b" not in lru
    assert lru.get_or_create("d", lambda: 4) == 4 and len(lru) == 2
    caches.clear_caches()
    assert len(lru) == 0


def test_clear_caches_empties_every_registered_cache():
    q = torch.randn(1, 2, 70, 16)
    ca.attention(q, q, q, mask=ca.Neighborhood((7, 10), 3))
    ca.attention(q, q, q, mask=ca.Causal())
    ca.explain(q, q, q, backend="torch")
    filled = {name: n for name, n in caches.cache_sizes().items() if n}
    assert "api.calls" in filled and len(filled) >= 2, filled
    ca.clear_caches()
    assert not any(caches.cache_sizes().values()), caches.cache_sizes()
    out = ca.attention(q, q, q, mask=ca.Causal())  # everything rebuilds on demand
    assert out.shape == q.shape


def test_call_cache_does_not_make_validation_order_dependent():
    q = torch.randn(1, 1, 4, 8)
    ca.attention(q, q, q, scale=1.0)
    with pytest.raises(ValueError, match="scale"):
        ca.attention(q, q, q, scale=True)


def test_direct_call_memo_serves_any_strides_and_only_valid_calls():
    # Calls served by torch SDPA directly are remembered without their strides: a later call with
    # other strides must still give its own exact result, and must not skip validation.
    q, k, v = (torch.randn(2, 3, 9, 16, dtype=torch.float64) for _ in range(3))
    ca.attention(q, k, v, mask=ca.Causal())
    assert "api.direct_calls" in {n for n, size in caches.cache_sizes().items() if size}
    for make in (lambda t: t.transpose(1, 2).contiguous().transpose(1, 2),   # bshd storage
                 lambda t: torch.cat([t, t], -1)[..., ::2],                  # unit stride lost
                 lambda t: t.expand(2, 3, 9, 16)):
        q2, k2, v2 = (make(t) for t in (q, k, v))
        s = (q2 @ k2.transpose(-1, -2)) * 16 ** -0.5
        s = s.masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1), float("-inf"))
        expected = torch.softmax(s, -1) @ v2
        torch.testing.assert_close(ca.attention(q2, k2, v2, mask=ca.Causal()), expected)
    with pytest.raises(TypeError, match="dtype"):
        ca.attention(q, k.float(), v, mask=ca.Causal())
