// Unfused neighborhood attention (NATTEN 0.17's na{1,2,3}d_qk / na{1,2,3}d_av and their
// backward passes), one N-d implementation for ranks 1-3.
//
// Layouts (all contiguous, heads first):
//   rows (q, k, v, d_out, dq, ...)  [BH, N, D]     N = L0 * L1 * L2, row-major over the axes
//   weights (attn, d_attn)          [BH, N, KK]    KK = E0 * E1 * E2, E = kernel size per axis
//   rpb, drpb (accumulator type)    [H, R]         R = (2E0-1) * (2E1-1) * (2E2-1)
// Axes past the problem's rank are length-1 bands (extent 1), so every loop below is a fixed
// three-deep nest whose unused levels run once.
//
// Slot t (row-major over the kernel dims) of query i holds key first + t*step per axis
// (na_keys_of_query); a slot is valid iff t < count on every axis, so a causally truncated
// window keeps its valid keys in the first slots. Invalid slots are -inf in the QK logits, 0 in
// d_attn, and never read by the other kernels.
//
// Four kernels serve the seven operations, because the two ops of each pair share an index
// pattern:
//   na_neighbor_dot      w[i, slot] = <a[i], b[key(i, slot)]>       qk forward (+rpb), d_attn of av
//   na_neighbor_gather   out[i] = sum_slot w[i, slot] * b[key]       av forward, dq
//   na_inverse_gather    out[j] = sum_{i sees j} w[i, slot(i,j)] a[i] dk, dv
//   na_rpb_backward      drpb[h, r] = sum over (b, i) of d_attn at the slot with rpb index r
// Each output element is written by exactly one thread (or one block) that sums its terms in a
// fixed order: the results are deterministic, with no atomics.
//
// Grids: x strides over the elements of one (batch, head) in 32-bit (64-bit division would be a
// subroutine call, and its ABI spills), y over (batch, head). The element-wise kernels carry no
// __launch_bounds__: with it ptxas caps them near 48 registers and spills; without it they need
// at most ~80, so a 256-thread block always fits.

#ifndef NA_UNFUSED_THREADS
#define NA_UNFUSED_THREADS 256
#endif
#ifndef NA_RPB_THREADS
#define NA_RPB_THREADS 256
#endif
static_assert((NA_RPB_THREADS & (NA_RPB_THREADS - 1)) == 0, "tree reduction needs a power of 2");

// Number of slots an axis contributes to a query's window (1 for unused band axes).
__device__ __forceinline__ int na_slot_extent(const NaAxis& a) {
    return a.mode == NA_AXIS_NEIGHBORHOOD ? a.kernel : 1;
}

// Everything the kernels need about the geometry, loaded once per thread from the table.
struct NaUnfusedGeom {
    NaAxis ax[NA_MAX_AXES];
    int ext[NA_MAX_AXES];  // slot extent per axis
    int num_tokens;        // N
    int num_slots;         // KK
    int num_rpb;           // R
};

__device__ __forceinline__ void na_load_unfused(const int* __restrict__ table, NaUnfusedGeom& g) {
    na_load_axes(table, g.ax);
    g.num_tokens = 1;
    g.num_slots = 1;
    g.num_rpb = 1;
#pragma unroll
    for (int a = 0; a < NA_MAX_AXES; ++a) {
        g.ext[a] = na_slot_extent(g.ax[a]);
        g.num_tokens *= g.ax[a].len_q;
        g.num_slots *= g.ext[a];
        g.num_rpb *= 2 * g.ext[a] - 1;
    }
}

// Row-major coordinates of flat token index `flat`.
__device__ __forceinline__ void na_unflatten(const NaUnfusedGeom& g, int flat, int* c) {
    c[2] = flat % g.ax[2].len_q;
    flat /= g.ax[2].len_q;
    c[1] = flat % g.ax[1].len_q;
    c[0] = flat / g.ax[1].len_q;
}

__device__ __forceinline__ int na_flatten(const NaUnfusedGeom& g, int c0, int c1, int c2) {
    return (c0 * g.ax[1].len_q + c1) * g.ax[2].len_q + c2;
}

template <typename Acc> __device__ __forceinline__ Acc na_neg_inf();
template <> __device__ __forceinline__ float na_neg_inf<float>() {
    return __int_as_float(0xff800000);
}
template <> __device__ __forceinline__ double na_neg_inf<double>() {
    return __longlong_as_double(0xfff0000000000000ULL);
}

__device__ __forceinline__ float na_load_acc(const float* p, long long idx, float) { return p[idx]; }
__device__ __forceinline__ double na_load_acc(const double* p, long long idx, double) {
    return p[idx];
}
template <typename T>
__device__ __forceinline__ float na_load_acc(const T* p, long long idx, float) {
    return na_to_float(p[idx]);
}

