// Fused neighborhood attention, FlashAttention-2 style: forward, backward dQ, backward dK/dV.
//
// A block of NA_WARPS warps owns QUERY_TILE queries (forward, dQ; each warp 16 rows) or KEY_TILE
// keys (dK/dV). Its tile is a box (runtime shape, product 64) inside ONE dilation group per axis,
// so the other side it must visit is the exact per-axis box `na_group_key_range` /
// `na_group_query_range`: tiles no row can see are never visited. That box is walked as tiles of
// 64 slots (also boxes), each loaded into shared memory in chunks of CHUNK rows.
//
// Fragment layout: the mma.sync m16n8k16 one. A warp's accumulator for 16 rows x (NT * 8)
// columns is float[NT][4]; lane (g = lane / 4, t = lane % 4) holds rows g and g + 8, columns
// n * 8 + 2t and n * 8 + 2t + 1 of every n-tile n. fp16/bf16 run mma.sync on tensor cores with
// fp32 accumulation; fp32 computes the same fragment elements with FMAs (exact fp32, no tf32).
//
// Two builds of this text. The plain one (fp32 everywhere, 16-bit with NA_PIPELINED=0): thread 0
// places each tile in a shared NaGeo record, slot lists in shared memory. The sm_80+ one
// (NA_PIPELINED=1, fp16/bf16): every thread derives the block's geometry and each tile's place in
// registers (shifts and masks of the power-of-two box sides, odometers over the tiles, no
// division per tile), the other side streams through a ring of cp.async stages with one barrier
// per step, the head dim is a compile-time bound everywhere, logits are in log2 units from one
// multiply and exponentials are ex2.approx.ftz, and tiles every row sees whole skip the mask.
//
// Backward: delta = rowsum(dO * O) - dlse (na_fused_backward_delta), P = exp(S - LSE),
// dS = P * (dP - delta) (* (1 - tanh^2) under softcap). dQ walks keys per query tile, dK/dV walk
// queries per key tile (and the query heads of a kv head inside), so there are no atomics and
// results are bitwise repeatable.

#define NA_WARPS 4
#define NA_THREADS (NA_WARPS * 32)
#define NA_FULL 0xffffffffu
#define NA_LOG2E 1.4426950408889634f
#define NA_LN2 0.6931471805599453f
#define NA_NO_KEY (-(1 << 30))
#define NA_INF __int_as_float(0x7f800000)

static_assert(QUERY_TILE == NA_WARPS * 16 && KEY_TILE == NA_WARPS * 16,
              "one warp owns 16 rows of a 64-row tile");
#define NA_TILE 64

// ---------------------------------------------------------------------------------------------
// Shared-memory layout of one staged operand: rows of HD elements. 16-bit rows are padded by 8
// elements so the 32-bit fragment loads of a warp hit distinct banks; fp32 rows are not padded
// (the FMA path staggers its column order per lane instead), which keeps D=128 within 99 KB.
// ---------------------------------------------------------------------------------------------
template <typename T, int HD> struct NaRows {
    static constexpr int LD = sizeof(T) == 2 ? HD + 8 : HD;
};

// Rows of the other side staged at once: smaller for fp32 to bound shared memory and registers.
template <typename T> struct NaChunk {
    static constexpr int FWD = sizeof(T) == 2 ? 64 : 32;
    static constexpr int DQ = sizeof(T) == 2 ? 64 : 16;
    static constexpr int DKDV = sizeof(T) == 2 ? 32 : 16;
};

__device__ __forceinline__ unsigned int na_ld32(const void* p) {
    return *reinterpret_cast<const unsigned int*>(p);
}

__device__ __forceinline__ void na_mma16816(float* c, const unsigned int* a, const unsigned int* b,
                                            na_half) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void na_mma16816(float* c, const unsigned int* a, const unsigned int* b,
                                            na_bf16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// ---------------------------------------------------------------------------------------------
// sm_80+ pipelined variant (NA_PIPELINED=1, 16-bit instances only; fused_pipelined.py): fragments
// loaded with ldmatrix, K/V tiles staged with cp.async into two buffers so that the next tile's
// copies overlap the current tile's math (forward). fp32 never takes these paths.
// ---------------------------------------------------------------------------------------------
#ifndef NA_PIPELINED
#define NA_PIPELINED 0
#endif
#ifndef NA_WGMMA  // the Hopper build (`fused_hopper`, sm_90a): the WG instances' wgmma paths
#define NA_WGMMA 0
#endif

#if NA_PIPELINED
// Four 8x8 b16 matrices; lanes 8m..8m+7 give the row addresses of matrix m (16-byte aligned).
__device__ __forceinline__ void na_ldsm_x4(unsigned int* r, const void* row) {
    const unsigned int a = (unsigned int)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ void na_ldsm_x4_trans(unsigned int* r, const void* row) {
    const unsigned int a = (unsigned int)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ void na_cp_async16(void* dst, const void* src) {
    const unsigned int a = (unsigned int)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(a), "l"(src));
}
__device__ __forceinline__ void na_cp_async_commit() { asm volatile("cp.async.commit_group;" ::); }
__device__ __forceinline__ void na_cp_async_wait_prev() {
    asm volatile("cp.async.wait_group %0;" :: "n"(1));
}
__device__ __forceinline__ void na_cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::); }
#endif

template <int NT> __device__ __forceinline__ void na_zero(float (&x)[NT][4]) {
#pragma unroll
    for (int n = 0; n < NT; ++n) x[n][0] = x[n][1] = x[n][2] = x[n][3] = 0.f;
}

// acc[16 x NT*8] += A[16 x kdim] * B[NT*8 x kdim]^T; A (the warp's 16 rows) and B in shared
// memory, both row-major with stride LD. Used for Q K^T, dO V^T, K Q^T and V dO^T.
template <typename T, int HD, int NT>
__device__ __forceinline__ void na_mma_abt(float (&acc)[NT][4], const T* A, const T* B, int kdim) {
    constexpr int LD = NaRows<T, HD>::LD;
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    if constexpr (sizeof(T) == 2 && NA_PIPELINED) {
        // A: matrices (rows 0-7 | 8-15) x (k0 | k0+8) = a0..a3; B: two n-tiles x (k0 | k0+8).
        static_assert(NT % 2 == 0, "n-tiles are loaded in pairs");
        for (int k0 = 0; k0 < kdim; k0 += 16) {
            unsigned int a[4];
            na_ldsm_x4(a, A + (lane % 16) * LD + k0 + (lane / 16) * 8);
#pragma unroll
            for (int n = 0; n < NT; n += 2) {
                unsigned int b[4];
                na_ldsm_x4(b, B + (n * 8 + (lane / 16) * 8 + lane % 8) * LD + k0 +
                                  ((lane / 8) % 2) * 8);
                na_mma16816(acc[n], a, b, T());
                na_mma16816(acc[n + 1], a, b + 2, T());
            }
        }
    } else if constexpr (sizeof(T) == 2) {
        for (int k0 = 0; k0 < kdim; k0 += 16) {
            unsigned int a[4];
            a[0] = na_ld32(A + g * LD + k0 + 2 * t);
            a[1] = na_ld32(A + (g + 8) * LD + k0 + 2 * t);
            a[2] = na_ld32(A + g * LD + k0 + 2 * t + 8);
            a[3] = na_ld32(A + (g + 8) * LD + k0 + 2 * t + 8);
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                const T* row = B + (n * 8 + g) * LD + k0 + 2 * t;
                unsigned int b[2] = {na_ld32(row), na_ld32(row + 8)};
                na_mma16816(acc[n], a, b, T());
            }
        }
    } else {
        // Zero-padded columns add nothing, so the whole row is summed; the per-lane rotation of
        // the column order spreads a warp's loads over 32 banks.
        const int rot = 4 * g + t;
#pragma unroll 2
        for (int i = 0; i < HD; ++i) {
            const int c = (i + rot) & (HD - 1);
            const float a0 = na_to_float(A[g * LD + c]), a1 = na_to_float(A[(g + 8) * LD + c]);
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                const float b0 = na_to_float(B[(n * 8 + 2 * t) * LD + c]);
                const float b1 = na_to_float(B[(n * 8 + 2 * t + 1) * LD + c]);
                acc[n][0] += a0 * b0;
                acc[n][1] += a0 * b1;
                acc[n][2] += a1 * b0;
                acc[n][3] += a1 * b1;
            }
        }
    }
}

