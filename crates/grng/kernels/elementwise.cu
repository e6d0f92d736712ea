// Element-wise vector operations and the fused optimizer updates (docs/math.md §5 "the small kernels
// every optimizer step needs"); launchers in src/cuda/elementwise.rs, CPU oracle
// src/cpu/elementwise.rs.
//
// Every update is ONE streaming pass: each element is read once and written once, float4
// loads/stores when every pointer is 16-byte aligned (always for cudaMalloc'd buffers; the
// scalar tail loop covers the rest and the unaligned case). The formulas are the CPU's 1:1,
// in the same operation order, written with the __f*_rn intrinsics so that nvcc cannot
// contract them into FMAs: every result is the correctly rounded f32 of the same sequence of
// operations as the CPU, i.e. bit-identical to it.
//
// Validation without touching the state: the fused optimizer updates read the old state,
// write new buffers and record, while they stream, the first index holding NaN/Inf per input
// array (and the first sign violation of one array) with integer atomicMin (order-independent,
// hence deterministic) into a status of 5 ints the host set to EW_NONE; the host reads it once
// and swaps the new buffers in only when it is clean. axpy and scale instead run the
// read-only `elementwise_check` pass first and write nothing unless its status is clean.
//
// Reductions (dot, norm2, up to three dots at once) are deterministic and take one launch: each
// block gives one f64 partial per sum (products of f32 inputs are exact in f64; grid-stride sums in f64, warp-shuffle
// and shared-memory tree per block), and the last block to finish (an atomic count after a
// __threadfence) reduces the partials in a fixed order. The grid depends on n only, so the
// result does not depend on the device or on the order blocks finish in.
#include "common.cuh"

// "No bad index" in a status slot (INT_MAX; NVRTC has no <climits>).
#define EW_NONE 0x7fffffff

// True when every pointer is 16-byte aligned (float4 path).
__device__ __forceinline__ bool ew_aligned16(const void* a, const void* b = nullptr,
                                             const void* c = nullptr, const void* d = nullptr) {
    const unsigned long long bits =
        reinterpret_cast<unsigned long long>(a) | reinterpret_cast<unsigned long long>(b) |
        reinterpret_cast<unsigned long long>(c) | reinterpret_cast<unsigned long long>(d);
    return (bits & 15ull) == 0;
}

// The status written by elementwise_check is clean (no bad index in any of its 5 slots).
__device__ __forceinline__ bool ew_clean(const int* status) {
    return (status[0] & status[1] & status[2] & status[3] & status[4]) == EW_NONE;
}

// Sum of a double over the block (blockDim.x a multiple of 32, at most 1024), fixed tree
// order; the result is valid in thread 0.
__device__ __forceinline__ double ew_block_sum_f64(double v) {
    __shared__ double red[32];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(GRNG_FULL_MASK, v, o);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) red[warp] = v;
    __syncthreads();
    double t = 0.0;
    if (warp == 0) {
        t = lane < static_cast<int>(blockDim.x >> 5) ? red[lane] : 0.0;
        for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(GRNG_FULL_MASK, t, o);
    }
    return t;
}

// ---------------------------------------------------------------------------------------
// Scalar formulas (the CPU's, same order, no contraction).

struct EwSgd {
    float lr, mu, lrwd;  // lrwd = lr * λ rounded to f32, as the CPU's left-to-right `lr * wd`
    __device__ __forceinline__ void operator()(float& p, float g, float& b) const {
        const float bi = __fadd_rn(__fmul_rn(mu, b), g);
        b = bi;
        p = __fsub_rn(__fsub_rn(p, __fmul_rn(lrwd, p)), __fmul_rn(lr, bi));
    }
};

struct EwAdamW {
    float lr, b1, omb1, b2, omb2, eps, lrwd, bc1, bc2;  // omb = 1 - β in f32
    __device__ __forceinline__ void operator()(float& p, float g, float& m, float& v) const {
        const float mi = __fadd_rn(__fmul_rn(b1, m), __fmul_rn(omb1, g));
        const float vi = __fadd_rn(__fmul_rn(b2, v), __fmul_rn(omb2, __fmul_rn(g, g)));
        m = mi;
        v = vi;
        const float den = __fadd_rn(__fsqrt_rn(__fdiv_rn(vi, bc2)), eps);
        const float step = __fdiv_rn(__fmul_rn(lr, __fdiv_rn(mi, bc1)), den);
        p = __fsub_rn(__fsub_rn(p, __fmul_rn(lrwd, p)), step);
    }
};

struct EwSophia {
    float lr, b1, omb1, gamma, eps, lrwd;
    __device__ __forceinline__ void operator()(float& p, float g, float& m, float h) const {
        const float mi = __fadd_rn(__fmul_rn(b1, m), __fmul_rn(omb1, g));
        m = mi;
        // Rust's f32::max(γh, ε) and clamp(-1, 1); ε > 0 and γh ≥ 0 are never NaN here.
        const float gh = __fmul_rn(gamma, h);
        float ratio = __fdiv_rn(mi, gh > eps ? gh : eps);
        ratio = ratio < -1.0f ? -1.0f : ratio;
        ratio = ratio > 1.0f ? 1.0f : ratio;
        p = __fsub_rn(__fsub_rn(p, __fmul_rn(lrwd, p)), __fmul_rn(lr, ratio));
    }
};

struct EwHessianEma {
    float b2, omb2, bs;  // bs = batch size B as f32
    __device__ __forceinline__ void operator()(float& h, float g) const {
        h = __fadd_rn(__fmul_rn(b2, h), __fmul_rn(omb2, __fmul_rn(__fmul_rn(bs, g), g)));
    }
};

// The per-element steps of the fused updates (single-tensor: ew_fused, multi-tensor:
// ew_multi): `step(p, g, s0, s1, gh)` updates p and the state in registers; TWO_STATE says
// whether s1 exists, sign1() whether s1 must be >= 0, writes1() whether s1 is written back,
// reads_gh() whether the Hessian sample is read.
struct EwStepSgd {
    EwSgd op;
    static constexpr bool TWO_STATE = false;
    __device__ __forceinline__ bool sign1() const { return false; }
    __device__ __forceinline__ bool writes1() const { return false; }
    __device__ __forceinline__ bool reads_gh() const { return false; }
    __device__ __forceinline__ void step(float& p, float g, float& s0, float&, float) const {
        op(p, g, s0);
    }
};

