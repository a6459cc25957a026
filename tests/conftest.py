"""Test configuration: make the repository root and tests/ importable regardless of how pytest is run."""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
# The layer folders too: a few test modules share helpers with a sibling (``from test_varlen ...``).
_LAYERS = [os.path.join(_HERE, d) for d in ("model", "engines", "surfaces", "tracing", "tools")]
for _p in (_ROOT, _HERE, *_LAYERS):
    if _p not in sys.path:
        sys.path.insert(0, _p)

# NVRTC cubins compiled by the tests go to a throwaway directory, not the user's cache.
if "CUDNN_ATTN_CUBIN_CACHE" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["CUDNN_ATTN_CUBIN_CACHE"] = tempfile.mkdtemp(prefix="cudnn_attn_cubins_")
    # removed when this pytest process ends (subprocesses that inherited it have ended by then)
    atexit.register(shutil.rmtree, os.environ["CUDNN_ATTN_CUBIN_CACHE"], ignore_errors=True)

# cuDNN remembers a failed load of its runtime-compiled engines (no libcuda.so.1) for the whole
# process, so the driver stand-in of the deviceless plans loads before any test touches cuDNN.
# A failure here is reported by the tests that need it (fixture ``deviceless``).
import importlib.util  # noqa: E402

if importlib.util.find_spec("cudnn") is not None:
    from cudnn_attn.graphs import driver_standin

    try:
        driver_standin.ensure_driver()
    except driver_standin.DriverUnavailable:
        pass
