// CUDA-on-host shim: runs the package's float/double kernel instances on the CPU so the CPU test
// suite can check their index, mask and reduction logic without a GPU.
//
// Blocks run one after another, so `__shared__` becomes `static` (a function static is
// block-shared); `extern __shared__` arrays are rewritten by build.py into pointers to the
// block's dynamic buffer, filled with 0xff bytes (NaN / -1) before every block so reads of
// never-written shared memory poison the result. Warp shuffles go through a per-warp exchange
// buffer and a per-warp barrier. Inline PTX (`asm`) statements are translated by build.py/asm.py
// into calls of the instruction emulations in ptx.h (mma.sync is a warp-collective rendezvous
// like the shuffles); an instruction with no emulation becomes a trap naming it.
//
// The threads of a block are either (default) fibers on one OS thread, switched only at
// barriers — deterministic, fast, and the worst interleaving for a missing barrier: each thread
// runs its segment before the next one starts, and warp 0 runs up to the next __syncthreads
// before warp 1 starts — or, with -DNA_EMU_REAL_THREADS, real std::threads (a barrier phase
// then costs milliseconds for a 256-thread block on 2 cores, but races show up as on hardware).
// Fibers detect a divergent barrier exactly; real threads abort after NA_EMU_TIMEOUT_S seconds
// rather than hang.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <ucontext.h>

#ifndef NA_EMU_TIMEOUT_S
#define NA_EMU_TIMEOUT_S 60
#endif

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#define __shared__ static

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
typedef dim3 uint3;
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(8) float2 { float x, y; };
static constexpr int warpSize = 32;

thread_local dim3 threadIdx, blockIdx, blockDim, gridDim;

namespace na_emu {

[[noreturn]] inline void trap(const char* why) {
    std::fprintf(stderr, "\n[host_cuda emu] fatal: %s (block %u,%u,%u thread %u,%u,%u)\n", why,
                 blockIdx.x, blockIdx.y, blockIdx.z, threadIdx.x, threadIdx.y, threadIdx.z);
    std::fflush(stderr);
    std::abort();
}

struct Barrier;
struct Warp;
// cp.async copies of one thread (ptx.h): issued but not yet committed, and committed groups in
// order. A copy lands in shared memory only when a wait completes its group.
struct AsyncCopy {
    unsigned char* dst;
    const unsigned char* src;
    int size, src_size;
};
struct AsyncCopies {
    std::vector<AsyncCopy> open;
    std::vector<std::vector<AsyncCopy>> groups;
};
struct ThreadCtx {
    Barrier* block;
    Warp* warp;
    unsigned char* dyn;
    int lane;
    int parity;
    uint64_t collectives = 0;  // warp-collective instructions this thread has executed
    size_t dyn_bytes = 0;      // size of the dynamic shared memory (the emulated .shared window)
    AsyncCopies async;
    bool wgmma_fenced = false;  // a wgmma.fence since the last wgmma.wait_group (ptx.h)
};
thread_local ThreadCtx* self;

#ifdef NA_EMU_REAL_THREADS
// A reusable barrier for `count` threads; a thread that returns from the kernel leaves it (CUDA
// lets exited threads skip later __syncthreads). Waiters spin on the generation with yield:
// cheaper than a condition variable when a block has more threads than the machine has cores.
struct Barrier {
    explicit Barrier(int count) : count_(count) {}
    void wait(const char* what) {
        unsigned gen;
        {
            std::lock_guard<std::mutex> lock(m_);
            gen = gen_.load(std::memory_order_relaxed);
            if (++waiting_ == count_) return release();
        }
        const auto start = std::chrono::steady_clock::now();
        for (unsigned spin = 1; gen_.load(std::memory_order_acquire) == gen; ++spin) {
            std::this_thread::yield();
            if (spin % 4096 == 0 && std::chrono::steady_clock::now() - start >
                                        std::chrono::seconds(NA_EMU_TIMEOUT_S))
                trap(what);
        }
    }
    void leave() {
        std::lock_guard<std::mutex> lock(m_);
        if (--count_ == waiting_ && waiting_ > 0) release();
    }