struct EwStepAdamW {
    EwAdamW op;
    static constexpr bool TWO_STATE = true;
    __device__ __forceinline__ bool sign1() const { return true; }
    __device__ __forceinline__ bool writes1() const { return true; }
    __device__ __forceinline__ bool reads_gh() const { return false; }
    __device__ __forceinline__ void step(float& p, float g, float& m, float& v, float) const {
        op(p, g, m, v);
    }
};

// Sophia with its Hessian EMA fused in: on a refresh step h' = EMA(h, gh) is written and the
// update reads h' (what the separate EMA then update did, in one pass); without one (always
// in the single-tensor elementwise_sophia) h is read only.
struct EwStepSophia {
    EwSophia op;
    EwHessianEma ema;
    int refresh;
    static constexpr bool TWO_STATE = true;
    __device__ __forceinline__ bool sign1() const { return true; }
    __device__ __forceinline__ bool writes1() const { return refresh != 0; }
    __device__ __forceinline__ bool reads_gh() const { return refresh != 0; }
    __device__ __forceinline__ void step(float& p, float g, float& m, float& h, float gh) const {
        if (refresh) ema(h, gh);
        op(p, g, m, h);
    }
};

// Grid-stride indices: float4 items k < n4, then the scalar elements from 4*n4 to n.
#define EW_TID (blockIdx.x * blockDim.x + threadIdx.x)
#define EW_STRIDE (blockDim.x * gridDim.x)

// ---------------------------------------------------------------------------------------
// y ← y + α x (n elements). Skipped unless `status` is clean.
extern "C" __global__ void elementwise_axpy(float* __restrict__ y, const float* __restrict__ x,
                                            float alpha, int n, const int* __restrict__ status) {
    if (!ew_clean(status)) return;
    const int n4 = ew_aligned16(y, x) ? n / 4 : 0;
    for (int k = EW_TID; k < n4; k += EW_STRIDE) {
        float4 a = reinterpret_cast<const float4*>(x)[k];
        float4 b = reinterpret_cast<float4*>(y)[k];
        b.x = __fadd_rn(b.x, __fmul_rn(alpha, a.x));
        b.y = __fadd_rn(b.y, __fmul_rn(alpha, a.y));
        b.z = __fadd_rn(b.z, __fmul_rn(alpha, a.z));
        b.w = __fadd_rn(b.w, __fmul_rn(alpha, a.w));
        reinterpret_cast<float4*>(y)[k] = b;
    }
    for (int i = 4 * n4 + EW_TID; i < n; i += EW_STRIDE) y[i] = __fadd_rn(y[i], __fmul_rn(alpha, x[i]));
}
GRNG_EMU_ENTRY(elementwise_axpy, (float*, const float*, float, int, const int*))

// x ← α x (n elements). Skipped unless `status` is clean.
extern "C" __global__ void elementwise_scale(float* __restrict__ x, float alpha, int n,
                                             const int* __restrict__ status) {
    if (!ew_clean(status)) return;
    const int n4 = ew_aligned16(x) ? n / 4 : 0;
    for (int k = EW_TID; k < n4; k += EW_STRIDE) {
        float4 a = reinterpret_cast<float4*>(x)[k];
        a.x = __fmul_rn(a.x, alpha);
        a.y = __fmul_rn(a.y, alpha);
        a.z = __fmul_rn(a.z, alpha);
        a.w = __fmul_rn(a.w, alpha);
        reinterpret_cast<float4*>(x)[k] = a;
    }
    for (int i = 4 * n4 + EW_TID; i < n; i += EW_STRIDE) x[i] = __fmul_rn(x[i], alpha);
}
GRNG_EMU_ENTRY(elementwise_scale, (float*, float, int, const int*))

// x[i] ← the float with bit pattern `bits` (n elements): presets of status slots and of the
// deferred ledger (EW_NONE) queued on the stream, where a host upload would stage the
// bytes through pageable memory on every call (and could not be captured in a CUDA graph).
extern "C" __global__ void elementwise_fill(float* __restrict__ x, unsigned int bits, int n) {
    for (int i = EW_TID; i < n; i += EW_STRIDE) reinterpret_cast<unsigned int*>(x)[i] = bits;
}
GRNG_EMU_ENTRY(elementwise_fill, (float*, unsigned int, int))

// dst ← src (n elements, bit patterns copied as they are).
extern "C" __global__ void elementwise_copy(float* __restrict__ dst, const float* __restrict__ src,
                                            int n) {
    const int n4 = ew_aligned16(dst, src) ? n / 4 : 0;
    for (int k = EW_TID; k < n4; k += EW_STRIDE)
        reinterpret_cast<float4*>(dst)[k] = reinterpret_cast<const float4*>(src)[k];
    for (int i = 4 * n4 + EW_TID; i < n; i += EW_STRIDE) dst[i] = src[i];
}
GRNG_EMU_ENTRY(elementwise_copy, (float*, const float*, int))

// The share of Σ x_i y_i of thread `tid` of `stride` threads: float4 items while both pointers
// are 16-byte aligned, then the scalar tail (every element of the pair exactly once over the
// threads).
__device__ __forceinline__ double ew_dot_part(const float* __restrict__ x,
                                              const float* __restrict__ y, int n, int tid,
                                              int stride) {
    double acc = 0.0;
    const int n4 = ew_aligned16(x, y) ? n / 4 : 0;
    for (int k = tid; k < n4; k += stride) {
        const float4 a = reinterpret_cast<const float4*>(x)[k];
        const float4 b = reinterpret_cast<const float4*>(y)[k];
        // f32 x f32 is exact in f64.
        acc += static_cast<double>(a.x) * static_cast<double>(b.x);
        acc += static_cast<double>(a.y) * static_cast<double>(b.y);
        acc += static_cast<double>(a.z) * static_cast<double>(b.z);
        acc += static_cast<double>(a.w) * static_cast<double>(b.w);
    }
    for (int i = 4 * n4 + tid; i < n; i += stride)
        acc += static_cast<double>(x[i]) * static_cast<double>(y[i]);
    return acc;
}