// acc[16 x HD] += P[16 x NT*8] * B[NT*8 x ncols]; P is a warp fragment in registers (it becomes the
// A operand directly), B row-major in shared memory. Used for P V, dS K, P^T dO and dS^T Q.
template <typename T, int HD, int NT>
__device__ __forceinline__ void na_mma_pb(float (&acc)[HD / 8][4], const float (&p)[NT][4],
                                          const T* B, int ncols) {
    constexpr int LD = NaRows<T, HD>::LD;
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    if constexpr (sizeof(T) == 2 && NA_PIPELINED) {
        // B row-major [k][n]: .trans matrices (k 0-7 | 8-15) x (n-tile n | n+1) = b0, b1 of
        // tile n, then of tile n + 1. A pair past ncols is skipped; a half past it reads the
        // zero-padded columns.
#pragma unroll
        for (int j = 0; j < NT / 2; ++j) {
            unsigned int a[4] = {na_pack2(p[2 * j][0], p[2 * j][1], T()),
                                 na_pack2(p[2 * j][2], p[2 * j][3], T()),
                                 na_pack2(p[2 * j + 1][0], p[2 * j + 1][1], T()),
                                 na_pack2(p[2 * j + 1][2], p[2 * j + 1][3], T())};
#pragma unroll
            for (int n = 0; n < HD / 8; n += 2) {
                if (n * 8 >= ncols) continue;
                unsigned int b[4];
                na_ldsm_x4_trans(b, B + (16 * j + ((lane / 8) % 2) * 8 + lane % 8) * LD +
                                        (n + lane / 16) * 8);
                na_mma16816(acc[n], a, b, T());
                na_mma16816(acc[n + 1], a, b + 2, T());
            }
        }
    } else if constexpr (sizeof(T) == 2) {
        const na_u16* b16 = reinterpret_cast<const na_u16*>(B);
#pragma unroll
        for (int j = 0; j < NT / 2; ++j) {
            unsigned int a[4] = {na_pack2(p[2 * j][0], p[2 * j][1], T()),
                                 na_pack2(p[2 * j][2], p[2 * j][3], T()),
                                 na_pack2(p[2 * j + 1][0], p[2 * j + 1][1], T()),
                                 na_pack2(p[2 * j + 1][2], p[2 * j + 1][3], T())};
            const na_u16* col = b16 + (16 * j + 2 * t) * LD + g;
#pragma unroll
            for (int n = 0; n < HD / 8; ++n) {
                if (n * 8 >= ncols) continue;
                const na_u16* c = col + n * 8;
                unsigned int b[2] = {(unsigned int)c[0] | ((unsigned int)c[LD] << 16),
                                     (unsigned int)c[8 * LD] | ((unsigned int)c[9 * LD] << 16)};
                na_mma16816(acc[n], a, b, T());
            }
        }
    } else {
        // The quad of lanes sharing a row holds that row's P: fetch each element from its owner.
        const int quad = lane & ~3;
#pragma unroll
        for (int k = 0; k < NT * 8; ++k) {
            const int n = k / 8, owner = (k % 8) / 2, e = k % 2;
            const float a0 = __shfl_sync(NA_FULL, p[n][e], quad | owner);
            const float a1 = __shfl_sync(NA_FULL, p[n][2 + e], quad | owner);
            const T* row = B + k * LD + 2 * t;
#pragma unroll
            for (int m = 0; m < HD / 8; ++m) {
                if (m * 8 >= ncols) continue;
                const float b0 = na_to_float(row[m * 8]), b1 = na_to_float(row[m * 8 + 1]);
                acc[m][0] += a0 * b0;
                acc[m][1] += a0 * b1;
                acc[m][2] += a1 * b0;
                acc[m][3] += a1 * b1;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Staging rows from global memory: row r is token tok[r] (< 0: absent), element c of it sits at
// src[tok * stride + c]. Columns >= d and absent rows are zero. `vec`: 16-byte loads are aligned.
// ---------------------------------------------------------------------------------------------
template <typename T, int HD>
__device__ __forceinline__ void na_stage_rows(T* dst, const T* __restrict__ src, const int* tok,
                                              int rows, long long stride, int d, int vec) {
    constexpr int LD = NaRows<T, HD>::LD, V = 16 / sizeof(T), PER_ROW = HD / V;
    const T zero = NaConvert<T>::from(0.f);
    for (int i = threadIdx.x; i < rows * PER_ROW; i += NA_THREADS) {
        const int r = i / PER_ROW, c = (i % PER_ROW) * V;
        const int tk = tok[r];
        T* out = dst + r * LD + c;
        if (vec && tk >= 0 && c + V <= d) {
            *reinterpret_cast<uint4*>(out) = *reinterpret_cast<const uint4*>(src + tk * stride + c);
        } else {
#pragma unroll
            for (int e = 0; e < V; ++e)
                out[e] = (tk >= 0 && c + e < d) ? src[tk * stride + c + e] : zero;
        }
    }
}

#if NA_PIPELINED
// na_stage_rows with the aligned 16-byte pieces copied by cp.async (the caller commits and
// waits); absent rows and columns past d are zero-filled by plain stores.
template <typename T, int HD>
__device__ __forceinline__ void na_stage_rows_async(T* dst, const T* __restrict__ src,
                                                    const int* tok, int rows, long long stride,
                                                    int d, int vec) {
    constexpr int LD = NaRows<T, HD>::LD, V = 16 / sizeof(T), PER_ROW = HD / V;
    const T zero = NaConvert<T>::from(0.f);
    for (int i = threadIdx.x; i < rows * PER_ROW; i += NA_THREADS) {
        const int r = i / PER_ROW, c = (i % PER_ROW) * V;
        const int tk = tok[r];
        T* out = dst + r * LD + c;
        if (vec && tk >= 0 && c + V <= d) {
            na_cp_async16(out, src + tk * stride + c);
        } else if (tk < 0 || c >= d) {
            *reinterpret_cast<uint4*>(out) = uint4{0u, 0u, 0u, 0u};
        } else {
#pragma unroll
            for (int e = 0; e < V; ++e) out[e] = c + e < d ? src[tk * stride + c + e] : zero;
        }
    }
}
#endif

// ---------------------------------------------------------------------------------------------
// Block geometry. Per axis: the dilation group, the block's own box and the range of the other
// side it must visit (group coordinates), and the other-side tile being visited.
// ---------------------------------------------------------------------------------------------
struct NaGeo {
    int g[3], d[3], len_q[3], len_kv[3], glen_q[3], kern[3];
    int own_lo[3], own_hi[3];  // own box (clipped to the group)
    int lo[3], hi[3];          // other side's range
    int tiles[3];              // other side's tiles per axis
    int cur_lo[3], cur_hi[3];  // the other-side tile being visited (clipped)
    int full;                  // every slot of that tile is visible from every row
};

// Tiles of `tile` positions per dilation group, groups one after another.
__device__ __forceinline__ int na_axis_tiles(int len, int d, int tile) {
    const int r = len % d, nhi = (len / d + 1 + tile - 1) / tile, nlo = (len / d + tile - 1) / tile;
    return r * nhi + (d - r) * nlo;
}

// Tile `t` of that enumeration: its group and first group coordinate.
__device__ __forceinline__ void na_axis_tile(int len, int d, int tile, int t, int* g, int* start) {
    const int r = len % d, nhi = (len / d + 1 + tile - 1) / tile, nlo = (len / d + tile - 1) / tile;
    if (t < r * nhi) {
        *g = t / nhi;
        *start = (t % nhi) * tile;
    } else {
        t -= r * nhi;
        *g = r + t / nlo;
        *start = (t % nlo) * tile;
    }
}

// Slot `j` of a box of shape `box` at `lo` (clipped at `hi`): its group coordinates, and whether
// it lies inside the clip.
__device__ __forceinline__ bool na_box_slot(int j, const int* box, const int* lo, const int* hi,
                                            int* c) {
    c[2] = lo[2] + j % box[2];
    c[1] = lo[1] + (j / box[2]) % box[1];
    c[0] = lo[0] + j / (box[1] * box[2]);
    return c[0] < hi[0] && c[1] < hi[1] && c[2] < hi[2];
}

// Flattened token of group coordinates `c` (row-major over the global axes of length `len`).
__device__ __forceinline__ int na_token(const NaGeo& geo, const int* c, const int* len) {
    int tok = 0;
#pragma unroll
    for (int a = 0; a < 3; ++a) tok = tok * len[a] + c[a] * geo.d[a] + geo.g[a];
    return tok;
}

// Thread 0: load the axes and place the block's own box. `own_is_query`: forward/dQ (the block
// owns queries, visits keys) or dK/dV (owns keys, visits queries).
__device__ __forceinline__ void na_setup_block(const int* __restrict__ table, NaAxis* ax, NaGeo& geo,
                               const int* own_box, const int* other_box, bool own_is_query) {
    na_load_axes(table, ax);
    int t = blockIdx.x, idx[3];
#pragma unroll
    for (int a = 2; a >= 0; --a) {
        const int d = na_axis_dilation(ax[a]);
        const int len = own_is_query ? ax[a].len_q : ax[a].len_kv;
        const int n = na_axis_tiles(len, d, own_box[a]);
        idx[a] = t % n;
        t /= n;
    }
#pragma unroll
    for (int a = 0; a < 3; ++a) {
        const int d = na_axis_dilation(ax[a]);
        int g, start;
        na_axis_tile(own_is_query ? ax[a].len_q : ax[a].len_kv, d, own_box[a], idx[a], &g, &start);
        geo.g[a] = g;
        geo.d[a] = d;
        geo.len_q[a] = ax[a].len_q;
        geo.len_kv[a] = ax[a].len_kv;
        geo.glen_q[a] = na_group_len(ax[a].len_q, d, g);
        geo.kern[a] = ax[a].kernel;
        const int glen_own = own_is_query ? geo.glen_q[a] : na_group_len(ax[a].len_kv, d, g);
        geo.own_lo[a] = start;
        geo.own_hi[a] = min(start + own_box[a], glen_own);
        int lo, hi;
        if (own_is_query)
            na_group_key_range(ax[a], geo.glen_q[a], geo.own_lo[a], geo.own_hi[a], &lo, &hi);
        else
            na_group_query_range(ax[a], geo.glen_q[a], geo.own_lo[a], geo.own_hi[a], &lo, &hi);
        geo.lo[a] = lo;
        geo.hi[a] = max(hi, lo);
        geo.tiles[a] = (geo.hi[a] - geo.lo[a] + other_box[a] - 1) / other_box[a];
    }
}

// Thread 0: place other-side tile `t` (row-major over the per-axis tile counts) and decide
// whether masking can be skipped for it.
__device__ __forceinline__ void na_place_other_tile(const NaAxis* ax, NaGeo& geo, const int* box, int t,
                                    bool own_is_query) {
    int full = 1;
#pragma unroll
    for (int a = 2; a >= 0; --a) {
        const int i = t % geo.tiles[a];
        t /= geo.tiles[a];
        const int lo = geo.lo[a] + i * box[a];
        geo.cur_lo[a] = lo;
        geo.cur_hi[a] = min(lo + box[a], geo.hi[a]);
        // Windows are monotone in the query: the first/last query bound what all of them see.
        int wl0, wh0, wl1, wh1;
        if (own_is_query) {
            na_group_window(ax[a], geo.own_lo[a], geo.glen_q[a], &wl0, &wh0);
            na_group_window(ax[a], geo.own_hi[a] - 1, geo.glen_q[a], &wl1, &wh1);
            full &= lo + box[a] <= geo.hi[a] && wl1 <= lo && lo + box[a] <= wh0;
        } else {
            na_group_window(ax[a], geo.cur_lo[a], geo.glen_q[a], &wl0, &wh0);
            na_group_window(ax[a], geo.cur_hi[a] - 1, geo.glen_q[a], &wl1, &wh1);
            full &= wl1 <= geo.own_lo[a] && geo.own_hi[a] <= wh0;
        }
    }
    geo.full = full;
}

// Slot j of a query box: its token (-1 if outside) and its key window per axis (empty if outside).
__device__ __forceinline__ void na_query_slot(const NaAxis* ax, const NaGeo& geo, const int* box,
                                              const int* lo, const int* hi, int j, int* tok,
                                              int* win, int* qc) {
    int c[3];
    const bool ok = na_box_slot(j, box, lo, hi, c);
    *tok = ok ? na_token(geo, c, geo.len_q) : -1;
#pragma unroll
    for (int a = 0; a < 3; ++a) {
        int wl = 0, wh = 0;
        if (ok) na_group_window(ax[a], c[a], geo.glen_q[a], &wl, &wh);
        win[2 * a] = wl;
        win[2 * a + 1] = wh;
        if (qc) qc[a] = c[a];
    }
}

// Slot j of a key box: its token (-1 if outside) and group coordinates (NA_NO_KEY if outside).
__device__ __forceinline__ void na_key_slot(const NaGeo& geo, const int* box, const int* lo,
                                            const int* hi, int j, int* tok, int* kc) {
    int c[3];
    const bool ok = na_box_slot(j, box, lo, hi, c);
    *tok = ok ? na_token(geo, c, geo.len_kv) : -1;
#pragma unroll
    for (int a = 0; a < 3; ++a) kc[a] = ok ? c[a] : NA_NO_KEY;
}

__device__ __forceinline__ bool na_visible(const int* win, const int* kc) {
    return kc[0] >= win[0] && kc[0] < win[1] && kc[1] >= win[2] && kc[1] < win[3] &&
           kc[2] >= win[4] && kc[2] < win[5];
}

// ---------------------------------------------------------------------------------------------
// Logits: s = scale * acc, softcap s = cap * tanh(s / cap), + RPB, masked -> -inf. Rows are the
// thread's fragment rows (query or key slots of the 64-slot tiles, `row0` = the warp's first),
// columns the chunk's slots starting at `col0`. One implementation for all three kernels.
// ---------------------------------------------------------------------------------------------
struct NaRpb {
    const float* table;  // [H, 2k0-1, 2k1-1, 2k2-1] fp32 or null
    const int* qc;       // query group coordinates per query slot (shared memory)
};

template <int NT, bool QUERY_ROWS>
__device__ __forceinline__ void na_logits(float (&s)[NT][4], float scale, float cap, float inv_cap,
                                          bool full,
                                          const int* s_win, const int* s_kc, int row0, int col0,
                                          const NaGeo& geo, NaRpb rpb) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int row = row0 + g + (e >> 1) * 8, col = col0 + n * 8 + 2 * t + (e & 1);
            const int q = QUERY_ROWS ? row : col, k = QUERY_ROWS ? col : row;
            float x = s[n][e] * scale;
            if (cap > 0.f) x = cap * tanhf(x * inv_cap);
            if (!full && !na_visible(s_win + q * 6, s_kc + k * 3)) {
                x = -NA_INF;
            } else if (rpb.table) {
                int idx = 0;
#pragma unroll
                for (int a = 0; a < 3; ++a)
                    idx = idx * (2 * geo.kern[a] - 1) + s_kc[k * 3 + a] - rpb.qc[q * 3 + a] +
                          geo.kern[a] - 1;
                x += rpb.table[idx];
            }
            s[n][e] = x;
        }
    }
}

// Backward elementwise step: s (logits, -inf where masked) -> P = exp(s - lse) and
// dp -> dS = P * (dp - delta) * dtanh. `lse`/`delta` per fragment element, already chosen by row
// or column; lse = +inf for a row that sees nothing.
__device__ __forceinline__ void na_grad_logit(float& s, float& dp, float lse, float delta,
                                              float cap, float inv_cap) {
    const float p = exp2f((s - lse) * NA_LOG2E);
    float ds = p * (dp - delta);
    if (cap > 0.f) {
        const float th = s * inv_cap;
        ds = s == -NA_INF ? 0.f : ds * (1.f - th * th);
    }
    s = p;
    dp = ds;
}

// Online softmax over one chunk (forward): s becomes P, running max m and sum l (per-thread
// partial sums of its columns) and the output accumulator o are rescaled.
template <int NT, int HD>
__device__ __forceinline__ void na_online_softmax(float (&s)[NT][4], float (&m)[2], float (&l)[2],
                                                  float (&o)[HD / 8][4]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float mx = -NA_INF;
#pragma unroll
        for (int n = 0; n < NT; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(NA_FULL, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(NA_FULL, mx, 2));
        const float m_new = fmaxf(m[r], mx);
        // A row that has seen nothing yet keeps shift 0: exp(-inf - 0) = 0, never NaN.
        const float shift = m_new == -NA_INF ? 0.f : m_new * NA_LOG2E;
        const float alpha = exp2f(m[r] * NA_LOG2E - shift);
        float sum = 0.f;
#pragma unroll
        for (int n = 0; n < NT; ++n) {
#pragma unroll
            for (int e = 2 * r; e < 2 * r + 2; ++e) {
                s[n][e] = exp2f(s[n][e] * NA_LOG2E - shift);
                sum += s[n][e];
            }
        }
        l[r] = l[r] * alpha + sum;
        m[r] = m_new;
#pragma unroll
        for (int n = 0; n < HD / 8; ++n) {
            o[n][2 * r] *= alpha;
            o[n][2 * r + 1] *= alpha;
        }
    }
}

// Store a warp's 16 x HD fragment (rows with token < 0 skipped, columns >= d dropped), times `mul`.
template <typename T, int HD>
__device__ __forceinline__ void na_store_rows(T* __restrict__ dst, const float (&acc)[HD / 8][4],
                                              const int* tok, int row0, long long stride, int d,
                                              float mul0, float mul1) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int tk = tok[row0 + g + 8 * r];
        if (tk < 0) continue;
        T* out = dst + tk * stride;
        const float mul = r ? mul1 : mul0;
#pragma unroll
        for (int n = 0; n < HD / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int c = n * 8 + 2 * t + e;
                if (c < d) out[c] = NaConvert<T>::from(acc[n][2 * r + e] * mul);
            }
        }
    }
}

// The kernels' parameter lists, one per kernel: each kernel has a definition in both builds (and
// the forward a wide one), all with the launcher's argument order (fused.py).
#define NA_FORWARD_PARAMS                                                                     \
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,              \
    T* __restrict__ o, float* __restrict__ lse, const int* __restrict__ table,              \
    const float* __restrict__ rpb, long long q_sb, long long q_st, long long q_sh,          \
    long long k_sb, long long k_st, long long k_sh, long long v_sb, long long v_st,         \
    long long v_sh, long long o_sb, long long o_st, long long o_sh, long long l_sb,         \
    long long l_st, long long l_sh, int heads_q, int heads_kv, int d_qk, int d_v, int qt0,  \
    int qt1, int qt2, int kt0, int kt1, int kt2, float scale, float softcap, int vec
#define NA_DQ_PARAMS                                                                          \
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,                  \
    const T* __restrict__ dout, const float* __restrict__ lse,                                  \
    const float* __restrict__ delta, T* __restrict__ dq, const int* __restrict__ table,         \
    long long q_sb, long long q_st, long long q_sh, long long k_sb, long long k_st,             \
    long long k_sh, long long v_sb, long long v_st, long long v_sh, long long do_sb,            \
    long long do_st, long long do_sh, long long dq_sb, long long dq_st, long long dq_sh,        \
    long long l_sb, long long l_st, long long l_sh, int heads_q, int heads_kv, int d_qk,        \
    int d_v, int qt0, int qt1, int qt2, int kt0, int kt1, int kt2, float scale, float softcap,  \
    int vec
#define NA_DKDV_PARAMS                                                                        \
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,                  \
    const T* __restrict__ dout, const float* __restrict__ lse,                                  \
    const float* __restrict__ delta, T* __restrict__ dk, T* __restrict__ dv,                    \
    const int* __restrict__ table, long long q_sb, long long q_st, long long q_sh,              \
    long long k_sb, long long k_st, long long k_sh, long long v_sb, long long v_st,             \
    long long v_sh, long long do_sb, long long do_st, long long do_sh, long long dk_sb,         \
    long long dk_st, long long dk_sh, long long dv_sb, long long dv_st, long long dv_sh,        \
    long long l_sb, long long l_st, long long l_sh, int heads_q, int heads_kv, int d_qk,        \
    int d_v, int qt0, int qt1, int qt2, int kt0, int kt1, int kt2, float scale, float softcap,  \
    int vec

#define NA_LOAD_SHAPES                                                                         \
    const int qbox[3] = {qt0, qt1, qt2};                                                       \
    const int kbox[3] = {kt0, kt1, kt2};                                                       \
    const int warp = threadIdx.x >> 5, row0 = warp * 16;                                       \
    const int b = blockIdx.z;

#if NA_PIPELINED
// ---------------------------------------------------------------------------------------------
// Forward, sm_80+ build (fp16/bf16). Every thread derives the block's geometry and each key
// tile's place in registers (power-of-two box sides: shifts and masks, an odometer over the
// tiles), so no thread waits on another for it; Q lives in registers as mma A fragments; K and V
// stream through a ring of cp.async stages with one barrier per tile; tiles every query sees
// whole skip the mask; logits are in log2 units from one multiply, exponentials `ex2.approx.ftz`.
// ---------------------------------------------------------------------------------------------

// K/V stages of the ring: three where they fit in the 99 KB a block may have on every sm_80+
// device, two at head dim 128. MIN_BLOCKS: the blocks per SM asked of the register allocator
// (__launch_bounds__), as many as shared memory admits on sm_80 (164 KB) up to four.
template <int HD> struct NaForwardStages {
    static constexpr int N = HD >= 128 ? 2 : 3;
    static constexpr int MIN_BLOCKS = HD >= 128 ? 1 : 3;
    static constexpr int MIN_BLOCKS_DQ = HD >= 128 ? 1 : HD >= 64 ? 2 : 3;  // dP's registers too
};

__device__ __forceinline__ float na_ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// 4 bytes, of which `bytes` (4 or 0) are read and the rest zero-filled.
__device__ __forceinline__ void na_cp_async4(void* dst, const void* src, int bytes) {
    const unsigned int a = (unsigned int)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" :: "r"(a), "l"(src), "r"(bytes));
}

template <int N> __device__ __forceinline__ void na_cp_async_wait_n() {
    asm volatile("cp.async.wait_group %0;" :: "n"(N));
}

// A box of power-of-two sides: slot j sits at offset (j >> shift[a]) & mask[a] on axis a.
struct NaBox {
    int shift[3], mask[3];
};

__device__ __forceinline__ int na_log2(int x) {
    int s = 0;
    while ((1 << s) < x) ++s;
    return s;
}

__device__ __forceinline__ NaBox na_make_box(const int* side) {
    NaBox box;
    int shift = 0;
#pragma unroll
    for (int a = 2; a >= 0; --a) {
        box.shift[a] = shift;
        box.mask[a] = side[a] - 1;
        shift += na_log2(side[a]);
    }
    return box;
}

// Tokens of one side (queries or keys) of the walk: group coordinates c are token
// base + sum_a c[a] * step[a] (step: the dilation times the axis' row-major multiplier).
struct NaTokens {
    int base, step[3];
};

__device__ __forceinline__ void na_add_axis(NaTokens& t, int a, int g, int d, int len, int& mult) {
    t.step[a] = d * mult;
    t.base += g * mult;
    mult *= len;
}

// Per axis: the dilation group, global lengths, the block's own query box (group coordinates,
// clipped), the key range it must visit, that range's tiles, and the two window bounds that
// decide whether a key tile is seen whole by every query of the box.
struct NaForwardGeo {
    int glen_q[3], kern[3];
    int own_lo[3], own_hi[3];
    int lo[3], hi[3], tiles[3];
    int last_lo[3], first_hi[3];
    NaTokens qtok, ktok;
};

// The block's own box (blockIdx.x, row-major over the own side's per-axis tile counts: queries
// when `own_is_query`, keys otherwise): per axis its dilation group and first position, and the
// token arithmetic of both sides.
__device__ __forceinline__ void na_place_own_box(const NaAxis* ax, const int* side,
                                                 bool own_is_query, int* group, int* start,
                                                 NaTokens& qtok, NaTokens& ktok) {
    int t = blockIdx.x, idx[3];
#pragma unroll
    for (int a = 2; a >= 0; --a) {
        const int len = own_is_query ? ax[a].len_q : ax[a].len_kv;
        const int n = na_axis_tiles(len, na_axis_dilation(ax[a]), side[a]);
        idx[a] = t % n;
        t /= n;
    }
    int mult_q = 1, mult_kv = 1;
    qtok.base = ktok.base = 0;
#pragma unroll
    for (int a = 2; a >= 0; --a) {
        const int d = na_axis_dilation(ax[a]);
        na_axis_tile(own_is_query ? ax[a].len_q : ax[a].len_kv, d, side[a], idx[a], &group[a],
                     &start[a]);
        na_add_axis(qtok, a, group[a], d, ax[a].len_q, mult_q);
        na_add_axis(ktok, a, group[a], d, ax[a].len_kv, mult_kv);
    }
}

__device__ __forceinline__ void na_forward_geometry(const NaAxis* ax, const int* qside,
                                                    const int* kside, NaForwardGeo& geo) {
    int group[3], first[3];
    na_place_own_box(ax, qside, true, group, first, geo.qtok, geo.ktok);
#pragma unroll
    for (int a = 0; a < 3; ++a) {
        const int d = na_axis_dilation(ax[a]), g = group[a], start = first[a];
        geo.kern[a] = ax[a].kernel;
        geo.glen_q[a] = na_group_len(ax[a].len_q, d, g);
        geo.own_lo[a] = start;
        geo.own_hi[a] = min(start + qside[a], geo.glen_q[a]);
        int lo, hi, unused;
        na_group_key_range(ax[a], geo.glen_q[a], geo.own_lo[a], geo.own_hi[a], &lo, &hi);
        geo.lo[a] = lo;
        geo.hi[a] = max(hi, lo);
        geo.tiles[a] = (geo.hi[a] - lo + kside[a] - 1) / kside[a];
        // Windows are monotone in the query: the last query's start and the first one's end
        // bound what every query of the box sees.
        na_group_window(ax[a], geo.own_hi[a] - 1, geo.glen_q[a], &geo.last_lo[a], &unused);
        na_group_window(ax[a], geo.own_lo[a], geo.glen_q[a], &unused, &geo.first_hi[a]);
    }
}

