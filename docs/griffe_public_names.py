"""Griffe extension for the API reference: public names that only exist at runtime.

Static analysis misses two kinds of public names, and without them the reference would have to
document them under an internal path (``cudnn_attn.verify.selftest``,
``cudnn_attn.compat.natten.ops``):

* names a package loads on first use through its ``__getattr__`` (``cudnn_attn.selftest``, the
  FP8 training names): they become alias members pointing at the object's home (its
  ``__module__`` and ``__qualname__``), so ``::: cudnn_attn.selftest`` renders under the public
  path with the target's signature and docstring;
* functions a module builds at import time (``cudnn_attn.compat.natten.ops.na2d_forward``, made by
  ``_ranked``): that module is inspected (imported), and the inspected functions replace what
  static analysis saw, so ``cudnn_attn.ops`` (whose ``from ... import *`` griffe follows) shows
  them with their real signatures.

Only names of a module's ``__all__`` that static analysis did not find are looked up; every other
object keeps its static description. Configured in mkdocs.yml (``options.extensions``):
``- docs/griffe_public_names.py: {packages: [cudnn_attn]}``.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from typing import Any

import griffe


class RuntimePublicNames(griffe.Extension):
    """Fill in the ``__all__`` names of ``packages``' modules that exist only at runtime."""

    def __init__(self, packages: list[str] | None = None) -> None:
        super().__init__()
        self.packages = set(packages or ())

    def on_module_members(self, *, mod: griffe.Module, agent: Any, **kwargs: Any) -> None:
        # Before the loader expands wildcard imports (``cudnn_attn.ops``' ``import *``), so that
        # they pick the filled-in names up.
        if mod.package.path not in self.packages:
            return
        missing = [name for name in mod.exports or () if isinstance(name, str)
                   and name not in mod.members]
        if not missing:
            return
        # The package from the tree griffe reads (mkdocs' ``paths``), not whatever is installed;
        # the rest of sys.path for its dependencies.
        root = Path(str(mod.package.filepath)).resolve().parent.parent
        runtime = griffe.dynamic_import(mod.path, [root, *sys.path])
        inspected = None
        for name in missing:
            obj = getattr(runtime, name)
            home = getattr(obj, "__module__", None)
            if home == mod.path and (inspect.isfunction(obj) or inspect.isclass(obj)):
                if inspected is None:  # built by the module itself: describe it as it runs
                    inspected = griffe.inspect(
                        mod.name, filepath=mod.filepath,  # type: ignore[arg-type]
                        import_paths=[root, *sys.path], parent=mod.parent,
                        docstring_parser=agent.docstring_parser,
                        docstring_options=agent.docstring_options)
                mod.set_member(name, inspected.members[name])
            elif home is not None and hasattr(obj, "__qualname__"):  # loaded lazily from elsewhere
                mod.set_member(name, griffe.Alias(name, f"{home}.{obj.__qualname__}", parent=mod))
