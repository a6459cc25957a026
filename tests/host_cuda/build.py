"""Compile a kernel module's CUDA source for the host (g++ + ``emu.h``) and launch it via ctypes.

The text compiled is exactly what NVRTC compiles (``_loader.source_text``: the module's DEFINES,
common.cu, the kernel file) with two mechanical rewrites C++ cannot express with macros alone:
each ``asm(...)`` statement becomes a call of its emulation in ``ptx.h`` (``asm.py``; an
instruction with no emulation a trap naming it) and ``extern __shared__ T name[];`` a pointer to
the block's dynamic shared-memory buffer. 16-bit storage types are checked as such: a kernel
parameter ``na_half*`` takes a float16 tensor, ``na_bf16*`` a bfloat16 one. One ``extern "C"`` entry point is generated per kernel instance; its
arguments are packed like ``cuLaunchKernel``'s (an array of pointers to the values), and every
packed value is checked against the instance's parameter types, so a launcher passing an int64
where the kernel takes an int fails here just as it would misbehave on a GPU.

Libraries are cached by the hash of their full text (and the compiler), so a test session
compiles each source once.

    lib = build.HostLibrary.build(unfused, {"dot_f32": "na_neighbor_dot<float>"}, cache_dir)
    lib["dot_f32"](grid, block, (q, k, rpb, w, table, np.int32(6), ...), shared_mem=0)
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from cudnn_attn.fallback_kernels import _loader

from . import asm

HERE = Path(__file__).resolve().parent
CXX_FLAGS = ("-std=c++20", "-O1", "-fno-strict-aliasing", "-shared", "-fPIC", "-pthread", "-w")
_EXTERN_SHARED = re.compile(
    r"extern\s+__shared__\s+(?:__align__\s*\(\s*\d+\s*\)\s+)?([A-Za-z_][\w:<>, ]*?)\s*"
    r"(?:__align__\s*\(\s*\d+\s*\)\s*)?\b(\w+)\s*\[\s*\]\s*;")


class HostBuildError(RuntimeError):
    """g++ is missing or rejected the host translation of a kernel source."""


def host_source(text: str) -> str:
    """The CUDA text rewritten for ``emu.h`` (inline PTX emulated, dynamic shared memory mapped).
    The text is preprocessed first (it includes nothing; ``emu.h``'s own macros apply later), so
    asm statements a macro builds are read with their literal text."""
    text = asm.rewrite(_preprocessed(text))
    text = _EXTERN_SHARED.sub(
        lambda m: f"{m.group(1)}* {m.group(2)} = "
                  f"reinterpret_cast<{m.group(1)}*>(na_emu::dynamic_smem());", text)
    if "extern __shared__" in text:
        raise HostBuildError("an `extern __shared__` declaration build.py cannot rewrite")
    return text


def _preprocessed(text: str) -> str:
    done = subprocess.run([_compiler(), "-E", "-P", "-x", "c++", "-"], input=text,
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise HostBuildError(f"preprocessing the kernel text failed:\n{done.stderr[-4000:]}")
    return done.stdout


def translation_unit(module, instances: dict[str, str]) -> str:
    """``#include "emu.h"``, the module's source as NVRTC sees it, one export per instance."""
    return translation_unit_of(_loader.source_text(module.SOURCE, module.DEFINES), instances)


# Parameter type codes of common.cu's 16-bit storage types (see emu.h's Code).
_STORAGE_CODES = ('namespace na_emu {\n'
                  'template <> struct Code<na_half> { static std::string get() { return "h2"; } };\n'
                  'template <> struct Code<na_bf16> { static std::string get() { return "b2"; } };\n'
                  '}\n')


def translation_unit_of(source: str, instances: dict[str, str]) -> str:
    """``translation_unit`` for an explicit source text (e.g. a mutated copy of a kernel)."""
    exports = "\n".join(f"NA_EMU_EXPORT({name}, {expr})" for name, expr in instances.items())
    codes = _STORAGE_CODES if "struct na_half" in source else ""
    return '#include "emu.h"\n' + host_source(source) + "\n\n" + codes + exports + "\n"


def _compiler() -> str:
    cxx = os.environ.get("CXX", "g++")
    path = shutil.which(cxx)
    if path is None:
        raise HostBuildError(f"the host-emulation kernel tests need a C++20 compiler: {cxx!r} was "
                             f"not found on PATH (install g++ >= 10 or set CXX)")
    return path


def compile_library(text: str, cache_dir: Path) -> Path:
    cxx = _compiler()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout
    emu = (HERE / "emu.h").read_text() + (HERE / "ptx.h").read_text()
    key = hashlib.sha256("\0".join((text, emu, version, *CXX_FLAGS)).encode()).hexdigest()[:20]
    lib = Path(cache_dir) / f"host_{key}.so"
    if lib.exists():
        return lib
    src = Path(cache_dir) / f"host_{key}.cpp"
    src.write_text(text)
    tmp = lib.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")  # builds_ahead's threads
    proc = subprocess.run([cxx, *CXX_FLAGS, f"-I{HERE}", "-o", str(tmp), str(src)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise HostBuildError(f"g++ could not compile the host translation {src}:\n"
                             f"{proc.stderr[-6000:]}")
    os.replace(tmp, lib)  # atomic: a concurrent session never loads a half-written library
    return lib


_SCALAR_CODES = {np.dtype(np.int32): "i4", np.dtype(np.uint32): "u4", np.dtype(np.int64): "i8",
                 np.dtype(np.float32): "f4", np.dtype(np.float64): "f8"}
_TORCH_CODES = {torch.float32: "f4", torch.float64: "f8", torch.int32: "i4", torch.int64: "i8",
                torch.float16: "h2", torch.bfloat16: "b2"}
_CTYPES = {"i4": ctypes.c_int32, "u4": ctypes.c_uint32, "i8": ctypes.c_int64,
           "f4": ctypes.c_float, "f8": ctypes.c_double}


def _dim3(v) -> ctypes.Array:
    v = tuple(int(x) for x in (v if isinstance(v, (tuple, list)) else (v,)))
    if not 1 <= len(v) <= 3 or min(v) < 1:
        raise ValueError(f"bad grid/block {v!r}")
    return (ctypes.c_uint * 3)(*(v + (1,) * (3 - len(v))))


class HostKernel:
    """One kernel instance, called like a CuPy ``RawKernel``: ``k(grid, block, args, shared_mem=)``.

    ``args``: torch tensors (CPU, passed as pointers; dtype checked against the parameter; any
    strides, the kernel gets the data pointer), ``np.uint64(0)`` for a null pointer and NumPy
    scalars (type checked exactly). ``stream`` is accepted and ignored.
    """

    def __init__(self, lib: ctypes.CDLL, name: str):
        self.name = name
        self._fn = getattr(lib, name)
        self._fn.restype = None
        self._fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p]
        sig = getattr(lib, name + "__signature")
        sig.restype = ctypes.c_char_p
        self.signature = tuple(sig().decode().split(","))
        self.calls = []  # (grid, block, shared_mem) of every launch, for launch-geometry checks

    def _pack(self, i: int, code: str, arg):
        where = f"{self.name} argument {i} (parameter type {code})"
        if isinstance(arg, torch.Tensor):
            if not code.startswith("p"):
                raise TypeError(f"{where}: got a tensor for a non-pointer parameter")
            if arg.device.type != "cpu":
                raise ValueError(f"{where}: tensor must be on the CPU")
            if _TORCH_CODES.get(arg.dtype) != code[1:]:
                raise TypeError(f"{where}: tensor dtype {arg.dtype} does not match")
            return ctypes.c_void_p(arg.data_ptr())
        if isinstance(arg, np.generic) and code.startswith("p"):
            # CuPy passes a uint64 as 8 raw bytes: the launchers' way of passing a null pointer.
            if arg.dtype != np.uint64 or arg != 0:
                raise TypeError(f"{where}: scalar {arg!r} for a pointer parameter")
            return ctypes.c_void_p(0)
        if isinstance(arg, np.generic):
            if _SCALAR_CODES.get(arg.dtype) != code:
                raise TypeError(f"{where}: scalar {arg!r} of dtype {arg.dtype} does not match")
            return _CTYPES[code](arg.item())
        raise TypeError(f"{where}: unsupported argument {type(arg).__name__} (CuPy would not "
                        f"pack a Python {type(arg).__name__} with a fixed width either)")

    def __call__(self, grid, block, args, shared_mem: int = 0, stream=None):
        args = tuple(args)
        if len(args) != len(self.signature):
            raise TypeError(f"{self.name} takes {len(self.signature)} arguments, got {len(args)}")
        values = [self._pack(i, c, a) for i, (c, a) in enumerate(zip(self.signature, args))]
        ptrs = (ctypes.c_void_p * len(values))(*(ctypes.addressof(v) for v in values))
        self.calls.append((tuple(grid), tuple(block), int(shared_mem)))
        self._fn(_dim3(grid), _dim3(block), int(shared_mem), ptrs)


class HostLibrary:
    def __init__(self, path: Path):
        self.path = path
        self._lib = ctypes.CDLL(str(path))
        self._kernels: dict[str, HostKernel] = {}

    @classmethod
    def build(cls, module, instances: dict[str, str], cache_dir: Path,
              real_threads: bool = False, source: str | None = None) -> HostLibrary:
        """Compile ``instances`` (export name -> C++ name expression) of ``module``'s source (or
        of ``source``, a full text as ``_loader.source_text`` returns it, e.g. a mutated copy);
        block threads are fibers unless ``real_threads`` (see emu.h)."""
        text = (translation_unit(module, instances) if source is None
                else translation_unit_of(source, instances))
        if real_threads:
            text = "#define NA_EMU_REAL_THREADS 1\n" + text
        return cls(compile_library(text, Path(cache_dir)))

    def __getitem__(self, name: str) -> HostKernel:
        if name not in self._kernels:
            self._kernels[name] = HostKernel(self._lib, name)
        return self._kernels[name]


def export_name(expression: str) -> str:
    """A C identifier for a name expression: ``na_neighbor_dot<float>`` -> ``na_neighbor_dot__float``."""
    return re.sub(r"\W+", "_", expression.replace("<", "__")).strip("_")


def cache_dir(request, tmp_path_factory) -> Path:
    """Where libraries are kept: ``$NA_HOST_CUDA_CACHE`` if set, pytest's cache (persists
    across runs) or a session temp dir."""
    if os.environ.get("NA_HOST_CUDA_CACHE"):
        path = Path(os.environ["NA_HOST_CUDA_CACHE"])
        path.mkdir(parents=True, exist_ok=True)
        return path
    cache = getattr(request.config, "cache", None)
    if cache is not None:
        return Path(cache.mkdir("host_cuda"))
    return tmp_path_factory.mktemp("host_cuda")


def host_library(request, tmp_path_factory, module, expressions,
                 real_threads: bool = False, source: str | None = None) -> HostLibrary:
    """For test fixtures: the library of ``expressions``, or a test failure naming the problem
    (never a skip: g++ is part of the CPU test requirements)."""
    return library(_build(module, expressions, cache_dir(request, tmp_path_factory), real_threads,
                          source))


def _build(module, expressions, directory: Path, real_threads: bool = False,
           source: str | None = None) -> HostLibrary | HostBuildError:
    try:
        return HostLibrary.build(module, {export_name(e): e for e in expressions}, directory,
                                 real_threads, source)
    except HostBuildError as exc:
        return exc


def library(built: HostLibrary | HostBuildError | Future) -> HostLibrary:
    """The library ``_build`` (or a future of ``builds_ahead``) gave, or a test failure."""
    import pytest

    if isinstance(built, Future):
        built = built.result()
    if isinstance(built, HostBuildError):
        pytest.fail(str(built), pytrace=False)
    return built


def builds_ahead(request, tmp_path_factory, module, builds: dict, jobs: int):
    """For module fixtures (a generator: ``yield from``): ``key -> future`` of each library of
    ``builds`` (``key -> (expressions, source)``), compiled ``jobs`` at a time in the order given
    while the tests run (g++ is a process of its own: a module of many libraries takes the
    cores the tests leave idle). Pass the futures to ``library``."""
    directory = cache_dir(request, tmp_path_factory)
    with ThreadPoolExecutor(jobs, thread_name_prefix="host_cuda-g++") as pool:
        futures = {key: pool.submit(_build, module, expressions, directory, False, source)
                   for key, (expressions, source) in builds.items()}
        try:
            yield futures
        finally:
            for future in futures.values():  # what no test will take is not built
                future.cancel()