// Block lb of the nb blocks that reduce the k = 1..3 pairs (xs[j], ys[j]) of one length n (the
// body of elementwise_dot, whose grid they are, and of each group of elementwise_multi_dot):
// the block's f64 partial of pair j goes to part[j * nb + lb]; the last of the nb blocks to
// finish (counted in out[2], whose bits start at `counted_from`) sums each pair's nb partials
// in block order, strided over its threads, and writes out[3j] = the f32 rounding of the sum
// (of its square root when `take_sqrt`), out[3j + 1] = 1 when the f64 sum is finite, else 0.
__device__ __forceinline__ void ew_dots(const float* const* xs, const float* const* ys, int k,
                                        int n, int lb, int nb, double* part, int take_sqrt,
                                        unsigned int counted_from, float* out) {
    const int tid = lb * static_cast<int>(blockDim.x) + static_cast<int>(threadIdx.x);
    const int stride = nb * static_cast<int>(blockDim.x);
GRNG_UNROLL
    for (int j = 0; j < 3; ++j) {
        if (j >= k) break;  // k is uniform: every thread leaves together
        // The block sum's shared buffer is reused: the last one's readers are done first.
        if (j > 0) __syncthreads();
        const double total = ew_block_sum_f64(ew_dot_part(xs[j], ys[j], n, tid, stride));
        if (threadIdx.x == 0) part[j * nb + lb] = total;
    }
    __shared__ int last;
    if (threadIdx.x == 0) {
        // Release: the partials are visible device-wide before the count says they are there
        // (thread 0 wrote them all).
        __threadfence();
        unsigned int* count = reinterpret_cast<unsigned int*>(out) + 2;
        last = atomicAdd(count, 1u) - counted_from == static_cast<unsigned int>(nb - 1);
        // Acquire: the partials the count has seen are visible to this block from here.
        if (last) __threadfence();
    }
    __syncthreads();
    if (last) {
        // volatile: read from memory, not from a cache line this SM may hold.
        const volatile double* p = part;
GRNG_UNROLL
        for (int j = 0; j < 3; ++j) {
            if (j >= k) break;
            double sum = 0.0;
            for (int b = threadIdx.x; b < nb; b += blockDim.x) sum += p[j * nb + b];
            if (j > 0) __syncthreads();
            sum = ew_block_sum_f64(sum);
            if (threadIdx.x == 0) {
                const bool finite = isfinite(sum);
                out[3 * j] = static_cast<float>(take_sqrt ? sqrt(sum) : sum);
                out[3 * j + 1] = finite ? 1.0f : 0.0f;
            }
        }
    }
}

// The k = 1..3 sums Σ x_j,i y_j,i of pairs of one length n in one launch (a Kronecker step's
// three model terms of a layer: one launch, not three). Block b writes pair j's f64 partial to
// grng_as_f64(partial)[j * gridDim.x + b]; the last block to finish (counted in out[2], whose
// bits start at `counted_from`) sums each pair's gridDim.x partials in block order, strided
// over its threads, and writes out[3j] = the f32 rounding of the sum (of its square root when
// `take_sqrt`), out[3j + 1] = 1 when the f64 sum is finite, else 0 (a NaN/Inf input; finite f32
// products cannot overflow f64). Whichever block is last, the same partials are summed in the
// same order, and each pair's sum is the one a launch of that pair alone gives, bit for bit:
// its own alignment test, grid and order. (A pair re-reads its x from cache when it shares it
// with another: the pairs stay independent so that the bits cannot depend on the company.)
// For norm2 the launcher passes x twice. blockDim.x a multiple of 32.
extern "C" __global__ void elementwise_dot(const float* __restrict__ x0, const float* __restrict__ y0,
                                           const float* __restrict__ x1, const float* __restrict__ y1,
                                           const float* __restrict__ x2, const float* __restrict__ y2,
                                           int k, int n, float* __restrict__ partial, int take_sqrt,
                                           unsigned int counted_from, float* __restrict__ out) {
    const float* xs[3] = {x0, x1, x2};
    const float* ys[3] = {y0, y1, y2};
    ew_dots(xs, ys, k, n, static_cast<int>(blockIdx.x), static_cast<int>(gridDim.x),
            grng_as_f64(partial), take_sqrt, counted_from, out);
}
GRNG_EMU_ENTRY(elementwise_dot,
               (const float*, const float*, const float*, const float*, const float*, const float*,
                int, int, float*, int, unsigned int, float*))

// Per-thread first bad indices (elementwise_check and the fused updates). A thread's indices
// grow along its float4 loop and then its scalar tail (every tail index exceeds every float4
// index), so its first hit is its minimum.
struct EwBad {
    int a[4] = {EW_NONE, EW_NONE, EW_NONE, EW_NONE};
    int sign = EW_NONE;
    __device__ __forceinline__ void note(int slot, float v, int i) {
        if (!isfinite(v) && a[slot] == EW_NONE) a[slot] = i;
    }
    __device__ __forceinline__ void note_negative(float v, int i) {
        if (v < 0.0f && sign == EW_NONE) sign = i;
    }
    // Warp minimum, then one atomicMin per warp and slot that saw a bad value. Every lane of
    // the warp must call it.
    __device__ __forceinline__ void flush(int* status) const {
GRNG_UNROLL
        for (int k = 0; k < 4; ++k) {
            const int m = __reduce_min_sync(GRNG_FULL_MASK, a[k]);
            if ((threadIdx.x & 31) == 0 && m != EW_NONE) atomicMin(&status[k], m);
        }
        const int m = __reduce_min_sync(GRNG_FULL_MASK, sign);
        if ((threadIdx.x & 31) == 0 && m != EW_NONE) atomicMin(&status[4], m);
    }
};

