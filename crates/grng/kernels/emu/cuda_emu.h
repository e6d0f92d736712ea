// CPU emulation of the CUDA subset grng's kernels use (GPU.md §2).
//
// The same kernels/*.cu sources compile as C++17 with g++/clang (-DGRNG_EMU) against this
// header and run on the CPU: every thread of a block is a cooperative fiber (runtime in
// cuda_emu.cpp) that switches only at barriers and warp collectives; blocks run one after
// another on the calling OS thread, along x in the order 0, 2, 4, …, 1, 3, 5, … (not the
// launch order, which a GPU does not keep either: a kernel that depends on it shows).
// Anything not declared here fails to compile on purpose.
//
// Semantics (each checked by kernels/emu/selftest.cu against its CUDA definition):
// - __shared__ is `static thread_local`: per OS thread, shared by the fibers of the running
//   block. Static shared memory is NOT reset between blocks; dynamic shared memory
//   (GRNG_DYN_SHARED) is filled with 0xFF bytes (NaN for float and bf16) before each block,
//   and a guard page right after it makes overruns fault.
// - __syncthreads must be reached by every thread of the block (strict: a thread that exited
//   while others wait is reported, as are barriers not all threads reach) → abort + message.
// - Warp collectives (shuffles, votes, __syncwarp, WMMA load/store/mma) complete when every
//   live lane of `mask` has arrived; the last lane to arrive computes every lane's result,
//   so no lane can run ahead and overwrite data another lane has yet to read. Reading a lane
//   outside the participating set, a lane not in its own mask, different collectives with
//   the same mask, or collectives that can never complete abort with a message.
// - WMMA fragments hold the whole 16x16 tile in every lane (layout is opaque in CUDA too);
//   load/store/mma check that all 32 lanes pass identical arguments/fragments, so per-lane
//   element tricks that depend on CUDA's private layout are caught rather than mis-emulated.
// - Atomics are plain read-modify-writes: fibers switch only at barriers, so nothing can
//   interleave inside one.
#pragma once

#ifndef GRNG_EMU
#error "cuda_emu.h is the CPU emulation of CUDA; compile with -DGRNG_EMU"
#endif

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <utility>

// ---------------------------------------------------------------------------------------
// Launch record shared with Rust (src/cuda/emu.rs `EmuLaunch`, #[repr(C)]).
extern "C" {
// A buffer passed to the kernel (host memory): WMMA checks pointer alignment relative to its
// base (cudaMalloc aligns to 256 bytes, host vectors less) and that tiles stay inside it.
struct grng_emu_buffer {
    uint64_t base;
    uint64_t bytes;
};
struct grng_emu_launch {
    uint32_t grid[3];
    uint32_t block[3];
    uint32_t shared_mem;
    uint32_t nbuffers;
    const grng_emu_buffer* buffers;
};
}

// ---------------------------------------------------------------------------------------
// Qualifiers and keywords.
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __shared__ static thread_local
#define __constant__ const
#define __align__(n) alignas(n)
#define __launch_bounds__(...)
// A by-value parameter read in place (CUDA: no local copy); here the fiber's own copy.
#define __grid_constant__
// __restrict__ is a GNU C++ keyword already. __noinline__ is not emulated: libstdc++ uses
// it as an attribute name.

constexpr int warpSize = 32;