// The next tile of a row-major walk over per-axis tile counts (last axis fastest).
__device__ __forceinline__ void na_odometer_step(int* idx, const int* tiles) {
#pragma unroll
    for (int a = 2; a >= 0; --a) {
        if (++idx[a] < tiles[a]) return;
        idx[a] = 0;
    }
}

// Token of box slot `r` of the box at group coordinates `lo` (-1 when the slot is clipped at
// `end`; CLIP = false: the caller knows the box lies before `end`, nothing is tested).
template <bool CLIP = true>
__device__ __forceinline__ int na_slot_token(const NaTokens& tk, const NaBox& box, const int* lo,
                                             const int* end, int r) {
    int tok = tk.base;
    bool ok = true;
#pragma unroll
    for (int a = 0; a < 3; ++a) {
        const int c = lo[a] + ((r >> box.shift[a]) & box.mask[a]);
        if (CLIP) ok &= c < end[a];
        tok += c * tk.step[a];
    }
    return ok ? tok : -1;
}

// Copy `ROWS` box slots (slots first.. of the box at group coordinates `lo`, clipped at `end`) of one or two
// operands into shared rows of LD elements: 16-byte pieces by cp.async, zeros for clipped rows and
// for columns past d (so that every mma may run over the whole compiled head dim).
// Where row r, column c (a multiple of 8) of a staged operand of ROWS rows lives: padded rows of
// HD + 8 elements (ldmatrix), or (SWIZZLE, the wgmma kernels) the 128-byte-swizzled canonical
// layout wgmma reads through a descriptor: 64-column blocks of ROWS rows of 128 bytes, the
// 16-byte piece c / 8 of row r stored at piece (c / 8) ^ (r % 8) of its row (1024-byte atoms of
// 8 rows, so a warp's 16-byte stores and wgmma's reads hit distinct banks).
template <int HD, int ROWS, bool SWIZZLE>
__device__ __forceinline__ int na_staged_offset(int r, int c) {
    if constexpr (SWIZZLE)
        return (c >> 6) * ROWS * 64 + r * 64 + ((((c >> 3) & 7) ^ (r & 7)) << 3);
    else
        return r * (HD + 8) + c;
}

template <typename T, int HD, int ROWS, int THREADS, bool SWIZZLE = false>
__device__ __forceinline__ void na_copy_box(T* dst0, const T* src0, long long st0, int d0,
                                            T* dst1, const T* src1, long long st1, int d1,
                                            const NaTokens& tk, const NaBox& box,
                                            const int* lo, const int* end, int vec,
                                            int first = 0) {
    constexpr int V = 8, PER_ROW = HD / V;
    static_assert((ROWS * PER_ROW) % THREADS == 0, "every thread copies the same count");
    static_assert(THREADS % PER_ROW == 0, "a thread keeps its column on every trip");
    // A trip moves by STEP rows; swizzled, a multiple of 8 keeps the thread's piece in its row.
    static_assert(!SWIZZLE || (THREADS / PER_ROW) % 8 == 0, "a swizzled trip keeps r % 8");
    const T zero = NaConvert<T>::from(0.f);
    // Counted trips from 0 (a loop from threadIdx.x is not unrolled): the column and the row
    // offset are the thread's own, computed once, and each trip is straight-line code.
    const int c = (threadIdx.x % PER_ROW) * V, r0 = threadIdx.x / PER_ROW;
    // The box's first token and the room left before `end` per axis, once: a trip then adds
    // only its slot's offsets.
    NaTokens at = tk;
    int room[3];
    const int origin[3] = {0, 0, 0};
#pragma unroll
    for (int a = 0; a < 3; ++a) {
        at.base += lo[a] * tk.step[a];
        room[a] = end[a] - lo[a];
    }
    constexpr int TRIPS = ROWS * PER_ROW / THREADS, STEP = THREADS / PER_ROW;  // rows per trip
    // The common case, tested once for the block (a uniform branch): every operand aligned and
    // as wide as the compiled head dim, the whole box before `end`. Then no piece is tested.
    bool whole = vec && d0 >= HD && (dst1 == nullptr || d1 >= HD);
#pragma unroll
    for (int a = 0; a < 3; ++a) whole &= room[a] > box.mask[a];
    if (whole) {
#pragma unroll
        for (int trip = 0; trip < TRIPS; ++trip) {
            const int tok = na_slot_token<false>(at, box, origin, room, first + r0 + trip * STEP);
            const int at_row = na_staged_offset<HD, ROWS, SWIZZLE>(r0 + trip * STEP, c);
            na_cp_async16(dst0 + at_row, src0 + c + tok * st0);
            if (dst1 != nullptr) na_cp_async16(dst1 + at_row, src1 + c + tok * st1);
        }
        return;
    }
#pragma unroll
    for (int trip = 0; trip < TRIPS; ++trip) {
        const int r = r0 + trip * STEP;
        const int tok = na_slot_token(at, box, origin, room, first + r);
#pragma unroll
        for (int o = 0; o < 2; ++o) {
            T* dst = o ? dst1 : dst0;
            if (dst == nullptr) continue;
            // The thread's column in both operands and its first row in shared memory are
            // fixed; a trip moves by whole rows (constant offsets, swizzled or not).
            const T* from = (o ? src1 : src0) + c;
            const long long st = o ? st1 : st0;
            const int d = o ? d1 : d0;
            T* out = dst + na_staged_offset<HD, ROWS, SWIZZLE>(r, c);
            if (vec && tok >= 0 && c + V <= d) {
                na_cp_async16(out, from + tok * st);
            } else if (tok < 0 || c >= d) {
                *reinterpret_cast<uint4*>(out) = uint4{0u, 0u, 0u, 0u};
            } else {
#pragma unroll
                for (int e = 0; e < V; ++e) out[e] = c + e < d ? from[tok * st + e] : zero;
            }
        }
    }
}

// s[16 x NT*8] = Q K^T for the warp's 16 rows: Q as A fragments in registers (qf[k-step]), K rows
// in shared memory (ldmatrix, two n-tiles per load).
template <typename T, int HD, int NT>
__device__ __forceinline__ void na_qk(float (&s)[NT][4], const unsigned int (&qf)[HD / 16][4],
                                      const T* K) {
    constexpr int LD = HD + 8;
    const int lane = threadIdx.x & 31;
    // The lane's own row and column of every ldmatrix, once: the loads then differ by constants.
    const T* krow = K + ((lane / 16) * 8 + lane % 8) * LD + ((lane / 8) % 2) * 8;
    na_zero(s);
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
#pragma unroll
        for (int n = 0; n < NT; n += 2) {
            unsigned int b[4];
            na_ldsm_x4(b, krow + n * 8 * LD + kk * 16);
            na_mma16816(s[n], qf[kk], b, T());
            na_mma16816(s[n + 1], qf[kk], b + 2, T());
        }
    }
}

// o[16 x HD] += P[16 x NT*8] V[NT*8 x HD]: P from the thread's fragments, V rows in shared memory
// (ldmatrix .trans, two n-tiles per load).
template <typename T, int HD, int NT>
__device__ __forceinline__ void na_pv(float (&o)[HD / 8][4], const float (&p)[NT][4], const T* V) {
    constexpr int LD = HD + 8;
    const int lane = threadIdx.x & 31;
    // The lane's own row and column of every ldmatrix, once: the loads then differ by constants.
    const T* vrow = V + (((lane / 8) % 2) * 8 + lane % 8) * LD + (lane / 16) * 8;
#pragma unroll
    for (int j = 0; j < NT / 2; ++j) {
        const unsigned int a[4] = {na_pack2(p[2 * j][0], p[2 * j][1], T()),
                                   na_pack2(p[2 * j][2], p[2 * j][3], T()),
                                   na_pack2(p[2 * j + 1][0], p[2 * j + 1][1], T()),
                                   na_pack2(p[2 * j + 1][2], p[2 * j + 1][3], T())};
#pragma unroll
        for (int n = 0; n < HD / 8; n += 2) {
            unsigned int b[4];
            na_ldsm_x4_trans(b, vrow + 16 * j * LD + n * 8);
            na_mma16816(o[n], a, b, T());
            na_mma16816(o[n + 1], a, b + 2, T());
        }
    }
}

// One query slot of the block, in shared memory (read by masked tiles and the bias only, so no
// register holds it through the loop): its key window [lo, hi) per axis (empty for a clipped
// slot), its part of the bias index, sum_a (k_a - 1 - qc_a) * R_a (R: the row-major multipliers
// of the [2k0-1, 2k1-1, 2k2-1] table; a key adds sum_a kc_a * R_a), and its token (-1: clipped).
struct __align__(16) NaQuerySlot {
    int lo[3], hi[3], rpb, tok;
};

// The bias table's row-major multipliers over its three axes.
__device__ __forceinline__ void na_rpb_multipliers(const int* kern, int* mul) {
    mul[2] = 1;
    mul[1] = 2 * kern[2] - 1;
    mul[0] = mul[1] * (2 * kern[1] - 1);
}

// Masked key tiles test visibility as bits: bit j of a 64-bit word is slot j of the tile (the
// tile's box has NA_TILE = 64 slots). A query's window is a range per axis, so the slots it sees
// are, per axis, a run of bits over one period of that axis (its side times the span of the axes
// below it), repeated across the tile; the AND over the axes. Built once per row and tile (some
// 20 integer operations per axis) instead of per score element (a shift, mask, add and two
// compares per axis), so that a masked element costs one bit test.

// period_ones[a]: a 1 at the start of every period of axis a of `kbox` (the multiplier that
// repeats a run of bits across the tile); block-constant, published to shared memory by the
// first threads (the loop's first barrier makes it visible).
__device__ __forceinline__ void na_publish_key_periods(unsigned long long* period_ones,
                                                       const NaBox& kbox) {
    const int a = threadIdx.x;
    if (a >= 3) return;
    const int period = (kbox.mask[a] + 1) << kbox.shift[a];
    unsigned long long ones = 1ull;
    for (int w = period; w < 64; w <<= 1) ones |= ones << w;
    period_ones[a] = ones;
}

// The word that holds the bits of KEYS slots: 32 bits where they fit (two fewer registers per
// row, which the wide kernel at head dim 128 does not have), else 64.
template <int KEYS> struct NaSlotWord { using T = unsigned long long; };
template <> struct NaSlotWord<32> { using T = unsigned int; };

// Bits [lo, hi) of a word W (none when hi <= lo); 0 <= lo, hi <= the width of W.
template <typename W>
__device__ __forceinline__ W na_bit_run(int lo, int hi) {
    constexpr int BITS = 8 * sizeof(W);
    return hi > lo ? (~W(0) >> (BITS - (hi - lo))) << lo : W(0);
}

// The slots first, first + 1, ... of the key tile at `klo` that the query of `row` sees, as the
// bits of a word W (bit i: slot first + i; `first` a multiple of W's width). An axis whose period
// fits in W repeats whole in it (whatever `first`); the one period wider than W (the outermost
// axis of a 64-slot tile in a 32-bit word) is cut to the word's part of it.
template <typename W>
__device__ __forceinline__ W na_seen_slots(const NaQuerySlot& row, const NaBox& kbox,
                                           const int* klo,
                                           const unsigned long long* period_ones, int first) {
    constexpr int BITS = 8 * sizeof(W);
    W seen = ~W(0);
#pragma unroll
    for (int a = 0; a < 3; ++a) {
        const int side = kbox.mask[a] + 1, period = side << kbox.shift[a];
        const int off = first & (period - 1);
        const int lo = min(max(row.lo[a] - klo[a], 0), side) << kbox.shift[a];
        const int hi = min(max(row.hi[a] - klo[a], 0), side) << kbox.shift[a];
        seen &= na_bit_run<W>(min(max(lo - off, 0), BITS), min(max(hi - off, 0), BITS)) *
                W(period_ones[a]);
    }
    return seen;
}

// The group coordinates of slot j of the key tile at `klo`.
__device__ __forceinline__ void na_slot_coords(const NaBox& kbox, const int* klo, int j, int* kc) {
#pragma unroll
    for (int a = 0; a < 3; ++a) kc[a] = klo[a] + ((j >> kbox.shift[a]) & kbox.mask[a]);
}

// The bias table entry of a query row (its part, `row_rpb`) and the key at coordinates kc.
__device__ __forceinline__ int na_rpb_index(int row_rpb, const int* kc, const int* rmul) {
    int idx = row_rpb;
#pragma unroll
    for (int a = 0; a < 3; ++a) idx += kc[a] * rmul[a];
    return idx;
}

// Logits in log2 units: x = s * scale * log2(e) (softcap: cap * tanh(s * scale / cap) * log2(e)),
// plus the positional bias, -inf where the mask hides the key (MASKED tiles only). Columns are the
// key tile's slots, whose group coordinates are (j >> shift) & mask past `klo`.
//
// BITS (the 64-query kernels): one pass per step over the thread's elements, each behind one
// uniform branch (a test per element would put a branch around every element of a plain tile),
// the mask as the rows' bits (`na_seen_slots`). Otherwise (the wide kernel, whose 32-row warps at
// head dim 128 have no register left for the passes: they spill) one fused pass testing each
// slot's coordinates against the row's window.
template <int NT, bool MASKED, bool BITS = true>
__device__ __forceinline__ void na_forward_logits(float (&s)[NT][4], const NaQuerySlot* slots,
                                                  const NaBox& kbox, const int* klo,
                                                  float scale, float cap, float inv_cap,
                                                  const float* rpb, const int* rmul,
                                                  const unsigned long long* period_ones,
                                                  int first = 0) {
    const int t = threadIdx.x & 3;
    if constexpr (!BITS) {
        const float scale_log2 = scale * NA_LOG2E;
        NaQuerySlot rows[2];
        if (MASKED || rpb != nullptr) {
            rows[0] = slots[0];
            rows[1] = slots[8];
        }
#pragma unroll
        for (int n = 0; n < NT; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = e >> 1, j = first + n * 8 + 2 * t + (e & 1);
                float x = cap > 0.f ? cap * NA_LOG2E * tanhf(s[n][e] * scale * inv_cap)
                                    : s[n][e] * scale_log2;
                int kc[3];
                na_slot_coords(kbox, klo, j, kc);
                bool seen = true;
                if (MASKED) {
#pragma unroll
                    for (int a = 0; a < 3; ++a)
                        seen &= kc[a] >= rows[r].lo[a] && kc[a] < rows[r].hi[a];
                }
                if (!seen) {
                    x = -NA_INF;
                } else if (rpb != nullptr && rows[r].tok >= 0) {  // a clipped row: no bias entry
                    x += rpb[na_rpb_index(rows[r].rpb, kc, rmul)] * NA_LOG2E;
                }
                s[n][e] = x;
            }
        }
        return;
    }
    if (cap > 0.f) {
        const float outer = cap * NA_LOG2E, inner = scale * inv_cap;
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[n][e] = outer * tanhf(s[n][e] * inner);
    } else {
        const float scale_log2 = scale * NA_LOG2E;
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[n][e] *= scale_log2;
    }
    // Row by row, so that one row's bits are live at a time; the bias pass, off the plain path,
    // builds them again.
    using W = typename NaSlotWord<NT * 8>::T;
    if (MASKED) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const W seen = na_seen_slots<W>(slots[8 * r], kbox, klo, period_ones, first) >> (2 * t);
#pragma unroll
            for (int n = 0; n < NT; ++n)
#pragma unroll
                for (int c = 0; c < 2; ++c)
                    if (!((seen >> (n * 8 + c)) & 1u)) s[n][2 * r + c] = -NA_INF;
        }
    }
    if (rpb == nullptr) return;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const NaQuerySlot& row = slots[8 * r];
        if (row.tok < 0) continue;  // a clipped row has no bias entry
        const W seen = MASKED ? na_seen_slots<W>(row, kbox, klo, period_ones, first) >> (2 * t)
                              : ~W(0);
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                if (!((seen >> (n * 8 + c)) & 1u)) continue;
                int kc[3];
                na_slot_coords(kbox, klo, first + n * 8 + 2 * t + c, kc);
                s[n][2 * r + c] += rpb[na_rpb_index(row.rpb, kc, rmul)] * NA_LOG2E;
            }
    }
}

// Online softmax over one key tile, in log2 units: the logits are s * mul (mul > 0: 1 when s is
// already in log2 units, scale * log2(e) when the tile's raw scores come straight from the mma,
// so that each takes one FMA before ex2). s becomes P (unnormalised), the running max m (log2
// units), the thread's partial row sums l and the output accumulator o are rescaled.
template <int NT, int HD>
__device__ __forceinline__ void na_online_softmax_log2(float (&s)[NT][4], float (&m)[2],
                                                       float (&l)[2], float (&o)[HD / 8][4],
                                                       float mul) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float mx = -NA_INF;