// Validation pass over `narr` (1..4) arrays, array a of n_a floats (any lengths: one launch
// for the gradients of several layers): status[a] ← min(status[a], first index of a NaN/Inf
// in array a); status[4] ← min(status[4], first index i with a[sign_arr][i] < 0 (strict = 0)
// or ≤ 0 (strict = 1)); sign_arr < 0 checks no sign. Unused array pointers may repeat a used
// one (their n_a is 0). Read-only on the arrays; integer atomicMin makes the result
// independent of the order blocks run in. s0..s3 (each null or 3·n_a bf16): array a's split3
// planes (grng_store_split3, plane p at p·n_a), written as it is read: the planes the
// f32-accurate products read (gemm/engine.cuh), so that a checked input (the optimizer step's
// gradients) is not split again by a gemm_split3 launch.
extern "C" __global__ void elementwise_check(const float* __restrict__ a0,
                                             const float* __restrict__ a1,
                                             const float* __restrict__ a2,
                                             const float* __restrict__ a3, int narr,
                                             int sign_arr, int strict, int n0, int n1, int n2,
                                             int n3, int* __restrict__ status,
                                             __nv_bfloat16* __restrict__ s0,
                                             __nv_bfloat16* __restrict__ s1,
                                             __nv_bfloat16* __restrict__ s2,
                                             __nv_bfloat16* __restrict__ s3) {
    const float* arr[4] = {a0, a1, a2, a3};
    __nv_bfloat16* planes[4] = {s0, s1, s2, s3};
    const int lens[4] = {n0, n1, n2, n3};
    const int n = max(max(n0, n1), max(n2, n3));
    EwBad bad;
    for (int i = EW_TID; i < n; i += EW_STRIDE) {
GRNG_UNROLL
        for (int a = 0; a < 4; ++a) {
            if (a < narr && i < lens[a]) {
                const float v = arr[a][i];
                bad.note(a, v, i);
                if (a == sign_arr && bad.sign == EW_NONE && (strict ? v <= 0.0f : v < 0.0f))
                    bad.sign = i;
                if (planes[a] != nullptr) grng_store_split3(planes[a], i, lens[a], v);
            }
        }
    }
    bad.flush(status);
}
GRNG_EMU_ENTRY(elementwise_check,
               (const float*, const float*, const float*, const float*, int, int, int, int, int,
                int, int, int*, __nv_bfloat16*, __nv_bfloat16*, __nv_bfloat16*, __nv_bfloat16*))

// The same validation for one bf16 array of n elements (the Kronecker SYRK's activations):
// status[0] ← min(status[0], first index of a NaN/Inf, i.e. all 8 exponent bits set).
extern "C" __global__ void elementwise_check_bf16(const __nv_bfloat16* __restrict__ a, int n,
                                                  int* __restrict__ status) {
    int bad = EW_NONE;
    for (int i = EW_TID; i < n; i += EW_STRIDE) {
        if (bad == EW_NONE && (__bfloat16_as_ushort(a[i]) & 0x7f80u) == 0x7f80u) bad = i;
    }
    const int m = __reduce_min_sync(GRNG_FULL_MASK, bad);
    if ((threadIdx.x & 31) == 0 && m != EW_NONE) atomicMin(&status[0], m);
}
GRNG_EMU_ENTRY(elementwise_check_bf16, (const __nv_bfloat16*, int, int*))

// ---------------------------------------------------------------------------------------
// The fused updates validate while they stream: no separate check pass. Each reads the old
// state and writes NEW buffers (out-of-place; the host swaps them in only when the status is
// clean, so a failed call leaves the state bit-for-bit unchanged), and records into a status
// of 5 ints (preset to EW_NONE) the first index of a NaN/Inf per input array (slots 0..3, in
// argument order) and the first sign violation (slot 4), exactly as elementwise_check does:
// integer atomicMin, issued only by warps that saw a bad value.

// Element k of a float4 (0..3).
__device__ __forceinline__ float ew_lane(const float4& x, int k) {
    return k == 0 ? x.x : k == 1 ? x.y : k == 2 ? x.z : x.w;
}

// out ← y + α x (n elements) into a new buffer, checking while it streams: status slots 0, 1,
// 2 ← the first index of a NaN/Inf in x, y and out (the CPU's axpy_new reports them in that
// order). One pass: no separate check of the inputs or of the result. With planes (else
// null), also the split3 planes of out (gemm_split3's layout, plane p at p·n), so that a
// product reading out splits nothing.
extern "C" __global__ void elementwise_axpy_new(float* __restrict__ out,
                                                const float* __restrict__ x,
                                                const float* __restrict__ y, float alpha, int n,
                                                int* __restrict__ status,
                                                __nv_bfloat16* __restrict__ planes) {
    EwBad bad;
    const int n4 = ew_aligned16(out, x, y) ? n / 4 : 0;
    for (int k = EW_TID; k < n4; k += EW_STRIDE) {
        const float4 a = reinterpret_cast<const float4*>(x)[k];
        float4 b = reinterpret_cast<const float4*>(y)[k];
GRNG_UNROLL
        for (int e = 0; e < 4; ++e) {
            bad.note(0, ew_lane(a, e), 4 * k + e);
            bad.note(1, ew_lane(b, e), 4 * k + e);
        }
        b.x = __fadd_rn(b.x, __fmul_rn(alpha, a.x));
        b.y = __fadd_rn(b.y, __fmul_rn(alpha, a.y));
        b.z = __fadd_rn(b.z, __fmul_rn(alpha, a.z));
        b.w = __fadd_rn(b.w, __fmul_rn(alpha, a.w));
GRNG_UNROLL
        for (int e = 0; e < 4; ++e) {
            bad.note(2, ew_lane(b, e), 4 * k + e);
            if (planes) grng_store_split3(planes, 4 * k + e, n, ew_lane(b, e));
        }
        reinterpret_cast<float4*>(out)[k] = b;
    }
    for (int i = 4 * n4 + EW_TID; i < n; i += EW_STRIDE) {
        const float a = x[i], b = y[i];
        bad.note(0, a, i);
        bad.note(1, b, i);
        const float v = __fadd_rn(b, __fmul_rn(alpha, a));
        bad.note(2, v, i);
        out[i] = v;
        if (planes) grng_store_split3(planes, i, n, v);
    }
    bad.flush(status);
}
GRNG_EMU_ENTRY(elementwise_axpy_new,
               (float*, const float*, const float*, float, int, int*, __nv_bfloat16*))