  private:
    void release() {
        waiting_ = 0;
        gen_.fetch_add(1, std::memory_order_release);
    }
    std::mutex m_;
    int count_, waiting_ = 0;
    std::atomic<unsigned> gen_{0};
};
#else
// Fibers: the threads of a block run on one OS thread, each until it waits on a barrier; a
// barrier opens once every live member waits on it. Deterministic.
struct Fiber {
    ucontext_t uc;
    ThreadCtx ctx;
    dim3 tid;
    Barrier* waiting = nullptr;
    bool done = false;
};
thread_local Fiber* running;
thread_local ucontext_t scheduler;
thread_local std::function<void()>* fiber_body;
inline void fiber_entry() {
    (*fiber_body)();
    running->done = true;  // returning resumes `scheduler` (uc_link)
}
struct Barrier {
    explicit Barrier(int) {}
    void wait(const char*) {
        running->waiting = this;
        swapcontext(&running->uc, &scheduler);
    }
    void leave() {}
};
#endif

struct Warp {
    explicit Warp(int lanes) : lanes(lanes), bar(lanes) {}
    int lanes;
    Barrier bar;
    uint64_t slot[2][32];  // double-buffered: one barrier per exchange suffices
    // Warp-collective instructions (ptx.h): each lane's operand registers, the instruction's tag,
    // and a per-parity cache of a result every lane shares (seq: the collective it belongs to).
    uint32_t regs[2][32][8];
    uint32_t tag[2][32];
    uint64_t seq[2] = {~0ull, ~0ull};
    double shared[2][16 * 8];
};

inline void* dynamic_smem() { return self->dyn; }

// The .shared state space: addresses are byte offsets into the block's dynamic shared memory
// (the kernels stage every tile there); anything else traps.
inline uint32_t shared_address(const void* p) {
    const auto* c = static_cast<const unsigned char*>(p);
    if (c < self->dyn || c >= self->dyn + self->dyn_bytes)
        trap("a .shared address outside the dynamic shared memory (static __shared__ is not "
             "addressable by cp.async/ldmatrix in the emulation)");
    return uint32_t(c - self->dyn);
}
inline unsigned char* shared_pointer(uint32_t addr, int bytes) {
    if (uint64_t(addr) + bytes > self->dyn_bytes) trap("a .shared access past the dynamic shared memory");
    return self->dyn + addr;
}

// A warp-collective instruction (mma.sync, ldmatrix): every lane publishes `n` <= 8 words and a
// tag naming the instruction, waits for the whole warp, and gets every lane's words. Traps if
// the warp is partial or its lanes ran different instructions. `*first`: this lane is the first
// to read this round, so per-warp results computed into `shared()` can be reused by the others.
struct Collective {
    const uint32_t (*regs)[8];
    double* shared;
    bool first;
};
inline Collective collective(const uint32_t* words, int n, uint32_t tag) {
    Warp& w = *self->warp;
    if (w.lanes != 32) trap("a .sync.aligned warp-collective instruction in a partial warp");
    const int p = self->parity;
    self->parity ^= 1;
    const uint64_t seq = self->collectives++;
    std::memcpy(w.regs[p][self->lane], words, sizeof(uint32_t) * n);
    w.tag[p][self->lane] = tag;
    w.bar.wait("warp-collective instruction never completed (divergent mma/ldmatrix?)");
    for (int l = 0; l < 32; ++l)
        if (w.tag[p][l] != tag)
            trap("lanes of a warp executed different warp-collective instructions");
#ifdef NA_EMU_REAL_THREADS
    (void)seq;  // lanes run concurrently: each computes the shared result itself
    static thread_local double scratch[16 * 8];
    return Collective{w.regs[p], scratch, true};
#else
    const bool first = w.seq[p] != seq;
    w.seq[p] = seq;
    return Collective{w.regs[p], w.shared[p], first};
#endif
}

// Every lane publishes `v`, then reads lane `src(lane)`'s value (-1: keep its own).
template <typename T, typename Src> inline T exchange(unsigned mask, T v, Src src) {
    static_assert(sizeof(T) <= 8, "shuffle of a type wider than 8 bytes");
    Warp& w = *self->warp;
    const unsigned full = w.lanes == 32 ? 0xffffffffu : (1u << w.lanes) - 1u;
    if ((mask & full) != full) trap("shuffle with a partial mask is not emulated");
    uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    const int p = self->parity;
    self->parity ^= 1;
    w.slot[p][self->lane] = bits;
    w.bar.wait("warp shuffle never completed (divergent shuffle?)");
    const int s = src(self->lane);
    if (s < 0 || s >= w.lanes) return v;
    T out;
    std::memcpy(&out, &w.slot[p][s], sizeof(T));
    return out;
}

// Runs one block: `body` once per thread, threadIdx and the thread context set.
inline void run_block(dim3 block, unsigned char* dyn, size_t dyn_bytes,
                      const std::function<void()>& body) {
    const int n = int(block.x * block.y * block.z);
    Barrier bar(n);
    std::vector<std::unique_ptr<Warp>> warps;
    for (int t = 0; t < n; t += 32) warps.emplace_back(new Warp(std::min(32, n - t)));
    auto tid = [&](int t) {
        return dim3{t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
    };
#ifdef NA_EMU_REAL_THREADS
    const dim3 grid = gridDim, bidx = blockIdx;
    std::vector<std::thread> pool;
    for (int t = 0; t < n; ++t)
        pool.emplace_back([&, t] {
            ThreadCtx me{&bar, warps[t / 32].get(), dyn, t % 32, 0, 0, dyn_bytes, {}};
            gridDim = grid, blockDim = block, blockIdx = bidx, threadIdx = tid(t), self = &me;
            body();
            me.warp->bar.leave();
            bar.leave();
        });
    for (auto& th : pool) th.join();
#else
    constexpr size_t kStack = 256 << 10;
    static thread_local std::vector<std::unique_ptr<char[]>> stacks;
    while (stacks.size() < size_t(n)) stacks.emplace_back(new char[kStack]);
    std::vector<Fiber> fibers(n);
    std::function<void()> wrapped = body;
    fiber_body = &wrapped;
    for (int t = 0; t < n; ++t) {
        Fiber& f = fibers[t];
        getcontext(&f.uc);
        f.uc.uc_stack.ss_sp = stacks[t].get();
        f.uc.uc_stack.ss_size = kStack;
        f.uc.uc_link = &scheduler;
        makecontext(&f.uc, fiber_entry, 0);
        f.ctx = ThreadCtx{&bar, warps[t / 32].get(), dyn, t % 32, 0, 0, dyn_bytes, {}};
        f.tid = tid(t);
    }
    // Warp by warp: run the warp's lanes (each until it waits), open the warp barrier once all
    // its live lanes wait on it, repeat until the warp waits on __syncthreads; then the next
    // warp. So warp 0 runs its whole segment before warp 1 starts: the worst case for a missing
    // barrier between warps. When every warp waits on __syncthreads, the block barrier opens.
    auto waits_on = [&](int t, const Barrier* b) {
        return fibers[t].done || fibers[t].waiting == b;
    };
    for (int t = 0;;) {
        if (t < n) {
            Fiber& f = fibers[t];
            if (!f.done && !f.waiting) {
                running = &f, threadIdx = f.tid, self = &f.ctx;
                swapcontext(&scheduler, &f.uc);
            }
            if (++t % 32 != 0 && t != n) continue;
            const int w = (t - 1) / 32, first = w * 32;
            bool all = true, any = false;
            for (int u = first; u < t; ++u) {
                all = all && waits_on(u, &warps[w]->bar);
                any = any || !fibers[u].done;
            }
            if (all && any) {
                for (int u = first; u < t; ++u) fibers[u].waiting = nullptr;
                t = first;
            }
            continue;
        }
        bool live = false;
        for (int u = 0; u < n; ++u) {
            if (!waits_on(u, &bar))
                trap("deadlock: threads of a block wait on different barriers (divergent "
                     "__syncthreads or shuffle)");
            live = live || !fibers[u].done;
        }
        if (!live) break;
        for (Fiber& f : fibers) f.waiting = nullptr;
        t = 0;
    }
#endif
}

// Unpacks cuLaunchKernel-style `void** args` (one pointer per kernel parameter) and runs the grid,
// one block at a time.
// cp.async timing (ptx.h): copies land when waited for (default: a read before the wait sees
// stale data), or at once with NA_EMU_CP_ASYNC_EAGER=1 in the environment at launch (a buffer
// overwritten while other warps still read it shows). Hardware may do either.
inline bool eager_cp_async = false;

template <typename... P, typename... A>
void launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, A... args) {
    constexpr size_t kGuard = 4096;  // canary bytes after the dynamic shared memory
    const char* eager = std::getenv("NA_EMU_CP_ASYNC_EAGER");
    eager_cp_async = eager && eager[0] == '1';
    std::vector<unsigned char> dyn(smem + kGuard);
    gridDim = grid, blockDim = block;
    for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
    for (unsigned bx = 0; bx < grid.x; ++bx) {
        std::fill(dyn.begin(), dyn.begin() + smem, 0xff);
        std::fill(dyn.begin() + smem, dyn.end(), 0x5a);
        blockIdx = dim3{bx, by, bz};
        run_block(block, dyn.data(), smem, [&] { kernel(args...); });
        for (size_t i = smem; i < dyn.size(); ++i)
            if (dyn[i] != 0x5a) trap("a thread wrote past the dynamic shared memory size");
    }
}

template <typename... P, size_t... I>
void launch_packed(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, void** args,
                   std::index_sequence<I...>) {
    launch(kernel, grid, block, smem, *static_cast<std::decay_t<P>*>(args[I])...);
}

// Parameter type codes, so the Python side can check what it packs: i4 (int), u4, i8, f4, f8,
// p<code> (pointer), s<size> (anything else).
template <typename T> struct Code {
    static std::string get() {
        if constexpr (std::is_pointer_v<T>)
            return "p" + Code<std::remove_cv_t<std::remove_pointer_t<T>>>::get();
        else if constexpr (std::is_floating_point_v<T>)
            return "f" + std::to_string(sizeof(T));
        else if constexpr (std::is_integral_v<T>)
            return (std::is_signed_v<T> ? "i" : "u") + std::to_string(sizeof(T));
        else
            return "s" + std::to_string(sizeof(T));
    }
};
template <typename... P> std::string signature(void (*)(P...)) {
    std::string s;
    ((s += (s.empty() ? "" : ",") + Code<std::decay_t<P>>::get()), ...);
    return s;
}

}  // namespace na_emu

