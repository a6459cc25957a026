"""A stand-in CUDA driver, so that cuDNN can plan graphs on a machine without a GPU.

cuDNN's runtime-compiled engines (``libcudnn_engines_runtime_compiled.so.9``) link against
``libcuda.so.1``; without a driver, cuDNN cannot load them and every deviceless plan fails with
``CUDNN_STATUS_SUBLIBRARY_LOADING_FAILED`` -- and cuDNN remembers that failure for the rest of the
process. ``ensure_driver()`` therefore runs before the first plan build:

* if a ``libcuda.so.1`` loads (a real driver, or the stand-in already loaded), it is used;
* otherwise ``devices/nocuda.c`` (package data) is compiled with the C compiler (``$CC``, else
  ``cc``, else ``gcc``) into a private temporary directory and loaded ``RTLD_GLOBAL`` under the
  soname ``libcuda.so.1``, so cuDNN's sub-library binds to it when it is loaded later. Device,
  context, memory and launch entry points all return ``CUDA_ERROR_NO_DEVICE``: nothing can run,
  and a library in this process that looks for a GPU finds none, as before.

``recorded_kernels()`` reads the kernel names cuDNN asked the stand-in for while it built plans
(the kernel a plan would launch). Never ``LD_PRELOAD``-ed; a real driver is never shadowed.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Optional

__all__ = ["SOURCE", "DriverUnavailable", "ensure_driver", "compile_standin", "recorded_kernels",
           "standin_loaded", "recording", "SUBLIBRARY_HINT"]

SOURCE = Path(__file__).resolve().parent / "devices" / "nocuda.c"
_MARKER = "cudnn_attn_standin_kernel"  # a symbol only the stand-in exports
_LOCK = threading.Lock()
# The stand-in's kernel-name record is process-wide: one deviceless build at a time reads it.
_BUILD_LOCK = threading.Lock()
_DRIVER: Optional[ctypes.CDLL] = None

SUBLIBRARY_HINT = ("cuDNN failed to load its runtime-compiled engines earlier in this process "
                   "(no libcuda.so.1 then); call cudnn_attn.graphs.deviceless.prepare() before "
                   "the first cuDNN plan build, or run in a fresh process")


class DriverUnavailable(RuntimeError):
    """No CUDA driver, and the stand-in could not be compiled (no C compiler)."""


def _compiler() -> str:
    for name in filter(None, (os.environ.get("CC"), "cc", "gcc")):
        path = shutil.which(name)
        if path:
            return path
    raise DriverUnavailable("deviceless cuDNN plans need a CUDA driver or a C compiler to build "
                            "its stand-in: no libcuda.so.1 loads, and neither $CC, cc nor gcc is "
                            "on PATH")


def compile_standin(directory: os.PathLike) -> Path:
    """Compile the stand-in into ``directory``; returns the library's path (``libcuda.so.1``)."""
    out = Path(directory) / "libcuda.so.1"
    cmd = [_compiler(), "-std=c99", "-O1", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1",
           "-o", str(out), str(SOURCE)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise DriverUnavailable(f"compiling the libcuda stand-in failed ({' '.join(cmd)}):\n"
                                f"{proc.stderr[-4000:]}")
    return out


def ensure_driver() -> ctypes.CDLL:
    """The process's ``libcuda.so.1``: the real driver when one loads, else the stand-in
    (compiled and loaded on first use). Call before cuDNN first builds an operation graph."""
    global _DRIVER
    with _LOCK:
        if _DRIVER is not None:
            return _DRIVER
        try:
            _DRIVER = ctypes.CDLL("libcuda.so.1", mode=ctypes.RTLD_GLOBAL)
            return _DRIVER
        except OSError:
            pass
        # A private directory (mode 0700): nobody else can swap the library before it loads.
        directory = tempfile.mkdtemp(prefix="cudnn_attn_driver_")
        try:
            _DRIVER = ctypes.CDLL(str(compile_standin(directory)), mode=ctypes.RTLD_GLOBAL)
        finally:
            shutil.rmtree(directory, ignore_errors=True)  # the loaded mapping stays
        return _DRIVER


def standin_loaded() -> bool:
    """Whether this process's ``libcuda.so.1`` is the stand-in."""
    return _DRIVER is not None and hasattr(_DRIVER, _MARKER)


def kernel_count() -> int:
    """How many kernel names the stand-in has recorded so far (0 with a real driver)."""
    if not standin_loaded():
        return 0
    fn = _DRIVER.cudnn_attn_standin_kernel_count
    fn.restype = ctypes.c_uint
    return int(fn())


def recorded_kernels(since: int) -> list[str]:
    """The kernel names cuDNN asked for after ``kernel_count()`` returned ``since`` (at most the
    last 8, oldest first); empty with a real driver."""
    if not standin_loaded():
        return []
    get = _DRIVER.cudnn_attn_standin_kernel
    get.restype = ctypes.c_char_p
    get.argtypes = [ctypes.c_uint]
    n = min(kernel_count() - since, 8)
    return [get(back).decode() for back in range(n - 1, -1, -1)]


@contextlib.contextmanager
def recording():
    """Around one deviceless build: loads the driver (or stand-in), serializes such builds and
    yields a list that holds, on exit, the kernel names cuDNN asked for meanwhile. A failed
    sub-library load (cuDNN's memory of a missing driver) is re-raised with ``SUBLIBRARY_HINT``."""
    ensure_driver()
    with _BUILD_LOCK:
        before, kernels = kernel_count(), []
        try:
            yield kernels
        except RuntimeError as exc:
            if "SUBLIBRARY_LOADING_FAILED" in str(exc):
                raise RuntimeError(SUBLIBRARY_HINT) from exc
            raise
        finally:
            kernels.extend(recorded_kernels(before))
