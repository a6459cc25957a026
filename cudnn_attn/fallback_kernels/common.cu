// Shared by every kernel of this package: storage types, conversions and the per-axis mask rule.
//
// NVRTC is run with no include path (no CUDA toolkit is needed on the machine), so nothing here
// includes <cuda_fp16.h>: half and bfloat16 are raw 16-bit storage converted with PTX `cvt`.
// The loader prepends a #define block and this file to every kernel file.

typedef unsigned short na_u16;

struct na_half { na_u16 bits; };
struct na_bf16 { na_u16 bits; };

__device__ __forceinline__ float na_to_float(float x) { return x; }
__device__ __forceinline__ double na_to_double(double x) { return x; }
__device__ __forceinline__ float na_to_float(double x) { return (float)x; }
__device__ __forceinline__ float na_to_float(na_half x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
}
__device__ __forceinline__ float na_to_float(na_bf16 x) {
    return __uint_as_float(((unsigned int)x.bits) << 16);
}

template <typename T> struct NaConvert;
template <> struct NaConvert<float> {
    __device__ __forceinline__ static float from(float f) { return f; }
};
template <> struct NaConvert<double> {
    __device__ __forceinline__ static double from(double f) { return f; }
};
template <> struct NaConvert<na_half> {
    __device__ __forceinline__ static na_half from(float f) {
        na_half h;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(f));
        return h;
    }
};
template <> struct NaConvert<na_bf16> {
    __device__ __forceinline__ static na_bf16 from(float f) {
        na_bf16 h;
        asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h.bits) : "f"(f));
        return h;
    }
};

// The type arithmetic runs in: double for double, float for everything else.
template <typename T> struct NaAccum { typedef float type; };
template <> struct NaAccum<double> { typedef double type; };

