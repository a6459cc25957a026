"""Make ``import flash_attn`` resolve to cudnn_attn, for libraries that import FlashAttention
themselves (ring-flash-attn, yunchang, ...)::

    import cudnn_attn.integrations.flash_attn as ca_fa
    ca_fa.register()                   # before the library is imported
    import ring_flash_attn             # its `from flash_attn.flash_attn_interface import ...`
                                       # now gets cudnn_attn.flash_attn_interface

After :func:`register`, ``flash_attn`` (``__version__ == "2.8.3"``, the public functions),
``flash_attn.flash_attn_interface`` (``cudnn_attn.flash_attn_interface``, FlashAttention's private
functions included) and ``flash_attn.bert_padding`` are this project's modules. It only edits
``sys.modules``: nothing is installed, and :func:`unregister` undoes it.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types

__all__ = ["register", "unregister", "FLASH_ATTN_VERSION"]

FLASH_ATTN_VERSION = "2.8.3"  # the FlashAttention release whose API the drop-in follows
_MARK = "__cudnn_attn_drop_in__"
_SUBMODULES = {"flash_attn_interface": "cudnn_attn.flash_attn_interface",
               "bert_padding": "cudnn_attn.compat.flash_attn.bert_padding"}


def _package() -> types.ModuleType:
    import cudnn_attn.flash_attn_interface as interface

    package = types.ModuleType("flash_attn", "cudnn_attn's FlashAttention 2.8.3 drop-in")
    package.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None, is_package=True)
    package.__path__ = []  # a package: its submodules come from sys.modules only
    package.__version__ = FLASH_ATTN_VERSION
    setattr(package, _MARK, True)
    for name in interface.__all__:
        if not name.startswith("_"):
            setattr(package, name, getattr(interface, name))
    return package


def register() -> types.ModuleType:
    """Point ``import flash_attn`` (and its ``flash_attn_interface`` and ``bert_padding``) at
    cudnn_attn; returns the ``flash_attn`` module. Calling it again is harmless.

    Raises ``RuntimeError`` if the real FlashAttention is already imported in this process
    (modules that imported it keep its functions, so swapping it now would mix the two).
    """
    current = sys.modules.get("flash_attn")
    if current is not None:
        if getattr(current, _MARK, False):
            return current
        where = getattr(current, "__file__", None) or "an unknown location"
        raise RuntimeError(
            f"flash_attn is already imported (from {where}): call "
            "cudnn_attn.integrations.flash_attn.register() before anything imports flash_attn")
    package = _package()
    for short, target in _SUBMODULES.items():
        module = importlib.import_module(target)
        sys.modules[f"flash_attn.{short}"] = module
        setattr(package, short, module)
    sys.modules["flash_attn"] = package
    return package


def unregister() -> None:
    """Undo :func:`register` (modules that already imported from ``flash_attn`` keep what they
    imported)."""
    if getattr(sys.modules.get("flash_attn"), _MARK, False):
        for short in _SUBMODULES:
            sys.modules.pop(f"flash_attn.{short}", None)
        del sys.modules["flash_attn"]
