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


# ---------------------------------------------------------------------------------------------
# One path from every surface to the plan (issue 25): compat speaks the core only, no module
# reaches into another's private names, and only the run API (execution.py) drives a plan.
# ---------------------------------------------------------------------------------------------

ENGINE_PACKAGES = ("cudnn_attn.graphs", "cudnn_attn.fallback_kernels", "cudnn_attn.torch_engine")
RUN_API = "cudnn_attn.execution"


def _imported_modules(path: pathlib.Path, tree: ast.AST) -> dict[str, str]:
    """Names bound to package modules by ``path``'s imports -> the module they name."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = _source(node, package)
            for a in node.names:
                if f"{source}.{a.name}" in NAMES:
                    bound[a.asname or a.name] = f"{source}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.asname and a.name in NAMES:
                    bound[a.asname] = a.name
    return bound


def _source(node: ast.ImportFrom, package: str) -> str:
    if not node.level:
        return node.module or ""
    base = package.split(".")
    base = base[:len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def exported(module: str) -> set[str]:
    """The names ``module`` lists in ``__all__``: an underscored name listed there is public on
    purpose (a peer's own spelling, e.g. FlashAttention's ``_flash_attn_forward``)."""
    path = NAMES.get(module)
    if path is None:
        return set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__"
                                                for t in node.targets):
            try:
                return set(ast.literal_eval(node.value))
            except ValueError:
                return set()
    return set()


def private_imports(path: pathlib.Path, text: str) -> list[str]:
    """``from <package module> import _name`` and ``module._name`` on an imported package module
    (private submodules such as ``_checks`` are modules, not names, and pass; so does a name its
    module exports in ``__all__``)."""
    tree = ast.parse(text)
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = _source(node, package)
            if source.split(".")[0] != "cudnn_attn":
                continue
            found += [f"line {node.lineno}: from {source} import {a.name}" for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__")
                      and f"{source}.{a.name}" not in NAMES and a.name not in exported(source)]
    bound = _imported_modules(path, tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in bound and node.attr.startswith("_") \
                and not node.attr.startswith("__") \
                and f"{bound[node.value.id]}.{node.attr}" not in NAMES:
            found.append(f"line {node.lineno}: {node.value.id}.{node.attr}")
    return found


def plan_calls(text: str) -> list[str]:
    """Calls that drive a plan: ``<...plan...>.forward(...)`` / ``.backward(...)`` where the
    receiver is a name or attribute called ``plan`` or a call of ``.plan(...)``."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("forward", "backward")):
            continue
        receiver = node.func.value
        if isinstance(receiver, ast.Call):
            receiver = receiver.func
        label = receiver.id if isinstance(receiver, ast.Name) else \
            receiver.attr if isinstance(receiver, ast.Attribute) else ""
        if label == "plan" or label.endswith("_plan"):
            found.append(f"line {node.lineno}: {ast.unparse(node.func)}")
    return found


def test_rule_finders_find_planted_violations():
    here = PACKAGE / "compat" / "flash_attn" / "dense.py"
    assert private_imports(here, "from ._core import _fa_mask\nfrom ... import _checks\n") == \
        ["line 1: from cudnn_attn.compat.flash_attn._core import _fa_mask"]
    assert private_imports(here, "from . import _core\n_core._forward(1)\n_core.forward(1)\n") \
        == ["line 2: _core._forward"]
    assert plan_calls("plan.forward(p, i)\nctx.plan.backward(p)\nb.plan(p).forward(p, i)\n"
                      "module.forward(x)\n") == ["line 1: plan.forward", "line 2: ctx.plan.backward",
                                                  "line 3: b.plan(p).forward"]


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_private_name_imported_across_modules(path):
    found = private_imports(path, path.read_text())
    assert not found, f"{path.relative_to(PACKAGE)} uses another module's private names " \
                      f"(promote them): {found}"


def test_only_the_run_api_drives_plans():
    driven = {module_name(p): plan_calls(p.read_text()) for p in MODULES}
    offenders = {name: calls for name, calls in driven.items() if calls and name != RUN_API}
    assert not offenders, f"plans driven outside {RUN_API}: {offenders}"
    assert driven[RUN_API], "the run API drives the plans (the finder must see it)"


def test_compat_imports_no_engine_internals():
    # Surfaces translate: they reach engines only through the core (dispatch, execution,
    # unfused_ops) or an engine package's public root (its __init__), never its modules.
    offenders = {}
    for name, path in NAMES.items():
        if not name.startswith("cudnn_attn.compat"):
            continue
        inner = sorted(t for t in imports_of(path)
                       if any(t.startswith(pkg + ".") for pkg in ENGINE_PACKAGES))
        if inner:
            offenders[name] = inner
    assert not offenders, f"compat modules import engine internals: {offenders}"