// One exported C entry point (and its signature string) per kernel instance.
#define NA_EMU_EXPORT(name, ...)                                                              \
    extern "C" void name(const unsigned* g, const unsigned* b, unsigned long smem, void** a) { \
        auto k = &__VA_ARGS__;                                                                \
        na_emu::launch_packed(k, dim3{g[0], g[1], g[2]}, dim3{b[0], b[1], b[2]}, smem, a,     \
                              std::make_index_sequence<std::tuple_size_v<                     \
                                  decltype(na_emu::args_of(k))>>());                          \
    }                                                                                         \
    extern "C" const char* name##__signature() {                                              \
        static const std::string s = na_emu::signature(&__VA_ARGS__);                        \
        return s.c_str();                                                                     \
    }

namespace na_emu {
template <typename... P> std::tuple<P...> args_of(void (*)(P...));
}

// ----- device built-ins -----------------------------------------------------------------------
inline void __syncthreads() { na_emu::self->block->wait("__syncthreads never completed"); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
    na_emu::exchange(mask, 0, [](int l) { return l; });
}
template <typename T> inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
    return na_emu::exchange(mask, v, [&](int l) { return l / width * width + src % width; });
}
template <typename T> inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
    // A source in a later segment of `width` lanes returns the caller's own value.
    return na_emu::exchange(mask, v, [&](int l) {
        const int s = l ^ lane_mask;
        return s / width > l / width ? -1 : s;
    });
}
template <typename T> inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    return na_emu::exchange(mask, v, [&](int l) {
        return l % width + int(delta) < width ? l + int(delta) : -1;
    });
}
template <typename T> inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    return na_emu::exchange(mask, v, [&](int l) { return l % width >= int(delta) ? l - int(delta) : -1; });
}

