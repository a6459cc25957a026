"""From an ``AttnProblem`` to the cuDNN SDPA graph it needs (``GraphSpec``), or to the reasons
cuDNN cannot run it. Everything here is knowable without a GPU and without importing ``cudnn``.

The engine's limits live in ``limits.LIMITS`` (one place); every reason here is derived from
them. Mask semantics (see ``cudnn_attn.model.masks``):

* cuDNN's diagonal band keeps key ``j`` of query ``i`` iff ``i' - L < j <= i' + R``: the left bound
  is exclusive, so FlashAttention's inclusive ``left`` becomes ``L = left + 1``; ``R = right``;
  ``Causal`` is ``R = 0``. Several causal/window masks intersect into one band.
* ``bottom_right`` aligns ``i' = i + S_kv - S_q`` (per batch with padding, as cuDNN does).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from ..model.masks import alibi_slopes, band_of
from ..model.score_mods import ScoreMod
from ..model.problem import AttnProblem
from ..model.storage import Paged, Ragged
from . import cache_files, decode_rows
from .limits import BACKWARD_HEAD_DIM, LIMITS, MAX_HEAD_DIM
from .score_mod_masks import neighborhood_as_band, program_for

__all__ = ["Band", "PagedKV", "GraphOptions", "GraphSpec", "analyze", "cudnn_reasons",
           "with_storage", "device_sm", "MAX_HEAD_DIM", "BACKWARD_HEAD_DIM", "LIMITS"]

@dataclass(frozen=True)
class Band:
    """One cuDNN diagonal band: ``alignment`` and the bounds in cuDNN's convention
    (``left`` exclusive, >= 1; ``right`` inclusive, >= 0; ``None`` = unbounded)."""

    alignment: str = "top_left"
    left: Optional[int] = None
    right: Optional[int] = None


@dataclass(frozen=True)
class PagedKV:
    """Paged K/V caches (forward only): containers ``[num_blocks, page_size, H_kv, D]``
    (``layout="bshd"``, FlashAttention's) or ``[num_blocks, H_kv, page_size, D]`` (``"bhsd"``);
    the problem's ``S_kv`` is the logical maximum (``pages_per_seq * page_size``)."""

    num_blocks: int
    page_size: int
    layout: str = "bshd"


@dataclass(frozen=True)
class GraphOptions:
    """Builder options outside ``AttnProblem``.

    ``deterministic``: deterministic backward (also implied by
    ``torch.use_deterministic_algorithms(True)``); ``dropout_mask``: the ``(mask, scale)`` dropout
    form instead of Philox; ``ragged``: packed varlen (THD) with ragged offsets on Q/K/V/O/Stats;
    ``max_total_seq_len_q/kv``: bounds of the packed token axis (ragged only); ``paged``: KV
    page tables (forward only); ``autotune``: the built graph times every plan cuDNN offers on
    its first execution and keeps the fastest (``graphs.autotune``; the engine's own graphs
    follow ``CUDNN_ATTN_AUTOTUNE=1``). Not part of the graph spec: it picks a plan, not a graph.
    """

    deterministic: bool = False
    dropout_mask: bool = False
    ragged: bool = False
    max_total_seq_len_q: Optional[int] = None
    max_total_seq_len_kv: Optional[int] = None
    paged: Optional[PagedKV] = None
    autotune: bool = False


@dataclass(frozen=True)
class GraphSpec:
    """Everything one SDPA graph depends on, normalized; hashable (a graph cache key part).

    Strides are logical ``(B, H, S, D)`` strides in elements. Runtime values (scale, padding
    lengths, dropout seed/offset) are graph inputs, never fields here; ``dropout_p`` is, because
    cuDNN bakes the Philox probability into the graph.
    """

    dtype: str
    batch: int
    heads_q: int
    heads_kv: int
    seq_q: int
    seq_kv: int
    dim_qk: int
    dim_v: int
    layout: str
    q_stride: tuple
    k_stride: tuple
    v_stride: tuple
    band: Optional[Band] = None
    padding: bool = False
    synthetic_padding: bool = False
    alibi: bool = False
    bias_dim: Optional[tuple] = None
    bias_stride: Optional[tuple] = None
    bias_dtype: Optional[str] = None
    dbias: bool = False
    dropout_p: float = 0.0
    dropout_mask: bool = False
    stats: bool = True
    deterministic: bool = False
    ragged: bool = False
    max_total_seq_len_q: Optional[int] = None
    max_total_seq_len_kv: Optional[int] = None
    paged: Optional[PagedKV] = None
    # softcap, a score_mod or a mask cuDNN has no attribute for, as one score_mod program
    # (cuDNN's score_mod excludes the built-in band, padding and ALiBi: the band is folded in).
    score_mod: Optional[ScoreMod] = None
    # a neighborhood's tile bitmask as cuDNN's block_mask (forward, sm_100+): skips empty tiles
    block_mask: bool = False

    # -- layouts of the tensors the engine allocates ---------------------------------------
    def out_stride(self, heads: int, seq: int, dim: int) -> tuple:
        """Logical (B, H, S, D) strides of a tensor contiguous in the call's layout."""
        if self.layout == "bhsd":
            return (heads * seq * dim, seq * dim, dim, 1)
        return (seq * heads * dim, dim, heads * dim, 1)

    @property
    def o_stride(self) -> tuple:
        return self.out_stride(self.heads_q, self.seq_q, self.dim_v)

    @property
    def stats_stride(self) -> tuple:
        if self.ragged:  # token-major "TH1", as the frontend's own THD path
            return (self.seq_q * self.heads_q, 1, self.heads_q, 1)
        return (self.heads_q * self.seq_q, self.seq_q, 1, 1)

    def forward_variant(self, stats: bool) -> "GraphSpec":
        """The forward graph's spec: backward-only fields cleared so graphs are shared."""
        return dataclasses.replace(self, stats=stats, dbias=False, deterministic=False)

    def backward_variant(self) -> "GraphSpec":
        return dataclasses.replace(self, stats=True)

    def forward_for(self, problem: AttnProblem) -> "GraphSpec":
        """The forward graph ``problem``'s plan builds: with stats when a backward or the LSE
        is needed."""
        return self.forward_variant(problem.requires_grad or problem.return_lse)


def device_sm(device) -> Optional[int]:
    """``10 * major + minor`` of a CUDA ``device`` torch can see, else ``None``."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def _logical_stride(spec_stride: tuple, layout: str) -> tuple:
    s = tuple(spec_stride)
    return s if layout == "bhsd" else (s[0], s[2], s[1], s[3])


def _bias_layout(problem: AttnProblem) -> tuple[tuple, tuple]:
    """Rank-4 dims/strides of the bias; broadcast (size-1 or stride-0) dims become size 1."""
    spec = problem.bias
    shape = (1,) * (4 - len(spec.shape)) + tuple(spec.shape)
    stride = (0,) * (4 - len(spec.stride)) + tuple(spec.stride)
    dims = tuple(1 if (n == 1 or st == 0) else n for n, st in zip(shape, stride))
    out, inner = [0, 0, 0, 0], 1
    for axis in (3, 2, 1, 0):  # size-1 dims get packed strides: some validators read them
        out[axis] = stride[axis] if dims[axis] > 1 else inner
        inner = max(inner, out[axis] * dims[axis])
    return dims, tuple(out)


def contiguous_strides(dims) -> tuple:
    """Row-major strides of a tensor of sizes ``dims`` (the last axis fastest)."""
    out, inner = [0] * len(dims), 1
    for axis in range(len(dims) - 1, -1, -1):
        out[axis], inner = inner, inner * dims[axis]
    return tuple(out)


def cudnn_band(problem: AttnProblem, padding: bool, alibi: bool, reasons: list,
               restricted: bool = False) -> Optional[Band]:
    """The diagonal band cuDNN is given for ``problem``'s mask (``masks.band_of`` plus cuDNN's
    own alignment and bound rules), or None; why it cannot be one goes to ``reasons``.
    ``restricted`` (a bias or dropout, which cuDNN's bottom-right diagonal excludes): without
    padding the static offset moves into a top-left band's bounds."""
    mask = problem.mask
    hood_band = neighborhood_as_band(problem.neighborhood)  # a causal 1-D neighborhood
    if hood_band is not None:
        mask = hood_band if mask is None else mask & hood_band
    s_q, s_kv = problem.seq_q, problem.seq_kv
    # Read top-left where both alignments coincide: that avoids cuDNN's bottom-right
    # restrictions (no bias, ALiBi or dropout).
    band = band_of(mask, s_q, s_kv, padding)
    if band is None:
        return None
    if band.alignment is None:
        reasons.append("the masks mix top_left and bottom_right alignments; cuDNN has one "
                       "diagonal band")
        return None
    alignment = band.alignment
    left = band.left if band.left >= 0 else None  # FlashAttention convention (inclusive)
    right = band.right if band.right >= 0 else None
    if padding and alignment == "bottom_right" and s_q == 1 and not alibi:
        right = None  # a decode query sits at its sequence's last key: nothing lies to its right
    if not padding:  # drop bounds that hide nothing (e.g. bottom-right causal at S_q = 1)
        offset = s_kv - s_q if alignment == "bottom_right" else 0
        if right is not None and not alibi and offset + right >= s_kv - 1:
            right = None  # even row 0 reaches the last key
        if left is not None and s_q - 1 + offset - left <= 0:
            left = None  # even the last row reaches key 0
    if left is None and right is None:
        return None
    band_left = None if left is None else left + 1
    if restricted and alignment == "bottom_right" and not padding and not alibi \
            and s_q <= s_kv:
        offset = s_kv - s_q  # i' = i + offset on every row: the same pairs (left bound >= 1)
        if band_left is None or band_left - offset >= 1:
            return Band("top_left", None if band_left is None else band_left - offset,
                        None if right is None else right + offset)
    return Band(alignment, band_left, right)


def analyze(problem: AttnProblem, *, target_sm: Optional[int] = None,
            options: Optional[GraphOptions] = None,
            backward: Optional[bool] = None,
            version: Optional[int] = None,
            two_rows: bool = True) -> tuple[Optional[GraphSpec], list[str]]:
    """``(spec, [])`` for a problem cuDNN can run, else ``(None, reasons)``.

    ``backward`` (default: ``problem.requires_grad``) adds the backward graph's rules;
    ``target_sm`` (default: the problem's CUDA device, if any) adds the architecture's;
    ``version`` (default: the installed ``cudnn.backend_version()`` where there is an
    architecture) adds that backend's floors. ``two_rows=False``: the rules of the problem as
    it stands, where the engine would run it as a two-row graph (``decode_rows``).
    """
    if two_rows and decode_rows.needed(problem):  # runs as a two-row graph
        declined = decode_rows.reasons(problem)
        if declined:  # with the one-row graph's own reasons
            return None, declined + analyze(problem, target_sm=target_sm, options=options,
                                            backward=backward, two_rows=False)[1]
        problem = decode_rows.padded_problem(problem)
    options = with_storage(options or GraphOptions(), problem.storage)
    backward = problem.requires_grad if backward is None else backward
    if target_sm is None:
        target_sm = device_sm(problem.device)
    if version is None and target_sm is not None:
        version = cache_files.cudnn_versions()[0]  # None when cudnn is not installed
    reasons: list[str] = []
    lim = LIMITS
    dtype = lim.io_dtypes.get(problem.dtype)
    if dtype is None:
        names = " or ".join(lim.io_dtypes.values())
        reasons.append(f"cuDNN SDPA takes {names} inputs, got {problem.dtype}")
    if problem.neighborhood is not None and not lim.neighborhood_masks:
        reasons.append("Neighborhood masks are not expressible as cuDNN SDPA attributes")
    if problem.softcap is not None and not lim.softcap:
        reasons.append("softcap needs a cuDNN score_mod subgraph, which excludes the built-in "
                       "masks, padding and ALiBi; this engine does not build one")
    if problem.rpb is not None:
        reasons.append("a RelPosBias table cannot be gathered inside a cuDNN score_mod (no "
                       "gather op); only a materialised bias tensor can carry it")
    d_qk, d_v = problem.dim_qk, problem.dim_v
    if d_qk % lim.head_dim_multiple or d_v % lim.head_dim_multiple:
        reasons.append(f"cuDNN needs head dims that are multiples of {lim.head_dim_multiple}, "
                       f"got D_qk={d_qk}, D_v={d_v}")
    if max(d_qk, d_v) > lim.max_head_dim:
        reasons.append(f"cuDNN's SDPA engines serve head dims up to {lim.max_head_dim}, got "
                       f"D_qk={d_qk}, D_v={d_v}")
    for name in ("q", "k", "v"):
        stride = getattr(problem, name).stride
        if stride[3] != 1:
            reasons.append(f"{name} must have stride 1 along its head dim (cuDNN), got strides "
                           f"{tuple(stride)}")

    padding = problem.padding is not None or options.ragged
    alibi = problem.alibi is not None
    band = cudnn_band(problem, padding, alibi, reasons, restricted=(
        problem.bias is not None or problem.dropout_p > 0 or options.dropout_mask
        or problem.dropout_mask is not None))
    score_mod = None
    hood = problem.neighborhood
    if hood is not None and neighborhood_as_band(hood) is not None:
        hood = None  # cuDNN's built-in band
    if problem.softcap is not None or problem.score_mod is not None or hood is not None:
        score_mod, band = program_for(problem, band, hood, padding, alibi, reasons), None
    bias_dims = bias_stride = bias_dtype = None
    if problem.bias is not None:
        bias_dtype = lim.bias_dtypes.get(problem.bias.dtype)
        if bias_dtype is None or (bias_dtype != "float32" and problem.bias.dtype != problem.dtype):
            reasons.append(f"a cuDNN bias must be {problem.dtype} (as q) or float32, got "
                           f"{problem.bias.dtype}")
        bias_dims, bias_stride = _bias_layout(problem)
        if bias_dims[3] > 1 and bias_stride[3] != 1:
            reasons.append(f"the bias must have stride 1 along S_kv (cuDNN), got strides "
                           f"{tuple(problem.bias.stride)}")
        if problem.bias_requires_grad and backward:
            full = (1,) * (4 - len(problem.bias.shape)) + tuple(problem.bias.shape)
            if bias_dims != full:
                reasons.append(f"dBias of an expanded (stride-0) bias of shape "
                               f"{tuple(problem.bias.shape)} is not a cuDNN reduction")
            elif bias_dims[2] != problem.seq_q or bias_dims[3] != problem.seq_kv:
                reasons.append(f"cuDNN computes dBias only for a bias spanning S_q and S_kv, "
                               f"got shape {tuple(problem.bias.shape)}")
        if backward and (bias_dims[2], bias_dims[3]) != (problem.seq_q, problem.seq_kv):
            # cuDNN's backward reads a bias of dims (1|B, 1|H_q, S_q, S_kv) only: a bias
            # broadcast along S_q or S_kv gave dQ errors of ~1.4 on an H200 (cuDNN 9.19, issue
            # 23) while the forward was right. The backward graph declares the full rows; the
            # plan materialises the bias to them per call (graphs/_runtime.bias_operand).
            bias_dims = (bias_dims[0], bias_dims[1], problem.seq_q, problem.seq_kv)
            bias_stride = contiguous_strides(bias_dims)
    # The explicit (mask, scale) dropout form: a builder option, or the problem's own.
    mask_dropout = options.dropout_mask or problem.dropout_mask is not None
    dropout = problem.dropout_p > 0 or mask_dropout

    # cuDNN's rule is for a bottom-right *causal* diagonal (a right bound); a left bound alone
    # passes its validator with a bias, ALiBi or dropout. (A folded band is None here.)
    if band is not None and band.alignment == "bottom_right" and band.right is not None:
        used = {"bias": bias_dims is not None, "alibi": alibi, "dropout": dropout}
        names = {"bias": "a bias", "alibi": "ALiBi", "dropout": "dropout"}
        extras = [names[f] for f in lim.bottom_right_excludes if used[f]]
        if extras:
            reasons.append("cuDNN's bottom-right diagonal cannot be combined with "
                           + ", ".join(extras))
        if not padding and problem.seq_q > problem.seq_kv:
            reasons.append(f"cuDNN's bottom-right diagonal needs S_q <= S_kv without padding, "
                           f"got S_q={problem.seq_q}, S_kv={problem.seq_kv}")
    if band is not None and band.left is not None and not padding \
            and problem.seq_q > problem.seq_kv:
        reasons.append(f"cuDNN's sliding window needs S_q <= S_kv without padding, got "
                       f"S_q={problem.seq_q}, S_kv={problem.seq_kv}")
    if alibi:
        if lim.alibi_needs_causal and (band is None or band.right != 0):
            reasons.append("cuDNN's ALiBi needs a causal mask (diagonal right bound 0)")
        slopes = problem.alibi.slopes
        if slopes is not None and not lim.alibi_custom_slopes:
            table = problem.alibi.slope_table(problem.batch, problem.heads_q)
            default = torch.tensor([alibi_slopes(problem.heads_q)], dtype=torch.float64)
            if not torch.allclose(table, default.expand_as(table), rtol=1e-6, atol=0):
                reasons.append("cuDNN's ALiBi uses the standard slopes only; custom slopes "
                               "were given")
    if not lim.decode_band_gqa and problem.seq_q == 1 and band is not None \
            and problem.heads_q != problem.heads_kv:
        reasons.append("cuDNN gives wrong results for decode (S_q = 1) with causal masking and "
                       "H_q != H_kv (cuDNN 9.18.1 release notes)")
    if backward and not lim.backward_single_token and problem.seq_q == 1 \
            and problem.seq_kv == 1:
        reasons.append("cuDNN's SDPA backward does not support S_q = S_kv = 1")
    elif backward and decode_rows.one_row_unplannable(problem):
        reasons.append("planning cuDNN's SDPA backward for B = H_q = S_q = 1 crashes the "
                       "process (cudnn-frontend #1071)")

    if backward and target_sm is not None and score_mod is not None \
            and score_mod.bprop is not None and target_sm // 10 < lim.score_mod_bprop_min_major:
        reasons.append(f"cuDNN plans no backward with a score_mod_bprop ({score_mod.label}) on "
                       f"sm_{target_sm}; sm_{lim.score_mod_bprop_min_major}0 or newer")
    deterministic = backward and (options.deterministic or problem.deterministic)
    _option_reasons(problem, options, mask_dropout, backward, reasons)
    if target_sm is not None:
        _arch_reasons(problem, target_sm, backward, deterministic, options.ragged,
                      dict(dbias=problem.bias_requires_grad, dropout=dropout, alibi=alibi),
                      version, reasons)
    if version is not None:
        reasons += lim.version_reasons(version, score_mod=score_mod is not None,
                                       score_mod_constants=bool(score_mod and
                                                                score_mod.has_constants))
    if reasons:
        return None, reasons

    synthetic = score_mod is None and not padding and _open_tiles(problem, bias_dims, backward)
    spec = GraphSpec(
        dtype=dtype, batch=problem.batch, heads_q=problem.heads_q, heads_kv=problem.heads_kv,
        seq_q=problem.seq_q, seq_kv=problem.seq_kv, dim_qk=d_qk, dim_v=d_v,
        layout=problem.layout, q_stride=_logical_stride(problem.q.stride, problem.layout),
        k_stride=_logical_stride(problem.k.stride, problem.layout),
        v_stride=_logical_stride(problem.v.stride, problem.layout), band=band,
        padding=padding or synthetic, synthetic_padding=synthetic, alibi=alibi,
        bias_dim=bias_dims, bias_stride=bias_stride, bias_dtype=bias_dtype,
        dbias=bool(problem.bias_requires_grad and backward), dropout_p=problem.dropout_p,
        dropout_mask=mask_dropout, stats=True, deterministic=deterministic,
        ragged=options.ragged, max_total_seq_len_q=options.max_total_seq_len_q,
        max_total_seq_len_kv=options.max_total_seq_len_kv, paged=options.paged,
        score_mod=score_mod, block_mask=bool(
            hood is not None and score_mod is not None and target_sm is not None
            and lim.block_mask_ok(target_sm // 10, version)))
    return spec, []


def _open_tiles(problem: AttnProblem, bias_dims, backward: bool) -> bool:
    """Whether a graph without a padding mask would let cuDNN read past the tensors' ends
    unmasked, so the engine gives it one with the full lengths (the frontend's own workaround
    for backward graphs up to cuDNN 9.15.0, which it then dropped; ``limits.CudnnLimits``'s
    ``key_tile`` says why it is still needed): a bias with ``S_kv`` not a multiple of the tile
    (forward and backward), and any backward graph with ``S_q`` or ``S_kv`` not a multiple of
    it. The padding mask changes no result: every position of every sequence is a token."""
    tile = LIMITS.key_tile
    ragged_kv = problem.seq_kv % tile != 0
    return (bias_dims is not None and ragged_kv) or \
        (backward and (ragged_kv or problem.seq_q % tile != 0))


def with_storage(options: GraphOptions, storage) -> GraphOptions:
    """The builder options a problem's packed or paged storage implies."""
    if isinstance(storage, Ragged):
        return dataclasses.replace(options, ragged=True)
    if isinstance(storage, Paged):
        return dataclasses.replace(options, paged=PagedKV(storage.num_blocks, storage.page_size,
                                                          storage.layout))
    return options


def _option_reasons(problem, options: GraphOptions, mask_dropout: bool, backward: bool,
                    reasons: list) -> None:
    if options.ragged:
        if problem.padding is None:
            reasons.append("ragged (packed) layouts need per-sequence lengths (a Padding mask)")
        if problem.layout != "bshd":
            reasons.append("ragged (packed) layouts are token-major: use layout='bshd'")
        widest = problem.batch * problem.seq_q * problem.heads_q * max(problem.dim_qk,
                                                                        problem.dim_v)
        if widest >= 2 ** 31:
            reasons.append(f"this engine's ragged offsets are int32: B * max_seqlen * H * D must "
                           f"stay below 2**31, got {widest}")
    elif options.max_total_seq_len_q is not None or options.max_total_seq_len_kv is not None:
        reasons.append("max_total_seq_len_q/kv applies to ragged (packed) layouts only")
    if mask_dropout and problem.dropout_p > 0:
        reasons.append("dropout takes either a probability (Philox) or a mask, not both")
    paged = options.paged
    if paged is not None:
        if problem.padding is None:
            reasons.append("paged KV caches need per-sequence lengths (a Padding mask)")
        if backward and not LIMITS.paged_backward:
            reasons.append("cuDNN has no SDPA backward for paged KV caches")
        if paged.page_size < 1 or paged.page_size & (paged.page_size - 1):
            reasons.append(f"the KV page size must be a power of two, got {paged.page_size}")
        elif problem.seq_kv % paged.page_size:
            reasons.append(f"S_kv ({problem.seq_kv}) must be a whole number of pages of "
                           f"{paged.page_size}")
        if options.ragged:
            reasons.append("paged KV caches with ragged offsets are not built by this engine")


def _arch_reasons(problem, sm: int, backward: bool, deterministic: bool, ragged: bool,
                  features: dict, version: Optional[int], reasons: list) -> None:
    lim = LIMITS
    major = sm // 10
    if major < lim.min_sm_major:
        reasons.append(f"cuDNN SDPA ({'/'.join(lim.io_dtypes.values())}) needs "
                       f"sm_{lim.min_sm_major}0 or newer, target is sm_{sm}")
        return
    d_qk, d_v = problem.dim_qk, problem.dim_v
    if backward:
        reasons += lim.backward_head_dim_reasons(sm, d_qk, d_v, version)
    if backward and ragged and major in lim.ragged_backward_lse_majors:
        reasons.append(f"cuDNN's packed (ragged) backward on sm_{sm} cannot read a packed LSE")
    if backward and ragged and major in lim.ragged_dbias_excluded_majors and features["dbias"]:
        reasons.append(f"cuDNN computes no dBias with ragged layouts on sm_{sm}")
    needs_stats = backward or problem.requires_grad or problem.return_lse
    if problem.dropout_p > 0 and not needs_stats and major in lim.philox_dropout_needs_stats_majors:
        reasons.append(f"cuDNN has no sm_{sm} engine for a forward with Philox dropout and no "
                       f"LSE output (an inference call with dropout_p > 0)")
    if backward and deterministic and major in lim.deterministic_feature_majors:
        used = [name for name, on in features.items() if on]
        if used:
            reasons.append(f"cuDNN's deterministic backward on sm_{sm} excludes "
                           + ", ".join(used))


def cudnn_reasons(problem: AttnProblem, target_sm: Optional[int] = None, *,
                  options: Optional[GraphOptions] = None,
                  backward: Optional[bool] = None, version: Optional[int] = None) -> list[str]:
    """Every reason, knowable without a GPU, why cuDNN cannot run ``problem`` (empty: it can
    try), one sentence each. ``target_sm`` (e.g. 90) and ``version`` (e.g. 91900) as
    ``analyze``'s: that architecture's limits and that cuDNN backend's floors."""
    return analyze(problem, target_sm=target_sm, options=options, backward=backward,
                   version=version)[1]


def problem_lengths(problem: AttnProblem) -> tuple[tuple, tuple]:
    pad = problem.padding
    if pad is None:
        return (problem.seq_q,) * problem.batch, (problem.seq_kv,) * problem.batch
    return pad.seq_lens_q, pad.seq_lens_kv