// The checks of one element at index i of the single-tensor fused updates' inputs: status
// slots 0..3 = p, g, s0, s1; slot 4 = first s1 < 0 where f.sign1(). F is an EwStep* step.
template <class F>
__device__ __forceinline__ void ew_fused_check(const F& f, EwBad& bad, int i, float p, float g,
                                               float s0, float s1) {
    bad.note(0, p, i);
    bad.note(1, g, i);
    bad.note(2, s0, i);
    if (F::TWO_STATE) {
        bad.note(3, s1, i);
        if (f.sign1()) bad.note_negative(s1, i);
    }
}

// The grid-stride loop of the single-tensor fused updates over n elements: p, g and the state
// s0 (and s1 with F::TWO_STATE) read, po, o0 (and o1 where f.writes1()) written. s1/o1 are
// unused (may be null) without them.
template <class F>
__device__ __forceinline__ void ew_fused(const F& f, const float* __restrict__ p,
                                         const float* __restrict__ g,
                                         const float* __restrict__ s0,
                                         const float* __restrict__ s1, float* __restrict__ po,
                                         float* __restrict__ o0, float* __restrict__ o1, int n,
                                         int* __restrict__ status) {
    EwBad bad;
    const bool two = F::TWO_STATE, w1 = f.writes1();
    const int n4 = ew_aligned16(p, g, s0, s1) && ew_aligned16(po, o0, o1) ? n / 4 : 0;
    for (int k = EW_TID; k < n4; k += EW_STRIDE) {
        float4 P = reinterpret_cast<const float4*>(p)[k];
        const float4 G = reinterpret_cast<const float4*>(g)[k];
        float4 S0 = reinterpret_cast<const float4*>(s0)[k];
        float4 S1 = two ? reinterpret_cast<const float4*>(s1)[k] : float4{};
GRNG_UNROLL
        for (int e = 0; e < 4; ++e) {
            ew_fused_check(f, bad, 4 * k + e, ew_lane(P, e), ew_lane(G, e), ew_lane(S0, e),
                           ew_lane(S1, e));
        }
        f.step(P.x, G.x, S0.x, S1.x, 0.0f);
        f.step(P.y, G.y, S0.y, S1.y, 0.0f);
        f.step(P.z, G.z, S0.z, S1.z, 0.0f);
        f.step(P.w, G.w, S0.w, S1.w, 0.0f);
        reinterpret_cast<float4*>(po)[k] = P;
        reinterpret_cast<float4*>(o0)[k] = S0;
        if (w1) reinterpret_cast<float4*>(o1)[k] = S1;
    }
    for (int i = 4 * n4 + EW_TID; i < n; i += EW_STRIDE) {
        float P = p[i], S0 = s0[i], S1 = two ? s1[i] : 0.0f;
        const float G = g[i];
        ew_fused_check(f, bad, i, P, G, S0, S1);
        f.step(P, G, S0, S1, 0.0f);
        po[i] = P;
        o0[i] = S0;
        if (w1) o1[i] = S1;
    }
    bad.flush(status);
}

// θ', b' ← fused SGD step (EwSgd) of θ, g, b over n elements; status slots 0..2 = p, g, b.
extern "C" __global__ void elementwise_sgd(const float* __restrict__ p, const float* __restrict__ g,
                                           const float* __restrict__ b, float* __restrict__ po,
                                           float* __restrict__ bo, float lr, float mu, float lrwd,
                                           int n, int* __restrict__ status) {
    ew_fused(EwStepSgd{EwSgd{lr, mu, lrwd}}, p, g, b, nullptr, po, bo, nullptr, n, status);
}
GRNG_EMU_ENTRY(elementwise_sgd, (const float*, const float*, const float*, float*, float*, float,
                                 float, float, int, int*))

// θ', m', v' ← fused AdamW step (EwAdamW) of θ, g, m, v over n elements; status slots 0..3 =
// p, g, m, v, slot 4 = first v < 0.
extern "C" __global__ void elementwise_adamw(const float* __restrict__ p,
                                             const float* __restrict__ g,
                                             const float* __restrict__ m,
                                             const float* __restrict__ v, float* __restrict__ po,
                                             float* __restrict__ mo, float* __restrict__ vo,
                                             float lr, float b1, float omb1, float b2, float omb2,
                                             float eps, float lrwd, float bc1, float bc2, int n,
                                             int* __restrict__ status) {
    const EwStepAdamW f{EwAdamW{lr, b1, omb1, b2, omb2, eps, lrwd, bc1, bc2}};
    ew_fused(f, p, g, m, v, po, mo, vo, n, status);
}
GRNG_EMU_ENTRY(elementwise_adamw, (const float*, const float*, const float*, const float*, float*,
                                   float*, float*, float, float, float, float, float, float, float,
                                   float, float, int, int*))

// θ', m' ← fused Sophia step (EwSophia) of θ, g, m, h over n elements (h read only); status
// slots 0..3 = p, g, m, h, slot 4 = first h < 0.
extern "C" __global__ void elementwise_sophia(const float* __restrict__ p,
                                              const float* __restrict__ g,
                                              const float* __restrict__ m,
                                              const float* __restrict__ h, float* __restrict__ po,
                                              float* __restrict__ mo, float lr, float b1,
                                              float omb1, float gamma, float eps, float lrwd, int n,
                                              int* __restrict__ status) {
    // No refresh: the update alone, h read only (the EMA's parameters unused).
    const EwStepSophia f{EwSophia{lr, b1, omb1, gamma, eps, lrwd}, EwHessianEma{}, 0};
    ew_fused(f, p, g, m, h, po, mo, nullptr, n, status);
}
GRNG_EMU_ENTRY(elementwise_sophia, (const float*, const float*, const float*, const float*, float*,
                                    float*, float, float, float, float, float, float, int, int*))

