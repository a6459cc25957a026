"""A device check of the wgmma operand layouts the Hopper kernels rely on (``na_wgmma_probe``).

The wgmma kernels (``fused_hopper``) read K, V, Q and dO through shared-memory matrix
descriptors of the 128-byte-swizzled layout; the host emulation runs them as the PTX ISA reads,
but only a GPU shows that reading right. The probe runs one tile of each product form the
kernels use (``S = Q K^T`` from two swizzled operands over two m64 halves, ``S = Q K^T`` with Q
in A fragments, ``O = P V`` with V MN-major) on small integers, so every result is exact in fp32
and a wrong layout shows as a wrong element, which the inputs then locate. The GPU test
(``tests/engines/test_cupy_gpu.py``) compares them bit for bit with float64 matmuls and keeps
the tensors of a mismatch; the host emulation runs the same kernel on the CPU.

Layouts: ``q [128, HD]``, ``k``, ``v [KEYS, HD]``, ``p [128, KEYS]`` (fp32), row-major;
``s_ss [128, KEYS] = q @ k.T``, ``s_rs [64, KEYS] = q[:64] @ k.T`` (``KEYS == 64`` only),
``o_pv [128, HD] = p @ v``.
"""

from __future__ import annotations

import torch

from .fused_build import CTYPES, HOPPER_DEFINES, HOPPER_TARGETS, SOURCE, THREADS

__all__ = ["SHAPES", "expression", "smem_bytes", "inputs", "expected", "run", "mismatches",
           "check"]

KERNEL = "na_wgmma_probe"
# (head dim, keys per step) of the products the kernels launch: 64 keys at head dims 64 and 128,
# the wide forward's 32-key steps at head dim 128 (an m64n32 Q K^T, an n128 P V of 32 keys) and
# the wide dQ's 16-key ones (m64n16, one k-step of keys).
SHAPES = ((64, 64), (128, 64), (128, 32), (128, 16))
ROWS = 128


def expression(dtype: torch.dtype, head_dim: int, keys: int) -> str:
    return f"{KERNEL}<{CTYPES[dtype]}, {head_dim}, {keys // 8}>"


def smem_bytes(dtype: torch.dtype, head_dim: int, keys: int) -> int:
    """Q swizzled (128 rows), K and V swizzled, the first 64 queries in padded rows, and the
    1024 bytes the atoms' alignment may cost."""
    element = torch.empty((), dtype=dtype).element_size()
    return element * (ROWS * head_dim + 2 * keys * head_dim + 64 * (head_dim + 8)) + 1024


def inputs(dtype: torch.dtype, head_dim: int, keys: int, seed: int = 0) -> dict:
    """CPU inputs of small integers (exact in 16 bits; every product sum exact in fp32)."""
    gen = torch.Generator().manual_seed(seed)

    def ints(*shape, low=-3, high=4):
        return torch.randint(low, high, shape, generator=gen).to(torch.float32)

    return {"q": ints(ROWS, head_dim).to(dtype), "k": ints(keys, head_dim).to(dtype),
            "v": ints(keys, head_dim).to(dtype), "p": ints(ROWS, keys, low=0, high=4)}


def expected(given: dict) -> dict:
    """The three products in float64, as fp32 (exact for ``inputs``)."""
    q, k, v, p = (given[name].double() for name in ("q", "k", "v", "p"))
    out = {"s_ss": q @ k.T, "o_pv": p @ v}
    if k.shape[0] == 64:
        out["s_rs"] = q[:64] @ k.T
    return {name: t.float() for name, t in out.items()}


def outputs_like(given: dict) -> dict:
    """NaN-filled outputs on the inputs' device (an element the kernel never writes shows)."""
    rows, keys, head_dim = given["q"].shape[0], given["k"].shape[0], given["q"].shape[1]
    device = given["q"].device
    return {"s_ss": torch.full((rows, keys), float("nan"), device=device),
            "s_rs": torch.full((64, keys), float("nan"), device=device),
            "o_pv": torch.full((rows, head_dim), float("nan"), device=device)}


def run(given: dict, device=None) -> dict:
    """The probe on ``device`` (default: ``given``'s tensors' CUDA device), one block; returns
    its outputs there (``s_rs`` only where ``keys == 64``)."""
    from cupy.cuda import driver

    from . import _loader, launch

    if device is not None:
        given = {name: t.to(device) for name, t in given.items()}
    dtype, (keys, head_dim) = given["q"].dtype, given["k"].shape
    out = outputs_like(given)
    shared = smem_bytes(dtype, head_dim, keys)
    with launch.TorchStream(given["q"].device) as ctx:
        fn = _loader.get_function(SOURCE, HOPPER_DEFINES, expression(dtype, head_dim, keys),
                                  ctx.index, HOPPER_TARGETS["sm_90"])
        driver.funcSetAttribute(fn.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                shared)
        inputs = [given[name].contiguous() for name in ("q", "k", "v", "p")]  # alive: launched
        args = [launch.kernel_arg(t) for t in inputs] + [launch.kernel_arg(out[name])
                                                         for name in ("s_ss", "s_rs", "o_pv")]
        fn((1, 1, 1), (THREADS, 1, 1), args, shared_mem=shared, stream=ctx.stream)
    if keys != 64:
        del out["s_rs"]
    return out


def mismatches(got: dict, want: dict) -> dict:
    """Per output, the number of elements that differ and the first few ``(row, col, got,
    expected)``; empty when every output is exact."""
    found = {}
    for name, ref in want.items():
        value = got[name].float().cpu()
        wrong = (value != ref).nonzero().tolist()
        if wrong:
            found[name] = {"count": len(wrong),
                           "first": [(r, c, value[r, c].item(), ref[r, c].item())
                                     for r, c in wrong[:8]]}
    return found


def check(device) -> dict:
    """Every shape and 16-bit type of the probe on ``device`` (:func:`run`):
    ``{"<dtype> hd<D> keys<K>": mismatches}`` for those that are not exact; empty when all are.
    ``fused`` asks it once per device before it launches a wgmma kernel."""
    found = {}
    for dtype in (torch.float16, torch.bfloat16):
        for head_dim, keys in SHAPES:
            given = inputs(dtype, head_dim, keys)
            wrong = mismatches(run(given, device), expected(given))
            if wrong:
                found[f"{str(dtype)[6:]} hd{head_dim} keys{keys}"] = wrong
    return found
