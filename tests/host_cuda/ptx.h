// Host emulation of the inline-PTX instructions the package's kernels use, written from the PTX
// ISA (cvt: "Data Movement and Conversion Instructions"; mma: "Matrix Fragments for mma.m16n8k16
// with floating point type"; wgmma: "Asynchronous Warpgroup Level Matrix Multiply-Accumulate",
// its register fragments, matrix descriptors and shared-memory layouts), not from the kernels. build.py/asm.py translate every `asm`
// statement into a call of one of these functions, operands in PTX order: destinations are
// references bound to the statement's output operands, sources are values.
//
// Conversions are bit-exact: round-to-nearest-even, overflow to infinity (.rn without
// .satfinite), half subnormals produced and consumed exactly, NaN becomes the canonical NaN
// (0x7fff for f16/bf16, 0x7fffffff for f32).
//
// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32 is a warp-collective: all 32
// lanes publish their A (4 x .b32) and B (2 x .b32) registers, the 16x16 A and 16x8 B matrices
// are rebuilt from the ISA's per-lane fragment tables (every element owned by exactly one lane
// and register half, which is checked), and each lane gets D = A * B + C for its own four
// accumulator elements. Products of two 16-bit values are exact in double; the 16 products are
// summed in double and C added before one rounding to f32. (The ISA leaves the accumulation order
// and internal precision of the tensor cores unspecified; a single rounding is the most exact
// behaviour the hardware can have, and the tests' tolerances are set against fp32-rounded
// references, not against this emulation.)
#pragma once