// h' ← Sophia-G's Hessian EMA (EwHessianEma) of h, g over n elements; status slots 0, 1 = h,
// g, slot 4 = first h < 0.
extern "C" __global__ void elementwise_hessian_ema(const float* __restrict__ h,
                                                   const float* __restrict__ g,
                                                   float* __restrict__ ho, float b2, float omb2,
                                                   float bs, int n, int* __restrict__ status) {
    const EwHessianEma op{b2, omb2, bs};
    EwBad bad;
    const int n4 = ew_aligned16(h, g, ho) ? n / 4 : 0;
    for (int k = EW_TID; k < n4; k += EW_STRIDE) {
        float4 H = reinterpret_cast<const float4*>(h)[k];
        const float4 G = reinterpret_cast<const float4*>(g)[k];
GRNG_UNROLL
        for (int e = 0; e < 4; ++e) {
            bad.note(0, ew_lane(H, e), 4 * k + e);
            bad.note(1, ew_lane(G, e), 4 * k + e);
            bad.note_negative(ew_lane(H, e), 4 * k + e);
        }
        op(H.x, G.x);
        op(H.y, G.y);
        op(H.z, G.z);
        op(H.w, G.w);
        reinterpret_cast<float4*>(ho)[k] = H;
    }
    for (int i = 4 * n4 + EW_TID; i < n; i += EW_STRIDE) {
        float H = h[i];
        const float G = g[i];
        bad.note(0, H, i);
        bad.note(1, G, i);
        bad.note_negative(H, i);
        op(H, G);
        ho[i] = H;
    }
    bad.flush(status);
}
GRNG_EMU_ENTRY(elementwise_hessian_ema, (const float*, const float*, float*, float, float, float,
                                         int, int*))

// ---------------------------------------------------------------------------------------
// Multi-tensor updates: one launch steps every parameter tensor of a model (PyTorch's
// multi_tensor_apply, with a searched item table instead of a chunk list).
//
// `table` holds EW_ENTRY 32-bit words per tensor t (see `MultiTable` in
// src/cuda/elementwise.rs): the addresses of its params p, gradient g, output params po and
// Hessian sample gh (64-bit, low word first; gh unused unless the kernel refreshes h), its
// length n, the offset of its segment in the flat state arrays (a multiple of 4 elements, so
// a float4 of one tensor's state never straddles two tensors), the index of its first float4
// item among all tensors' items and the flat position of its first element (the prefix sum
// of the lengths, what the status records). Thread k of the grid-stride loop finds the tensor
// of item k by binary search (log2 T cached loads, negligible against the 28-32 bytes per
// element the updates move); an item is 4 elements of one tensor: float4 loads and stores
// when all its pointers are 16-byte aligned and it is whole, scalar otherwise (tails,
// misaligned tensors). Empty tensors have no item.
//
// The status (EW_MSLOTS ints preset to EW_NONE) records, per slot, the first flat position of
// a NaN/Inf in: 0 params, 1 grad, 2 state s0, 3 state s1, 4 Hessian sample; 5 the first
// s1 < 0 (AdamW's v, Sophia's h); 6, 7, 8 the first non-finite OUTPUT po, s0', s1' (an
// overflow from finite inputs). Outputs go to separate buffers the host swaps in only when
// every slot is clean, so a failed step changes nothing, and a clean step costs one pass and
// one 36-byte read-back.

#define EW_ENTRY 12
#define EW_MSLOTS 9

// A multi-tensor kernel's table, passed by value (`KernelArgs::table`): the launch carries it,
// so no copy to the device precedes the launch, and a stream capture would hold it whole.
// __grid_constant__ keeps it in parameter memory, read through a pointer without a local
// copy (sm_70 and later). Its 4000 bytes leave room for the kernels' other parameters under
// the 4 KiB parameter limit (elementwise_multi_sophia's take 4088 bytes in all: a parameter
// more needs a smaller table); a launch with more entries than fit is split by the launcher.
#define EW_TABLE_WORDS 1000
struct EwTable {
    unsigned w[EW_TABLE_WORDS];
};

__device__ __forceinline__ const float* ew_entry_ptr(const unsigned* e, int k) {
    const unsigned long long a =
        static_cast<unsigned long long>(e[2 * k]) |
        (static_cast<unsigned long long>(e[2 * k + 1]) << 32);
    return reinterpret_cast<const float*>(a);
}

// The tensor holding float4 item k of a table of `entry` words per tensor whose word `first`
// is the tensor's first item: the last t with item_begin(t) <= k (empty tensors share their
// successor's item_begin and are skipped).
__device__ __forceinline__ int ew_find_item(const unsigned* table, int entry, int first,
                                            int ntensors, int k) {
    int lo = 0, hi = ntensors - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (static_cast<int>(table[entry * mid + first]) <= k)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}


// First flat position per status slot, per thread (positions grow along a thread's items).
struct EwFirst {
    int a[EW_MSLOTS];
    __device__ __forceinline__ EwFirst() {
GRNG_UNROLL
        for (int s = 0; s < EW_MSLOTS; ++s) a[s] = EW_NONE;
    }
    __device__ __forceinline__ void note(int slot, float v, int pos) {
        if (!isfinite(v) && a[slot] == EW_NONE) a[slot] = pos;
    }
    __device__ __forceinline__ void note_negative(int slot, float v, int pos) {
        if (v < 0.0f && a[slot] == EW_NONE) a[slot] = pos;
    }
    // Warp minimum, then one atomicMin per warp and slot that saw a bad value. Every lane of
    // the warp must call it.
    __device__ __forceinline__ void flush(int* status) const {
GRNG_UNROLL
        for (int s = 0; s < EW_MSLOTS; ++s) {
            const int m = __reduce_min_sync(GRNG_FULL_MASK, a[s]);
            if ((threadIdx.x & 31) == 0 && m != EW_NONE) atomicMin(&status[s], m);
        }
    }
};

