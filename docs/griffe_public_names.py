"""Griffe extension for the API reference: what of the public API only exists at runtime.

Static analysis misses three things, and without them the reference would document names under
an internal path (``cudnn_attn.verify.selftest``, ``cudnn_attn.compat.natten.ops``) or not at all:

* names a package loads on first use through its ``__getattr__`` (``cudnn_attn.selftest``): they
  become alias members pointing at the object's home (its ``__module__`` and ``__qualname__``),
  so ``::: cudnn_attn.selftest`` renders under the public path with the target's signature and
  docstring;
* functions a module builds at import time (``cudnn_attn.compat.natten.ops.na2d_forward``, made
  by ``_ranked``): that module is inspected (imported), and the inspected functions join the
  static ones, so ``cudnn_attn.ops`` (whose ``from ... import *`` griffe follows) shows them
  with their real signatures;
* a computed ``__all__`` (``cudnn_attn.natten`` assembles NATTEN's namespace from its parts) and
  docstrings written at import time (NATTEN's ``na1d``/``na2d``/``na3d`` share one, the modules'
  ``__doc__ = "2-D " + ...``): both are taken from the imported module.

Only modules with an ``__all__`` are looked at, and only what static analysis could not read is
taken from runtime; everything else keeps its static description. Configured in mkdocs.yml
(``options.extensions``): ``- docs/griffe_public_names.py: {packages: [cudnn_attn]}``.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from typing import Any

import griffe


class RuntimePublicNames(griffe.Extension):
    """Complete the public names (``__all__``) of ``packages``' modules from runtime."""

    def __init__(self, packages: list[str] | None = None) -> None:
        super().__init__()
        self.packages = set(packages or ())

    def on_module_members(self, *, mod: griffe.Module, agent: Any, **kwargs: Any) -> None:
        # Runs before the loader expands wildcard imports (``cudnn_attn.ops``' ``import *``), so
        # that they pick the filled-in names up.
        if mod.package.path not in self.packages or "__all__" not in mod.members:
            return
        # The package from the tree griffe reads (mkdocs' ``paths``), not whatever is installed;
        # the rest of sys.path for its dependencies.
        import_paths = [Path(str(mod.package.filepath)).resolve().parent.parent, *sys.path]
        if not mod.exports:  # a computed __all__; its names come from ``import *`` lines
            mod.exports = list(griffe.dynamic_import(mod.path, import_paths).__all__)
            return
        names = [n for n in mod.exports if isinstance(n, str)]
        missing = [n for n in names if n not in mod.members]
        undocumented = [n for n in names if n in mod.members and not mod.members[n].is_alias
                        and (mod.members[n].is_function or mod.members[n].is_class)
                        and mod.members[n].docstring is None]
        if not (missing or undocumented):
            return
        runtime = griffe.dynamic_import(mod.path, import_paths)
        for name in undocumented:
            doc = inspect.getdoc(getattr(runtime, name))
            if doc:
                member = mod.members[name]
                member.docstring = griffe.Docstring(doc, parent=member,
                                                    parser=agent.docstring_parser,
                                                    parser_options=agent.docstring_options)
        inspected = None
        for name in missing:
            obj = getattr(runtime, name)
            home = getattr(obj, "__module__", None)
            if home == mod.path and (inspect.isfunction(obj) or inspect.isclass(obj)):
                if inspected is None:  # built by the module itself: describe it as it runs
                    inspected = griffe.inspect(
                        mod.name, filepath=mod.filepath,  # type: ignore[arg-type]
                        import_paths=import_paths, parent=mod.parent,
                        docstring_parser=agent.docstring_parser,
                        docstring_options=agent.docstring_options)
                mod.set_member(name, inspected.members[name])
            elif home is not None and hasattr(obj, "__qualname__"):  # loaded lazily from elsewhere
                mod.set_member(name, griffe.Alias(name, f"{home}.{obj.__qualname__}", parent=mod))