template <typename T> inline T atomicAdd(T* p, T v) {
    static std::mutex m;
    std::lock_guard<std::mutex> lock(m);
    T old = *p;
    *p = old + v;
    return old;
}

template <typename To, typename From> inline To na_emu_bits(From x) {
    static_assert(sizeof(To) == sizeof(From));
    To y;
    std::memcpy(&y, &x, sizeof(To));
    return y;
}
inline float __int_as_float(int x) { return na_emu_bits<float>(x); }
inline float __uint_as_float(unsigned x) { return na_emu_bits<float>(x); }
inline int __float_as_int(float x) { return na_emu_bits<int>(x); }
inline unsigned __float_as_uint(float x) { return na_emu_bits<unsigned>(x); }
inline double __longlong_as_double(long long x) { return na_emu_bits<double>(x); }
inline long long __double_as_longlong(double x) { return na_emu_bits<long long>(x); }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fdividef(float a, float b) { return a / b; }
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline size_t __cvta_generic_to_shared(const void* p) { return na_emu::shared_address(p); }

// CUDA's overloaded min/max (device functions, no templates: mixed calls promote as in CUDA).
#define NA_EMU_MINMAX(T)                                   \
    inline T min(T a, T b) { return b < a ? b : a; }       \
    inline T max(T a, T b) { return a < b ? b : a; }
NA_EMU_MINMAX(int)
NA_EMU_MINMAX(unsigned)
NA_EMU_MINMAX(long long)
NA_EMU_MINMAX(unsigned long long)
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(double a, double b) { return fmax(a, b); }
#undef NA_EMU_MINMAX

#include "ptx.h"