namespace na_emu {
namespace ptx {

// ----- operand registers ------------------------------------------------------------------------
// Constraint letter -> register type (h: .b16, r: .b32, l: .b64, f: .f32, d: .f64).
template <char C> struct Reg;
template <> struct Reg<'h'> { typedef uint16_t type; };
template <> struct Reg<'r'> { typedef uint32_t type; };
template <> struct Reg<'l'> { typedef uint64_t type; };
template <> struct Reg<'f'> { typedef float type; };
template <> struct Reg<'d'> { typedef double type; };

// An output operand: the lvalue itself, which must have the register's type.
template <char C, typename T> inline typename Reg<C>::type& out(T& x) {
    static_assert(std::is_same_v<T, typename Reg<C>::type>,
                  "asm output operand type does not match its constraint");
    return x;
}
// An input operand: the value converted to the register type (an integer constraint of another
// width takes the value modulo 2^bits, as a register move would).
template <char C, typename T> inline typename Reg<C>::type in(const T& x) {
    if constexpr (std::is_pointer_v<T>) {  // an address ("l"): a generic 64-bit address
        static_assert(C == 'l', "a pointer asm operand needs the 64-bit constraint l");
        return reinterpret_cast<uintptr_t>(x);
    } else {
        static_assert(std::is_arithmetic_v<T>, "asm input operand is not a scalar");
        return static_cast<typename Reg<C>::type>(x);
    }
}

// ----- conversions -------------------------------------------------------------------------------
inline uint32_t f32_bits(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
}
inline float f32_from(uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// Round the integer `m` right by `shift` bits to nearest, ties to even.
inline uint32_t shift_rne(uint32_t m, int shift) {
    if (shift >= 32) return 0;
    const uint32_t q = m >> shift, rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1);
    return q + ((rem > half || (rem == half && (q & 1u))) ? 1u : 0u);
}

// cvt.rn.f16.f32
inline uint16_t f16_from_f32_rn(float f) {
    const uint32_t x = f32_bits(f), sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return 0x7fff;                     // NaN
    if (ax >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // >= 65520 (max + half ulp): inf
    const int e = int(ax >> 23);                             // biased f32 exponent
    const uint32_t m = (ax & 0x7fffffu) | 0x800000u;         // significand, 24 bits
    if (e >= 113) {  // normal half: exponent e - 112, 10 fraction bits; a carry bumps the exponent
        return uint16_t(sign | (uint32_t(e - 112) << 10) + shift_rne(m, 13) - 0x400u);
    }
    if (e < 102) return uint16_t(sign);  // below 2^-25: rounds to zero
    // Subnormal half: value / 2^-24 = m * 2^(e - 150 + 24); may round up to the smallest normal.
    return uint16_t(sign | shift_rne(m, 126 - e));
}

// cvt.f32.f16 (exact)
inline float f32_from_f16(uint16_t h) {
    const uint32_t sign = uint32_t(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0x1f) return f32_from(m ? 0x7fffffffu : (sign | 0x7f800000u));
    if (e == 0) {  // zero or subnormal: m * 2^-24
        const float v = std::ldexp(float(m), -24);
        return sign ? -v : v;
    }
    return f32_from(sign | ((e + 112u) << 23) | (m << 13));
}

// cvt.rn.bf16.f32
inline uint16_t bf16_from_f32_rn(float f) {
    const uint32_t x = f32_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return 0x7fff;
    return uint16_t((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);  // overflow carries into inf
}

inline float f32_from_bf16(uint16_t h) { return f32_from(uint32_t(h) << 16); }

inline void cvt_f32_f16(float& d, uint16_t a) { d = f32_from_f16(a); }
inline void cvt_f32_bf16(float& d, uint16_t a) { d = f32_from_bf16(a); }
inline void cvt_rn_f16_f32(uint16_t& d, float a) { d = f16_from_f32_rn(a); }
inline void cvt_rn_bf16_f32(uint16_t& d, float a) { d = bf16_from_f32_rn(a); }
// .f16x2 / .bf16x2: a -> the upper half of d, b -> the lower half.
inline void cvt_rn_f16x2_f32(uint32_t& d, float a, float b) {
    d = (uint32_t(f16_from_f32_rn(a)) << 16) | f16_from_f32_rn(b);
}
inline void cvt_rn_bf16x2_f32(uint32_t& d, float a, float b) {
    d = (uint32_t(bf16_from_f32_rn(a)) << 16) | bf16_from_f32_rn(b);
}

// ----- ex2.approx.ftz.f32 --------------------------------------------------------------------------
// 2^a. The hardware's approximation (max relative error 2^-22.5 per the ISA) is emulated by the
// correctly rounded value; .ftz: a subnormal input is read as zero (of its sign) and a subnormal
// result is flushed to zero. ex2(-inf) = +0, ex2(+inf) = +inf, NaN stays NaN.
inline void ex2_approx_ftz_f32(float& d, float a) {
    if (std::fpclassify(a) == FP_SUBNORMAL) a = std::copysign(0.0f, a);
    float y = float(std::exp2(double(a)));
    if (std::fpclassify(y) == FP_SUBNORMAL) y = 0.0f;
    d = y;
}

// ----- mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32 ---------------------------
enum : uint32_t { kMmaF16 = 0x6d6d6101u, kMmaBf16 = 0x6d6d6102u };

// Element i (0..7) of lane `lane`'s A fragment: its (row, col) in the 16x16 A.
inline void mma_a_position(int lane, int i, int* row, int* col) {
    const int group = lane >> 2, tig = lane % 4;
    *row = (i < 2 || (i >= 4 && i < 6)) ? group : group + 8;
    *col = tig * 2 + (i & 1) + (i >= 4 ? 8 : 0);
}
// Element i (0..3) of lane `lane`'s B fragment: its (row = k, col = n) in the 16x8 B.
inline void mma_b_position(int lane, int i, int* row, int* col) {
    const int group = lane >> 2, tig = lane % 4;
    *row = tig * 2 + (i & 1) + (i >= 2 ? 8 : 0);
    *col = group;
}
// Element i (0..3) of lane `lane`'s C/D fragment: its (row, col) in the 16x8 C/D.
inline void mma_c_position(int lane, int i, int* row, int* col) {
    const int group = lane >> 2, tig = lane % 4;
    *row = i < 2 ? group : group + 8;
    *col = tig * 2 + (i & 1);
}

template <uint32_t Tag>
inline void mma_m16n8k16_f32(float& d0, float& d1, float& d2, float& d3, uint32_t a0, uint32_t a1,
                             uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1, float c0,
                             float c1, float c2, float c3) {
    const uint32_t mine[6] = {a0, a1, a2, a3, b0, b1};
    const Collective all = collective(mine, 6, Tag);
    double* ab = all.shared;  // the 16 x 8 product A * B, computed once per warp
    if (all.first) {
        auto value = [](uint32_t reg, int half) {
            const uint16_t bits = uint16_t(half ? reg >> 16 : reg & 0xffffu);  // element 2k: low
            return double(Tag == kMmaF16 ? f32_from_f16(bits) : f32_from_bf16(bits));
        };
        double A[16][16], B[16][8];
        int seen_a[16][16] = {}, seen_b[16][8] = {};
        for (int lane = 0; lane < 32; ++lane) {
            for (int i = 0; i < 8; ++i) {
                int r, c;
                mma_a_position(lane, i, &r, &c);
                A[r][c] = value(all.regs[lane][i / 2], i & 1);
                ++seen_a[r][c];
            }
            for (int i = 0; i < 4; ++i) {
                int r, c;
                mma_b_position(lane, i, &r, &c);
                B[r][c] = value(all.regs[lane][4 + i / 2], i & 1);
                ++seen_b[r][c];
            }
        }
        for (int r = 0; r < 16; ++r)
            for (int c = 0; c < 16; ++c)
                if (seen_a[r][c] != 1 || (c < 8 && seen_b[r][c] != 1))
                    trap("mma fragment tables do not cover the matrices exactly once");
        for (int r = 0; r < 16; ++r)
            for (int n = 0; n < 8; ++n) {
                double s = 0.0;
                for (int k = 0; k < 16; ++k) s += A[r][k] * B[k][n];
                ab[r * 8 + n] = s;
            }
    }
    float* d[4] = {&d0, &d1, &d2, &d3};
    const float c[4] = {c0, c1, c2, c3};
    for (int i = 0; i < 4; ++i) {
        int r, n;
        mma_c_position(self->lane, i, &r, &n);
        *d[i] = float(ab[r * 8 + n] + double(c[i]));
    }
}

// ----- cp.async (sm_80): asynchronous global -> shared copies -------------------------------------
// cp.async.{ca,cg}.shared.global [dst], [src], cp-size{, src-size}: copies src-size bytes (default
// cp-size) and zero-fills the rest. Deferred: the bytes land when cp.async.wait_group/wait_all
// completes the copy's committed group, so reading a tile before waiting sees stale (poisoned)
// shared memory, as on hardware it may; or at once (emu.h's eager_cp_async), so that overwriting a
// buffer other warps still read shows.
inline void cp_async(uint32_t dst, uint64_t src, int cp_size, int src_size) {
    if (cp_size != 4 && cp_size != 8 && cp_size != 16) trap("cp.async cp-size must be 4, 8 or 16");
    if (src_size < 0 || src_size > cp_size) trap("cp.async src-size outside [0, cp-size]");
    if (dst % cp_size != 0 || src % cp_size != 0) trap("cp.async address not cp-size aligned");
    unsigned char* to = shared_pointer(dst, cp_size);
    const auto* from = reinterpret_cast<const unsigned char*>(uintptr_t(src));
    if (eager_cp_async) {  // lands now; the group bookkeeping is unchanged
        if (src_size) std::memcpy(to, from, size_t(src_size));
        std::memset(to + src_size, 0, size_t(cp_size - src_size));
        self->async.open.push_back(AsyncCopy{to, from, 0, 0});
        return;
    }
    self->async.open.push_back(AsyncCopy{to, from, cp_size, src_size});
}
inline void cp_async_cg_shared_global(uint32_t dst, uint64_t src, int cp_size) {
    if (cp_size != 16) trap("cp.async.cg needs cp-size 16");
    cp_async(dst, src, cp_size, cp_size);
}
inline void cp_async_cg_shared_global(uint32_t dst, uint64_t src, int cp_size, int src_size) {
    if (cp_size != 16) trap("cp.async.cg needs cp-size 16");
    cp_async(dst, src, cp_size, src_size);
}
inline void cp_async_ca_shared_global(uint32_t dst, uint64_t src, int cp_size) {
    cp_async(dst, src, cp_size, cp_size);
}
inline void cp_async_ca_shared_global(uint32_t dst, uint64_t src, int cp_size, int src_size) {
    cp_async(dst, src, cp_size, src_size);
}
inline void cp_async_commit_group() {
    self->async.groups.push_back(std::move(self->async.open));
    self->async.open.clear();
}
inline void cp_async_wait_group(int pending) {
    auto& groups = self->async.groups;
    while (int(groups.size()) > pending) {
        for (const AsyncCopy& c : groups.front()) {
            if (c.src_size) std::memcpy(c.dst, c.src, size_t(c.src_size));
            std::memset(c.dst + c.src_size, 0, size_t(c.size - c.src_size));
        }
        groups.erase(groups.begin());
    }
}
inline void cp_async_wait_all() {
    cp_async_commit_group();
    cp_async_wait_group(0);
}

// ----- ldmatrix.sync.aligned.m8n8.{x1,x2,x4}{,.trans}.shared.b16 ---------------------------------
// Warp-collective: lanes 8m..8m+7 give the row addresses (16-byte aligned rows of eight b16) of
// matrix m. Register m of lane l holds, without .trans, row l/4, columns 2(l%4) and 2(l%4)+1 of
// matrix m (low half first); with .trans, rows 2(l%4) and 2(l%4)+1 of column l/4.
enum : uint32_t { kLdmatrix = 0x6c646d00u };
template <int X, bool TRANS> inline void ldmatrix_impl(uint32_t* d, uint32_t addr) {
    const uint32_t mine[1] = {addr};
    const Collective all = collective(mine, 1, kLdmatrix + X * 2 + TRANS);
    const int lane = self->lane;
    for (int m = 0; m < X; ++m) {
        auto element = [&](int row, int col) {
            const uint32_t row_addr = all.regs[8 * m + row][0];
            if (row_addr % 16) trap("ldmatrix row address not 16-byte aligned");
            uint16_t v;
            std::memcpy(&v, shared_pointer(row_addr, 16) + 2 * col, 2);
            return uint32_t(v);
        };
        const int a = TRANS ? 2 * (lane % 4) : lane / 4, b = TRANS ? lane / 4 : 2 * (lane % 4);
        d[m] = TRANS ? element(a, b) | (element(a + 1, b) << 16)
                     : element(a, b) | (element(a, b + 1) << 16);
    }
}
inline void ldmatrix_sync_aligned_m8n8_x1_shared_b16(uint32_t& d0, uint32_t a) {
    ldmatrix_impl<1, false>(&d0, a);
}
inline void ldmatrix_sync_aligned_m8n8_x2_shared_b16(uint32_t& d0, uint32_t& d1, uint32_t a) {
    uint32_t d[2];
    ldmatrix_impl<2, false>(d, a);
    d0 = d[0], d1 = d[1];
}
inline void ldmatrix_sync_aligned_m8n8_x4_shared_b16(uint32_t& d0, uint32_t& d1, uint32_t& d2,
                                                     uint32_t& d3, uint32_t a) {
    uint32_t d[4];
    ldmatrix_impl<4, false>(d, a);
    d0 = d[0], d1 = d[1], d2 = d[2], d3 = d[3];
}
inline void ldmatrix_sync_aligned_m8n8_x2_trans_shared_b16(uint32_t& d0, uint32_t& d1, uint32_t a) {
    uint32_t d[2];
    ldmatrix_impl<2, true>(d, a);
    d0 = d[0], d1 = d[1];
}
inline void ldmatrix_sync_aligned_m8n8_x4_trans_shared_b16(uint32_t& d0, uint32_t& d1,
                                                           uint32_t& d2, uint32_t& d3, uint32_t a) {
    uint32_t d[4];
    ldmatrix_impl<4, true>(d, a);
    d0 = d[0], d1 = d[1], d2 = d[2], d3 = d[3];
}

// ----- wgmma.mma_async.sync.aligned.m64nNk16.f32.{f16,bf16}.{f16,bf16} (sm_90a) -----------------
// A warpgroup (4 consecutive warps) computes D[64 x N] (+)= A[64 x 16] B[16 x N]; warp w of the
// group owns rows 16w..16w+15, its lanes holding them in the mma.sync C layout (element i of
// lane l: n-tile i / 4, then i % 4 as mma_c_position). A comes from shared memory (descriptor,
// K-major) or from the warp's registers (mma.sync's A fragment of its 16 rows); B from shared
// memory, K-major ((n, k) at row n) or, with imm-trans-b, MN-major ((k, n) at row k). Rows of a
// warp depend only on its own A rows, so the emulation is a warp-collective (descriptors checked
// equal across lanes) that runs at issue; the ISA's asynchrony is not modelled beyond requiring a
// wgmma.fence since the last wait (the kernels wait for every group before reading D or
// reusing shared memory).
//
// Descriptors (matrix-descriptor format): start address >> 4 (bits 0-13), leading byte offset
// >> 4 (16-29), stride byte offset >> 4 (32-45), base offset (49-51), layout (62-63). Only the
// 128-byte swizzle (layout 1, base offset 0) is emulated. Its canonical layouts, in bytes from the
// start and before the swizzle: K-major element (row, k): (row / 8) * SBO + (row % 8) * 128 +
// 2k; MN-major element (k, n): (n / 64) * LBO + (k / 8) * SBO + (k % 8) * 128 + 2 (n % 64). The
// swizzle XORs address bits 4-6 with bits 7-9 (16-byte pieces within 1024-byte atoms).
struct WgmmaDescriptor {
    uint32_t start, lead, stride;
};
inline WgmmaDescriptor wgmma_descriptor(uint64_t d) {
    if (((d >> 62) & 3u) != 1u) trap("wgmma descriptor: only the 128-byte swizzle is emulated");
    if (((d >> 49) & 7u) != 0u) trap("wgmma descriptor: a nonzero base offset is not emulated");
    return WgmmaDescriptor{uint32_t(d & 0x3fffu) << 4, uint32_t((d >> 16) & 0x3fffu) << 4,
                           uint32_t((d >> 32) & 0x3fffu) << 4};
}
inline uint32_t swizzle128(uint32_t addr) { return addr ^ (((addr >> 7) & 7u) << 4); }
template <uint32_t Tag> inline double wgmma_element(uint32_t addr) {
    uint16_t bits;
    std::memcpy(&bits, shared_pointer(swizzle128(addr), 2), 2);
    return double(Tag == kMmaF16 ? f32_from_f16(bits) : f32_from_bf16(bits));
}
inline double wgmma_k_major(const WgmmaDescriptor& d, int row, int k, uint32_t tag) {
    const uint32_t a = d.start + uint32_t(row / 8) * d.stride + uint32_t(row % 8) * 128 + 2 * k;
    return tag == kMmaF16 ? wgmma_element<kMmaF16>(a) : wgmma_element<kMmaBf16>(a);
}
inline double wgmma_mn_major(const WgmmaDescriptor& d, int k, int n, uint32_t tag) {
    const uint32_t a = d.start + uint32_t(n / 64) * d.lead + uint32_t(k / 8) * d.stride +
                       uint32_t(k % 8) * 128 + 2 * (n % 64);
    return tag == kMmaF16 ? wgmma_element<kMmaF16>(a) : wgmma_element<kMmaBf16>(a);
}
// Operands in PTX order: the N/2 accumulators, then either (SS) a-desc, b-desc, scale-d,
// imm-scale-a, imm-scale-b, imm-trans-a, imm-trans-b, or (RS) a0..a3, b-desc, scale-d,
// imm-scale-a, imm-scale-b, imm-trans-b. scale-d: the value of the predicate's integer source.
template <int N, uint32_t Tag, typename... Args> inline void wgmma_m64k16(Args&&... args) {
    constexpr int ND = N / 2, NARGS = int(sizeof...(Args));
    static_assert(NARGS == ND + 7 || NARGS == ND + 9, "wgmma operand count");
    constexpr bool A_REGS = NARGS == ND + 9;
    float* d[ND];
    uint64_t rest[9];
    int i = 0;
    auto take = [&](auto&& x) {
        if constexpr (std::is_same_v<std::remove_cvref_t<decltype(x)>, float>) {
            d[i++] = &x;
        } else {
            rest[i++ - ND] = uint64_t(x);
        }
    };
    (take(std::forward<Args>(args)), ...);
    if (!self->wgmma_fenced) trap("wgmma.mma_async without a wgmma.fence since the last wait");
    const uint64_t desc_b = rest[A_REGS ? 4 : 1], desc_a = A_REGS ? 0 : rest[0];
    const bool scale_d = rest[A_REGS ? 5 : 2] != 0;
    const uint64_t* imm = rest + (A_REGS ? 6 : 3);  // scale-a, scale-b, [trans-a,] trans-b
    if (imm[0] != 1 || imm[1] != 1) trap("wgmma: only imm-scale-a = imm-scale-b = 1 is emulated");
    if (!A_REGS && imm[2] != 0) trap("wgmma: a transposed A is not emulated");
    const bool trans_b = imm[A_REGS ? 2 : 3] != 0;
    // Every lane's descriptors (checked equal) and, with A in registers, its four A registers.
    const uint32_t mine[8] = {uint32_t(desc_b), uint32_t(desc_b >> 32), uint32_t(desc_a),
                              uint32_t(desc_a >> 32), uint32_t(rest[0]), uint32_t(rest[1]),
                              uint32_t(rest[2]), uint32_t(rest[3])};
    const uint32_t tag = 0x77670000u + N * 4 + (A_REGS ? 2 : 0) + (Tag == kMmaF16 ? 1 : 0);
    const Collective all = collective(mine, A_REGS ? 8 : 4, tag);
    for (int l = 0; l < 32; ++l)
        for (int w = 0; w < 4; ++w)
            if (all.regs[l][w] != mine[w]) trap("wgmma: lanes passed different descriptors");
    const WgmmaDescriptor b = wgmma_descriptor(desc_b);
    const int warp_rows = 16 * int((threadIdx.x / 32) % 4);  // the warp's rows in the 64
    double A[16][16];
    if constexpr (A_REGS) {
        for (int lane = 0; lane < 32; ++lane)
            for (int e = 0; e < 8; ++e) {
                int r, c;
                mma_a_position(lane, e, &r, &c);
                const uint32_t reg = all.regs[lane][4 + e / 2];
                const uint16_t bits = uint16_t(e & 1 ? reg >> 16 : reg & 0xffffu);
                A[r][c] = double(Tag == kMmaF16 ? f32_from_f16(bits) : f32_from_bf16(bits));
            }
    } else {
        const WgmmaDescriptor a = wgmma_descriptor(desc_a);
        for (int r = 0; r < 16; ++r)
            for (int k = 0; k < 16; ++k) A[r][k] = wgmma_k_major(a, warp_rows + r, k, Tag);
    }
    for (int e = 0; e < ND; ++e) {
        int r, c;
        mma_c_position(self->lane, e % 4, &r, &c);
        c += 8 * (e / 4);
        double sum = 0.0;
        for (int k = 0; k < 16; ++k)
            sum += A[r][k] * (trans_b ? wgmma_mn_major(b, k, c, Tag) : wgmma_k_major(b, c, k, Tag));
        *d[e] = float(sum + (scale_d ? double(*d[e]) : 0.0));
    }
}
inline void wgmma_fence_sync_aligned() { self->wgmma_fenced = true; }
inline void wgmma_commit_group_sync_aligned() {}
inline void wgmma_wait_group_sync_aligned(int) { self->wgmma_fenced = false; }
inline void fence_proxy_async_shared_cta() {}

}  // namespace ptx
}  // namespace na_emu