#pragma unroll
        for (int n = 0; n < NT; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(NA_FULL, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(NA_FULL, mx, 2));
        mx = fmaxf(m[r], mx * mul);
        // A row that has seen nothing yet keeps shift 0: ex2(-inf - 0) = 0, never NaN.
        const float shift = mx == -NA_INF ? 0.f : mx;
        const float alpha = na_ex2(m[r] - shift);
        float sum = 0.f;
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            s[n][2 * r] = na_ex2(fmaf(s[n][2 * r], mul, -shift));
            s[n][2 * r + 1] = na_ex2(fmaf(s[n][2 * r + 1], mul, -shift));
            sum += s[n][2 * r] + s[n][2 * r + 1];
        }
        l[r] = l[r] * alpha + sum;
        m[r] = mx;
#pragma unroll
        for (int n = 0; n < HD / 8; ++n) {
            o[n][2 * r] *= alpha;
            o[n][2 * r + 1] *= alpha;
        }
    }
}

// One key tile's place in the walk: its first slot per axis, and whether every query of the block
// sees all of it (then the mask is skipped). Windows are monotone in the query, so the box's last
// query's window start and its first query's window end bound what every query sees.
__device__ __forceinline__ bool na_key_tile(const NaForwardGeo& geo, const int* kidx,
                                            const int* kside, int* klo) {
    bool whole = true;
#pragma unroll
    for (int a = 0; a < 3; ++a) {
        klo[a] = geo.lo[a] + kidx[a] * kside[a];
        whole &= klo[a] + kside[a] <= geo.hi[a] && geo.last_lo[a] <= klo[a] &&
                 klo[a] + kside[a] <= geo.first_hi[a];
    }
    return whole;
}

// The ring of K/V stages the query-major kernels stream key tiles through, KSTEP keys (a whole
// 64-slot tile, or a part of one) per step: step `it` lives in stage it % STAGES (its K rows,
// then its V rows). Steps are copied in walk order (an odometer over the tiles, the part inside
// a tile), so `issue` is called once per step, in order; every call commits one cp.async group,
// empty past the last step, which keeps the group count of a wait a constant.
// SWIZZLE: the stages in wgmma's swizzled layout (`na_staged_offset`), 1024-byte aligned.
template <typename T, int HD, int KSTEP = NA_TILE, int NSTAGES = NaForwardStages<HD>::N,
          bool SWIZZLE = false>
struct NaKeyRing {
    static constexpr int LD = SWIZZLE ? HD : HD + 8, STAGES = NSTAGES, STAGE = 2 * KSTEP * LD;
    static constexpr int PARTS = NA_TILE / KSTEP;  // steps per key tile
    T* smem;
    const T* k;
    const T* v;
    long long k_st, v_st;
    int d_qk, d_v, vec, nsteps;
    int idx[3], part;

    __device__ __forceinline__ const T* keys(int it) const { return smem + (it % STAGES) * STAGE; }
    __device__ __forceinline__ const T* values(int it) const { return keys(it) + KSTEP * LD; }

    __device__ __forceinline__ void issue(int it, const NaForwardGeo& geo, const NaBox& kbox,
                                          const int* kside) {
        if (it < nsteps) {
            int klo[3];
            na_key_tile(geo, idx, kside, klo);
            T* stage = smem + (it % STAGES) * STAGE;
            na_copy_box<T, HD, KSTEP, NA_THREADS, SWIZZLE>(stage, k, k_st, d_qk,
                                                           stage + KSTEP * LD, v, v_st, d_v,
                                                           geo.ktok, kbox, klo, geo.hi, vec,
                                                           part * KSTEP);
            if (++part == PARTS) {
                part = 0;
                na_odometer_step(idx, geo.tiles);
            }
        }
        na_cp_async_commit();
    }
};

// Threads 0..ROWS-1 write the block's ROWS query slots (windows, bias index bases, tokens); the
// caller's next barrier publishes them.
template <int ROWS = NA_TILE>
__device__ __forceinline__ void na_publish_query_slots(NaQuerySlot* s_slot, const NaAxis* ax,
                                                       const NaForwardGeo& geo, const NaBox& qbox,
                                                       const int* rmul) {
    const int r = threadIdx.x;
    if (r >= ROWS) return;
    NaQuerySlot slot;
    slot.tok = na_slot_token(geo.qtok, qbox, geo.own_lo, geo.own_hi, r);
    slot.rpb = 0;
#pragma unroll
    for (int a = 0; a < 3; ++a) {
        const int c = geo.own_lo[a] + ((r >> qbox.shift[a]) & qbox.mask[a]);
        slot.lo[a] = slot.hi[a] = 0;
        if (slot.tok >= 0) na_group_window(ax[a], c, geo.glen_q[a], &slot.lo[a], &slot.hi[a]);
        slot.rpb += (geo.kern[a] - 1 - c) * rmul[a];
    }
    s_slot[r] = slot;
}

// Thread 0 writes the bias table's multipliers and head `h`'s table (null without a bias) for
// the tiles that add the bias; the caller's next barrier publishes them.
__device__ __forceinline__ void na_publish_bias(int* s_rmul, const float** s_bias,
                                                const int* rmul, const float* rpb, int h,
                                                const int* kern) {
    if (threadIdx.x != 0) return;
#pragma unroll
    for (int a = 0; a < 3; ++a) s_rmul[a] = rmul[a];
    *s_bias = rpb ? rpb + (long long)h * ((2 * kern[0] - 1) * (2 * kern[1] - 1) *
                                          (2 * kern[2] - 1))
                  : nullptr;
}

// The warp's 16 rows of A fragments (Q or dO) from shared memory, for the whole head dim.
template <typename T, int HD>
__device__ __forceinline__ void na_load_a_fragments(unsigned int (&f)[HD / 16][4], const T* rows) {
    constexpr int LD = HD + 8;
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk)
        na_ldsm_x4(f[kk], rows + (lane % 16) * LD + kk * 16 + (lane / 16) * 8);
}

// Store the thread's fragment rows (tokens tok[0], tok[1]; < 0 skipped) times mul[r], columns
// past d dropped; two columns per 32-bit store where `vec` says the rows are aligned.
template <typename T, int HD>
__device__ __forceinline__ void na_store_fragment_rows(T* base, long long stride,
                                                       const float (&acc)[HD / 8][4],
                                                       const int* tok, const float* mul, int d,
                                                       int vec) {
    const int t = threadIdx.x & 3;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        if (tok[r] < 0) continue;
        T* out = base + tok[r] * stride;
#pragma unroll
        for (int n = 0; n < HD / 8; ++n) {
            const int c = n * 8 + 2 * t;
            const float x0 = acc[n][2 * r] * mul[r], x1 = acc[n][2 * r + 1] * mul[r];
            if (vec && c + 1 < d) {
                *reinterpret_cast<unsigned int*>(out + c) = na_pack2(x0, x1, T());
            } else {
                if (c < d) out[c] = NaConvert<T>::from(x0);
                if (c + 1 < d) out[c + 1] = NaConvert<T>::from(x1);
            }
        }
    }
}

#define NA_QUERY_MAJOR_SETUP(Ring, WARP_ROWS)                                                 \
    const int qside[3] = {qt0, qt1, qt2}, kside[3] = {kt0, kt1, kt2};                          \
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, row0 = warp * (WARP_ROWS);     \
    const int b = blockIdx.z, h = blockIdx.y, hk = h / (heads_q / heads_kv);                   \
    NaAxis ax[3];                                                                              \
    na_load_axes(table, ax);                                                                   \
    NaForwardGeo geo;                                                                          \
    na_forward_geometry(ax, qside, kside, geo);                                                \
    const NaBox qbox = na_make_box(qside), kbox = na_make_box(kside);                          \
    __shared__ unsigned long long s_period_ones[3];                                            \
    na_publish_key_periods(s_period_ones, kbox);                                               \
    int rmul[3];                                                                               \
    na_rpb_multipliers(geo.kern, rmul);                                                        \
    const float inv_cap = softcap > 0.f ? __frcp_rn(softcap) : 0.f;                            \
    Ring ring = {nullptr, k + b * k_sb + hk * k_sh, v + b * v_sb + hk * v_sh, k_st, v_st, d_qk,   \
                 d_v, vec, geo.tiles[0] * geo.tiles[1] * geo.tiles[2] * Ring::PARTS, {0, 0, 0}, \
                 0};                                                                            \
    int kidx[3] = {0, 0, 0};

// Bytes from `smem` to the next 1024-byte boundary of the shared window (the swizzled layout's
// atoms must start there).
__device__ __forceinline__ unsigned int na_align1024(const void* smem) {
    return (1024u - (unsigned int)__cvta_generic_to_shared(smem) % 1024u) % 1024u;
}

#if NA_WGMMA
// ---------------------------------------------------------------------------------------------
// Hopper warpgroup MMA (sm_90a, `fused_hopper`): the kernels' products as wgmma.mma_async. The 4
// warps are one warpgroup; an m64 product gives warp w rows 16w..16w+15 of its 64, in the
// mma.sync C layout (so the softmax, the mask and P's conversion to A fragments are the same
// code). The 64-query forward and dQ are one m64 product with Q in the warps' A fragments (as
// their mma.sync paths hold it); the wide forward's 128 queries are two m64 halves read from
// shared memory, warp w holding rows 16w + g and 64 + 16w + g; dK/dV's 64 keys are one m64
// product read from shared memory. B operands are read through descriptors of the
// 128-byte-swizzled layout (`na_staged_offset`): K-major when their rows are the product's
// columns (K in S = Q K^T), MN-major (imm-trans-b) when they are its k dimension (V in P V); P
// and dS come from the accumulator registers.
// ---------------------------------------------------------------------------------------------

// The instruction's type suffix (NVRTC has no <type_traits>).
template <typename T> struct NaIsBf16 { static constexpr bool value = false; };
template <> struct NaIsBf16<na_bf16> { static constexpr bool value = true; };

// A shared-memory matrix descriptor: start address, leading and stride byte offsets (>> 4), the
// 128-byte swizzle (layout type 1, bits 62-63).
__device__ __forceinline__ unsigned long long na_wg_desc(const void* smem, int lead_bytes,
                                                         int stride_bytes) {
    const unsigned int a = (unsigned int)__cvta_generic_to_shared(smem);
    return (unsigned long long)((a & 0x3ffffu) >> 4) |
           ((unsigned long long)(lead_bytes >> 4) << 16) |
           ((unsigned long long)(stride_bytes >> 4) << 32) | (1ull << 62);
}
// The descriptor of the operand `elements` 16-bit elements further on (a multiple of 8: the start
// address field counts 16-byte units; constant offsets then cost one add, not a new descriptor).
__device__ __forceinline__ unsigned long long na_wg_at(unsigned long long desc, int elements) {
    return desc + (unsigned long long)(elements / 8);
}
__device__ __forceinline__ void na_wg_fence() {
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void na_wg_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void na_wg_wait_all() {
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
}
// cp.async writes through the generic proxy; wgmma reads through the async proxy.
__device__ __forceinline__ void na_fence_async_smem() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// One wgmma.mma_async per accumulator shape and type: the accumulators d[NT][4] (mma.sync's C
// layout, n-tile by n-tile) are the first N/2 operands, numbered in REGS; `accumulate` becomes
// the scale-d predicate. SS: A and B K-major in shared memory (descriptors a, b). RS: A from
// the warps' fragment registers, B in shared memory, MN-major when TRANS_B.
#define NA_WG_D(i) "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])
#define NA_WG_D2 NA_WG_D(0), NA_WG_D(1)
#define NA_WG_D4 NA_WG_D2, NA_WG_D(2), NA_WG_D(3)
#define NA_WG_D8 NA_WG_D4, NA_WG_D(4), NA_WG_D(5), NA_WG_D(6), NA_WG_D(7)
#define NA_WG_D16 NA_WG_D8, NA_WG_D(8), NA_WG_D(9), NA_WG_D(10), NA_WG_D(11), NA_WG_D(12),     \
                  NA_WG_D(13), NA_WG_D(14), NA_WG_D(15)
#define NA_WG_R8 "%0, %1, %2, %3, %4, %5, %6, %7"
#define NA_WG_R16 NA_WG_R8 ", %8, %9, %10, %11, %12, %13, %14, %15"
#define NA_WG_R32                                                                              \
    NA_WG_R16 ", %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define NA_WG_R64                                                                              \
    NA_WG_R32 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, "  \
              "%47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, "    \
              "%62, %63"
// The accumulator operands come last (a comma-separated list).
#define NA_WGMMA_SS(SHAPE, TYPE, REGS, A, B, ACC, ...)                                         \
    asm volatile("{ .reg .pred p; setp.ne.b32 p, " ACC ", 0; "                                 \
                 "wgmma.mma_async.sync.aligned." SHAPE ".f32." TYPE "." TYPE " "               \
                 "{" REGS "}, " A ", " B ", p, 1, 1, 0, 0; }"                                   \
                 : __VA_ARGS__ : "l"(a), "l"(b), "r"(accumulate))
#define NA_WGMMA_RS(SHAPE, TYPE, REGS, A0, B, ACC, TRANS, ...)                                 \
    asm volatile("{ .reg .pred p; setp.ne.b32 p, " ACC ", 0; "                                 \
                 "wgmma.mma_async.sync.aligned." SHAPE ".f32." TYPE "." TYPE " "               \
                 "{" REGS "}, " A0 ", " B ", p, 1, 1, " TRANS "; }"                              \
                 : __VA_ARGS__                                                                 \
                 : "r"(frag[0]), "r"(frag[1]), "r"(frag[2]), "r"(frag[3]), "l"(b),            \
                   "r"(accumulate), "n"(TRANS_B))
// The instruction for T's type suffix.
#define NA_WG_TYPED(MACRO, SHAPE, ...)                                                         \
    do {                                                                                       \
        if constexpr (NaIsBf16<T>::value)                                                      \
            MACRO(SHAPE, "bf16", __VA_ARGS__);                                                 \
        else                                                                                   \
            MACRO(SHAPE, "f16", __VA_ARGS__);                                                  \
    } while (0)

// d[64 x NT*8] (+)= A[64 x 16] B[16 x NT*8], A and B K-major in shared memory; `accumulate` 0
// overwrites d.
template <typename T, int NT>
__device__ __forceinline__ void na_wgmma_ss(float (&d)[NT][4], unsigned long long a,
                                            unsigned long long b, int accumulate) {
    if constexpr (NT == 2)
        NA_WG_TYPED(NA_WGMMA_SS, "m64n16k16", NA_WG_R8, "%8", "%9", "%10", NA_WG_D2);
    else if constexpr (NT == 4)
        NA_WG_TYPED(NA_WGMMA_SS, "m64n32k16", NA_WG_R16, "%16", "%17", "%18", NA_WG_D4);
    else if constexpr (NT == 8)
        NA_WG_TYPED(NA_WGMMA_SS, "m64n64k16", NA_WG_R32, "%32", "%33", "%34", NA_WG_D8);
    else
        static_assert(NT == 0, "no wgmma shape for this accumulator");
}

// d[64 x NT*8] (+)= A[64 x 16] B[16 x NT*8], A from the warps' fragment registers (mma.sync's A
// layout), B in shared memory: K-major, or MN-major with TRANS_B; `accumulate` 0 overwrites d.
template <typename T, int NT, int TRANS_B>
__device__ __forceinline__ void na_wgmma_rs(float (&d)[NT][4], const unsigned int (&frag)[4],
                                            unsigned long long b, int accumulate) {
    if constexpr (NT == 8)
        NA_WG_TYPED(NA_WGMMA_RS, "m64n64k16", NA_WG_R32, "{%32, %33, %34, %35}", "%36", "%37",
                    "%38", NA_WG_D8);
    else if constexpr (NT == 16)
        NA_WG_TYPED(NA_WGMMA_RS, "m64n128k16", NA_WG_R64, "{%64, %65, %66, %67}", "%68", "%69",
                    "%70", NA_WG_D16);
    else
        static_assert(NT == 0, "no wgmma shape for this accumulator");
}

// s[mt] = Q K^T for MT m64 products: Q (ROWS rows) and the step's K (NT * 8 rows) swizzled in
// shared memory, one k-step of 16 head-dim columns per wgmma (32 bytes into the 128-byte rows).
template <typename T, int HD, int NT, int ROWS, int MT>
__device__ __forceinline__ void na_qk_wgmma(float (&s)[MT][NT][4], const T* Q, const T* K) {
    constexpr int KEYS = NT * 8;
    const unsigned long long qd = na_wg_desc(Q, 16, 1024), kd = na_wg_desc(K, 16, 1024);
    na_wg_fence();  // s was last written by the softmax
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk)
            na_wgmma_ss<T, NT>(s[mt],
                               na_wg_at(qd, (kk / 4) * ROWS * 64 + mt * 64 * 64 + (kk % 4) * 16),
                               na_wg_at(kd, (kk / 4) * KEYS * 64 + (kk % 4) * 16), kk > 0);
    na_wg_commit();
    na_wg_wait_all();
}