// ---------------------------------------------------------------------------------------
// Vector types (same size and alignment as CUDA's).
struct uint3 {
    unsigned int x, y, z;
};
struct dim3 {
    unsigned int x, y, z;
    constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1)
        : x(x_), y(y_), z(z_) {}
};
struct alignas(8) float2 {
    float x, y;
};
struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(8) int2 {
    int x, y;
};
struct alignas(16) int4 {
    int x, y, z, w;
};
struct alignas(8) uint2 {
    unsigned int x, y;
};
struct alignas(16) uint4 {
    unsigned int x, y, z, w;
};
inline float2 make_float2(float x, float y) { return float2{x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
inline int2 make_int2(int x, int y) { return int2{x, y}; }
inline int4 make_int4(int x, int y, int z, int w) { return int4{x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return uint2{x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) {
    return uint4{x, y, z, w};
}

// ---------------------------------------------------------------------------------------
// Runtime interface (kernels/emu/cuda_emu.cpp). Kernels never call these directly.
namespace grng_emu {

// The public part of a fiber; the runtime extends it.
struct ThreadInfo {
    uint3 idx;          // threadIdx
    unsigned tid;       // linear thread id in the block
    unsigned lane;      // tid % 32
    unsigned warp;      // tid / 32
    uint64_t xresult;   // result of the last collective this thread took part in
};
struct BlockInfo {
    uint3 idx;  // blockIdx
    dim3 dim;   // blockDim
    dim3 grid;  // gridDim
};

extern thread_local ThreadInfo* tl_thread;
extern thread_local BlockInfo* tl_block;

[[noreturn]] void fail(const char* what);
unsigned char* dyn_smem();

enum BlockOp { BLOCK_SYNC = 0, BLOCK_COUNT, BLOCK_AND, BLOCK_OR };
int block_sync(BlockOp op, int pred);

enum WarpOp {
    W_SYNC = 0,
    W_SHFL_IDX,
    W_SHFL_UP,
    W_SHFL_DOWN,
    W_SHFL_XOR,
    W_BALLOT,
    W_ANY,
    W_ALL,
    W_RED_ADD,
    W_RED_MIN_I,
    W_RED_MAX_I,
    W_RED_MIN_U,
    W_RED_MAX_U,
    W_FN,
};
// One warp-collective operation: blocks until every live lane of `mask` has arrived; the
// last one computes each participant's result (left in tl_thread->xresult). For W_FN, `fn`
// is called once with every lane's `ctx` (null for lanes not participating).
void warp_op(unsigned mask, WarpOp op, uint64_t value, int b, int width, void* ctx,
             void (*fn)(void* const* ctxs, unsigned participants));
// Full-warp check for WMMA: all 32 lanes must exist.
void require_full_warp(const char* what);

void run_grid(const grng_emu_launch* cfg, const char* name, void (*body)(void*), void* ctx);

template <class... A>
struct LaunchCtx {
    void (*f)(A...);
    void** args;
};
template <class... A, std::size_t... I>
inline void call_unpacked(void (*f)(A...), void** args, std::index_sequence<I...>) {
    f(*static_cast<std::remove_cv_t<A>*>(args[I])...);
}
template <class... A>
void thunk(void* p) {
    auto* c = static_cast<LaunchCtx<A...>*>(p);
    call_unpacked(c->f, c->args, std::index_sequence_for<A...>{});
}
// Kernel parameters are what the Rust argument builder can pass: pointers and scalars of at
// most 8 bytes (each read from its own 8-byte slot, exactly like cuLaunchKernel's params), and
// plain structs of 32-bit words (a multi-tensor table, `KernelArgs::table`), read from a
// buffer of their own size.
template <class T>
constexpr bool is_kernel_param =
    std::is_pointer<T>::value || (std::is_arithmetic<T>::value && sizeof(T) <= 8) ||
    (std::is_class<T>::value && std::is_trivially_copyable<T>::value && alignof(T) == 4);
template <class... A>
void launch(const grng_emu_launch* cfg, const char* name, void (*f)(A...), void** args) {
    static_assert((is_kernel_param<A> && ...),
                  "kernel parameters must be pointers, scalars of at most 8 bytes or tables");
    LaunchCtx<A...> c{f, args};
    run_grid(cfg, name, &thunk<A...>, &c);
}
template <class F, class Sig>
struct SameSig : std::is_same<F, Sig*> {};

}  // namespace grng_emu

// Built-in variables (read-only).
#define threadIdx (static_cast<const uint3&>(::grng_emu::tl_thread->idx))
#define blockIdx (static_cast<const uint3&>(::grng_emu::tl_block->idx))
#define blockDim (static_cast<const dim3&>(::grng_emu::tl_block->dim))
#define gridDim (static_cast<const dim3&>(::grng_emu::tl_block->grid))

// Entry point for the Rust emulated launch: `extern "C" void grng_emu_<name>(cfg, args)`
// where args[i] points at the i-th argument value (cuLaunchKernel's kernelParams). The
// parameter types come from the kernel itself; an optional parenthesized type list is
// checked against them: GRNG_EMU_ENTRY(k) or GRNG_EMU_ENTRY(k, (float*, const float*, int)).
#define GRNG_EMU_ENTRY(name, ...)                                                         \
    __VA_OPT__(static_assert(::grng_emu::SameSig<decltype(&name), void __VA_ARGS__>::value, \
                             "GRNG_EMU_ENTRY(" #name "): type list differs from the kernel");) \
    extern "C" void grng_emu_##name(const grng_emu_launch* cfg, void** args) {           \
        ::grng_emu::launch(cfg, #name, &name, args);                                      \
    }

// Dynamic shared memory (`extern __shared__` cannot be emulated by keyword substitution).
#define GRNG_DYN_SHARED(T, name) T* name = reinterpret_cast<T*>(::grng_emu::dyn_smem())

// ---------------------------------------------------------------------------------------
// Barriers and fences.
inline void __syncthreads() { ::grng_emu::block_sync(::grng_emu::BLOCK_SYNC, 0); }
inline int __syncthreads_count(int p) { return ::grng_emu::block_sync(::grng_emu::BLOCK_COUNT, p); }
inline int __syncthreads_and(int p) { return ::grng_emu::block_sync(::grng_emu::BLOCK_AND, p); }
inline int __syncthreads_or(int p) { return ::grng_emu::block_sync(::grng_emu::BLOCK_OR, p); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
    ::grng_emu::warp_op(mask, ::grng_emu::W_SYNC, 0, 0, 32, nullptr, nullptr);
}
// One OS thread runs the whole grid: memory is always coherent.
inline void __threadfence() {}
inline void __threadfence_block() {}

// ---------------------------------------------------------------------------------------
// bfloat16 (bit-exact with cuda_bf16.h; no implicit conversions or operators, matching
// common.cuh's __CUDA_NO_BFLOAT16_CONVERSIONS__/__CUDA_NO_BFLOAT16_OPERATORS__ on CUDA).
struct alignas(2) __nv_bfloat16 {
    unsigned short __x;
    __nv_bfloat16() = default;
};
struct alignas(4) __nv_bfloat162 {
    __nv_bfloat16 x, y;
    __nv_bfloat162() = default;
    constexpr __nv_bfloat162(__nv_bfloat16 a, __nv_bfloat16 b) : x(a), y(b) {}
};
typedef __nv_bfloat16 nv_bfloat16;
typedef __nv_bfloat162 nv_bfloat162;

inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) {
    __nv_bfloat16 r;
    r.__x = u;
    return r;
}
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.__x; }
inline float __bfloat162float(__nv_bfloat16 h) {
    uint32_t u = uint32_t(h.__x) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
// Round to nearest even; every NaN becomes the canonical 0x7fff (as cuda_bf16.hpp does).
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return __ushort_as_bfloat16(0x7fff);
    uint32_t r = u >> 16;
    uint32_t rem = u << 16;
    if (rem > 0x80000000u || (rem == 0x80000000u && (r & 1u))) ++r;
    return __ushort_as_bfloat16(static_cast<unsigned short>(r));
}
inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }
inline __nv_bfloat16 __float2bfloat16_rz(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return __ushort_as_bfloat16(0x7fff);
    return __ushort_as_bfloat16(static_cast<unsigned short>(u >> 16));
}
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
    return __nv_bfloat162(__float2bfloat16_rn(a), __float2bfloat16_rn(b));
}
inline __nv_bfloat162 __float22bfloat162_rn(float2 v) { return __floats2bfloat162_rn(v.x, v.y); }
inline __nv_bfloat162 __float2bfloat162_rn(float a) { return __floats2bfloat162_rn(a, a); }
inline __nv_bfloat162 __halves2bfloat162(__nv_bfloat16 a, __nv_bfloat16 b) {
    return __nv_bfloat162(a, b);
}
inline float2 __bfloat1622float2(__nv_bfloat162 v) {
    return float2{__bfloat162float(v.x), __bfloat162float(v.y)};
}
inline float __low2float(__nv_bfloat162 v) { return __bfloat162float(v.x); }
inline float __high2float(__nv_bfloat162 v) { return __bfloat162float(v.y); }
inline __nv_bfloat16 __low2bfloat16(__nv_bfloat162 v) { return v.x; }
inline __nv_bfloat16 __high2bfloat16(__nv_bfloat162 v) { return v.y; }

// ---------------------------------------------------------------------------------------
// Math. <cmath> gives sqrtf, expf, logf, fabsf, fmaxf, fminf, fmaf, powf, tanhf, ...
using std::isfinite;
using std::isinf;
using std::isnan;
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline double rsqrt(double x) { return 1.0 / std::sqrt(x); }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline double __fma_rn(double a, double b, double c) { return std::fma(a, b, c); }
// The _rn forms are never contracted into an FMA (the emu build uses -ffp-contract=off).
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __frcp_rn(float a) { return 1.0f / a; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
// Fast intrinsics: CUDA's are approximate; the emulation is exact (tolerances cover it).
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __log2f(float x) { return std::log2(x); }
inline float __sinf(float x) { return std::sin(x); }
inline float __cosf(float x) { return std::cos(x); }
inline float __powf(float a, float b) { return std::pow(a, b); }
inline float __fdividef(float a, float b) { return a / b; }
inline float fdividef(float a, float b) { return a / b; }
inline float __saturatef(float x) { return x != x ? 0.0f : (x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x)); }
// The bits of a 4-byte `from` as a `To` (CUDA's __*_as_* reinterpretations).
template <class To, class From>
inline To grng_emu_bits(From from) {
    static_assert(sizeof(To) == 4 && sizeof(From) == 4, "4-byte reinterpretations only");
    To to;
    std::memcpy(&to, &from, 4);
    return to;
}
inline int __float_as_int(float f) { return grng_emu_bits<int>(f); }
inline float __int_as_float(int i) { return grng_emu_bits<float>(i); }
inline unsigned __float_as_uint(float f) { return grng_emu_bits<unsigned>(f); }
inline float __uint_as_float(unsigned i) { return grng_emu_bits<float>(i); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
inline int __clzll(long long x) {
    return x == 0 ? 64 : __builtin_clzll(static_cast<unsigned long long>(x));
}
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned __brev(unsigned x) {
    x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
    x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
    x = ((x >> 4) & 0x0f0f0f0fu) | ((x & 0x0f0f0f0fu) << 4);
    x = ((x >> 8) & 0x00ff00ffu) | ((x & 0x00ff00ffu) << 8);
    return (x >> 16) | (x << 16);
}
// CUDA's device min/max overloads.
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline float min(float a, float b) { return std::fmin(a, b); }
inline float max(float a, float b) { return std::fmax(a, b); }
inline double min(double a, double b) { return std::fmin(a, b); }
inline double max(double a, double b) { return std::fmax(a, b); }

// Read-only-cache load.
template <class T>
inline T __ldg(const T* p) {
    return *p;
}

// ---------------------------------------------------------------------------------------
// Atomics (plain read-modify-write: no fiber switch can happen inside one).
inline int atomicAdd(int* a, int v) { int o = *a; *a = o + v; return o; }
inline unsigned atomicAdd(unsigned* a, unsigned v) { unsigned o = *a; *a = o + v; return o; }
inline unsigned long long atomicAdd(unsigned long long* a, unsigned long long v) {
    unsigned long long o = *a;
    *a = o + v;
    return o;
}
inline float atomicAdd(float* a, float v) { float o = *a; *a = o + v; return o; }
inline double atomicAdd(double* a, double v) { double o = *a; *a = o + v; return o; }
inline int atomicSub(int* a, int v) { int o = *a; *a = o - v; return o; }
inline unsigned atomicSub(unsigned* a, unsigned v) { unsigned o = *a; *a = o - v; return o; }
inline int atomicMax(int* a, int v) { int o = *a; *a = o > v ? o : v; return o; }
inline unsigned atomicMax(unsigned* a, unsigned v) { unsigned o = *a; *a = o > v ? o : v; return o; }
inline int atomicMin(int* a, int v) { int o = *a; *a = o < v ? o : v; return o; }
inline unsigned atomicMin(unsigned* a, unsigned v) { unsigned o = *a; *a = o < v ? o : v; return o; }
inline int atomicExch(int* a, int v) { int o = *a; *a = v; return o; }
inline unsigned atomicExch(unsigned* a, unsigned v) { unsigned o = *a; *a = v; return o; }
inline float atomicExch(float* a, float v) { float o = *a; *a = v; return o; }
inline int atomicCAS(int* a, int c, int v) { int o = *a; if (o == c) *a = v; return o; }
inline unsigned atomicCAS(unsigned* a, unsigned c, unsigned v) {
    unsigned o = *a;
    if (o == c) *a = v;
    return o;
}
inline unsigned long long atomicCAS(unsigned long long* a, unsigned long long c,
                                    unsigned long long v) {
    unsigned long long o = *a;
    if (o == c) *a = v;
    return o;
}
inline int atomicAnd(int* a, int v) { int o = *a; *a = o & v; return o; }
inline int atomicOr(int* a, int v) { int o = *a; *a = o | v; return o; }
inline int atomicXor(int* a, int v) { int o = *a; *a = o ^ v; return o; }
inline unsigned atomicAnd(unsigned* a, unsigned v) { unsigned o = *a; *a = o & v; return o; }
inline unsigned atomicOr(unsigned* a, unsigned v) { unsigned o = *a; *a = o | v; return o; }
inline unsigned atomicXor(unsigned* a, unsigned v) { unsigned o = *a; *a = o ^ v; return o; }

// ---------------------------------------------------------------------------------------
// Warp shuffles, votes and reductions (CUDA semantics: warp of 32, PTX shfl.sync clamp and
// segment rules for `width`, value types CUDA accepts).
namespace grng_emu {
template <class T>
struct is_shfl_type
    : std::integral_constant<bool, std::is_same<T, int>::value || std::is_same<T, unsigned>::value ||
                                       std::is_same<T, long>::value ||
                                       std::is_same<T, unsigned long>::value ||
                                       std::is_same<T, long long>::value ||
                                       std::is_same<T, unsigned long long>::value ||
                                       std::is_same<T, float>::value ||
                                       std::is_same<T, double>::value ||
                                       std::is_same<T, __nv_bfloat16>::value ||
                                       std::is_same<T, __nv_bfloat162>::value> {};
template <class T>
inline T shfl(unsigned mask, T v, WarpOp op, int b, int width) {
    static_assert(is_shfl_type<T>::value, "type not supported by CUDA warp shuffles");
    uint64_t slot = 0;
    std::memcpy(&slot, &v, sizeof(T));
    warp_op(mask, op, slot, b, width, nullptr, nullptr);
    T r;
    std::memcpy(&r, &tl_thread->xresult, sizeof(T));
    return r;
}
}  // namespace grng_emu

template <class T>
inline T __shfl_sync(unsigned mask, T var, int srcLane, int width = warpSize) {
    return ::grng_emu::shfl(mask, var, ::grng_emu::W_SHFL_IDX, srcLane, width);
}
template <class T>
inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
    return ::grng_emu::shfl(mask, var, ::grng_emu::W_SHFL_UP, static_cast<int>(delta), width);
}
template <class T>
inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
    return ::grng_emu::shfl(mask, var, ::grng_emu::W_SHFL_DOWN, static_cast<int>(delta), width);
}
template <class T>
inline T __shfl_xor_sync(unsigned mask, T var, int laneMask, int width = warpSize) {
    return ::grng_emu::shfl(mask, var, ::grng_emu::W_SHFL_XOR, laneMask, width);
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
    ::grng_emu::warp_op(mask, ::grng_emu::W_BALLOT, pred != 0, 0, 32, nullptr, nullptr);
    return static_cast<unsigned>(::grng_emu::tl_thread->xresult);
}
inline int __any_sync(unsigned mask, int pred) {
    ::grng_emu::warp_op(mask, ::grng_emu::W_ANY, pred != 0, 0, 32, nullptr, nullptr);
    return static_cast<int>(::grng_emu::tl_thread->xresult);
}
inline int __all_sync(unsigned mask, int pred) {
    ::grng_emu::warp_op(mask, ::grng_emu::W_ALL, pred != 0, 0, 32, nullptr, nullptr);
    return static_cast<int>(::grng_emu::tl_thread->xresult);
}
// sm_80 warp reductions.
inline unsigned __reduce_add_sync(unsigned mask, unsigned v) {
    ::grng_emu::warp_op(mask, ::grng_emu::W_RED_ADD, v, 0, 32, nullptr, nullptr);
    return static_cast<unsigned>(::grng_emu::tl_thread->xresult);
}
inline int __reduce_add_sync(unsigned mask, int v) {
    return static_cast<int>(__reduce_add_sync(mask, static_cast<unsigned>(v)));
}
inline int __reduce_min_sync(unsigned mask, int v) {
    ::grng_emu::warp_op(mask, ::grng_emu::W_RED_MIN_I, static_cast<uint32_t>(v), 0, 32, nullptr,
                        nullptr);
    return static_cast<int>(static_cast<uint32_t>(::grng_emu::tl_thread->xresult));
}
inline int __reduce_max_sync(unsigned mask, int v) {
    ::grng_emu::warp_op(mask, ::grng_emu::W_RED_MAX_I, static_cast<uint32_t>(v), 0, 32, nullptr,
                        nullptr);
    return static_cast<int>(static_cast<uint32_t>(::grng_emu::tl_thread->xresult));
}
inline unsigned __reduce_min_sync(unsigned mask, unsigned v) {
    ::grng_emu::warp_op(mask, ::grng_emu::W_RED_MIN_U, v, 0, 32, nullptr, nullptr);
    return static_cast<unsigned>(::grng_emu::tl_thread->xresult);
}
inline unsigned __reduce_max_sync(unsigned mask, unsigned v) {
    ::grng_emu::warp_op(mask, ::grng_emu::W_RED_MAX_U, v, 0, 32, nullptr, nullptr);
    return static_cast<unsigned>(::grng_emu::tl_thread->xresult);
}

// ---------------------------------------------------------------------------------------
// sm_80 warp-level matrix primitives, per lane as the PTX ISA defines them. Kernels use them
// through kernels/gemm/mma_sm80.cuh (inline PTX on CUDA), never directly.
// - mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32: a collective of the 32 lanes of a
//   full warp; each lane passes its own fragment registers (layout in mma_sm80.cuh) and the
//   last lane to arrive computes every lane's D from all lanes' A, B, C.
// - ldmatrix.sync.aligned.m8n8.x4{,.trans}.shared.b16: lane l supplies the address of row
//   l % 8 of matrix l / 8 (16 bytes, 16-byte aligned, inside the dynamic shared memory);
//   every lane receives its 4 registers as the ISA's fragment layout says.
// - cp.async.cg.shared.global (16 bytes, src_bytes ≤ 16 read, the rest zero-filled): queued
//   per thread and performed only when a cp.async.wait_group lets its group complete, so a
//   kernel that reads the stage before waiting sees the NaN poison, not the data. The queue
//   is flushed when the thread exits.
namespace grng_emu {
void mma_m16n8k16_bf16(float* d, const unsigned* a, const unsigned* b, const float* c);
void ldmatrix_x4(unsigned* r, const void* row, bool trans);
void cp_async_16(void* dst, const void* src, int src_bytes);
void cp_async_commit();
void cp_async_wait(int pending);
}  // namespace grng_emu

// ---------------------------------------------------------------------------------------
// WMMA: bf16 inputs, f32 accumulators, m16n16k16 only (other shapes/types do not compile).
namespace nvcuda {
namespace wmma {
struct row_major {};
struct col_major {};
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
enum layout_t { mem_row_major, mem_col_major };

template <class Use, int M, int N, int K, class T, class Layout = void>
class fragment;  // undefined: unsupported combinations fail to compile

// Element (r, c) of the tile is x[r * 16 + c] in every lane.
template <class Layout>
class fragment<matrix_a, 16, 16, 16, __nv_bfloat16, Layout> {
    static_assert(std::is_same<Layout, row_major>::value || std::is_same<Layout, col_major>::value,
                  "matrix_a fragments need row_major or col_major");

  public:
    static constexpr int num_elements = 256;
    __nv_bfloat16 x[256];
};
template <class Layout>
class fragment<matrix_b, 16, 16, 16, __nv_bfloat16, Layout> {
    static_assert(std::is_same<Layout, row_major>::value || std::is_same<Layout, col_major>::value,
                  "matrix_b fragments need row_major or col_major");

  public:
    static constexpr int num_elements = 256;
    __nv_bfloat16 x[256];
};
template <>
class fragment<accumulator, 16, 16, 16, float, void> {
  public:
    static constexpr int num_elements = 256;
    float x[256];
};

template <class Use, class T, class L>
inline void fill_fragment(fragment<Use, 16, 16, 16, T, L>& f, const T& v) {
    for (int i = 0; i < 256; ++i) f.x[i] = v;
}

namespace detail {
struct LoadArgs {
    void* frag;
    const void* ptr;
    unsigned ldm;
    int col_major;  // memory layout
    int elem_size;  // 2 (bf16) or 4 (float)
};
struct MmaArgs {
    float* d;
    const __nv_bfloat16* a;
    const __nv_bfloat16* b;
    const float* c;
};
void load_all(void* const* ctxs, unsigned participants);
void store_all(void* const* ctxs, unsigned participants);
void mma_all(void* const* ctxs, unsigned participants);
void check_ptr(const void* p, unsigned ldm, int elem_size, bool col_major, const char* what);
inline void collective(void* ctx, void (*fn)(void* const*, unsigned), const char* what) {
    ::grng_emu::require_full_warp(what);
    ::grng_emu::warp_op(0xffffffffu, ::grng_emu::W_FN, 0, 0, 32, ctx, fn);
}
}  // namespace detail

template <class L>
inline void load_matrix_sync(fragment<matrix_a, 16, 16, 16, __nv_bfloat16, L>& a,
                             const __nv_bfloat16* p, unsigned ldm) {
    detail::check_ptr(p, ldm, 2, std::is_same<L, col_major>::value, "load_matrix_sync(matrix_a)");
    detail::LoadArgs args{a.x, p, ldm, std::is_same<L, col_major>::value, 2};
    detail::collective(&args, &detail::load_all, "load_matrix_sync");
}
// matrix_b element (k, n): row_major at p[k*ldm + n], col_major at p[k + n*ldm]. Stored in
// the fragment as x[k*16 + n].
template <class L>
inline void load_matrix_sync(fragment<matrix_b, 16, 16, 16, __nv_bfloat16, L>& b,
                             const __nv_bfloat16* p, unsigned ldm) {
    detail::check_ptr(p, ldm, 2, std::is_same<L, col_major>::value, "load_matrix_sync(matrix_b)");
    detail::LoadArgs args{b.x, p, ldm, std::is_same<L, col_major>::value, 2};
    detail::collective(&args, &detail::load_all, "load_matrix_sync");
}
inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float>& c, const float* p,
                             unsigned ldm, layout_t layout) {
    detail::check_ptr(p, ldm, 4, layout == mem_col_major, "load_matrix_sync(accumulator)");
    detail::LoadArgs args{c.x, p, ldm, layout == mem_col_major, 4};
    detail::collective(&args, &detail::load_all, "load_matrix_sync");
}
inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float>& c,
                              unsigned ldm, layout_t layout) {
    detail::check_ptr(p, ldm, 4, layout == mem_col_major, "store_matrix_sync");
    detail::LoadArgs args{const_cast<float*>(c.x), p, ldm, layout == mem_col_major, 4};
    detail::collective(&args, &detail::store_all, "store_matrix_sync");
}
// d = a * b + c: the bf16 products are exact in f32; sums are f32, in k order.
template <class LA, class LB>
inline void mma_sync(fragment<accumulator, 16, 16, 16, float>& d,
                     const fragment<matrix_a, 16, 16, 16, __nv_bfloat16, LA>& a,
                     const fragment<matrix_b, 16, 16, 16, __nv_bfloat16, LB>& b,
                     const fragment<accumulator, 16, 16, 16, float>& c) {
    detail::MmaArgs args{d.x, a.x, b.x, c.x};
    detail::collective(&args, &detail::mma_all, "mma_sync");
}
}  // namespace wmma
}  // namespace nvcuda
