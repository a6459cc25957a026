"""Types on the whole public API (issue 26): every function and public method reachable from the
public import paths has an annotation on each parameter and on its return, the package ships
``py.typed``, and no signature shows a sentinel object."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest

import cudnn_attn

PUBLIC = ["cudnn_attn", "cudnn_attn.natten", "cudnn_attn.natten.functional",
          "cudnn_attn.natten.context", "cudnn_attn.flash_attn_interface", "cudnn_attn.flash_api",
          "cudnn_attn.ops", "cudnn_attn.graphs", "cudnn_attn.distributed",
          "cudnn_attn.integrations.transformers", "cudnn_attn.nn"]


def public_callables() -> list[tuple[str, object]]:
    found = []
    for name in PUBLIC:
        module = importlib.import_module(name)
        for attr in module.__all__:
            obj = getattr(module, attr)
            if inspect.isfunction(obj):
                found.append((f"{name}.{attr}", obj))
            elif inspect.isclass(obj) and obj.__module__.startswith("cudnn_attn"):
                for member_name, member in vars(obj).items():
                    if member_name.startswith("_") and member_name != "__init__":
                        continue
                    function = member.__func__ if isinstance(member, (classmethod, staticmethod)) \
                        else member
                    if inspect.isfunction(function):
                        found.append((f"{name}.{attr}.{member_name}", function))
    methods = type(cudnn_attn.graph_cache)
    found += [(f"cudnn_attn.graph_cache.{n}", f) for n, f in vars(methods).items()
              if inspect.isfunction(f) and not n.startswith("_")]
    return found


CALLABLES = public_callables()


def test_the_public_api_is_large_enough_to_mean_something():
    assert len(CALLABLES) > 150


@pytest.mark.parametrize("name, function", CALLABLES, ids=[n for n, _ in CALLABLES])
def test_every_parameter_and_return_is_annotated(name, function):
    signature = inspect.signature(function)
    missing = [p.name for i, p in enumerate(signature.parameters.values())
               if p.annotation is inspect.Parameter.empty
               and not (i == 0 and p.name in ("self", "cls"))]
    assert not missing, f"{name}: parameters without a type: {missing}"
    if function.__name__ != "__init__":
        assert signature.return_annotation is not inspect.Signature.empty, f"{name}: no return type"
    assert "object at 0x" not in str(signature)


def test_py_typed_ships_with_the_package():
    package = Path(cudnn_attn.__file__).parent
    assert (package / "py.typed").is_file()
    pyproject = (package.parent / "pyproject.toml").read_text()
    assert '"cudnn_attn" = ["py.typed"]' in pyproject


def test_multihead_attention_forward_shows_its_default():
    from cudnn_attn.nn import MultiheadAttention

    mask = inspect.signature(MultiheadAttention.forward).parameters["mask"]
    assert mask.default is None