// w[bh, i, slot] = <a[bh, i], b[bh, key(i, slot)]> (+ rpb[h, r(i, slot)]); invalid slots get
// -inf when `invalid_neg_inf`, else 0. One thread per (bh, i, slot).
template <typename T>
__global__ void
na_neighbor_dot(const T* __restrict__ a, const T* __restrict__ b,
                const typename NaAccum<T>::type* __restrict__ rpb, T* __restrict__ w,
                const int* __restrict__ table, int bh_count, int heads, int dim,
                int has_rpb, int invalid_neg_inf) {
    typedef typename NaAccum<T>::type Acc;
    NaUnfusedGeom g;
    na_load_unfused(table, g);
    const int per_bh = g.num_tokens * g.num_slots;
    for (int bh = blockIdx.y; bh < bh_count; bh += gridDim.y)
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < per_bh; e += gridDim.x * blockDim.x) {
        const int slot = e % g.num_slots;
        const int i = e / g.num_slots;
        const long long row = (long long)bh * g.num_tokens + i;
        int ic[NA_MAX_AXES], t[NA_MAX_AXES], jc[NA_MAX_AXES];
        na_unflatten(g, i, ic);
        t[2] = slot % g.ext[2];
        t[1] = (slot / g.ext[2]) % g.ext[1];
        t[0] = slot / (g.ext[2] * g.ext[1]);
        bool valid = true;
        int r = 0;
#pragma unroll
        for (int x = 0; x < NA_MAX_AXES; ++x) {
            int first, count, step;
            na_keys_of_query(g.ax[x], ic[x], &first, &count, &step);
            valid = valid && t[x] < count;
            jc[x] = first + t[x] * step;
            // (j - i) / d + E - 1, an exact division: j and i share the dilation group.
            r = r * (2 * g.ext[x] - 1) + (jc[x] - ic[x]) / step + g.ext[x] - 1;
        }
        Acc acc;
        if (valid) {
            const T* pa = a + row * dim;
            const T* pb = b + ((long long)bh * g.num_tokens + na_flatten(g, jc[0], jc[1], jc[2])) * dim;
            acc = Acc(0);
            for (int c = 0; c < dim; ++c)
                acc += na_load_acc(pa, c, Acc()) * na_load_acc(pb, c, Acc());
            if (has_rpb) acc += rpb[(bh % heads) * g.num_rpb + r];
        } else {
            acc = invalid_neg_inf ? na_neg_inf<Acc>() : Acc(0);
        }
        w[row * g.num_slots + slot] = NaConvert<T>::from(acc);
    }
}

// out[bh, i, c] = sum over valid slots of w[bh, i, slot] * b[bh, key(i, slot), c].
// One thread per (bh, i, c); slots visited in row-major order.
template <typename T>
__global__ void
na_neighbor_gather(const T* __restrict__ w, const T* __restrict__ b, T* __restrict__ out,
                   const int* __restrict__ table, int bh_count, int dim) {
    typedef typename NaAccum<T>::type Acc;
    NaUnfusedGeom g;
    na_load_unfused(table, g);
    const int per_bh = g.num_tokens * dim;
    for (int bh = blockIdx.y; bh < bh_count; bh += gridDim.y)
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < per_bh; e += gridDim.x * blockDim.x) {
        const int c = e % dim;
        const int i = e / dim;
        const long long row = (long long)bh * g.num_tokens + i;
        int ic[NA_MAX_AXES], first[NA_MAX_AXES], count[NA_MAX_AXES], step[NA_MAX_AXES];
        na_unflatten(g, i, ic);
#pragma unroll
        for (int x = 0; x < NA_MAX_AXES; ++x)
            na_keys_of_query(g.ax[x], ic[x], &first[x], &count[x], &step[x]);
        const T* pw = w + row * g.num_slots;
        const T* pb = b + (long long)bh * g.num_tokens * dim + c;
        Acc acc = Acc(0);
        for (int t0 = 0; t0 < count[0]; ++t0) {
            for (int t1 = 0; t1 < count[1]; ++t1) {
                for (int t2 = 0; t2 < count[2]; ++t2) {
                    const int slot = (t0 * g.ext[1] + t1) * g.ext[2] + t2;
                    const int j = na_flatten(g, first[0] + t0 * step[0], first[1] + t1 * step[1],
                                             first[2] + t2 * step[2]);
                    acc += na_load_acc(pw, slot, Acc()) * na_load_acc(pb, (long long)j * dim, Acc());
                }
            }
        }
        out[row * dim + c] = NaConvert<T>::from(acc);
    }
}

// Queries seeing key coordinate j on one axis: global query = (lo + u) * d + group for u in
// [0, hi - lo). Windows are monotone in the query, so they form one run (na_group_query_range).
__device__ __forceinline__ void na_queries_of_key(const NaAxis& a, int j, int* lo, int* hi,
                                                  int* group, int* d) {
    *d = na_axis_dilation(a);
    *group = j % *d;
    const int glen = na_group_len(a.len_q, *d, *group);
    na_group_query_range(a, glen, j / *d, j / *d + 1, lo, hi);
}

// Slot index of key coordinate j on one axis within query i's window.
__device__ __forceinline__ int na_slot_of_key(const NaAxis& a, int i, int j) {
    int first, count, step;
    na_keys_of_query(a, i, &first, &count, &step);
    return (j - first) / step;
}