// One element at flat position pos: checks of the inputs, the step, checks of the outputs.
template <class F>
__device__ __forceinline__ void ew_multi_elem(const F& f, EwFirst& bad, int pos, float& p,
                                              float g, float& s0, float& s1, float gh) {
    bad.note(0, p, pos);
    bad.note(1, g, pos);
    bad.note(2, s0, pos);
    if (F::TWO_STATE) {
        bad.note(3, s1, pos);
        if (f.sign1()) bad.note_negative(5, s1, pos);
    }
    if (f.reads_gh()) bad.note(4, gh, pos);
    f.step(p, g, s0, s1, gh);
    bad.note(6, p, pos);
    bad.note(7, s0, pos);
    if (f.writes1()) bad.note(8, s1, pos);
}

// The grid-stride loop over all tensors' float4 items shared by the multi-tensor kernels.
// s1/o1 are unused (may be null) without TWO_STATE, o1 unless writes1().
template <class F>
__device__ __forceinline__ void ew_multi(const F& f, const unsigned* table,
                                         int ntensors, int nitems, const float* __restrict__ s0,
                                         const float* __restrict__ s1, float* __restrict__ o0,
                                         float* __restrict__ o1, int* __restrict__ status) {
    EwFirst bad;
    const bool two = F::TWO_STATE, w1 = f.writes1(), rg = f.reads_gh();
    for (int k = EW_TID; k < nitems; k += EW_STRIDE) {
        const unsigned* e = table + EW_ENTRY * ew_find_item(table, EW_ENTRY, 10, ntensors, k);
        const float* p = ew_entry_ptr(e, 0);
        const float* g = ew_entry_ptr(e, 1);
        float* po = const_cast<float*>(ew_entry_ptr(e, 2));
        const float* gh = rg ? ew_entry_ptr(e, 3) : nullptr;
        const int n = static_cast<int>(e[8]);
        const int i0 = 4 * (k - static_cast<int>(e[10]));
        const int si = static_cast<int>(e[9]) + i0;  // state index (segment starts at 4m)
        const int pos = static_cast<int>(e[11]) + i0;
        const int cnt = n - i0 < 4 ? n - i0 : 4;
        const bool vec = cnt == 4 && ew_aligned16(p + i0, g + i0, po + i0, s0 + si) &&
                         ew_aligned16(o0 + si, two ? s1 + si : s0 + si, w1 ? o1 + si : o0 + si,
                                      rg ? gh + i0 : p + i0);
        if (vec) {
            float4 P = *reinterpret_cast<const float4*>(p + i0);
            const float4 G = *reinterpret_cast<const float4*>(g + i0);
            float4 S0 = *reinterpret_cast<const float4*>(s0 + si);
            float4 S1 = two ? *reinterpret_cast<const float4*>(s1 + si) : float4{};
            const float4 GH = rg ? *reinterpret_cast<const float4*>(gh + i0) : float4{};
            ew_multi_elem(f, bad, pos, P.x, G.x, S0.x, S1.x, GH.x);
            ew_multi_elem(f, bad, pos + 1, P.y, G.y, S0.y, S1.y, GH.y);
            ew_multi_elem(f, bad, pos + 2, P.z, G.z, S0.z, S1.z, GH.z);
            ew_multi_elem(f, bad, pos + 3, P.w, G.w, S0.w, S1.w, GH.w);
            *reinterpret_cast<float4*>(po + i0) = P;
            *reinterpret_cast<float4*>(o0 + si) = S0;
            if (w1) *reinterpret_cast<float4*>(o1 + si) = S1;
        } else {
            for (int j = 0; j < cnt; ++j) {
                float P = p[i0 + j], S0 = s0[si + j], S1 = two ? s1[si + j] : 0.0f;
                ew_multi_elem(f, bad, pos + j, P, g[i0 + j], S0, S1, rg ? gh[i0 + j] : 0.0f);
                po[i0 + j] = P;
                o0[si + j] = S0;
                if (w1) o1[si + j] = S1;
            }
        }
    }
    bad.flush(status);
}

// SGD over all tensors: state s0 = momentum buffer b.
extern "C" __global__ void elementwise_multi_sgd(const __grid_constant__ EwTable table,
                                                 int ntensors, int nitems,
                                                 const float* __restrict__ b,
                                                 float* __restrict__ bo, float lr, float mu,
                                                 float lrwd, int* __restrict__ status) {
    const EwStepSgd f{EwSgd{lr, mu, lrwd}};
    ew_multi(f, table.w, ntensors, nitems, b, nullptr, bo, nullptr, status);
}
GRNG_EMU_ENTRY(elementwise_multi_sgd, (EwTable, int, int, const float*, float*, float, float,
                                       float, int*))

// AdamW over all tensors: state s0 = m, s1 = v.
extern "C" __global__ void elementwise_multi_adamw(
    const __grid_constant__ EwTable table, int ntensors, int nitems, const float* __restrict__ m,
    const float* __restrict__ v, float* __restrict__ mo, float* __restrict__ vo, float lr,
    float b1, float omb1, float b2, float omb2, float eps, float lrwd, float bc1, float bc2,
    int* __restrict__ status) {
    const EwStepAdamW f{EwAdamW{lr, b1, omb1, b2, omb2, eps, lrwd, bc1, bc2}};
    ew_multi(f, table.w, ntensors, nitems, m, v, mo, vo, status);
}
GRNG_EMU_ENTRY(elementwise_multi_adamw, (EwTable, int, int, const float*, const float*,
                                         float*, float*, float, float, float, float, float, float,
                                         float, float, float, int*))

// Sophia over all tensors: state s0 = m, s1 = h; with refresh != 0 the Hessian EMA of h with
// the tables' samples gh (β₂, batch size bs) is fused in and h' written to ho.
extern "C" __global__ void elementwise_multi_sophia(
    const __grid_constant__ EwTable table, int ntensors, int nitems, const float* __restrict__ m,
    const float* __restrict__ h, float* __restrict__ mo, float* __restrict__ ho, float lr,
    float b1, float omb1, float gamma, float eps, float lrwd, int refresh, float b2, float omb2,
    float bs, int* __restrict__ status) {
    const EwStepSophia f{EwSophia{lr, b1, omb1, gamma, eps, lrwd}, EwHessianEma{b2, omb2, bs},
                          refresh};
    ew_multi(f, table.w, ntensors, nitems, m, h, mo, ho, status);
}
GRNG_EMU_ENTRY(elementwise_multi_sophia, (EwTable, int, int, const float*, const float*,
                                          float*, float*, float, float, float, float, float,
                                          float, int, float, float, float, int*))

