"""Environment facts (versions, GPU, platform) for ``cudnn-attn info`` and benchmark reports.

Every optional dependency is imported inside a guard: this module works with none of the CUDA
extras installed and on machines without a GPU.
"""

from __future__ import annotations

import datetime
import importlib
import platform
import shutil
import subprocess
import sys
from typing import Any


def package_version() -> str:
    """The installed distribution's version (``cudnn_attn.__version__``; "unknown" if none)."""
    try:
        from importlib.metadata import version

        return version("cudnn-attn")
    except Exception:  # a source tree that was never installed
        return "unknown"


def cudnn_version_text(number: Any) -> Any:
    """cuDNN's integer version as people write it: 92800 -> "9.28.0", 8907 -> "8.9.7".

    cuDNN 9 encodes ``major * 10000 + minor * 100 + patch``, older releases
    ``major * 1000 + minor * 100 + patch``. Anything that is not a positive int is returned as is.
    """
    if isinstance(number, bool) or not isinstance(number, int) or number <= 0:
        return number
    if number >= 90000:
        return f"{number // 10000}.{number % 10000 // 100}.{number % 100}"
    return f"{number // 1000}.{number % 1000 // 100}.{number % 100}"


def _optional(module: str) -> Any | None:
    """Import ``module`` or return None when it (or a library it loads) is missing."""
    try:
        return importlib.import_module(module)
    except Exception:
        return None


def _cudnn_frontend() -> dict[str, Any]:
    cudnn = _optional("cudnn")
    if cudnn is None:
        return {"cudnn_frontend": None, "cudnn_backend": None}
    facts: dict[str, Any] = {"cudnn_frontend": getattr(cudnn, "__version__", "unknown")}
    try:
        facts["cudnn_backend"] = cudnn_version_text(cudnn.backend_version())
    except Exception as exc:  # the frontend imports but cannot load libcudnn
        facts["cudnn_backend"] = f"unavailable ({type(exc).__name__}: {exc})"
    return facts


def _gpu(torch: Any) -> dict[str, Any]:
    if torch is None or not torch.cuda.is_available():
        return {"gpu": None}
    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    facts: dict[str, Any] = {
        "gpu": props.name,
        "gpu_sm": f"{props.major}{props.minor}",
        "gpu_count": torch.cuda.device_count(),
        "gpu_memory_gib": round(props.total_memory / 2**30, 1),
    }
    facts["gpu_driver"] = _driver_version()
    return facts


def _driver_version() -> str | None:
    """The NVIDIA driver version from ``nvidia-smi``, else the CUDA driver API version via CuPy."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run(
                [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20, check=True,
            ).stdout.split()
            if out:
                return out[0]
        except (OSError, subprocess.SubprocessError):
            pass
    cupy = _optional("cupy")
    if cupy is not None:
        try:
            v = cupy.cuda.runtime.driverGetVersion()
            return f"CUDA driver API {v // 1000}.{(v % 1000) // 10}"
        except Exception:
            pass
    return None


def collect() -> dict[str, Any]:
    """Return a JSON-serialisable dict describing this machine and software stack.

    Keys: ``cudnn_attn``, ``python``, ``platform``, ``date`` (UTC, ISO 8601), ``torch``,
    ``torch_cuda``, ``torch_cudnn``, ``cudnn_frontend``, ``cudnn_backend``, ``cupy``, ``gpu``,
    and, when a CUDA GPU is visible, ``gpu_sm``, ``gpu_count``, ``gpu_memory_gib``,
    ``gpu_driver``. Absent components are ``None``.
    """
    torch = _optional("torch")
    facts: dict[str, Any] = {
        "cudnn_attn": package_version(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": getattr(torch, "__version__", None),
        "torch_cuda": getattr(getattr(torch, "version", None), "cuda", None),
        "torch_cudnn": None,
    }
    if torch is not None:
        try:
            facts["torch_cudnn"] = cudnn_version_text(torch.backends.cudnn.version())
        except Exception:
            pass
    facts.update(_cudnn_frontend())
    cupy = _optional("cupy")
    facts["cupy"] = getattr(cupy, "__version__", None)
    facts.update(_gpu(torch))
    return facts
