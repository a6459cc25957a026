"""Types on the whole public API (issue 26): every function and public method reachable from the
public import paths (inherited methods included) has an annotation on each parameter and on its
return, none of them ``Any`` outside the justified list below, the package ships ``py.typed``,
and no signature shows a sentinel object."""

from __future__ import annotations

import importlib
import inspect
import re
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
                found += [(f"{name}.{attr}.{n}", f) for n, f in public_methods(obj)]
    methods = type(cudnn_attn.graph_cache)
    found += [(f"cudnn_attn.graph_cache.{n}", f) for n, f in vars(methods).items()
              if inspect.isfunction(f) and not n.startswith("_")]
    return found


def public_methods(cls: type) -> list[tuple[str, object]]:
    """The public methods (and ``__init__``) of ``cls``, inherited ones from our own (private)
    bases included: ``SdpaAttributes``' setters live on ``_Attributes``."""
    found: dict[str, object] = {}
    for klass in cls.__mro__:
        if not klass.__module__.startswith("cudnn_attn"):
            continue
        for member_name, member in vars(klass).items():
            if member_name in found or (member_name.startswith("_") and member_name != "__init__"):
                continue
            function = member.__func__ if isinstance(member, (classmethod, staticmethod)) \
                else member
            if inspect.isfunction(function):
                found[member_name] = function
    return list(found.items())


CALLABLES = public_callables()

ANY = re.compile(r"\bAny\b")
# Where ``Any`` is the honest type, and why. Keys: (qualified name, parameter or "return").
_FLASH_RESULT = ("FlashAttention's functions return ``out`` or a tuple depending on a runtime "
                 "flag (return_attn_probs / return_softmax_lse), and FlashAttention annotates "
                 "nothing: a union would make every caller narrow the common ``out = f(...)``")
ANY_ALLOWED = {
    **{(f"cudnn_attn.flash_attn_interface.{f}", "return"): _FLASH_RESULT
       for f in ("flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
                 "flash_attn_varlen_func", "flash_attn_varlen_qkvpacked_func",
                 "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache")},
    ("cudnn_attn.graphs.describe", "attention_kwargs"):
        "**kwargs passed on to attention() unchanged (mask=, bias=, scale=, ...)",
    ("cudnn_attn.integrations.transformers.attention_forward", "kwargs"):
        "**kwargs of transformers' attention interface, passed through (s_aux, ...)",
    ("cudnn_attn.nn.MultiheadAttention.from_torch", "kwargs"):
        "**kwargs passed on to MultiheadAttention's constructor",
    ("cudnn_attn.graphs.GraphCache.peek", "return"):
        "the graph cache holds values of every engine (built graphs, plans): the caller knows "
        "what its key stores",
    ("cudnn_attn.graph_cache.peek", "return"): "as cudnn_attn.graphs.GraphCache.peek",
}


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


def any_annotations(name: str, function) -> list[str]:
    """The parameters (and "return") of ``function`` annotated with ``Any`` (anywhere inside the
    annotation: ``Any``, ``list[Any]``, ``Callable[..., Any]``) that the allow-list does not
    justify."""
    signature = inspect.signature(function)
    found = [p.name for p in signature.parameters.values()
             if p.annotation is not inspect.Parameter.empty and ANY.search(str(p.annotation))]
    if ANY.search(str(signature.return_annotation)):
        found.append("return")
    return [where for where in found if (name, where) not in ANY_ALLOWED]


@pytest.mark.parametrize("name, function", CALLABLES, ids=[n for n, _ in CALLABLES])
def test_no_public_annotation_is_any_without_a_reason(name, function):
    unjustified = any_annotations(name, function)
    assert not unjustified, f"{name}: annotated Any: {unjustified} (give the real type, or add " \
                            f"it to ANY_ALLOWED with the reason)"


def test_the_any_check_catches_any_and_every_allowance_is_still_needed():
    from typing import Any

    def user_facing(x: Any, y: list[Any], z: int) -> Any:
        return x

    assert any_annotations("example", user_facing) == ["x", "y", "return"]
    callables = dict(CALLABLES)
    stale = [(name, where) for name, where in ANY_ALLOWED if name not in callables
             or where not in any_annotations("not allowed", callables[name])]
    assert not stale, f"ANY_ALLOWED entries with nothing left to justify: {stale}"


def test_inherited_setters_are_checked_too():
    names = {n for n, _ in CALLABLES}
    assert "cudnn_attn.SdpaAttributes.set_sliding_window" in names  # defined on _Attributes
    assert "cudnn_attn.SdpaBackwardAttributes.set_score_mod_bprop" in names
    assert "cudnn_attn.natten.NeighborhoodAttention2D.__init__" in names


def test_py_typed_ships_with_the_package():
    package = Path(cudnn_attn.__file__).parent
    assert (package / "py.typed").is_file()
    pyproject = (package.parent / "pyproject.toml").read_text()
    assert '"cudnn_attn" = ["py.typed"]' in pyproject


def test_multihead_attention_forward_shows_its_default():
    from cudnn_attn.nn import MultiheadAttention

    mask = inspect.signature(MultiheadAttention.forward).parameters["mask"]
    assert mask.default is None