// out[bh, j, c] = sum over queries i that see key j of w[bh, i, slot(i, j)] * a[bh, i, c]
// (the transpose of na_neighbor_gather). One thread per (bh, j, c); queries visited in
// row-major order.
template <typename T>
__global__ void
na_inverse_gather(const T* __restrict__ w, const T* __restrict__ a, T* __restrict__ out,
                  const int* __restrict__ table, int bh_count, int dim) {
    typedef typename NaAccum<T>::type Acc;
    NaUnfusedGeom g;
    na_load_unfused(table, g);
    const int per_bh = g.num_tokens * dim;
    for (int bh = blockIdx.y; bh < bh_count; bh += gridDim.y)
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < per_bh; e += gridDim.x * blockDim.x) {
        const int c = e % dim;
        const int j = e / dim;
        const long long row = (long long)bh * g.num_tokens + j;
        int jc[NA_MAX_AXES], lo[NA_MAX_AXES], hi[NA_MAX_AXES], grp[NA_MAX_AXES], dil[NA_MAX_AXES];
        na_unflatten(g, j, jc);
#pragma unroll
        for (int x = 0; x < NA_MAX_AXES; ++x)
            na_queries_of_key(g.ax[x], jc[x], &lo[x], &hi[x], &grp[x], &dil[x]);
        const T* pw = w + (long long)bh * g.num_tokens * g.num_slots;
        const T* pa = a + (long long)bh * g.num_tokens * dim + c;
        Acc acc = Acc(0);
        for (int u0 = lo[0]; u0 < hi[0]; ++u0) {
            const int i0 = u0 * dil[0] + grp[0];
            const int s0 = na_slot_of_key(g.ax[0], i0, jc[0]);
            for (int u1 = lo[1]; u1 < hi[1]; ++u1) {
                const int i1 = u1 * dil[1] + grp[1];
                const int s1 = s0 * g.ext[1] + na_slot_of_key(g.ax[1], i1, jc[1]);
                for (int u2 = lo[2]; u2 < hi[2]; ++u2) {
                    const int i2 = u2 * dil[2] + grp[2];
                    const int slot = s1 * g.ext[2] + na_slot_of_key(g.ax[2], i2, jc[2]);
                    const long long i = na_flatten(g, i0, i1, i2);
                    acc += na_load_acc(pw, i * g.num_slots + slot, Acc()) *
                           na_load_acc(pa, i * dim, Acc());
                }
            }
        }
        out[row * dim + c] = NaConvert<T>::from(acc);
    }
}

// drpb[h, r] = sum over batches b and queries i of d_attn[b, h, i, slot] for the slot (if any)
// whose key sits at the per-axis offset r_x - (E_x - 1) (in dilated steps) from i. One block
// per (h, r): each thread sums a fixed strided subset of (b, i), then a fixed tree reduction.
template <typename T>
__global__ void __launch_bounds__(NA_RPB_THREADS)
na_rpb_backward(const T* __restrict__ d_attn, typename NaAccum<T>::type* __restrict__ drpb,
                const int* __restrict__ table, int batch, int heads) {
    typedef typename NaAccum<T>::type Acc;
    __shared__ Acc partial[NA_RPB_THREADS];
    NaUnfusedGeom g;
    na_load_unfused(table, g);
    const int entries = heads * g.num_rpb;
    for (int entry = blockIdx.x; entry < entries; entry += gridDim.x) {
        const int h = entry / g.num_rpb;
        int r = entry % g.num_rpb, off[NA_MAX_AXES];
#pragma unroll
        for (int x = NA_MAX_AXES - 1; x >= 0; --x) {
            const int span = 2 * g.ext[x] - 1;
            off[x] = r % span - (g.ext[x] - 1);
            r /= span;
        }
        Acc acc = Acc(0);
        for (int b = 0; b < batch; ++b) {
            const long long base = ((long long)b * heads + h) * g.num_tokens;
            for (int i = threadIdx.x; i < g.num_tokens; i += NA_RPB_THREADS) {
                int ic[NA_MAX_AXES];
                na_unflatten(g, i, ic);
                bool valid = true;
                int slot = 0;
#pragma unroll
                for (int x = 0; x < NA_MAX_AXES; ++x) {
                    int first, count, step;
                    na_keys_of_query(g.ax[x], ic[x], &first, &count, &step);
                    // The key at this offset is ic + off * step; its slot, exact (same group).
                    const int t = (ic[x] + off[x] * step - first) / step;
                    valid = valid && t >= 0 && t < count;
                    slot = slot * g.ext[x] + t;
                }
                if (valid) acc += na_load_acc(d_attn, (base + i) * g.num_slots + slot, Acc());
            }
        }
        partial[threadIdx.x] = acc;
        __syncthreads();
#pragma unroll
        for (int width = NA_RPB_THREADS / 2; width > 0; width >>= 1) {
            if (threadIdx.x < width) partial[threadIdx.x] += partial[threadIdx.x + width];
            __syncthreads();
        }
        if (threadIdx.x == 0) drpb[entry] = partial[0];
        __syncthreads();  // partial[] is reused by the next entry
    }
}
