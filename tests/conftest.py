"""Test configuration: make the repository root and tests/ importable regardless of how pytest is run."""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
for _p in (_ROOT, _HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

# NVRTC cubins compiled by the tests go to a throwaway directory, not the user's cache.
if "CUDNN_ATTN_CUBIN_CACHE" not in os.environ:
    import tempfile

    os.environ["CUDNN_ATTN_CUBIN_CACHE"] = tempfile.mkdtemp(prefix="cudnn_attn_cubins_")