// ---------------------------------------------------------------------------------------
// out_t ← y_t + α_t x_t for every tensor t of `table` in one launch: a lazy Kronecker step's
// first-order inverses X₀ − d·S₀, one per factor whose damping moved (one launch for the
// step, not one per factor). Element for element elementwise_axpy_new's arithmetic, so each
// out_t and its planes are the bits a launch of that tensor alone writes.
//
// `table` holds EW_AXPY_ENTRY 32-bit words per tensor (`multi_axpy_new` in
// src/cuda/elementwise.rs): the addresses of out, x, y and planes (two words each, low
// first; planes 0 for none, else 3n bf16 in gemm_split3's layout), the length n, the index of
// its first float4 item among all tensors' items, and the bits of α. Status slots 5t, 5t + 1,
// 5t + 2 ← the first index of a NaN/Inf in x_t, y_t and out_t (integer atomicMin only where a
// value is bad: a clean pass issues none).
#define EW_AXPY_ENTRY 11

__device__ __forceinline__ void ew_axpy_flag(int* slot, float v, int i) {
    if (!isfinite(v)) atomicMin(slot, i);
}

extern "C" __global__ void elementwise_multi_axpy_new(const __grid_constant__ EwTable table,
                                                      int ntensors, int nitems,
                                                      int* __restrict__ status) {
    for (int k = EW_TID; k < nitems; k += EW_STRIDE) {
        const int t = ew_find_item(table.w, EW_AXPY_ENTRY, 9, ntensors, k);
        const unsigned* e = table.w + EW_AXPY_ENTRY * t;
        float* out = const_cast<float*>(ew_entry_ptr(e, 0));
        const float* x = ew_entry_ptr(e, 1);
        const float* y = ew_entry_ptr(e, 2);
        __nv_bfloat16* planes =
            reinterpret_cast<__nv_bfloat16*>(const_cast<float*>(ew_entry_ptr(e, 3)));
        const int n = static_cast<int>(e[8]);
        const float alpha = __uint_as_float(e[10]);
        const int i0 = 4 * (k - static_cast<int>(e[9]));
        const int cnt = n - i0 < 4 ? n - i0 : 4;
        int* st = status + 5 * t;
        const bool vec = cnt == 4 && ew_aligned16(out + i0, x + i0, y + i0);
        float a[4], b[4];
        if (vec) {
            const float4 A = *reinterpret_cast<const float4*>(x + i0);
            const float4 B = *reinterpret_cast<const float4*>(y + i0);
GRNG_UNROLL
            for (int j = 0; j < 4; ++j) {
                a[j] = ew_lane(A, j);
                b[j] = ew_lane(B, j);
            }
        } else {
            for (int j = 0; j < cnt; ++j) {
                a[j] = x[i0 + j];
                b[j] = y[i0 + j];
            }
        }
        float v[4];
GRNG_UNROLL
        for (int j = 0; j < 4; ++j) {
            if (j >= cnt) break;
            ew_axpy_flag(&st[0], a[j], i0 + j);
            ew_axpy_flag(&st[1], b[j], i0 + j);
            v[j] = __fadd_rn(b[j], __fmul_rn(alpha, a[j]));
            ew_axpy_flag(&st[2], v[j], i0 + j);
            if (planes) grng_store_split3(planes, i0 + j, n, v[j]);
        }
        if (vec) {
            *reinterpret_cast<float4*>(out + i0) = float4{v[0], v[1], v[2], v[3]};
        } else {
            for (int j = 0; j < cnt; ++j) out[i0 + j] = v[j];
        }
    }
}
GRNG_EMU_ENTRY(elementwise_multi_axpy_new, (EwTable, int, int, int*))

// ---------------------------------------------------------------------------------------
// The groups of elementwise_dot in one launch: a Kronecker step's model terms, every layer's
// (one launch for the step, not one per layer). Group g (1..3 pairs of one length n_g) takes
// nb_g consecutive blocks, the grid a launch of elementwise_dot would give it, and runs its
// body (ew_dots) with its own partials, count and outputs: each sum is the one that launch
// gives, bit for bit.
//
// `table` holds EW_DOT_ENTRY 32-bit words per group (`multi_dots` in src/cuda/elementwise.rs):
// the addresses of x0, y0, x1, y1, x2, y2 (two words each, low first; unused pairs repeat a
// used one), then k, n, the group's first block, its block count nb, the offset of its
// partials in f64s (k·nb of them) and of its outputs in floats (3 per pair).
#define EW_DOT_ENTRY 18

extern "C" __global__ void elementwise_multi_dot(const __grid_constant__ EwTable table,
                                                 int ngroups, float* __restrict__ partial,
                                                 int take_sqrt, unsigned int counted_from,
                                                 float* __restrict__ out) {
    const int g = ew_find_item(table.w, EW_DOT_ENTRY, 14, ngroups, static_cast<int>(blockIdx.x));
    const unsigned* e = table.w + EW_DOT_ENTRY * g;
    const float* xs[3] = {ew_entry_ptr(e, 0), ew_entry_ptr(e, 2), ew_entry_ptr(e, 4)};
    const float* ys[3] = {ew_entry_ptr(e, 1), ew_entry_ptr(e, 3), ew_entry_ptr(e, 5)};
    const int lb = static_cast<int>(blockIdx.x) - static_cast<int>(e[14]);
    ew_dots(xs, ys, static_cast<int>(e[12]), static_cast<int>(e[13]), lb, static_cast<int>(e[15]),
            grng_as_f64(partial) + e[16], take_sqrt, counted_from, out + e[17]);
}
GRNG_EMU_ENTRY(elementwise_multi_dot, (EwTable, int, float*, int, unsigned int, float*))