// s = Q K^T for the 64-query kernel's one m64 product: Q from the warps' fragment registers, the
// step's K (NT * 8 keys) swizzled in shared memory.
template <typename T, int HD, int NT>
__device__ __forceinline__ void na_qk_wgmma_regs(float (&s)[NT][4],
                                                 const unsigned int (&qf)[HD / 16][4],
                                                 const T* K) {
    const unsigned long long kd = na_wg_desc(K, 16, 1024);
    na_wg_fence();  // s was last written by the softmax
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk)
        na_wgmma_rs<T, NT, 0>(s, qf[kk], na_wg_at(kd, (kk / 4) * NT * 8 * 64 + (kk % 4) * 16),
                              kk > 0);
    na_wg_commit();
    na_wg_wait_all();
}

// o[mt] += P[mt] V for MT m64 products: P packed to A fragments first (they must stay intact
// until the wait), V's 16-key slices MN-major (stride between 8-key groups 1024 bytes, between
// 64-column blocks KEYS * 128).
template <typename T, int HD, int NT, int MT>
__device__ __forceinline__ void na_pv_wgmma(float (&o)[MT][HD / 8][4], const float (&p)[MT][NT][4],
                                            const T* V) {
    constexpr int KEYS = NT * 8;
    unsigned int a[MT][NT / 2][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < NT / 2; ++j) {
            a[mt][j][0] = na_pack2(p[mt][2 * j][0], p[mt][2 * j][1], T());
            a[mt][j][1] = na_pack2(p[mt][2 * j][2], p[mt][2 * j][3], T());
            a[mt][j][2] = na_pack2(p[mt][2 * j + 1][0], p[mt][2 * j + 1][1], T());
            a[mt][j][3] = na_pack2(p[mt][2 * j + 1][2], p[mt][2 * j + 1][3], T());
        }
    const unsigned long long vd = na_wg_desc(V, KEYS * 128, 1024);
    na_wg_fence();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < NT / 2; ++j)
            na_wgmma_rs<T, HD / 8, 1>(o[mt], a[mt][j], na_wg_at(vd, j * 16 * 64), 1);
    na_wg_commit();
    na_wg_wait_all();
}

// The operand layouts above checked on the device, with one tile of each product the kernels
// run through them (`wgmma_probe.py`; the host emulation runs the same): S = Q K^T for 128
// queries with both operands swizzled (na_qk_wgmma's two m64 halves, as the wide forward), S =
// Q K^T for the first 64 queries with Q in A fragments (na_qk_wgmma_regs; NT = 8, its only
// shape) and O = P V for 128 queries with V MN-major (na_pv_wgmma). Inputs row-major in global
// memory: q [128][HD], k and v [NT * 8][HD], p [128][NT * 8] (fp32, in the accumulator layout
// the softmax leaves); outputs row-major fp32. Staged by cp.async as the kernels' rings stage.
// One block of NA_THREADS, dynamic shared memory `wgmma_probe.smem_bytes`.
template <int COLS>
__device__ __forceinline__ void na_probe_store(float* out, const float (&acc)[COLS][4], int row) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int n = 0; n < COLS; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            out[(row + g + 8 * (e >> 1)) * (COLS * 8) + n * 8 + 2 * t + (e & 1)] = acc[n][e];
}

template <typename T, int HD, int NT>
__global__ void __launch_bounds__(NA_THREADS, 1)
na_wgmma_probe(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
               const float* __restrict__ p, float* __restrict__ s_ss, float* __restrict__ s_rs,
               float* __restrict__ o_pv) {
    constexpr int KEYS = NT * 8, ROWS = 2 * 64, LD = HD + 8, PIECES = HD / 8;
    extern __shared__ __align__(16) unsigned char na_smem[];
    T* sQ = reinterpret_cast<T*>(na_smem + na_align1024(na_smem));
    T* sK = sQ + ROWS * HD;  // whole kilobytes: every operand starts on an atom
    T* sV = sK + KEYS * HD;
    T* sQrows = sV + KEYS * HD;  // the first 64 queries in padded rows, for ldmatrix
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    for (int i = threadIdx.x; i < ROWS * PIECES; i += NA_THREADS) {
        const int r = i / PIECES, c = (i % PIECES) * 8;
        na_cp_async16(sQ + na_staged_offset<HD, ROWS, true>(r, c), q + r * HD + c);
        if (r < 64) na_cp_async16(sQrows + r * LD + c, q + r * HD + c);
    }
    for (int i = threadIdx.x; i < KEYS * PIECES; i += NA_THREADS) {
        const int r = i / PIECES, c = (i % PIECES) * 8;
        na_cp_async16(sK + na_staged_offset<HD, KEYS, true>(r, c), k + r * HD + c);
        na_cp_async16(sV + na_staged_offset<HD, KEYS, true>(r, c), v + r * HD + c);
    }
    na_cp_async_commit();
    na_cp_async_wait_all();
    na_fence_async_smem();
    __syncthreads();

    float s[2][NT][4];
    na_qk_wgmma<T, HD, NT, ROWS, 2>(s, sQ, sK);
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) na_probe_store<NT>(s_ss, s[mt], 64 * mt + 16 * warp);
    if constexpr (NT == 8) {
        unsigned int qf[HD / 16][4];
        na_load_a_fragments<T, HD>(qf, sQrows + 16 * warp * LD);
        float s1[NT][4];
        na_qk_wgmma_regs<T, HD, NT>(s1, qf, sK);
        na_probe_store<NT>(s_rs, s1, 16 * warp);
    }
    float pr[2][NT][4], o[2][HD / 8][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
        na_zero(o[mt]);
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                pr[mt][n][e] = p[(64 * mt + 16 * warp + g + 8 * (e >> 1)) * KEYS + n * 8 + 2 * t +
                                 (e & 1)];
    }
    na_pv_wgmma<T, HD, NT, 2>(o, pr, sV);
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) na_probe_store<HD / 8>(o_pv, o[mt], 64 * mt + 16 * warp);
}
#endif  // NA_WGMMA

// s = Q K^T for the 64-query kernels' warp rows, Q in the warps' A fragments: on wgmma (WG) or
// on mma.sync.
template <typename T, int HD, int NT, bool WG>
__device__ __forceinline__ void na_qk_rows(float (&s)[NT][4], const unsigned int (&qf)[HD / 16][4],
                                           const T* K) {
    static_assert(!WG || NA_WGMMA, "the wgmma kernels are the NA_WGMMA build's");
#if NA_WGMMA
    if constexpr (WG) {
        na_qk_wgmma_regs<T, HD, NT>(s, qf, K);
        return;
    }
#endif
    if constexpr (!WG) na_qk<T, HD, NT>(s, qf, K);
}

// WG (`fused_hopper`, sm_90a): both products on wgmma, K and V swizzled in the ring (Q keeps its
// padded rows: only ldmatrix reads them, into the A fragments).
template <typename T, int HD, bool WG = false>
__global__ void __launch_bounds__(NA_THREADS, NaForwardStages<HD>::MIN_BLOCKS)
na_fused_forward(NA_FORWARD_PARAMS) {
    constexpr int LD = HD + 8, NT = NA_TILE / 8, STAGES = NaForwardStages<HD>::N;
    using Ring = NaKeyRing<T, HD, NA_TILE, STAGES, WG>;
    NA_QUERY_MAJOR_SETUP(Ring, 16)
    // Shared memory: the Q tile, the ring, the query slots. The ring's swizzled atoms are
    // 1024-byte aligned (the launch asks for 1024 bytes more; Q's rows are whole kilobytes).
    extern __shared__ __align__(16) unsigned char na_smem[];
    T* sQ = reinterpret_cast<T*>(na_smem + (WG ? na_align1024(na_smem) : 0));
    ring.smem = sQ + NA_TILE * LD;
    NaQuerySlot* s_slot = reinterpret_cast<NaQuerySlot*>(ring.smem + STAGES * ring.STAGE);

    // Q joins the first tile's cp.async group; the ring is primed with STAGES - 1 tiles.
    na_copy_box<T, HD, NA_TILE, NA_THREADS>(sQ, q + b * q_sb + h * q_sh, q_st, d_qk, nullptr,
                                            nullptr, 0, 0, geo.qtok, qbox, geo.own_lo,
                                            geo.own_hi, vec);
#pragma unroll
    for (int it = 0; it < STAGES - 1; ++it) ring.issue(it, geo, kbox, kside);
    na_publish_query_slots(s_slot, ax, geo, qbox, rmul);
    const NaQuerySlot* my_slots = s_slot + row0 + (lane >> 2);  // rows g and g + 8
    // The bias table's multipliers and this head's table wait in shared memory (only tiles that
    // add the bias read them; registers are for the accumulators).
    __shared__ int s_rmul[3];
    __shared__ const float* s_bias;
    na_publish_bias(s_rmul, &s_bias, rmul, rpb, h, geo.kern);

    // Whole tiles of a plain call (positive scale, no softcap, no bias) fold the scale into the
    // softmax's FMA (the row max of the raw scores is the max of the logits only when scale > 0).
    const bool fold = scale > 0.f && softcap <= 0.f && rpb == nullptr;
    // Q's A fragments, read at it == 0 and carried through the loop. Defined before it: left
    // undefined on the loop's entry path, ptxas (12.9 and 13.0, sm_90a, head dim 64) kept the
    // wgmma A registers alive for one iteration only and reused them for P and the mask, so
    // every later key step multiplied garbage by K.
    unsigned int qf[HD / 16][4] = {};
    float acc[HD / 8][4], m[2] = {-NA_INF, -NA_INF}, l[2] = {0.f, 0.f};
    na_zero(acc);
    for (int it = 0; it < ring.nsteps; ++it) {
        na_cp_async_wait_n<STAGES - 2>();  // this thread's copies of tile it (and Q) landed
#if NA_WGMMA
        if constexpr (WG) na_fence_async_smem();  // ... and are visible to wgmma's reads
#endif
        __syncthreads();  // everyone's; and everyone is done with tile it - 1, whose stage we refill
        ring.issue(it + STAGES - 1, geo, kbox, kside);
        if (it == 0) na_load_a_fragments<T, HD>(qf, sQ + row0 * LD);
        int klo[3];
        const bool whole = na_key_tile(geo, kidx, kside, klo);
        float s[NT][4], mul = 1.f;
        na_qk_rows<T, HD, NT, WG>(s, qf, ring.keys(it));
        if (!whole)
            na_forward_logits<NT, true>(s, my_slots, kbox, klo, scale, softcap, inv_cap,
                                        rpb ? s_bias : nullptr, s_rmul, s_period_ones);
        else if (fold)
            mul = scale * NA_LOG2E;  // nothing to add or hide: the softmax takes the raw scores
        else
            na_forward_logits<NT, false>(s, my_slots, kbox, klo, scale, softcap, inv_cap,
                                         rpb ? s_bias : nullptr, s_rmul, s_period_ones);
        na_online_softmax_log2<NT, HD>(s, m, l, acc, mul);
#if NA_WGMMA
        if constexpr (WG)
            na_pv_wgmma<T, HD, NT, 1>(reinterpret_cast<float(&)[1][HD / 8][4]>(acc),
                                      reinterpret_cast<const float(&)[1][NT][4]>(s),
                                      ring.values(it));
        else
#endif
            na_pv<T, HD, NT>(acc, s, ring.values(it));
        na_odometer_step(kidx, geo.tiles);
    }
    na_cp_async_wait_all();
    __syncthreads();  // the query slots are published even when no key tile was visited

    float inv[2];
    int tok[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(NA_FULL, l[r], 1);
        l[r] += __shfl_xor_sync(NA_FULL, l[r], 2);
        inv[r] = l[r] > 0.f ? __frcp_rn(l[r]) : 0.f;
        tok[r] = my_slots[8 * r].tok;
        if ((lane & 3) == 0 && tok[r] >= 0)
            lse[b * l_sb + tok[r] * l_st + h * l_sh] =
                l[r] > 0.f ? (m[r] + log2f(l[r])) * NA_LN2 : -NA_INF;
    }
    na_store_fragment_rows<T, HD>(o + b * o_sb + h * o_sh, o_st, acc, tok, inv, d_v, vec);
}

// ---------------------------------------------------------------------------------------------
// The wide forward, sm_80+ build: 128-query boxes, each of the 4 warps owning 32 rows (two m16
// tiles), so every K and V fragment loaded from shared memory feeds two mma and every key step
// serves twice the queries of the 64-query kernel. Keys stream in steps of KSTEP (a whole 64-slot
// tile, or half of one at head dim 128, whose two 32-row accumulators leave no registers for
// more); Q stays in registers up to head dim 64 and is read from shared memory at 128.
// ---------------------------------------------------------------------------------------------
#define NA_WIDE_QUERIES 128

template <int HD> struct NaWide {
    static constexpr int KSTEP = HD >= 128 ? 32 : 64;
    static constexpr int STAGES = 3;
    static constexpr bool Q_IN_REGS = HD <= 64;
    // Masked tiles as bits (`na_forward_logits`'s passes) where they fit: at head dim 128 they
    // spill (72 bytes on sm_90), and the per-slot test stays.
    static constexpr bool MASK_BITS = HD <= 64;
};

// s[mt] = Q K^T for the warp's two m16 tiles; each K fragment pair serves both.
template <typename T, int HD, int NT, bool QREG>
__device__ __forceinline__ void na_qk_wide(float (&s)[2][NT][4],
                                           const unsigned int (&qf)[2][QREG ? HD / 16 : 1][4],
                                           const T* Q, const T* K) {
    constexpr int LD = HD + 8;
    const int lane = threadIdx.x & 31;
    // The lane's own row and column of every ldmatrix, once: the loads then differ by constants.
    const T* krow = K + ((lane / 16) * 8 + lane % 8) * LD + ((lane / 8) % 2) * 8;
    na_zero(s[0]);
    na_zero(s[1]);
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
        unsigned int a[2][4];
        if constexpr (QREG) {
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                for (int i = 0; i < 4; ++i) a[mt][i] = qf[mt][kk][i];
        } else {
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
                na_ldsm_x4(a[mt], Q + (16 * mt + lane % 16) * LD + kk * 16 + (lane / 16) * 8);
        }
#pragma unroll
        for (int n = 0; n < NT; n += 2) {
            unsigned int b[4];
            na_ldsm_x4(b, krow + n * 8 * LD + kk * 16);
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
                na_mma16816(s[mt][n], a[mt], b, T());
                na_mma16816(s[mt][n + 1], a[mt], b + 2, T());
            }
        }
    }
}

// o[mt] += P[mt] V for the warp's two m16 tiles; each V fragment pair serves both.
template <typename T, int HD, int NT>
__device__ __forceinline__ void na_pv_wide(float (&o)[2][HD / 8][4], const float (&p)[2][NT][4],
                                           const T* V) {
    constexpr int LD = HD + 8;
    const int lane = threadIdx.x & 31;
    // The lane's own row and column of every ldmatrix, once: the loads then differ by constants.
    const T* vrow = V + (((lane / 8) % 2) * 8 + lane % 8) * LD + (lane / 16) * 8;
#pragma unroll
    for (int j = 0; j < NT / 2; ++j) {
        unsigned int a[2][4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
            a[mt][0] = na_pack2(p[mt][2 * j][0], p[mt][2 * j][1], T());
            a[mt][1] = na_pack2(p[mt][2 * j][2], p[mt][2 * j][3], T());
            a[mt][2] = na_pack2(p[mt][2 * j + 1][0], p[mt][2 * j + 1][1], T());
            a[mt][3] = na_pack2(p[mt][2 * j + 1][2], p[mt][2 * j + 1][3], T());
        }
#pragma unroll
        for (int n = 0; n < HD / 8; n += 2) {
            unsigned int b[4];
            na_ldsm_x4_trans(b, vrow + 16 * j * LD + n * 8);
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
                na_mma16816(o[mt][n], a[mt], b, T());
                na_mma16816(o[mt][n + 1], a[mt], b + 2, T());
            }
        }
    }
}

// s[mt] = A B^T for the wide kernels' two m-tiles (A: the block's 128 rows of Q or dO; B: the
// step's K or V): on wgmma (WG: A swizzled at A) or on mma.sync (A from the fragments af when
// AREG, else from the warp's padded rows at Aw).
template <typename T, int HD, int NT, bool AREG, bool WG>
__device__ __forceinline__ void na_wide_abt(float (&s)[2][NT][4],
                                            const unsigned int (&af)[2][AREG ? HD / 16 : 1][4],
                                            const T* A, const T* Aw, const T* B) {
    static_assert(!WG || NA_WGMMA, "the wgmma kernels are the NA_WGMMA build's");
#if NA_WGMMA
    if constexpr (WG) {
        na_qk_wgmma<T, HD, NT, NA_WIDE_QUERIES, 2>(s, A, B);
        return;
    }
#endif
    if constexpr (!WG) na_qk_wide<T, HD, NT, AREG>(s, af, Aw, B);
}