// Two floats packed into one 32-bit register as f16x2 / bf16x2 (`lo` in the low half), the
// operand format of mma.sync.
__device__ __forceinline__ unsigned int na_pack2(float lo, float hi, na_half) {
    unsigned int r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
__device__ __forceinline__ unsigned int na_pack2(float lo, float hi, na_bf16) {
    unsigned int r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// ---------------------------------------------------------------------------------------------
// The mask, one axis at a time.
//
// Every mask this package runs is an AND over at most three axes of a per-axis rule, and on every
// axis a query sees a contiguous run of keys *inside its dilation group* (global index t*d + g,
// g = i % d). Runs are non-decreasing in the query index, so the queries that see one key (or a
// range of keys) are also a contiguous run: that is what lets the backward walk keys-major.
//
//   mode NA_AXIS_NEIGHBORHOOD: NATTEN 0.21's rule (kernel, stride, dilation, causal); len_q == len_kv.
//   mode NA_AXIS_BAND: a 1-D band, key j visible iff i + offset - left <= j <= i + offset + right
//       (left/right < 0: unbounded); dense, causal and sliding-window masks are bands.
// ---------------------------------------------------------------------------------------------

#define NA_AXIS_NEIGHBORHOOD 0
#define NA_AXIS_BAND 1
#define NA_MAX_AXES 3

struct NaAxis {
    int mode;
    int len_q;
    int len_kv;
    int kernel;
    int stride;
    int dilation;
    int causal;
    int left;
    int right;
    int offset;
};

// Number of positions of an axis of length `len` in dilation group `g`: ceil((len - g) / d).
__device__ __forceinline__ int na_group_len(int len, int d, int g) {
    return (len - g + d - 1) / d;
}

// Keys [*lo, *hi) (group coordinates) seen by the query at group index `idx` of a group of
// `glen` positions.
__device__ __forceinline__ void na_group_window(const NaAxis& a, int idx, int glen, int* lo,
                                                int* hi) {
    if (a.mode == NA_AXIS_BAND) {
        int aligned = idx + a.offset;
        int l = a.left < 0 ? 0 : max(aligned - a.left, 0);
        int h = a.right < 0 ? a.len_kv : min(aligned + a.right + 1, a.len_kv);
        *lo = min(l, a.len_kv);
        *hi = max(h, *lo);
        return;
    }
    int k = a.kernel, s = a.stride;
    if (a.causal) {
        int leader = min((idx / s) * s + s - 1, glen - 1);
        *lo = max(leader - k + 1, 0);
        *hi = min(idx + 1, glen);
    } else {
        int wl = k / 2, wr = k / 2 + (k % 2) - 1;
        int leader = min((idx / s) * s + s / 2, glen - 1);
        int start = max(leader - wl, 0) + (leader + wr >= glen ? glen - wr - leader - 1 : 0);
        *lo = start;
        *hi = start + k;
    }
}

// Dilation of the axis (1 for bands).
__device__ __forceinline__ int na_axis_dilation(const NaAxis& a) {
    return a.mode == NA_AXIS_NEIGHBORHOOD ? a.dilation : 1;
}

// Keys of one query in global coordinates: first, count, step (keys first + t*step, t < count).
__device__ __forceinline__ void na_keys_of_query(const NaAxis& a, int i, int* first, int* count,
                                                 int* step) {
    int d = na_axis_dilation(a);
    int g = i % d, idx = i / d;
    int lo, hi;
    na_group_window(a, idx, na_group_len(a.len_q, d, g), &lo, &hi);
    *first = lo * d + g;
    *count = hi - lo;
    *step = d;
}

// Is key j visible from query i on this axis?
__device__ __forceinline__ bool na_axis_visible(const NaAxis& a, int i, int j) {
    int d = na_axis_dilation(a);
    if (j % d != i % d) return false;
    int g = i % d, lo, hi;
    na_group_window(a, i / d, na_group_len(a.len_q, d, g), &lo, &hi);
    int t = j / d;
    return t >= lo && t < hi;
}

// Keys (group coordinates) seen by any query of the group range [q0, q1): [*lo, *hi).
// Exact because windows are monotone in the query index.
__device__ __forceinline__ void na_group_key_range(const NaAxis& a, int glen, int q0, int q1,
                                                   int* lo, int* hi) {
    int lo0, hi0, lo1, hi1;
    na_group_window(a, q0, glen, &lo0, &hi0);
    na_group_window(a, q1 - 1, glen, &lo1, &hi1);
    *lo = lo0;
    *hi = max(hi1, lo0);
}

// Queries (group coordinates, same group) that see any key of the group range [k0, k1):
// [*lo, *hi). Binary search on the monotone window ends.
__device__ __forceinline__ void na_group_query_range(const NaAxis& a, int glen_q, int k0, int k1,
                                                     int* lo, int* hi) {
    // First query whose window ends after k0.
    int a0 = 0, b0 = glen_q;
    while (a0 < b0) {
        int mid = (a0 + b0) >> 1, wl, wh;
        na_group_window(a, mid, glen_q, &wl, &wh);
        if (wh > k0) b0 = mid; else a0 = mid + 1;
    }
    // First query whose window starts at or after k1.
    int a1 = a0, b1 = glen_q;
    while (a1 < b1) {
        int mid = (a1 + b1) >> 1, wl, wh;
        na_group_window(a, mid, glen_q, &wl, &wh);
        if (wl >= k1) b1 = mid; else a1 = mid + 1;
    }
    *lo = a0;
    *hi = a1;
}

// Relative-positional-bias index on a neighborhood axis: (j - i) / d + k - 1 (NATTEN 0.17).
__device__ __forceinline__ int na_rpb_index(const NaAxis& a, int i, int j) {
    return (j - i) / a.dilation + a.kernel - 1;
}

// Geometry arrives as a small int32 device array (built once per plan, so no per-call copy):
// NA_MAX_AXES records of NA_AXIS_FIELDS ints in NaAxis field order. Unused axes are length-1
// bands (left = right = -1).
#define NA_AXIS_FIELDS 10

__device__ __forceinline__ void na_load_axes(const int* __restrict__ table, NaAxis* axes) {
#pragma unroll
    for (int a = 0; a < NA_MAX_AXES; ++a) {
        const int* p = table + a * NA_AXIS_FIELDS;
        axes[a].mode = p[0];
        axes[a].len_q = p[1];
        axes[a].len_kv = p[2];
        axes[a].kernel = p[3];
        axes[a].stride = p[4];
        axes[a].dilation = p[5];
        axes[a].causal = p[6];
        axes[a].left = p[7];
        axes[a].right = p[8];
        axes[a].offset = p[9];
    }
}
