"""NATTEN 0.21.7's probes: ``__version__``, ``HAS_LIBNATTEN`` and the ``get_configs_for_*`` /
``get_bwd_configs_for_*`` functions code calls before choosing a NATTEN backend and its tiles.

Same names, signatures and return shapes as NATTEN 0.21.7:

* FNA (neighborhood, ``[B, *spatial, H, D]``): a list of ``(q_tile_shape, kv_tile_shape)``
  (one int per spatial axis); Hopper forward: ``((q_tile_shape, kv_tile_shape),
  KernelSchedule)``.
* FMHA (``[B, S, H, D]``): a list of ``(q_tile_size, kv_tile_size)``; Hopper forward:
  ``((q_tile_size, kv_tile_size), KernelSchedule)``.

NATTEN's device rules decide whether a list is empty: the CUTLASS families need a CUDA tensor
(Ampere-class kernels: compute capability >= 5.0; Hopper: 9.0 and 16-bit inputs with head dim 32,
64, 128 or 256 (backward: up to 128); Blackwell: 10.0/10.3), so on the CPU they are ``[]``, as NATTEN returns; the Flex
lists are NATTEN's on any device. Where a CUTLASS list is not empty it holds that family's
default tile configuration only, not NATTEN's whole tuning table: those kernels do not exist here,
and every ``na*d`` / ``attention`` call takes any listed tile (or none) as a hint that changes no
result. ``HAS_LIBNATTEN`` is True: it tells callers that the fused neighborhood operations run
(NATTEN sets it when its compiled library loads), and here they always do.
"""

from __future__ import annotations

from enum import Enum
from typing import Union

import torch

# Written out (not computed) so that static readers (mypy, griffe) see the names.
__all__ = [
    "__version__", "HAS_LIBNATTEN", "KernelSchedule", "get_configs_for_cutlass_fna",
    "get_configs_for_cutlass_fmha", "get_configs_for_cutlass_hopper_fna",
    "get_configs_for_cutlass_hopper_fmha", "get_configs_for_cutlass_blackwell_fna",
    "get_configs_for_cutlass_blackwell_fmha", "get_bwd_configs_for_cutlass_fna",
    "get_bwd_configs_for_cutlass_fmha", "get_bwd_configs_for_cutlass_hopper_fna",
    "get_bwd_configs_for_cutlass_hopper_fmha", "get_bwd_configs_for_cutlass_blackwell_fna",
    "get_bwd_configs_for_cutlass_blackwell_fmha", "get_configs_for_flex_fna",
    "get_configs_for_flex_fmha",
]

__version__ = "0.21.7"  # the NATTEN release whose API this namespace follows
HAS_LIBNATTEN = True


class KernelSchedule(Enum):
    """NATTEN's Hopper kernel schedules (``natten.types.KernelSchedule``)."""

    NonPersistent = 0
    WarpSpecializedCooperative = 1
    WarpSpecializedPingpong = 2


# NATTEN's names for what the probes return: an FMHA tile is ``(q_tile_size, kv_tile_size)``, an
# FNA tile one shape per spatial axis for q and for kv.
FmhaTiles = tuple[int, int]
FnaTiles = Union[tuple[tuple[int], tuple[int]], tuple[tuple[int, int], tuple[int, int]],
                 tuple[tuple[int, int, int], tuple[int, int, int]]]

# Defaults per spatial rank (NATTEN 0.21.7's default tiles of each family).
_AMPERE: dict[int, FnaTiles] = {1: ((64,), (64,)), 2: ((8, 8), (8, 8)), 3: ((4, 4, 4), (4, 4, 4))}
_HOPPER_FWD: dict[int, FnaTiles] = {1: ((64,), (128,)), 2: ((8, 8), (16, 8)), 3: ((4, 4, 4), (4, 4, 8))}
_HOPPER_BWD: dict[int, FnaTiles] = {1: ((64,), (128,)), 2: ((8, 8), (16, 8)), 3: ((4, 4, 4), (4, 4, 8))}
_BLACKWELL_FWD: dict[int, FnaTiles] = {1: ((256,), (128,)), 2: ((16, 16), (16, 8)), 3: ((8, 4, 8), (4, 4, 8))}
_BLACKWELL_BWD: dict[int, FnaTiles] = {1: ((128,), (128,)), 2: ((16, 8), (16, 8)), 3: ((4, 4, 8), (4, 4, 8))}
_FLEX: dict[int, list[FnaTiles]] = {1: [((64,), (64,))],
         2: [((8, 8), (8, 8)), ((4, 16), (4, 16)), ((4, 16), (8, 8))],
         3: [((4, 4, 4), (4, 4, 4)), ((2, 4, 8), (2, 4, 8)), ((2, 4, 8), (4, 4, 4))]}


def _rank(query, fmha: bool) -> int:
    if not isinstance(query, torch.Tensor):
        raise TypeError(f"query must be a torch.Tensor, got {type(query).__name__}")
    if fmha:
        if query.dim() != 4:
            raise ValueError("Only 4-D tensors are supported in FMHA.")
        return 1
    if query.dim() not in (4, 5, 6):
        raise ValueError(f"query must be [batch, *spatial (1-3 axes), heads, head_dim], got "
                         f"{query.dim()}-D")
    return query.dim() - 3