// WG (`fused_hopper`, sm_90a): both products on wgmma over swizzled operands (NA_WGMMA above);
// warp w's m-tiles are then rows 16w and 64 + 16w rather than 32w and 32w + 16.
template <typename T, int HD, bool WG = false>
__global__ void __launch_bounds__(NA_THREADS, 1)
na_fused_forward_wide(NA_FORWARD_PARAMS) {
    constexpr int KSTEP = NaWide<HD>::KSTEP, NT = KSTEP / 8;
    constexpr int STAGES = NaWide<HD>::STAGES;
    constexpr int LD = WG ? HD : HD + 8, MT_ROWS = WG ? 64 : 16;  // rows between m-tiles
    constexpr bool QREG = !WG && NaWide<HD>::Q_IN_REGS, BITS = NaWide<HD>::MASK_BITS;
    using Ring = NaKeyRing<T, HD, KSTEP, STAGES, WG>;
    NA_QUERY_MAJOR_SETUP(Ring, WG ? 16 : 32)
    // Shared memory: the Q tile, the ring, the query slots. The swizzled layout's atoms are
    // 1024-byte aligned (the launch asks for 1024 bytes more).
    extern __shared__ __align__(16) unsigned char na_smem[];
    T* sQ = reinterpret_cast<T*>(na_smem + (WG ? na_align1024(na_smem) : 0));
    ring.smem = sQ + NA_WIDE_QUERIES * LD;
    NaQuerySlot* s_slot = reinterpret_cast<NaQuerySlot*>(ring.smem + STAGES * Ring::STAGE);

    na_copy_box<T, HD, NA_WIDE_QUERIES, NA_THREADS, WG>(sQ, q + b * q_sb + h * q_sh, q_st, d_qk,
                                                        nullptr, nullptr, 0, 0, geo.qtok, qbox,
                                                        geo.own_lo, geo.own_hi, vec);
#pragma unroll
    for (int it = 0; it < STAGES - 1; ++it) ring.issue(it, geo, kbox, kside);
    na_publish_query_slots<NA_WIDE_QUERIES>(s_slot, ax, geo, qbox, rmul);
    const NaQuerySlot* my_slots = s_slot + row0 + (lane >> 2);  // rows g, g + 8 of each m-tile
    // The bias table's multipliers and this head's table wait in shared memory (only tiles that
    // add the bias read them; registers are for the accumulators).
    __shared__ int s_rmul[3];
    __shared__ const float* s_bias;
    na_publish_bias(s_rmul, &s_bias, rmul, rpb, h, geo.kern);

    const bool fold = scale > 0.f && softcap <= 0.f && rpb == nullptr;
    unsigned int qf[2][QREG ? HD / 16 : 1][4];
    float acc[2][HD / 8][4], m[2][2], l[2][2];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
        na_zero(acc[mt]);
        m[mt][0] = m[mt][1] = -NA_INF;
        l[mt][0] = l[mt][1] = 0.f;
    }
    const T* sQw = sQ + row0 * LD;
    for (int it = 0; it < ring.nsteps; ++it) {
        na_cp_async_wait_n<STAGES - 2>();  // this thread's copies of step it (and Q) landed
#if NA_WGMMA
        if constexpr (WG) na_fence_async_smem();  // ... and are visible to wgmma's reads
#endif
        __syncthreads();  // everyone's; and everyone is done with step it - 1, whose stage we refill
        ring.issue(it + STAGES - 1, geo, kbox, kside);
        if constexpr (QREG) {
            if (it == 0) {
#pragma unroll
                for (int mt = 0; mt < 2; ++mt) na_load_a_fragments<T, HD>(qf[mt], sQw + 16 * mt * LD);
            }
        }
        const int first = (it % Ring::PARTS) * KSTEP;  // the step's first slot of its key tile
        int klo[3];
        const bool whole = na_key_tile(geo, kidx, kside, klo);
        float s[2][NT][4], mul = 1.f;
        na_wide_abt<T, HD, NT, QREG, WG>(s, qf, sQ, sQw, ring.keys(it));
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
            if (!whole)
                na_forward_logits<NT, true, BITS>(s[mt], my_slots + MT_ROWS * mt, kbox, klo,
                                                  scale, softcap, inv_cap,
                                                  rpb ? s_bias : nullptr, s_rmul,
                                                  s_period_ones, first);
            else if (!fold)
                na_forward_logits<NT, false, BITS>(s[mt], my_slots + MT_ROWS * mt, kbox, klo,
                                                   scale, softcap, inv_cap,
                                                   rpb ? s_bias : nullptr, s_rmul,
                                                   s_period_ones, first);
        }
        if (whole && fold) mul = scale * NA_LOG2E;  // the softmax takes the raw scores
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) na_online_softmax_log2<NT, HD>(s[mt], m[mt], l[mt], acc[mt], mul);
#if NA_WGMMA
        if constexpr (WG)
            na_pv_wgmma<T, HD, NT, 2>(acc, s, ring.values(it));
        else
#endif
            na_pv_wide<T, HD, NT>(acc, s, ring.values(it));
        if ((it + 1) % Ring::PARTS == 0) na_odometer_step(kidx, geo.tiles);
    }
    na_cp_async_wait_all();
    __syncthreads();  // the query slots are published even when no key was visited

#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
        float inv[2];
        int tok[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float sum = l[mt][r];
            sum += __shfl_xor_sync(NA_FULL, sum, 1);
            sum += __shfl_xor_sync(NA_FULL, sum, 2);
            inv[r] = sum > 0.f ? __frcp_rn(sum) : 0.f;
            tok[r] = my_slots[MT_ROWS * mt + 8 * r].tok;
            if ((lane & 3) == 0 && tok[r] >= 0)
                lse[b * l_sb + tok[r] * l_st + h * l_sh] =
                    sum > 0.f ? (m[mt][r] + log2f(sum)) * NA_LN2 : -NA_INF;
        }
        na_store_fragment_rows<T, HD>(o + b * o_sb + h * o_sh, o_st, acc[mt], tok, inv, d_v, vec);
    }
}

// dQ's elementwise step on one key step's fragments: s holds the logits in log2 units times
// 1 / mul (-inf where masked), dp = dO V^T; dp becomes dS = P (dP - delta) (* (1 - tanh^2) under
// softcap), P = ex2(s * mul - lse * log2 e). Rows r: the fragment rows g, g + 8.
template <int NT>
__device__ __forceinline__ void na_dq_scores(float (&dp)[NT][4], const float (&s)[NT][4],
                                             float mul, const float* row_lse,
                                             const float* row_delta, float softcap,
                                             float inv_cap) {
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int r = e >> 1;
            const float x = s[n][e];
            float ds = na_ex2(fmaf(x, mul, -row_lse[r])) * (dp[n][e] - row_delta[r]);
            if (softcap > 0.f) {
                const float th = x * (NA_LN2 * inv_cap);  // x = cap * log2(e) * tanh(.)
                ds = x == -NA_INF ? 0.f : ds * (1.f - th * th);
            }
            dp[n][e] = ds;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Backward dQ, sm_80+ build: the forward's walk (same geometry, ring and mask paths). Q is held
// as A fragments, dO stays in shared memory; P = ex2(x - lse * log2 e), dS = P * (dP - delta)
// (* (1 - tanh^2) under softcap), dQ = scale * dS K.
// ---------------------------------------------------------------------------------------------
// WG (`fused_hopper`, sm_90a): the three products on wgmma, K and V swizzled in the ring, dO
// swizzled in its own tile (dP = dO V^T reads it through a descriptor); Q keeps its padded rows
// in the ring's last stage until the warps hold it as A fragments.
template <typename T, int HD, bool WG = false>
__global__ void __launch_bounds__(NA_THREADS, NaForwardStages<HD>::MIN_BLOCKS_DQ)
na_fused_backward_dq(NA_DQ_PARAMS) {
    constexpr int LD = HD + 8, NT = NA_TILE / 8, STAGES = NaForwardStages<HD>::N;
    constexpr int DO_LD = WG ? HD : LD;  // dO's rows: swizzled for wgmma, else padded
    using Ring = NaKeyRing<T, HD, NA_TILE, STAGES, WG>;
    NA_QUERY_MAJOR_SETUP(Ring, 16)
    // Shared memory: the dO tile, the ring, the query slots. Q waits in the ring's last stage
    // until its fragments are read (before that stage's first tile is issued).
    extern __shared__ __align__(16) unsigned char na_smem[];
    T* sDO = reinterpret_cast<T*>(na_smem + (WG ? na_align1024(na_smem) : 0));
    ring.smem = sDO + NA_TILE * DO_LD;
    NaQuerySlot* s_slot = reinterpret_cast<NaQuerySlot*>(ring.smem + STAGES * ring.STAGE);
    T* sQ = ring.smem + (STAGES - 1) * ring.STAGE;

    if constexpr (WG) {  // Q padded (ldmatrix reads it), dO swizzled (wgmma reads it)
        na_copy_box<T, HD, NA_TILE, NA_THREADS>(sQ, q + b * q_sb + h * q_sh, q_st, d_qk, nullptr,
                                                nullptr, 0, 0, geo.qtok, qbox, geo.own_lo,
                                                geo.own_hi, vec);
        na_copy_box<T, HD, NA_TILE, NA_THREADS, true>(sDO, dout + b * do_sb + h * do_sh, do_st,
                                                      d_v, nullptr, nullptr, 0, 0, geo.qtok,
                                                      qbox, geo.own_lo, geo.own_hi, vec);
    } else {
        na_copy_box<T, HD, NA_TILE, NA_THREADS>(sQ, q + b * q_sb + h * q_sh, q_st, d_qk, sDO,
                                                dout + b * do_sb + h * do_sh, do_st, d_v,
                                                geo.qtok, qbox, geo.own_lo, geo.own_hi, vec);
    }
#pragma unroll
    for (int it = 0; it < STAGES - 1; ++it) ring.issue(it, geo, kbox, kside);
    na_publish_query_slots(s_slot, ax, geo, qbox, rmul);
    const NaQuerySlot* my_slots = s_slot + row0 + (lane >> 2);

    // Row statistics in log2 units; a row that saw nothing (lse = -inf) or is clipped gets
    // +inf, so its P is 0.
    int tok[2];
    float row_lse[2], row_delta[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        tok[r] = na_slot_token(geo.qtok, qbox, geo.own_lo, geo.own_hi, row0 + (lane >> 2) + 8 * r);
        const long long at = b * l_sb + (long long)tok[r] * l_st + h * l_sh;
        const float x = tok[r] >= 0 ? lse[at] : NA_INF;
        row_lse[r] = x == -NA_INF ? NA_INF : x * NA_LOG2E;
        row_delta[r] = tok[r] >= 0 ? delta[at] : 0.f;
    }

    unsigned int qf[HD / 16][4] = {};  // defined before the loop: see na_fused_forward
    float acc[HD / 8][4];
    na_zero(acc);
    for (int it = 0; it < ring.nsteps; ++it) {
        na_cp_async_wait_n<STAGES - 2>();
#if NA_WGMMA
        if constexpr (WG) na_fence_async_smem();  // ... and are visible to wgmma's reads
#endif
        __syncthreads();  // tile it (and Q, dO) landed for all; tile it - 1 is done everywhere
        if (it == 0) {
            na_load_a_fragments<T, HD>(qf, sQ + row0 * LD);
            __syncthreads();  // every warp has its Q before the last stage is refilled
        }
        ring.issue(it + STAGES - 1, geo, kbox, kside);
        int klo[3];
        const bool whole = na_key_tile(geo, kidx, kside, klo);
        float s[NT][4], dp[NT][4];
        na_qk_rows<T, HD, NT, WG>(s, qf, ring.keys(it));
        // Whole tiles without softcap keep the raw scores: P takes the scale in its FMA.
        const float mul = whole && softcap <= 0.f ? scale * NA_LOG2E : 1.f;
        if (!whole)
            na_forward_logits<NT, true>(s, my_slots, kbox, klo, scale, softcap, inv_cap,
                                        nullptr, rmul, s_period_ones);
        else if (softcap > 0.f)
            na_forward_logits<NT, false>(s, my_slots, kbox, klo, scale, softcap, inv_cap,
                                         nullptr, rmul, s_period_ones);
#if NA_WGMMA
        if constexpr (WG) {  // dP = dO V^T; dS then dQ += dS K (K MN-major, as V in P V)
            auto& dp1 = reinterpret_cast<float(&)[1][NT][4]>(dp);
            na_qk_wgmma<T, HD, NT, NA_TILE, 1>(dp1, sDO, ring.values(it));
            na_dq_scores<NT>(dp, s, mul, row_lse, row_delta, softcap, inv_cap);
            na_pv_wgmma<T, HD, NT, 1>(reinterpret_cast<float(&)[1][HD / 8][4]>(acc), dp1,
                                      ring.keys(it));
        } else
#endif
        {
            na_zero(dp);
            na_mma_abt<T, HD, NT>(dp, sDO + row0 * LD, ring.values(it), HD);
            na_dq_scores<NT>(dp, s, mul, row_lse, row_delta, softcap, inv_cap);
            na_pv<T, HD, NT>(acc, dp, ring.keys(it));
        }
        na_odometer_step(kidx, geo.tiles);
    }
    na_cp_async_wait_all();
    const float mul[2] = {scale, scale};
    na_store_fragment_rows<T, HD>(dq + b * dq_sb + h * dq_sh, dq_st, acc, tok, mul, d_qk, vec);
}

// ---------------------------------------------------------------------------------------------
// The wide dQ, sm_80+ build (launched on sm_90+): the wide forward's 128-query boxes, each of
// the 4 warps owning 32 rows (two m16 tiles), so every K and V fragment loaded from shared
// memory feeds two mma (S = Q K^T, dP = dO V^T, dQ += dS K). Keys stream through the ring in
// steps of KSTEP: two score-sized fragments (S and dP) per m16 tile are live beside the dQ
// accumulators, so the steps are half the forward's (a quarter at head dim 128, whose Q and dO
// tiles fill shared memory). Q and dO stay in registers where they fit, else are read from
// shared memory at every step. No atomics: each block writes its own query rows.
// ---------------------------------------------------------------------------------------------
template <int HD> struct NaWideDq {
    static constexpr int KSTEP = HD >= 128 ? 16 : 32;  // 64 at head dim 32 spills on sm_90
    static constexpr int STAGES = 3;
    static constexpr bool Q_IN_REGS = HD <= 64;
    static constexpr bool DO_IN_REGS = HD <= 64;
};

// WG (`fused_hopper`, sm_90a): the three products on wgmma (two m64 halves each), Q, dO, K and V
// swizzled in shared memory and read through descriptors; warp w's m-tiles are then rows 16w and
// 64 + 16w, as in the wide forward.
template <typename T, int HD, bool WG = false>
__global__ void __launch_bounds__(NA_THREADS, 1)
na_fused_backward_dq_wide(NA_DQ_PARAMS) {
    constexpr int LD = WG ? HD : HD + 8, KSTEP = NaWideDq<HD>::KSTEP, NT = KSTEP / 8;
    constexpr int STAGES = NaWideDq<HD>::STAGES, MT_ROWS = WG ? 64 : 16;  // rows between m-tiles
    constexpr bool QREG = !WG && NaWideDq<HD>::Q_IN_REGS;
    constexpr bool DOREG = !WG && NaWideDq<HD>::DO_IN_REGS;
    using Ring = NaKeyRing<T, HD, KSTEP, STAGES, WG>;
    NA_QUERY_MAJOR_SETUP(Ring, WG ? 16 : 32)
    // Shared memory: the dO tile, the Q tile, the ring, the query slots. The swizzled layout's
    // atoms are 1024-byte aligned (the launch asks for 1024 bytes more; the tiles are whole KB).
    extern __shared__ __align__(16) unsigned char na_smem[];
    T* sDO = reinterpret_cast<T*>(na_smem + (WG ? na_align1024(na_smem) : 0));
    T* sQ = sDO + NA_WIDE_QUERIES * LD;
    ring.smem = sQ + NA_WIDE_QUERIES * LD;
    NaQuerySlot* s_slot = reinterpret_cast<NaQuerySlot*>(ring.smem + STAGES * Ring::STAGE);

    // Q and dO join the first step's cp.async group; the ring is primed with STAGES - 1 steps.
    na_copy_box<T, HD, NA_WIDE_QUERIES, NA_THREADS, WG>(sQ, q + b * q_sb + h * q_sh, q_st, d_qk,
                                                        sDO, dout + b * do_sb + h * do_sh, do_st,
                                                        d_v, geo.qtok, qbox, geo.own_lo,
                                                        geo.own_hi, vec);
#pragma unroll
    for (int it = 0; it < STAGES - 1; ++it) ring.issue(it, geo, kbox, kside);
    na_publish_query_slots<NA_WIDE_QUERIES>(s_slot, ax, geo, qbox, rmul);
    const NaQuerySlot* my_slots = s_slot + row0 + (lane >> 2);  // rows g, g + 8 of each m-tile

    // Row statistics of the thread's four rows (g, g + 8 of each m16 tile) in log2 units; a row
    // that saw nothing (lse = -inf) or is clipped gets +inf, so its P is 0.
    int tok[2][2];
    float row_lse[2][2], row_delta[2][2];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            tok[mt][r] = na_slot_token(geo.qtok, qbox, geo.own_lo, geo.own_hi,
                                       row0 + MT_ROWS * mt + (lane >> 2) + 8 * r);
            const long long at = b * l_sb + (long long)tok[mt][r] * l_st + h * l_sh;
            const float x = tok[mt][r] >= 0 ? lse[at] : NA_INF;
            row_lse[mt][r] = x == -NA_INF ? NA_INF : x * NA_LOG2E;
            row_delta[mt][r] = tok[mt][r] >= 0 ? delta[at] : 0.f;
        }
    }

    unsigned int qf[2][QREG ? HD / 16 : 1][4], dof[2][DOREG ? HD / 16 : 1][4];
    float acc[2][HD / 8][4];
    na_zero(acc[0]);
    na_zero(acc[1]);
    const T* sQw = sQ + row0 * LD;
    const T* sDOw = sDO + row0 * LD;
    for (int it = 0; it < ring.nsteps; ++it) {
        na_cp_async_wait_n<STAGES - 2>();  // this thread's copies of step it (and Q, dO) landed
#if NA_WGMMA
        if constexpr (WG) na_fence_async_smem();  // ... and are visible to wgmma's reads
#endif
        __syncthreads();  // step it (and Q, dO) landed for all; step it - 1 is done everywhere
        ring.issue(it + STAGES - 1, geo, kbox, kside);
        if (it == 0) {
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
                if constexpr (QREG) na_load_a_fragments<T, HD>(qf[mt], sQw + 16 * mt * LD);
                if constexpr (DOREG) na_load_a_fragments<T, HD>(dof[mt], sDOw + 16 * mt * LD);
            }
        }
        const int first = (it % Ring::PARTS) * KSTEP;  // the step's first slot of its key tile
        int klo[3];
        const bool whole = na_key_tile(geo, kidx, kside, klo);
        float s[2][NT][4], dp[2][NT][4];
        na_wide_abt<T, HD, NT, QREG, WG>(s, qf, sQ, sQw, ring.keys(it));
        // Whole tiles without softcap keep the raw scores: P takes the scale in its FMA.
        const float mul = whole && softcap <= 0.f ? scale * NA_LOG2E : 1.f;
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
            if (!whole)
                na_forward_logits<NT, true, false>(s[mt], my_slots + MT_ROWS * mt, kbox, klo,
                                                   scale, softcap, inv_cap, nullptr, rmul,
                                                   s_period_ones, first);
            else if (softcap > 0.f)
                na_forward_logits<NT, false, false>(s[mt], my_slots + MT_ROWS * mt, kbox, klo,
                                                    scale, softcap, inv_cap, nullptr, rmul,
                                                    s_period_ones, first);
        }
        na_wide_abt<T, HD, NT, DOREG, WG>(dp, dof, sDO, sDOw, ring.values(it));  // dP = dO V^T
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
            na_dq_scores<NT>(dp[mt], s[mt], mul, row_lse[mt], row_delta[mt], softcap, inv_cap);
