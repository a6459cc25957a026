"""The GPU tests' sync-free blocks copy nothing from the host.

``torch.cuda.set_sync_debug_mode("error")`` flags a host-to-device copy from pageable memory
(``t.to("cuda")``, ``t.cuda()``, ``torch.tensor(..., device="cuda")``): it synchronises the
host. Issue 23: ``test_paged_decode_reads_nothing_past_the_lengths_sync_free`` failed on an H200
because it moved ``q`` to the device inside its ``sync_free()`` block, not because the paged
decode synchronised. Inputs go to the device before the block; this check reads the test files'
syntax, so it runs on any machine.
"""

import ast
from pathlib import Path

import pytest

GPU_TESTS = sorted(Path(__file__).parents[1].rglob("test_*_gpu.py"))  # every layer folder


def _is_sync_free(item: ast.withitem) -> bool:
    call = item.context_expr
    return isinstance(call, ast.Call) and getattr(call.func, "id", None) == "sync_free"


def _host_copies(node: ast.AST):
    """Calls under ``node`` that copy host data to a device."""
    for call in ast.walk(node):
        if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Attribute):
            continue
        name = call.func.attr
        device_arg = [a for a in call.args if getattr(a, "id", None) == "DEV" or
                      getattr(a, "value", None) == "cuda"]
        device_kw = [k for k in call.keywords if k.arg == "device"]
        if name == "cuda" or (name == "to" and device_arg) or \
                (name in ("tensor", "as_tensor") and device_kw):
            yield call.lineno, ast.unparse(call)


@pytest.mark.parametrize("path", GPU_TESTS, ids=[p.name for p in GPU_TESTS])
def test_sync_free_blocks_copy_nothing_from_the_host(path):
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.With) and any(_is_sync_free(i) for i in node.items):
            for stmt in node.body:
                found.extend(_host_copies(stmt))
    assert not found, f"{path.name}: host-to-device copies inside sync_free(): {found}"


def test_the_check_sees_a_copy_inside_the_block():
    tree = ast.parse("with sync_free():\n    f(q.to(DEV), torch.tensor([1], device=DEV))\n")
    (block,) = [n for n in ast.walk(tree) if isinstance(n, ast.With)]
    assert len(list(_host_copies(block.body[0]))) == 2