def _capability(query):
    """``major * 10 + minor`` of query's CUDA device, or None off CUDA."""
    if query.device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(query.device)
    return major * 10 + minor


def _hopper_ok(query, backward: bool = False) -> bool:
    head_dims = (32, 64, 128) if backward else (32, 64, 128, 256)
    return (_capability(query) == 90 and query.dtype in (torch.float16, torch.bfloat16)
            and query.shape[-1] in head_dims)


def _sizes(configs):
    """FNA tile shapes of rank 1 -> FMHA tile sizes."""
    return [(q[0], kv[0]) for q, kv in configs]


def _ampere(query, fmha: bool):
    rank = _rank(query, fmha)
    cc = _capability(query)
    configs = [_AMPERE[rank]] if cc is not None and cc >= 50 else []
    return _sizes(configs) if fmha else configs


def _blackwell(query, fmha: bool, table: dict):
    rank = _rank(query, fmha)
    configs = [table[rank]] if _capability(query) in (100, 103) else []
    return _sizes(configs) if fmha else configs


def get_configs_for_cutlass_fna(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                ) -> list[FnaTiles]:
    """NATTEN's CUTLASS (sm50+) FNA forward tile configurations for these tensors."""
    return _ampere(query, False)


def get_configs_for_cutlass_fmha(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 ) -> list[FmhaTiles]:
    """NATTEN's CUTLASS (sm50+) FMHA forward tile sizes for these tensors."""
    return _ampere(query, True)


def get_bwd_configs_for_cutlass_fna(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                    ) -> list[FnaTiles]:
    """NATTEN's CUTLASS (sm50+) FNA backward tile configurations for these tensors."""
    return _ampere(query, False)


def get_bwd_configs_for_cutlass_fmha(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                     ) -> list[FmhaTiles]:
    """NATTEN's CUTLASS (sm50+) FMHA backward tile sizes for these tensors."""
    return _ampere(query, True)


def get_configs_for_cutlass_hopper_fna(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                       ) -> list[tuple[FnaTiles, KernelSchedule]]:
    """NATTEN's Hopper FNA forward configurations: ``[((q_tile, kv_tile), KernelSchedule)]``."""
    rank = _rank(query, False)
    return [(_HOPPER_FWD[rank], KernelSchedule.NonPersistent)] if _hopper_ok(query) else []


def get_configs_for_cutlass_hopper_fmha(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                        ) -> list[tuple[FmhaTiles, KernelSchedule]]:
    """NATTEN's Hopper FMHA forward configurations: ``[((q_tile, kv_tile), KernelSchedule)]``."""
    _rank(query, True)
    if not _hopper_ok(query):
        return []
    (q, kv), = _sizes([_HOPPER_FWD[1]])
    return [((q, kv), KernelSchedule.NonPersistent)]


def get_bwd_configs_for_cutlass_hopper_fna(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                           ) -> list[FnaTiles]:
    """NATTEN's Hopper FNA backward tile configurations."""
    rank = _rank(query, False)
    return [_HOPPER_BWD[rank]] if _hopper_ok(query, backward=True) else []


def get_bwd_configs_for_cutlass_hopper_fmha(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                            ) -> list[FmhaTiles]:
    """NATTEN's Hopper FMHA backward tile sizes."""
    _rank(query, True)
    return _sizes([_HOPPER_BWD[1]]) if _hopper_ok(query, backward=True) else []


def get_configs_for_cutlass_blackwell_fna(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                          ) -> list[FnaTiles]:
    """NATTEN's Blackwell FNA forward tile configurations."""
    return _blackwell(query, False, _BLACKWELL_FWD)


def get_configs_for_cutlass_blackwell_fmha(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                           ) -> list[FmhaTiles]:
    """NATTEN's Blackwell FMHA forward tile sizes."""
    return _blackwell(query, True, _BLACKWELL_FWD)


def get_bwd_configs_for_cutlass_blackwell_fna(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                              ) -> list[FnaTiles]:
    """NATTEN's Blackwell FNA backward tile configurations."""
    return _blackwell(query, False, _BLACKWELL_BWD)


def get_bwd_configs_for_cutlass_blackwell_fmha(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                               ) -> list[FmhaTiles]:
    """NATTEN's Blackwell FMHA backward tile sizes."""
    return _blackwell(query, True, _BLACKWELL_BWD)


def get_configs_for_flex_fna(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             torch_compile: bool = False) -> list[FnaTiles]:
    """NATTEN's Flex FNA tile configurations (any device)."""
    return list(_FLEX[_rank(query, False)])


def get_configs_for_flex_fmha(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              torch_compile: bool = False) -> list[FmhaTiles]:
    """NATTEN's Flex FMHA tile sizes (any device)."""
    _rank(query, True)
    return _sizes(_FLEX[1])