#if NA_WGMMA
        if constexpr (WG)  // dQ += dS K, K MN-major (as V in P V)
            na_pv_wgmma<T, HD, NT, 2>(acc, dp, ring.keys(it));
        else
#endif
            na_pv_wide<T, HD, NT>(acc, dp, ring.keys(it));
        if ((it + 1) % Ring::PARTS == 0) na_odometer_step(kidx, geo.tiles);
    }
    na_cp_async_wait_all();
    const float mul[2] = {scale, scale};
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
        na_store_fragment_rows<T, HD>(dq + b * dq_sb + h * dq_sh, dq_st, acc[mt], tok[mt], mul,
                                      d_qk, vec);
}
#else
// ---------------------------------------------------------------------------------------------
// Forward: O and LSE (natural log; -inf and O = 0 for a row that sees nothing).
// ---------------------------------------------------------------------------------------------
template <typename T, int HD>
__global__ void
na_fused_forward(NA_FORWARD_PARAMS) {
    constexpr int LD = NaRows<T, HD>::LD, CH = NaChunk<T>::FWD, NT = CH / 8;
    NA_LOAD_SHAPES
    const float inv_cap = softcap > 0.f ? __frcp_rn(softcap) : 0.f;
    const int h = blockIdx.y, hk = h / (heads_q / heads_kv);
    __shared__ NaAxis s_ax[NA_MAX_AXES];
    __shared__ NaGeo geo;
    extern __shared__ __align__(16) unsigned char na_smem[];
    T* sQ = reinterpret_cast<T*>(na_smem);
    T* sK = sQ + NA_TILE * LD;
    T* sV = sK + CH * LD;
    int* s_qtok = reinterpret_cast<int*>(sV + CH * LD);
    int* s_qwin = s_qtok + NA_TILE;
    int* s_qc = s_qwin + NA_TILE * 6;
    int* s_ktok = s_qc + NA_TILE * 3;
    int* s_kc = s_ktok + NA_TILE;

    if (threadIdx.x == 0) na_setup_block(table, s_ax, geo, qbox, kbox, true);
    __syncthreads();
    if (threadIdx.x < NA_TILE)
        na_query_slot(s_ax, geo, qbox, geo.own_lo, geo.own_hi, threadIdx.x, s_qtok + threadIdx.x,
                      s_qwin + threadIdx.x * 6, s_qc + threadIdx.x * 3);
    __syncthreads();
    na_stage_rows<T, HD>(sQ, q + b * q_sb + h * q_sh, s_qtok, NA_TILE, q_st, d_qk, vec);

    const T* kbase = k + b * k_sb + hk * k_sh;
    const T* vbase = v + b * v_sb + hk * v_sh;
    const NaRpb bias = {rpb ? rpb + (long long)h * ((2 * geo.kern[0] - 1) * (2 * geo.kern[1] - 1) *
                                                    (2 * geo.kern[2] - 1))
                            : nullptr,
                        s_qc};
    float acc[HD / 8][4], m[2] = {-NA_INF, -NA_INF}, l[2] = {0.f, 0.f};
    na_zero(acc);
    const int ntiles = geo.tiles[0] * geo.tiles[1] * geo.tiles[2];
    for (int it = 0; it < ntiles; ++it) {
        __syncthreads();  // everyone is done with the previous tile's slots
        if (threadIdx.x == 0) na_place_other_tile(s_ax, geo, kbox, it, true);
        __syncthreads();
        if (threadIdx.x < NA_TILE)
            na_key_slot(geo, kbox, geo.cur_lo, geo.cur_hi, threadIdx.x, s_ktok + threadIdx.x,
                        s_kc + threadIdx.x * 3);
        const bool full = geo.full;
        for (int c0 = 0; c0 < NA_TILE; c0 += CH) {
            __syncthreads();
            na_stage_rows<T, HD>(sK, kbase, s_ktok + c0, CH, k_st, d_qk, vec);
            na_stage_rows<T, HD>(sV, vbase, s_ktok + c0, CH, v_st, d_v, vec);
            __syncthreads();
            float s[NT][4];
            na_zero(s);
            na_mma_abt<T, HD, NT>(s, sQ + row0 * LD, sK, d_qk);
            na_logits<NT, true>(s, scale, softcap, inv_cap, full, s_qwin, s_kc, row0, c0, geo, bias);
            na_online_softmax<NT, HD>(s, m, l, acc);
            na_mma_pb<T, HD, NT>(acc, s, sV, d_v);
        }
    }

    const int lane = threadIdx.x & 31, g = lane >> 2;
    float inv[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(NA_FULL, l[r], 1);
        l[r] += __shfl_xor_sync(NA_FULL, l[r], 2);
        inv[r] = l[r] > 0.f ? __frcp_rn(l[r]) : 0.f;
        const int tk = s_qtok[row0 + g + 8 * r];
        if ((lane & 3) == 0 && tk >= 0)
            lse[b * l_sb + tk * l_st + h * l_sh] = l[r] > 0.f ? m[r] + logf(l[r]) : -NA_INF;
    }
    na_store_rows<T, HD>(o + b * o_sb + h * o_sh, acc, s_qtok, row0, o_st, d_v, inv[0], inv[1]);
}

// ---------------------------------------------------------------------------------------------
// Backward dQ: query-tile-major, like the forward. delta = rowsum(dO * O) - dlse (fp32), laid
// out like lse.
// ---------------------------------------------------------------------------------------------
template <typename T, int HD>
__global__ void
na_fused_backward_dq(NA_DQ_PARAMS) {
    constexpr int LD = NaRows<T, HD>::LD, CH = NaChunk<T>::DQ, NT = CH / 8;
    NA_LOAD_SHAPES
    const float inv_cap = softcap > 0.f ? __frcp_rn(softcap) : 0.f;
    const int h = blockIdx.y, hk = h / (heads_q / heads_kv);
    __shared__ NaAxis s_ax[NA_MAX_AXES];
    __shared__ NaGeo geo;
    extern __shared__ __align__(16) unsigned char na_smem[];
    T* sQ = reinterpret_cast<T*>(na_smem);
    T* sDO = sQ + NA_TILE * LD;
    T* sK = sDO + NA_TILE * LD;
    T* sV = sK + CH * LD;
    int* s_qtok = reinterpret_cast<int*>(sV + CH * LD);
    int* s_qwin = s_qtok + NA_TILE;
    int* s_ktok = s_qwin + NA_TILE * 6;
    int* s_kc = s_ktok + NA_TILE;

    if (threadIdx.x == 0) na_setup_block(table, s_ax, geo, qbox, kbox, true);
    __syncthreads();
    if (threadIdx.x < NA_TILE)
        na_query_slot(s_ax, geo, qbox, geo.own_lo, geo.own_hi, threadIdx.x, s_qtok + threadIdx.x,
                      s_qwin + threadIdx.x * 6, nullptr);
    __syncthreads();
    na_stage_rows<T, HD>(sQ, q + b * q_sb + h * q_sh, s_qtok, NA_TILE, q_st, d_qk, vec);
    na_stage_rows<T, HD>(sDO, dout + b * do_sb + h * do_sh, s_qtok, NA_TILE, do_st, d_v, vec);

    const int lane = threadIdx.x & 31, g = lane >> 2;
    float row_lse[2], row_delta[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int tk = s_qtok[row0 + g + 8 * r];
        const long long at = b * l_sb + (long long)tk * l_st + h * l_sh;
        const float x = tk >= 0 ? lse[at] : NA_INF;
        row_lse[r] = x == -NA_INF ? NA_INF : x;  // a row that saw nothing: P = 0
        row_delta[r] = tk >= 0 ? delta[at] : 0.f;
    }

    const T* kbase = k + b * k_sb + hk * k_sh;
    const T* vbase = v + b * v_sb + hk * v_sh;
    const NaRpb none = {nullptr, nullptr};
    float acc[HD / 8][4];
    na_zero(acc);
    const int ntiles = geo.tiles[0] * geo.tiles[1] * geo.tiles[2];
    for (int it = 0; it < ntiles; ++it) {
        __syncthreads();
        if (threadIdx.x == 0) na_place_other_tile(s_ax, geo, kbox, it, true);
        __syncthreads();
        if (threadIdx.x < NA_TILE)
            na_key_slot(geo, kbox, geo.cur_lo, geo.cur_hi, threadIdx.x, s_ktok + threadIdx.x,
                        s_kc + threadIdx.x * 3);
        const bool full = geo.full;
        for (int c0 = 0; c0 < NA_TILE; c0 += CH) {
            __syncthreads();
            na_stage_rows<T, HD>(sK, kbase, s_ktok + c0, CH, k_st, d_qk, vec);
            na_stage_rows<T, HD>(sV, vbase, s_ktok + c0, CH, v_st, d_v, vec);
            __syncthreads();
            float s[NT][4], dp[NT][4];
            na_zero(s);
            na_mma_abt<T, HD, NT>(s, sQ + row0 * LD, sK, d_qk);
            na_logits<NT, true>(s, scale, softcap, inv_cap, full, s_qwin, s_kc, row0, c0, geo, none);
            na_zero(dp);
            na_mma_abt<T, HD, NT>(dp, sDO + row0 * LD, sV, d_v);
#pragma unroll
            for (int n = 0; n < NT; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    na_grad_logit(s[n][e], dp[n][e], row_lse[e >> 1], row_delta[e >> 1], softcap,
                                  inv_cap);
            na_mma_pb<T, HD, NT>(acc, dp, sK, d_qk);
        }
    }
    na_store_rows<T, HD>(dq + b * dq_sb + h * dq_sh, acc, s_qtok, row0, dq_st, d_qk, scale, scale);
}

#endif  // NA_PIPELINED (query-major kernels)

#if NA_PIPELINED
// ---------------------------------------------------------------------------------------------
// Backward dK, dV, sm_80+ build: key-major. The block owns a key box of kv head `hk` (K and V in
// shared memory) and walks steps (query tile, query head of the kv head's group, chunk of
// QSTEP queries) through a ring of cp.async stages, each stage holding the step's Q and dO rows,
// its query slots (windows, tokens) and its lse and delta. Geometry in every thread's registers;
// query tiles that see the whole key box (a contiguous range per axis) skip the mask.
// ---------------------------------------------------------------------------------------------

// Queries per step (one ring stage) and stages: a 64-query tile in one step up to head dim 64,
// in two of 32 at 128 (so three stages fit beside K and V); two stages at 64. KEYS: the block's
// key box, 64 keys (4 warps of 16 key rows) or, for the wide dK/dV (sm_90+, head dims up to 64:
// at 128 dK and dV of 32 rows alone would take every register), 128 keys in 4 warps of 32 rows
// (MT = 2 m16 tiles), so every Q and dO fragment feeds two mma; its score fragments take 32
// queries per step at head dim 64.
template <int HD, int KEYS = NA_TILE> struct NaDkdvSteps {
    static constexpr int MT = KEYS / NA_TILE;
    static constexpr int QSTEP = MT > 1 ? (HD >= 64 ? 16 : 32) : HD >= 128 ? 32 : 64;
    static constexpr int STAGES = MT > 1 ? 3 : HD >= 128 ? 3 : HD >= 64 ? 2 : 3;
    static constexpr int MIN_BLOCKS = MT > 1 || HD >= 64 ? 1 : 2;
};

struct NaKeyMajorGeo {
    int glen_q[3];
    int own_lo[3], own_hi[3];       // the key box (group coordinates, clipped)
    int lo[3], tiles[3];            // the query range's first position and its tiles
    int hi[3];                      // the query range's end
    int whole_lo[3], whole_hi[3];   // query tiles [whole_lo, whole_hi) see the whole key box
    NaTokens qtok, ktok;
};

__device__ __forceinline__ void na_key_major_geometry(const NaAxis* ax, const int* qside,
                                                      const int* kside, NaKeyMajorGeo& geo) {
    int group[3], first[3];
    na_place_own_box(ax, kside, false, group, first, geo.qtok, geo.ktok);
#pragma unroll
    for (int a = 0; a < 3; ++a) {
        const int d = na_axis_dilation(ax[a]), g = group[a], start = first[a];
        geo.glen_q[a] = na_group_len(ax[a].len_q, d, g);
        geo.own_lo[a] = start;
        geo.own_hi[a] = min(start + kside[a], na_group_len(ax[a].len_kv, d, g));
        int lo, hi;
        na_group_query_range(ax[a], geo.glen_q[a], geo.own_lo[a], geo.own_hi[a], &lo, &hi);
        geo.lo[a] = lo;
        geo.hi[a] = max(hi, lo);
        geo.tiles[a] = (geo.hi[a] - lo + qside[a] - 1) / qside[a];
        // Monotone windows: a tile sees the whole box iff its last query's window starts at or
        // before the box and its first query's window ends at or after it, and no slot of the
        // tile is clipped: a prefix meets a suffix, so the whole tiles are one range.
        geo.whole_lo[a] = geo.tiles[a];
        geo.whole_hi[a] = 0;
        for (int i = 0; i < geo.tiles[a]; ++i) {
            const int q0 = lo + i * qside[a], q1 = q0 + qside[a];
            int wl, wh, unused;
            if (q1 > geo.hi[a]) break;
            na_group_window(ax[a], q1 - 1, geo.glen_q[a], &wl, &unused);
            na_group_window(ax[a], q0, geo.glen_q[a], &unused, &wh);
            if (wl <= geo.own_lo[a] && geo.own_hi[a] <= wh) {
                geo.whole_lo[a] = min(geo.whole_lo[a], i);
                geo.whole_hi[a] = i + 1;
            }
        }
    }
}

// WG (`fused_hopper`, sm_90a; 64-key boxes): the four products on wgmma, K and V (the A operands
// of S^T = K Q^T and dP^T = V dO^T) and every stage's Q and dO swizzled in shared memory, P^T and
// dS^T from registers; stages start on 1024-byte boundaries.
template <typename T, int HD, int KEYS = NA_TILE, bool WG = false>
__global__ void __launch_bounds__(NA_THREADS, NaDkdvSteps<HD, KEYS>::MIN_BLOCKS)
na_fused_backward_dkdv(NA_DKDV_PARAMS) {
    using Steps = NaDkdvSteps<HD, KEYS>;
    constexpr int LD = WG ? HD : HD + 8, QSTEP = Steps::QSTEP, NT = QSTEP / 8, MT = Steps::MT;
    constexpr int STAGES = Steps::STAGES, CHUNKS = NA_TILE / QSTEP;
    static_assert(!WG || MT == 1, "the wgmma dK/dV takes 64-key boxes");
    // A stage: Q rows, dO rows, query slots, lse, delta.
    constexpr int STAGE_USED = 2 * QSTEP * LD * (int)sizeof(T) + QSTEP * (32 + 8);
    constexpr int STAGE_BYTES = WG ? (STAGE_USED + 1023) / 1024 * 1024 : STAGE_USED;
    const int qside[3] = {qt0, qt1, qt2}, kside[3] = {kt0, kt1, kt2};
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, row0 = warp * 16 * MT;
    const int b = blockIdx.z, hk = blockIdx.y, group = heads_q / heads_kv;
    const float inv_cap = softcap > 0.f ? __frcp_rn(softcap) : 0.f;
    extern __shared__ __align__(16) unsigned char na_smem[];
    T* sK = reinterpret_cast<T*>(na_smem + (WG ? na_align1024(na_smem) : 0));
    T* sV = sK + KEYS * LD;
    unsigned char* ring = reinterpret_cast<unsigned char*>(sV + KEYS * LD);

    // The block's geometry is read once per step, so it waits in shared memory rather than in
    // registers the accumulators need (thread 0 writes it once; every thread derived it).
    __shared__ NaKeyMajorGeo s_geo;
    __shared__ NaAxis s_ax[NA_MAX_AXES];
    {
        NaAxis ax[3];
        na_load_axes(table, ax);
        NaKeyMajorGeo mine;
        na_key_major_geometry(ax, qside, kside, mine);
        if (threadIdx.x == 0) {
            s_geo = mine;
#pragma unroll
            for (int a = 0; a < 3; ++a) s_ax[a] = ax[a];
        }
    }
    __syncthreads();
    const NaKeyMajorGeo& geo = s_geo;
    const NaAxis* ax = s_ax;
    const NaBox qbox = na_make_box(qside), kbox = na_make_box(kside);

    // K and V join the first step's cp.async group.
    na_copy_box<T, HD, KEYS, NA_THREADS, WG>(sK, k + b * k_sb + hk * k_sh, k_st, d_qk, sV,
                                             v + b * v_sb + hk * v_sh, v_st, d_v, geo.ktok, kbox,
                                             geo.own_lo, geo.own_hi, vec);

    // Steps go (query tile, head, chunk), chunk fastest, tiles row-major over the per-axis counts.
    const int ntiles = geo.tiles[0] * geo.tiles[1] * geo.tiles[2];
    const int nsteps = ntiles * group * CHUNKS;
    int copy_tile[3] = {0, 0, 0}, copy_sub = 0;  // sub-step: head * CHUNKS + chunk
    auto issue = [&](int step) {
        if (step < nsteps) {
            unsigned char* stage = ring + (step % STAGES) * STAGE_BYTES;
            T* sQ = reinterpret_cast<T*>(stage);
            T* sDO = sQ + QSTEP * LD;
            NaQuerySlot* slots = reinterpret_cast<NaQuerySlot*>(sDO + QSTEP * LD);
            float* s_lse = reinterpret_cast<float*>(slots + QSTEP);
            float* s_delta = s_lse + QSTEP;
            const int h = hk * group + copy_sub / CHUNKS, first = (copy_sub % CHUNKS) * QSTEP;
            int qlo[3], qend[3];
#pragma unroll
            for (int a = 0; a < 3; ++a) {
                qlo[a] = geo.lo[a] + copy_tile[a] * qside[a];
                qend[a] = geo.hi[a];
            }
            na_copy_box<T, HD, QSTEP, NA_THREADS, WG>(sQ, q + b * q_sb + h * q_sh, q_st, d_qk,
                                                      sDO, dout + b * do_sb + h * do_sh, do_st,
                                                      d_v, geo.qtok, qbox, qlo, qend, vec, first);
            if (threadIdx.x < QSTEP) {
                const int r = first + threadIdx.x;
                NaQuerySlot slot;
                slot.tok = na_slot_token(geo.qtok, qbox, qlo, qend, r);
                slot.rpb = 0;
#pragma unroll
                for (int a = 0; a < 3; ++a) {
                    const int c = qlo[a] + ((r >> qbox.shift[a]) & qbox.mask[a]);
                    slot.lo[a] = slot.hi[a] = 0;
                    if (slot.tok >= 0)
                        na_group_window(ax[a], c, geo.glen_q[a], &slot.lo[a], &slot.hi[a]);
                }
                slots[threadIdx.x] = slot;
                // A clipped slot reads lse = delta = 0 (zero-filled): its P is masked to 0.
                const long long at = slot.tok >= 0 ? b * l_sb + (long long)slot.tok * l_st + h * l_sh
                                                   : 0;
                const int bytes = slot.tok >= 0 ? 4 : 0;
                na_cp_async4(s_lse + threadIdx.x, lse + at, bytes);
                na_cp_async4(s_delta + threadIdx.x, delta + at, bytes);
            }
            if (++copy_sub == group * CHUNKS) {
                copy_sub = 0;
                na_odometer_step(copy_tile, geo.tiles);
            }
        }
        na_cp_async_commit();
    };
#pragma unroll
    for (int step = 0; step < STAGES - 1; ++step) issue(step);

    // The thread's key rows (g, g + 8 of each of the warp's m16 tiles): group coordinates and
    // tokens.
    int kc[MT][2][3], ktok[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int slot = row0 + 16 * mt + (lane >> 2) + 8 * r;
            ktok[mt][r] = na_slot_token(geo.ktok, kbox, geo.own_lo, geo.own_hi, slot);
#pragma unroll
            for (int a = 0; a < 3; ++a)
                kc[mt][r][a] = geo.own_lo[a] + ((slot >> kbox.shift[a]) & kbox.mask[a]);
        }
    }

    const float scale_log2 = scale * NA_LOG2E;
    const int t = lane & 3;
    float dk_acc[MT][HD / 8][4], dv_acc[MT][HD / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        na_zero(dk_acc[mt]);
        na_zero(dv_acc[mt]);
    }
    int tile[3] = {0, 0, 0}, sub = 0;
    for (int step = 0; step < nsteps; ++step) {
        na_cp_async_wait_n<STAGES - 2>();
#if NA_WGMMA
        if constexpr (WG) na_fence_async_smem();  // ... and are visible to wgmma's reads
#endif
        __syncthreads();  // step `step` landed for all; step - 1 is done everywhere
        issue(step + STAGES - 1);
        const unsigned char* stage = ring + (step % STAGES) * STAGE_BYTES;
        const T* sQ = reinterpret_cast<const T*>(stage);
        const T* sDO = sQ + QSTEP * LD;
        const NaQuerySlot* slots = reinterpret_cast<const NaQuerySlot*>(sDO + QSTEP * LD);
        const float* s_lse = reinterpret_cast<const float*>(slots + QSTEP);
        const float* s_delta = s_lse + QSTEP;
        bool whole = true;
#pragma unroll
        for (int a = 0; a < 3; ++a) whole &= geo.whole_lo[a] <= tile[a] && tile[a] < geo.whole_hi[a];

        float s[MT][NT][4], dp[MT][NT][4];
#if NA_WGMMA
        if constexpr (WG) {  // K and V: the m64 A operands; this step's Q and dO rows: B
            na_qk_wgmma<T, HD, NT, NA_TILE, 1>(s, sK, sQ);
            na_qk_wgmma<T, HD, NT, NA_TILE, 1>(dp, sV, sDO);
        } else
#endif
        if constexpr (MT == 1) {
            na_zero(s[0]);
            na_mma_abt<T, HD, NT>(s[0], sK + row0 * LD, sQ, HD);
            na_zero(dp[0]);
            na_mma_abt<T, HD, NT>(dp[0], sV + row0 * LD, sDO, HD);
        } else {  // K and V rows as the A operands of both m16 tiles, from shared memory
            const unsigned int none[2][1][4] = {};
            na_qk_wide<T, HD, NT, false>(s, none, sK + row0 * LD, sQ);
            na_qk_wide<T, HD, NT, false>(dp, none, sV + row0 * LD, sDO);
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int n = 0; n < NT; ++n) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int r = e >> 1, col = n * 8 + 2 * t + (e & 1);
                    bool seen = true;
                    if (!whole) {
                        const NaQuerySlot& qs = slots[col];
#pragma unroll
                        for (int a = 0; a < 3; ++a)
                            seen &= kc[mt][r][a] >= qs.lo[a] && kc[mt][r][a] < qs.hi[a];
                    }
                    const float l = s_lse[col];
                    // A query that saw nothing has lse = -inf: its P is 0 (it sees no key here).
                    const float lse2 = l == -NA_INF ? NA_INF : l * NA_LOG2E;
                    float p, ds;
                    if (softcap > 0.f) {
                        const float th = tanhf(s[mt][n][e] * scale * inv_cap);
                        p = seen ? na_ex2(softcap * NA_LOG2E * th - lse2) : 0.f;
                        ds = seen ? p * (dp[mt][n][e] - s_delta[col]) * (1.f - th * th) : 0.f;
                    } else {
                        p = seen ? na_ex2(fmaf(s[mt][n][e], scale_log2, -lse2)) : 0.f;
                        ds = p * (dp[mt][n][e] - s_delta[col]);
                    }
                    s[mt][n][e] = p;
                    dp[mt][n][e] = ds;
                }
            }
        }
