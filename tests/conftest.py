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

# Bytecode is cached even where PYTHONDONTWRITEBYTECODE is set (this machine sets it): otherwise
# every pytest process of the suite (two workers, and the pytest runs the GPU proof's smoke tests
# start) rewrites the asserts of and compiles all ~250 test modules again, ~15 s of CPU each;
# the subprocesses inherit the setting. (__pycache__ is ignored by git.)
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

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


# The files that take longest (seconds of a 2-core run under ``-n 2 --dist loadfile``), started
# first: pytest-xdist hands files out in collection order, so a long file collected late would
# run alone while the other worker sits idle at the end (longest first packs two workers best).
LONGEST_FIRST = (
    "engines/test_kernels_compile.py",      # ~280 s: NVRTC + ptxas, two threads
    "engines/test_emulation_16bit.py",      # ~170 s: g++ host builds of the kernels
    "engines/test_emulation_mutations.py",  # ~90 s
    "tools/test_gpu_proof.py",              # ~140 s: subprocess runs of the proof
    "tools/test_gpu_proof_survival.py",     # ~110 s
    "surfaces/test_natten_grids.py",        # ~100 s
    "surfaces/test_transformers_static_packed.py",  # ~90 s: torch.compile of generation
    "engines/test_score_mods.py",           # ~60 s
    "tracing/test_compile.py",              # ~60 s
    "tools/test_selftest_isolation.py",     # ~55 s, mostly waiting on a hung engine's timeout
    "surfaces/test_natten_peer.py",         # ~50 s
    "surfaces/test_distributed.py",         # ~40 s: torchrun processes
)


def pytest_collection_modifyitems(config, items):
    def rank(item):
        path = item.path.as_posix()
        for i, suffix in enumerate(LONGEST_FIRST):
            if path.endswith("tests/" + suffix):
                return i
        return len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the rest keep their order