#if NA_WGMMA
        if constexpr (WG) {  // dV += P^T dO, dK += dS^T Q (dO and Q MN-major)
            na_pv_wgmma<T, HD, NT, 1>(dv_acc, s, sDO);
            na_pv_wgmma<T, HD, NT, 1>(dk_acc, dp, sQ);
        } else
#endif
        if constexpr (MT == 1) {
            na_pv<T, HD, NT>(dv_acc[0], s[0], sDO);
            na_pv<T, HD, NT>(dk_acc[0], dp[0], sQ);
        } else {  // each dO and Q fragment feeds both m16 tiles
            na_pv_wide<T, HD, NT>(dv_acc, s, sDO);
            na_pv_wide<T, HD, NT>(dk_acc, dp, sQ);
        }
        if (++sub == group * CHUNKS) {
            sub = 0;
            na_odometer_step(tile, geo.tiles);
        }
    }
    na_cp_async_wait_all();
    const float dk_mul[2] = {scale, scale}, dv_mul[2] = {1.f, 1.f};
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        na_store_fragment_rows<T, HD>(dk + b * dk_sb + hk * dk_sh, dk_st, dk_acc[mt], ktok[mt],
                                      dk_mul, d_qk, vec);
        na_store_fragment_rows<T, HD>(dv + b * dv_sb + hk * dv_sh, dv_st, dv_acc[mt], ktok[mt],
                                      dv_mul, d_v, vec);
    }
}
#else
// ---------------------------------------------------------------------------------------------
// Backward dK, dV: key-tile-major. The block owns a key box of kv head `hk`, visits the query
// boxes that see it and, inside, every query head of the kv head's group.
// ---------------------------------------------------------------------------------------------
template <typename T, int HD>
__global__ void
na_fused_backward_dkdv(NA_DKDV_PARAMS) {
    constexpr int LD = NaRows<T, HD>::LD, CH = NaChunk<T>::DKDV, NT = CH / 8;
    NA_LOAD_SHAPES
    const float inv_cap = softcap > 0.f ? __frcp_rn(softcap) : 0.f;
    const int hk = blockIdx.y, group = heads_q / heads_kv;
    __shared__ NaAxis s_ax[NA_MAX_AXES];
    __shared__ NaGeo geo;
    extern __shared__ __align__(16) unsigned char na_smem[];
    T* sK = reinterpret_cast<T*>(na_smem);
    T* sV = sK + NA_TILE * LD;
    T* sQ = sV + NA_TILE * LD;
    T* sDO = sQ + CH * LD;
    int* s_ktok = reinterpret_cast<int*>(sDO + CH * LD);
    int* s_kc = s_ktok + NA_TILE;
    int* s_qtok = s_kc + NA_TILE * 3;
    int* s_qwin = s_qtok + NA_TILE;
    float* s_lse = reinterpret_cast<float*>(s_qwin + NA_TILE * 6);
    float* s_delta = s_lse + NA_TILE;

    if (threadIdx.x == 0) na_setup_block(table, s_ax, geo, kbox, qbox, false);
    __syncthreads();
    if (threadIdx.x < NA_TILE)
        na_key_slot(geo, kbox, geo.own_lo, geo.own_hi, threadIdx.x, s_ktok + threadIdx.x,
                    s_kc + threadIdx.x * 3);
    __syncthreads();
    na_stage_rows<T, HD>(sK, k + b * k_sb + hk * k_sh, s_ktok, NA_TILE, k_st, d_qk, vec);
    na_stage_rows<T, HD>(sV, v + b * v_sb + hk * v_sh, s_ktok, NA_TILE, v_st, d_v, vec);

    const NaRpb none = {nullptr, nullptr};
    const int lane = threadIdx.x & 31, t = lane & 3;
    float dk_acc[HD / 8][4], dv_acc[HD / 8][4];
    na_zero(dk_acc);
    na_zero(dv_acc);
    const int ntiles = geo.tiles[0] * geo.tiles[1] * geo.tiles[2];
    for (int it = 0; it < ntiles; ++it) {
        __syncthreads();
        if (threadIdx.x == 0) na_place_other_tile(s_ax, geo, qbox, it, false);
        __syncthreads();
        if (threadIdx.x < NA_TILE)
            na_query_slot(s_ax, geo, qbox, geo.cur_lo, geo.cur_hi, threadIdx.x,
                          s_qtok + threadIdx.x, s_qwin + threadIdx.x * 6, nullptr);
        const bool full = geo.full;
        for (int h = hk * group; h < (hk + 1) * group; ++h) {
            __syncthreads();  // s_qtok ready; previous head's lse/delta no longer read
            if (threadIdx.x < NA_TILE) {
                const int tk = s_qtok[threadIdx.x];
                const long long at = b * l_sb + (long long)tk * l_st + h * l_sh;
                const float x = tk >= 0 ? lse[at] : NA_INF;
                s_lse[threadIdx.x] = x == -NA_INF ? NA_INF : x;
                s_delta[threadIdx.x] = tk >= 0 ? delta[at] : 0.f;
            }
            const T* qbase = q + b * q_sb + h * q_sh;
            const T* dobase = dout + b * do_sb + h * do_sh;
            for (int c0 = 0; c0 < NA_TILE; c0 += CH) {
                __syncthreads();
                na_stage_rows<T, HD>(sQ, qbase, s_qtok + c0, CH, q_st, d_qk, vec);
                na_stage_rows<T, HD>(sDO, dobase, s_qtok + c0, CH, do_st, d_v, vec);
                __syncthreads();
                float s[NT][4], dp[NT][4];
                na_zero(s);
                na_mma_abt<T, HD, NT>(s, sK + row0 * LD, sQ, d_qk);
                na_logits<NT, false>(s, scale, softcap, inv_cap, full, s_qwin, s_kc, row0, c0, geo, none);
                na_zero(dp);
                na_mma_abt<T, HD, NT>(dp, sV + row0 * LD, sDO, d_v);
#pragma unroll
                for (int n = 0; n < NT; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int col = c0 + n * 8 + 2 * t + (e & 1);
                        na_grad_logit(s[n][e], dp[n][e], s_lse[col], s_delta[col], softcap, inv_cap);
                    }
                na_mma_pb<T, HD, NT>(dv_acc, s, sDO, d_v);
                na_mma_pb<T, HD, NT>(dk_acc, dp, sQ, d_qk);
            }
        }
    }
    na_store_rows<T, HD>(dk + b * dk_sb + hk * dk_sh, dk_acc, s_ktok, row0, dk_st, d_qk, scale,
                         scale);
    na_store_rows<T, HD>(dv + b * dv_sb + hk * dv_sh, dv_acc, s_ktok, row0, dv_st, d_v, 1.f, 1.f);
}
#endif  // NA_PIPELINED (dK/dV)

// ---------------------------------------------------------------------------------------------
// Backward preprocessing: delta = rowsum(dO * O) - dlse (fp32, laid out like lse; dlse may be
// null), one warp per (token, head) row of batch blockIdx.y. Both builds compile it: the
// backward kernels read what it writes.
// ---------------------------------------------------------------------------------------------
template <typename T, int HD>
__global__ void __launch_bounds__(NA_THREADS)
na_fused_backward_delta(const T* __restrict__ o, const T* __restrict__ dout,
                        const float* __restrict__ dlse, float* __restrict__ delta,
                        long long o_sb, long long o_st, long long o_sh,
                        long long do_sb, long long do_st, long long do_sh,
                        long long l_sb, long long l_st, long long l_sh,
                        long long dl_sb, long long dl_st, long long dl_sh,
                        int tokens, int heads, int d_v) {
    const int row = blockIdx.x * NA_WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    const int b = blockIdx.y;
    if (row >= tokens * heads) return;  // the whole warp leaves together
    const int t = row / heads, h = row % heads;
    const T* orow = o + b * o_sb + t * o_st + h * o_sh;
    const T* drow = dout + b * do_sb + t * do_st + h * do_sh;
    float sum = 0.f;
#pragma unroll
    for (int c = lane; c < HD; c += 32)
        if (c < d_v) sum += na_to_float(orow[c]) * na_to_float(drow[c]);
#pragma unroll
    for (int m = 16; m >= 1; m >>= 1) sum += __shfl_xor_sync(NA_FULL, sum, m);
    if (lane == 0)
        delta[b * l_sb + t * l_st + h * l_sh] =
            sum - (dlse != nullptr ? dlse[b * dl_sb + t * dl_st + h * dl_sh] : 0.f);
}
