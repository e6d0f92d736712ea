// Runtime of the CUDA CPU emulation (see cuda_emu.h for the semantics).
//
// Every thread of a block is a fiber with its own stack; a scheduler on the calling OS
// thread resumes READY fibers in thread order until all have finished. Fibers block only in
// __syncthreads and warp collectives, and the last arrival releases the others. On Linux
// x86_64 the switch is a few instructions of assembly (ucontext's swapcontext makes a
// sigprocmask system call per switch, ~20x slower); elsewhere ucontext is used.
#include "cuda_emu.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdarg>
#include <memory>
#include <vector>

#if defined(__x86_64__) && defined(__linux__) && !defined(GRNG_EMU_UCONTEXT)
#define GRNG_EMU_ASM_SWITCH 1
#else
#define GRNG_EMU_ASM_SWITCH 0
#include <ucontext.h>
#endif

#if GRNG_EMU_ASM_SWITCH
// grng_emu_switch(save, load): push the callee-saved registers and the SSE/x87 control words
// on the current stack, store the stack pointer in *save, switch to `load` and pop the same
// frame from there. A new fiber's stack holds such a frame whose return address is the
// trampoline, which calls r13(r12) = entry(fiber).
extern "C" void grng_emu_switch(void** save, void* load);
extern "C" void grng_emu_trampoline();
__asm__(
    ".text\n"
    ".p2align 4\n"
    ".hidden grng_emu_switch\n"
    ".globl grng_emu_switch\n"
    ".type grng_emu_switch,@function\n"
    "grng_emu_switch:\n"
    "    pushq %rbp\n"
    "    pushq %rbx\n"
    "    pushq %r12\n"
    "    pushq %r13\n"
    "    pushq %r14\n"
    "    pushq %r15\n"
    "    subq $8, %rsp\n"
    "    stmxcsr (%rsp)\n"
    "    fnstcw 4(%rsp)\n"
    "    movq %rsp, (%rdi)\n"
    "    movq %rsi, %rsp\n"
    "    ldmxcsr (%rsp)\n"
    "    fldcw 4(%rsp)\n"
    "    addq $8, %rsp\n"
    "    popq %r15\n"
    "    popq %r14\n"
    "    popq %r13\n"
    "    popq %r12\n"
    "    popq %rbx\n"
    "    popq %rbp\n"
    "    ret\n"
    ".size grng_emu_switch, .-grng_emu_switch\n"
    ".p2align 4\n"
    ".hidden grng_emu_trampoline\n"
    ".globl grng_emu_trampoline\n"
    ".type grng_emu_trampoline,@function\n"
    "grng_emu_trampoline:\n"
    "    movq %r12, %rdi\n"
    "    callq *%r13\n"
    "    ud2\n"
    ".size grng_emu_trampoline, .-grng_emu_trampoline\n");
#endif

namespace grng_emu {

thread_local ThreadInfo* tl_thread = nullptr;
thread_local BlockInfo* tl_block = nullptr;

namespace {

constexpr size_t kStackBytes = 256 * 1024;  // WMMA fragments hold whole tiles per lane
constexpr uint32_t kMaxThreads = 1024;
constexpr uint32_t kMaxDynSmem = 232448;  // sm_90 opt-in maximum (227 KiB)

enum State { READY, WAIT_BLOCK, WAIT_WARP, DONE };

struct Ctx {
#if GRNG_EMU_ASM_SWITCH
    void* sp = nullptr;
#else
    ucontext_t uc;
#endif
};

// A cp.async issued by a thread, performed when a wait_group completes its group.
struct PendingCopy {
    unsigned char* dst;
    const unsigned char* src;
    int src_bytes;
    unsigned group;  // 0 while not committed
};

struct Fiber : ThreadInfo {
    Ctx ctx;
    State state = DONE;
    int pred = 0;
    std::vector<PendingCopy> copies;
    unsigned committed = 0;  // cp.async groups committed so far
};

struct WarpSlot {
    bool active = false;
    unsigned mask = 0;
    unsigned arrived = 0;
    WarpOp op = W_SYNC;
    void (*fn)(void* const*, unsigned) = nullptr;
    uint64_t val[32];
    int b[32];
    int width[32];
    void* ctx[32];
};

struct Warp {
    unsigned existing = 0;  // lanes that exist (partial last warp)
    unsigned done = 0;      // lanes that have exited
    int nslots = 0;
    WarpSlot slots[32];
};

struct Stack {
    char* map = nullptr;  // guard page, then kStackBytes of stack
    size_t len = 0;
};

struct Runtime {
    std::vector<Stack> stacks;
    std::vector<Fiber> fibers;
    std::vector<Warp> warps;
    BlockInfo block{};
    Ctx sched;
    const char* name = nullptr;
    void (*body)(void*) = nullptr;
    void* body_ctx = nullptr;
    uint32_t nthreads = 0;
    uint32_t ndone = 0;
    uint32_t bar_arrived = 0;
    int bar_count = 0, bar_and = 1, bar_or = 0;
    unsigned char* smem = nullptr;  // dynamic shared memory of the launch
    size_t smem_bytes = 0;
    char* smem_map = nullptr;
    size_t smem_map_len = 0;
    bool running = false;
    Fiber* cur = nullptr;
    const grng_emu_buffer* buffers = nullptr;
    uint32_t nbuffers = 0;

    ~Runtime() {
        for (Stack& s : stacks) munmap(s.map, s.len);
    }
};

thread_local std::unique_ptr<Runtime> tl_rt;

Runtime& rt() {
    if (!tl_rt) tl_rt.reset(new Runtime());
    return *tl_rt;
}

size_t page_size() {
    static const size_t p = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    return p;
}

[[noreturn]] void failf(const char* fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    fail(msg);
}

// ---- fibers ---------------------------------------------------------------------------

void fiber_entry(void* arg);

#if GRNG_EMU_ASM_SWITCH
void ctx_init(Ctx& c, char* lo, size_t size, void* arg) {
    // Frame popped by grng_emu_switch, lowest address first: mxcsr|fpucw, r15, r14, r13,
    // r12, rbx, rbp, return address. After `ret` rsp must be 16-byte aligned so that the
    // trampoline's call gives the callee the ABI's (rsp + 8) % 16 == 0.
    uintptr_t top = (reinterpret_cast<uintptr_t>(lo) + size) & ~uintptr_t(15);
    uint64_t* ret_slot = reinterpret_cast<uint64_t*>(top - 8);  // (top - 8) + 8 ≡ 0 mod 16
    uint64_t* f = ret_slot - 7;
    uint32_t csr[2] = {0x1F80u, 0x037Fu};  // default MXCSR and x87 control word
    std::memcpy(&f[0], csr, 8);
    f[1] = 0;                                         // r15
    f[2] = 0;                                         // r14
    f[3] = reinterpret_cast<uint64_t>(&fiber_entry);  // r13: entry
    f[4] = reinterpret_cast<uint64_t>(arg);           // r12: its argument
    f[5] = 0;                                         // rbx
    f[6] = 0;                                         // rbp
    *ret_slot = reinterpret_cast<uint64_t>(&grng_emu_trampoline);
    c.sp = f;
}
inline void ctx_switch(Ctx& from, Ctx& to) { grng_emu_switch(&from.sp, to.sp); }
#else
void uc_entry(unsigned hi, unsigned lo) {
    fiber_entry(reinterpret_cast<void*>((uintptr_t(hi) << 32) | uintptr_t(lo)));
}
void ctx_init(Ctx& c, char* lo, size_t size, void* arg) {
    getcontext(&c.uc);
    c.uc.uc_stack.ss_sp = lo;
    c.uc.uc_stack.ss_size = size;
    c.uc.uc_link = nullptr;
    uintptr_t p = reinterpret_cast<uintptr_t>(arg);
    makecontext(&c.uc, reinterpret_cast<void (*)()>(&uc_entry), 2, unsigned(p >> 32),
                unsigned(p & 0xffffffffu));
}
inline void ctx_switch(Ctx& from, Ctx& to) { swapcontext(&from.uc, &to.uc); }
#endif

void ensure_stacks(Runtime& r, uint32_t n) {
    const size_t pg = page_size();
    while (r.stacks.size() < n) {
        Stack s;
        s.len = kStackBytes + pg;
        void* m = mmap(nullptr, s.len, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (m == MAP_FAILED) fail("cannot map a fiber stack");
        s.map = static_cast<char*>(m);
        // Guard page below the stack: an overflow faults instead of corrupting a neighbour.
        if (mprotect(s.map, pg, PROT_NONE) != 0) fail("cannot protect a fiber stack guard page");
        r.stacks.push_back(s);
    }
}

// Switch from the running fiber back to the scheduler.
void yield(Runtime& r, Fiber& f) { ctx_switch(f.ctx, r.sched); }

// ---- warp collectives -----------------------------------------------------------------

unsigned live_lanes(const Warp& w) { return w.existing & ~w.done; }

void complete(Runtime& r, uint32_t warp, WarpSlot& s) {
    const unsigned part = s.arrived;
    uint64_t out[32];
    switch (s.op) {
        case W_SYNC:
            break;
        case W_SHFL_IDX:
        case W_SHFL_UP:
        case W_SHFL_DOWN:
        case W_SHFL_XOR:
            for (int p = 0; p < 32; ++p) {
                if (!(part >> p & 1u)) continue;
                // PTX shfl.sync: c = ((32 - width) << 8) | clamp, clamp = 0 for up, 31 else.
                const int seg = (32 - s.width[p]) & 31;
                const int clamp = s.op == W_SHFL_UP ? 0 : 31;
                const int bval = s.b[p] & 31;
                const int min_lane = p & seg;
                const int max_lane = (p & seg) | (clamp & ~seg);
                int j = p;
                bool ok = false;
                switch (s.op) {
                    case W_SHFL_UP: j = p - bval; ok = j >= max_lane; break;
                    case W_SHFL_DOWN: j = p + bval; ok = j <= max_lane; break;
                    case W_SHFL_XOR: j = p ^ bval; ok = j <= max_lane; break;
                    default: j = min_lane | (bval & ~seg); ok = j <= max_lane; break;
                }
                if (!ok) j = p;
                if (!(part >> j & 1u))
                    failf("warp %u lane %d: shuffle reads lane %d, which is not taking part "
                          "(participants 0x%08x)",
                          warp, p, j, part);
                out[p] = s.val[j];
            }
            break;
        case W_BALLOT:
        case W_ANY:
        case W_ALL: {
            unsigned bits = 0;
            for (int p = 0; p < 32; ++p)
                if ((part >> p & 1u) && s.val[p]) bits |= 1u << p;
            const uint64_t v = s.op == W_BALLOT ? bits : s.op == W_ANY ? bits != 0 : bits == part;
            for (int p = 0; p < 32; ++p) out[p] = v;
            break;
        }
        case W_RED_ADD:
        case W_RED_MIN_I:
        case W_RED_MAX_I:
        case W_RED_MIN_U:
        case W_RED_MAX_U: {
            uint32_t acc = 0;
            bool first = true;
            for (int p = 0; p < 32; ++p) {
                if (!(part >> p & 1u)) continue;
                const uint32_t v = static_cast<uint32_t>(s.val[p]);
                if (first) {
                    acc = v;
                    first = false;
                    continue;
                }
                switch (s.op) {
                    case W_RED_ADD: acc += v; break;
                    case W_RED_MIN_I: acc = int32_t(v) < int32_t(acc) ? v : acc; break;
                    case W_RED_MAX_I: acc = int32_t(v) > int32_t(acc) ? v : acc; break;
                    case W_RED_MIN_U: acc = v < acc ? v : acc; break;
                    default: acc = v > acc ? v : acc; break;
                }
            }
            for (int p = 0; p < 32; ++p) out[p] = acc;
            break;
        }
        case W_FN: {
            void* ctxs[32];
            for (int p = 0; p < 32; ++p) ctxs[p] = (part >> p & 1u) ? s.ctx[p] : nullptr;
            s.fn(ctxs, part);
            break;
        }
    }
    for (int p = 0; p < 32; ++p) {
        if (!(part >> p & 1u)) continue;
        Fiber& f = r.fibers[warp * 32 + p];
        if (s.op != W_SYNC && s.op != W_FN) f.xresult = out[p];
        if (&f != r.cur) f.state = READY;
    }
    s.active = false;
    s.arrived = 0;
    Warp& w = r.warps[warp];
    while (w.nslots > 0 && !w.slots[w.nslots - 1].active) --w.nslots;
}

const char* op_name(WarpOp op) {
    switch (op) {
        case W_SYNC: return "__syncwarp";
        case W_SHFL_IDX: return "__shfl_sync";
        case W_SHFL_UP: return "__shfl_up_sync";
        case W_SHFL_DOWN: return "__shfl_down_sync";
        case W_SHFL_XOR: return "__shfl_xor_sync";
        case W_BALLOT: return "__ballot_sync";
        case W_ANY: return "__any_sync";
        case W_ALL: return "__all_sync";
        case W_FN: return "a WMMA operation";
        default: return "__reduce_*_sync";
    }
}

// ---- threads and blocks ---------------------------------------------------------------

void perform(const PendingCopy& c) {
    if (c.src_bytes > 0) std::memcpy(c.dst, c.src, size_t(c.src_bytes));
    std::memset(c.dst + c.src_bytes, 0, size_t(16 - c.src_bytes));
}

// Performs the copies whose group is complete once at most `pending` groups are in flight.
void complete_copies(Fiber& f, unsigned pending) {
    size_t keep = 0;
    for (size_t i = 0; i < f.copies.size(); ++i) {
        const PendingCopy& c = f.copies[i];
        if (c.group != 0 && c.group + pending <= f.committed)
            perform(c);
        else
            f.copies[keep++] = c;
    }
    f.copies.resize(keep);
}

[[noreturn]] void thread_exit(Runtime& r, Fiber& f) {
    // Copies still in flight land anyway on a GPU (nothing can read them any more).
    for (const PendingCopy& c : f.copies) perform(c);
    f.copies.clear();
    f.state = DONE;
    ++r.ndone;
    if (r.bar_arrived > 0)
        failf("thread %u exited while %u threads wait at __syncthreads (every thread of a "
              "block must reach each barrier)",
              f.tid, r.bar_arrived);
    Warp& w = r.warps[f.warp];
    w.done |= 1u << f.lane;
    // Lanes that exit no longer hold up a warp collective naming them.
    for (int i = 0; i < w.nslots; ++i) {
        WarpSlot& s = w.slots[i];
        if (s.active && s.arrived == (s.mask & live_lanes(w))) complete(r, f.warp, s);
    }
    yield(r, f);
    fail("a finished fiber was resumed");
}

void fiber_entry(void* arg) {
    Runtime& r = rt();
    Fiber& f = *static_cast<Fiber*>(arg);
    r.body(r.body_ctx);
    thread_exit(r, f);
}

[[noreturn]] void deadlock(Runtime& r) {
    char buf[768];
    int n = snprintf(buf, sizeof buf,
                     "deadlock: no thread can progress (%u of %u exited, %u waiting at "
                     "__syncthreads)",
                     r.ndone, r.nthreads, r.bar_arrived);
    for (size_t wi = 0; wi < r.warps.size() && n < int(sizeof buf) - 100; ++wi) {
        const Warp& w = r.warps[wi];
        for (int i = 0; i < w.nslots; ++i) {
            const WarpSlot& s = w.slots[i];
            if (!s.active) continue;
            n += snprintf(buf + n, sizeof buf - n,
                          "; warp %zu: %s(mask 0x%08x) has lanes 0x%08x, waits for 0x%08x", wi,
                          op_name(s.op), s.mask, s.arrived, s.mask & live_lanes(w) & ~s.arrived);
        }
    }
    fail(buf);
}

void run_block(Runtime& r) {
    const dim3 bd = r.block.dim;
    const uint32_t n = r.nthreads;
    const uint32_t nwarps = (n + 31) / 32;
    for (uint32_t w = 0; w < nwarps; ++w) {
        Warp& wp = r.warps[w];
        const uint32_t lanes = n - w * 32 < 32 ? n - w * 32 : 32;
        wp.existing = lanes == 32 ? 0xffffffffu : (1u << lanes) - 1;
        wp.done = 0;
        wp.nslots = 0;
    }
    for (uint32_t t = 0; t < n; ++t) {
        Fiber& f = r.fibers[t];
        f.idx = uint3{t % bd.x, (t / bd.x) % bd.y, t / (bd.x * bd.y)};
        f.tid = t;
        f.lane = t % 32;
        f.warp = t / 32;
        f.xresult = 0;
        f.state = READY;
        f.copies.clear();
        f.committed = 0;
        const Stack& s = r.stacks[t];
        const size_t pg = page_size();
        ctx_init(f.ctx, s.map + pg, s.len - pg, &f);
    }
    if (r.smem_bytes) std::memset(r.smem, 0xFF, r.smem_bytes);  // NaN poison
    r.ndone = 0;
    r.bar_arrived = 0;
    r.bar_count = 0;
    r.bar_and = 1;
    r.bar_or = 0;
    for (;;) {
        bool progress = false;
        for (uint32_t t = 0; t < n; ++t) {
            Fiber& f = r.fibers[t];
            if (f.state != READY) continue;
            progress = true;
            r.cur = &f;
            tl_thread = &f;
            ctx_switch(r.sched, f.ctx);
        }
        r.cur = nullptr;
        tl_thread = nullptr;
        if (r.ndone == n) return;
        if (!progress) deadlock(r);
    }
}

void map_smem(Runtime& r, size_t bytes) {
    r.smem = nullptr;
    r.smem_bytes = bytes;
    r.smem_map = nullptr;
    if (!bytes) return;
    // The buffer ends at a PROT_NONE page, so reading or writing past the launch's dynamic
    // shared memory faults. Start aligned to 128 bytes like GRNG_DYN_SHARED on CUDA.
    const size_t pg = page_size();
    const size_t body = (bytes + 127) / 128 * 128;
    const size_t mapped = (body + pg - 1) / pg * pg;
    r.smem_map_len = mapped + pg;
    void* m = mmap(nullptr, r.smem_map_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                   -1, 0);
    if (m == MAP_FAILED) fail("cannot map dynamic shared memory");
    r.smem_map = static_cast<char*>(m);
    if (mprotect(r.smem_map + mapped, pg, PROT_NONE) != 0)
        fail("cannot protect the shared memory guard page");
    r.smem = reinterpret_cast<unsigned char*>(r.smem_map + mapped - body);
}

}  // namespace

// ---- interface used by cuda_emu.h -----------------------------------------------------

[[noreturn]] void fail(const char* what) {
    Runtime* r = tl_rt.get();
    if (r && r->running && r->name) {
        if (r->cur)
            fprintf(stderr,
                    "grng emu: kernel %s, block (%u,%u,%u), thread (%u,%u,%u): %s\n", r->name,
                    r->block.idx.x, r->block.idx.y, r->block.idx.z, r->cur->idx.x, r->cur->idx.y,
                    r->cur->idx.z, what);
        else
            fprintf(stderr, "grng emu: kernel %s, block (%u,%u,%u): %s\n", r->name,
                    r->block.idx.x, r->block.idx.y, r->block.idx.z, what);
    } else {
        fprintf(stderr, "grng emu: %s\n", what);
    }
    fflush(stderr);
    abort();
}

unsigned char* dyn_smem() { return rt().smem; }

int block_sync(BlockOp op, int pred) {
    Runtime& r = rt();
    Fiber& f = *r.cur;
    if (r.ndone > 0)
        failf("__syncthreads reached after %u threads of the block exited (every thread of a "
              "block must reach each barrier)",
              r.ndone);
    r.bar_count += pred != 0;
    r.bar_and &= pred != 0;
    r.bar_or |= pred != 0;
    if (++r.bar_arrived < r.nthreads) {
        f.state = WAIT_BLOCK;
        yield(r, f);
        return static_cast<int>(f.xresult);
    }
    const int res = op == BLOCK_COUNT ? r.bar_count
                    : op == BLOCK_AND ? r.bar_and
                    : op == BLOCK_OR  ? r.bar_or
                                      : 0;
    for (uint32_t t = 0; t < r.nthreads; ++t) {
        Fiber& o = r.fibers[t];
        o.xresult = static_cast<uint64_t>(res);
        if (o.state == WAIT_BLOCK) o.state = READY;
    }
    r.bar_arrived = 0;
    r.bar_count = 0;
    r.bar_and = 1;
    r.bar_or = 0;
    return res;
}

void warp_op(unsigned mask, WarpOp op, uint64_t value, int b, int width, void* ctx,
             void (*fn)(void* const*, unsigned)) {
    Runtime& r = rt();
    Fiber& f = *r.cur;
    Warp& w = r.warps[f.warp];
    const unsigned bit = 1u << f.lane;
    if (!(mask & bit))
        failf("%s: mask 0x%08x does not include the calling lane %u", op_name(op), mask, f.lane);
    if (width < 1 || width > 32 || (width & (width - 1)))
        failf("%s: width %d is not a power of two in [1, 32]", op_name(op), width);
    // At most one pending collective per mask (every lane of it must arrive before any
    // leaves). Different masks may overlap: lanes outside a partial-mask collective can wait
    // in a full-mask one until the others get there.
    WarpSlot* s = nullptr;
    for (int i = 0; i < w.nslots && !s; ++i)
        if (w.slots[i].active && w.slots[i].mask == mask) s = &w.slots[i];
    if (!s) {
        int i = 0;
        while (i < w.nslots && w.slots[i].active) ++i;
        if (i == w.nslots) ++w.nslots;
        s = &w.slots[i];
        s->active = true;
        s->mask = mask;
        s->arrived = 0;
        s->op = op;
        s->fn = fn;
    } else if (s->op != op || s->fn != fn) {
        failf("lane %u calls %s while lanes 0x%08x of its warp wait in %s with the same mask",
              f.lane, op_name(op), s->arrived, op_name(s->op));
    }
    s->arrived |= bit;
    s->val[f.lane] = value;
    s->b[f.lane] = b;
    s->width[f.lane] = width;
    s->ctx[f.lane] = ctx;
    if (s->arrived == (mask & live_lanes(w))) {
        complete(r, f.warp, *s);
        return;
    }
    f.state = WAIT_WARP;
    yield(r, f);
}

void require_full_warp(const char* what) {
    Runtime& r = rt();
    if (r.warps[r.cur->warp].existing != 0xffffffffu)
        failf("%s needs all 32 lanes of the warp (blockDim has a partial warp)", what);
}

void run_grid(const grng_emu_launch* cfg, const char* name, void (*body)(void*), void* ctx) {
    Runtime& r = rt();
    if (r.running) fail("a kernel launched another kernel (not supported)");
    const uint64_t n = uint64_t(cfg->block[0]) * cfg->block[1] * cfg->block[2];
    if (n == 0 || n > kMaxThreads || cfg->block[2] > 64 || cfg->grid[0] == 0 ||
        cfg->grid[1] == 0 || cfg->grid[2] == 0 || cfg->grid[1] > 65535 || cfg->grid[2] > 65535 ||
        cfg->grid[0] > 0x7fffffffu || cfg->shared_mem > kMaxDynSmem)
        failf("kernel %s: invalid launch grid (%u,%u,%u) block (%u,%u,%u) shared %u", name,
              cfg->grid[0], cfg->grid[1], cfg->grid[2], cfg->block[0], cfg->block[1],
              cfg->block[2], cfg->shared_mem);
    r.nthreads = static_cast<uint32_t>(n);
    ensure_stacks(r, r.nthreads);
    if (r.fibers.size() < r.nthreads) r.fibers.resize(r.nthreads);
    if (r.warps.size() < (r.nthreads + 31) / 32) r.warps.resize((r.nthreads + 31) / 32);
    map_smem(r, cfg->shared_mem);
    r.name = name;
    r.buffers = cfg->buffers;
    r.nbuffers = cfg->buffers ? cfg->nbuffers : 0;
    r.body = body;
    r.body_ctx = ctx;
    r.block.dim = dim3(cfg->block[0], cfg->block[1], cfg->block[2]);
    r.block.grid = dim3(cfg->grid[0], cfg->grid[1], cfg->grid[2]);
    r.running = true;
    tl_block = &r.block;
    // Blocks run one after another, along x in the order 0, 2, 4, …, 1, 3, 5, …: a GPU runs
    // them in no given order, so a kernel must not depend on it, and an order other than the
    // launch order lets the tests see one that does (a block reading what a later block of its
    // launch writes, or two parts of a launch sharing scratch: elementwise_multi_dot's groups).
    const uint32_t gx = cfg->grid[0], evens = (gx + 1) / 2;
    for (uint32_t z = 0; z < cfg->grid[2]; ++z)
        for (uint32_t y = 0; y < cfg->grid[1]; ++y)
            for (uint32_t i = 0; i < gx; ++i) {
                const uint32_t x = i < evens ? 2 * i : 2 * (i - evens) + 1;
                r.block.idx = uint3{x, y, z};
                run_block(r);
            }
    tl_block = nullptr;
    r.running = false;
    r.name = nullptr;
    r.buffers = nullptr;
    r.nbuffers = 0;
    if (r.smem_map) munmap(r.smem_map, r.smem_map_len);
    r.smem_map = nullptr;
    r.smem = nullptr;
}

// ---- sm_80 warp-level matrix primitives ------------------------------------------------

namespace {
struct MmaLane {
    float* d;
    const unsigned* a;
    const unsigned* b;
    const float* c;
};
struct LdmLane {
    unsigned* r;
    const unsigned char* row;
    int trans;
};

float bf16_bits(unsigned bits) {
    const uint32_t u = bits << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
unsigned lo16(unsigned r) { return r & 0xffffu; }
unsigned hi16(unsigned r) { return r >> 16; }

void require_all_lanes(unsigned participants, const char* what) {
    if (participants != 0xffffffffu)
        failf("%s with lanes 0x%08x only: all 32 lanes must take part", what, participants);
}

// PTX ISA "Matrix Fragments for mma.m16n8k16" (bf16): lane p, groupID g = p / 4, threadID in
// group t = p % 4. A (16x16, row): a0 = A[g][2t..2t+1], a1 = A[g+8][2t..], a2 = A[g][2t+8..],
// a3 = A[g+8][2t+8..] (lower half = lower column). B (16x8, col): b0 = B[2t..2t+1][g],
// b1 = B[2t+8..2t+9][g]. C, D (16x8): c0, c1 = C[g][2t], C[g][2t+1]; c2, c3 = row g+8.
void mma_all(void* const* ctxs, unsigned participants) {
    require_all_lanes(participants, "mma.sync");
    float A[16][16], B[16][8], C[16][8];
    for (int p = 0; p < 32; ++p) {
        const MmaLane& l = *static_cast<const MmaLane*>(ctxs[p]);
        const int g = p / 4, t = p % 4;
        for (int h = 0; h < 2; ++h) {  // h: rows g / g + 8 of A, C; k 2t / 2t + 8 of B
            const unsigned lo = h ? l.a[1] : l.a[0], hi = h ? l.a[3] : l.a[2];
            A[g + 8 * h][2 * t] = bf16_bits(lo16(lo));
            A[g + 8 * h][2 * t + 1] = bf16_bits(hi16(lo));
            A[g + 8 * h][2 * t + 8] = bf16_bits(lo16(hi));
            A[g + 8 * h][2 * t + 9] = bf16_bits(hi16(hi));
            B[2 * t + 8 * h][g] = bf16_bits(lo16(l.b[h]));
            B[2 * t + 8 * h + 1][g] = bf16_bits(hi16(l.b[h]));
            C[g + 8 * h][2 * t] = l.c[2 * h];
            C[g + 8 * h][2 * t + 1] = l.c[2 * h + 1];
        }
    }
    // Products of bf16 are exact in f32; the sum is f32 in k order (hardware may order and
    // round differently: tests allow a few ulps per term).
    float D[16][8];
    for (int i = 0; i < 16; ++i)
        for (int j = 0; j < 8; ++j) {
            float acc = C[i][j];
            for (int k = 0; k < 16; ++k) acc += A[i][k] * B[k][j];
            D[i][j] = acc;
        }
    for (int p = 0; p < 32; ++p) {
        const MmaLane& l = *static_cast<const MmaLane*>(ctxs[p]);
        const int g = p / 4, t = p % 4;
        for (int h = 0; h < 2; ++h) {
            l.d[2 * h] = D[g + 8 * h][2 * t];
            l.d[2 * h + 1] = D[g + 8 * h][2 * t + 1];
        }
    }
}

// PTX ISA "ldmatrix": matrix j's row i is the 16 bytes at lane 8j + i's address. Without
// .trans lane p receives row p / 4, elements 2(p % 4) and 2(p % 4) + 1 of each matrix; with
// .trans the same positions of the transposed matrix (elements (2(p % 4) + {0, 1}, p / 4)).
void ldmatrix_all(void* const* ctxs, unsigned participants) {
    require_all_lanes(participants, "ldmatrix.x4");
    const int trans = static_cast<const LdmLane*>(ctxs[0])->trans;
    uint16_t M[4][8][8];
    for (int p = 0; p < 32; ++p) {
        const LdmLane& l = *static_cast<const LdmLane*>(ctxs[p]);
        if (l.trans != trans) failf("ldmatrix: lanes 0 and %d disagree on .trans", p);
        std::memcpy(M[p / 8][p % 8], l.row, 16);
    }
    for (int p = 0; p < 32; ++p) {
        const LdmLane& l = *static_cast<const LdmLane*>(ctxs[p]);
        const int r = p / 4, c = 2 * (p % 4);
        for (int j = 0; j < 4; ++j) {
            const unsigned e0 = trans ? M[j][c][r] : M[j][r][c];
            const unsigned e1 = trans ? M[j][c + 1][r] : M[j][r][c + 1];
            l.r[j] = e0 | (e1 << 16);
        }
    }
}

// Shared-memory operands must lie in the launch's dynamic shared memory (GRNG_DYN_SHARED).
void check_smem16(const void* p, const char* what) {
    const Runtime& r = rt();
    const unsigned char* a = static_cast<const unsigned char*>(p);
    if (reinterpret_cast<uintptr_t>(a) % 16 != 0) failf("%s: shared address %p is not 16-byte aligned", what, p);
    if (!r.smem || a < r.smem || a + 16 > r.smem + r.smem_bytes)
        failf("%s: address %p is not 16 bytes inside the dynamic shared memory", what, p);
}
}  // namespace

void mma_m16n8k16_bf16(float* d, const unsigned* a, const unsigned* b, const float* c) {
    require_full_warp("mma.sync");
    MmaLane l{d, a, b, c};
    warp_op(0xffffffffu, W_FN, 0, 0, 32, &l, &mma_all);
}

void ldmatrix_x4(unsigned* r, const void* row, bool trans) {
    require_full_warp("ldmatrix.x4");
    check_smem16(row, "ldmatrix");
    LdmLane l{r, static_cast<const unsigned char*>(row), trans ? 1 : 0};
    warp_op(0xffffffffu, W_FN, 0, 0, 32, &l, &ldmatrix_all);
}

void cp_async_16(void* dst, const void* src, int src_bytes) {
    Runtime& r = rt();
    check_smem16(dst, "cp.async");
    if (src_bytes < 0 || src_bytes > 16) failf("cp.async: src-size %d outside [0, 16]", src_bytes);
    const uintptr_t s = reinterpret_cast<uintptr_t>(src);
    if (s % 16 != 0) failf("cp.async: global address %p is not 16-byte aligned", src);
    if (src_bytes > 0 && r.nbuffers > 0) {
        bool inside = false;
        for (uint32_t i = 0; i < r.nbuffers && !inside; ++i)
            inside = s >= r.buffers[i].base && s + src_bytes <= r.buffers[i].base + r.buffers[i].bytes;
        if (!inside) failf("cp.async: %d bytes at %p are not inside a kernel buffer", src_bytes, src);
    }
    r.cur->copies.push_back(PendingCopy{static_cast<unsigned char*>(dst),
                                        static_cast<const unsigned char*>(src), src_bytes, 0});
}

void cp_async_commit() {
    Fiber& f = *rt().cur;
    ++f.committed;
    for (PendingCopy& c : f.copies)
        if (c.group == 0) c.group = f.committed;
}

void cp_async_wait(int pending) {
    if (pending < 0) failf("cp.async.wait_group %d: N must be non-negative", pending);
    complete_copies(*rt().cur, unsigned(pending));
}

}  // namespace grng_emu

// ---- WMMA (one lane computes for the warp; every lane must pass identical arguments) ----
namespace nvcuda {
namespace wmma {
namespace detail {

namespace {
// WMMA operations are warp-wide: all 32 lanes, none exited.
int leader(unsigned participants) {
    if (participants != 0xffffffffu)
        grng_emu::failf("WMMA operation with lanes 0x%08x only: all 32 lanes must take part",
                        participants);
    return 0;
}
}  // namespace

void check_ptr(const void* p, unsigned ldm, int elem_size, bool col_major, const char* what) {
    // CUDA: a 256-bit aligned pointer and ldm a multiple of 16 bytes. Kernel buffers are
    // 256-byte aligned on the GPU but not on the host, so inside one the offset from its base
    // is checked (and that the whole 16x16 tile lies inside); elsewhere (shared memory) the
    // address itself.
    if ((ldm * unsigned(elem_size)) % 16 != 0)
        grng_emu::failf("%s: ldm %u is not a multiple of %d elements", what, ldm, 16 / elem_size);
    if (ldm < 16)
        grng_emu::failf("%s: ldm %u is smaller than the tile (16)", what, ldm);
    (void)col_major;  // both layouts span 15 * ldm + 16 elements
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    const grng_emu::Runtime& r = grng_emu::rt();
    for (uint32_t i = 0; i < r.nbuffers; ++i) {
        const uint64_t base = r.buffers[i].base, bytes = r.buffers[i].bytes;
        if (a < base || a >= base + bytes) continue;
        if ((a - base) % 32 != 0)
            grng_emu::failf("%s: pointer is %llu bytes into a kernel buffer, not a multiple of 32",
                            what, (unsigned long long)(a - base));
        const uint64_t extent = (uint64_t(15) * ldm + 16) * uint64_t(elem_size);
        if (a - base + extent > bytes)
            grng_emu::failf("%s: the 16x16 tile (ldm %u) at byte %llu runs past the end of its "
                            "%llu-byte buffer",
                            what, ldm, (unsigned long long)(a - base), (unsigned long long)bytes);
        return;
    }
    if (a % 32 != 0) grng_emu::failf("%s: pointer %p is not 32-byte aligned", what, p);
}

void load_all(void* const* ctxs, unsigned participants) {
    const LoadArgs& a = *static_cast<const LoadArgs*>(ctxs[leader(participants)]);
    for (int p = 0; p < 32; ++p) {
        if (!ctxs[p]) continue;
        const LoadArgs& o = *static_cast<const LoadArgs*>(ctxs[p]);
        if (o.ptr != a.ptr || o.ldm != a.ldm || o.col_major != a.col_major)
            grng_emu::failf("load_matrix_sync: lane %d passes (%p, ldm %u) but lane %d (%p, ldm %u)",
                            p, o.ptr, o.ldm, leader(participants), a.ptr, a.ldm);
    }
    for (int r = 0; r < 16; ++r)
        for (int c = 0; c < 16; ++c) {
            const size_t src = a.col_major ? size_t(r) + size_t(c) * a.ldm : size_t(r) * a.ldm + c;
            const char* from = static_cast<const char*>(a.ptr) + src * a.elem_size;
            std::memcpy(static_cast<char*>(a.frag) + (r * 16 + c) * a.elem_size, from, a.elem_size);
        }
    for (int p = 0; p < 32; ++p)
        if (ctxs[p] && ctxs[p] != &a)
            std::memcpy(static_cast<const LoadArgs*>(ctxs[p])->frag, a.frag, 256 * a.elem_size);
}

void store_all(void* const* ctxs, unsigned participants) {
    const LoadArgs& a = *static_cast<const LoadArgs*>(ctxs[leader(participants)]);
    for (int p = 0; p < 32; ++p) {
        if (!ctxs[p]) continue;
        const LoadArgs& o = *static_cast<const LoadArgs*>(ctxs[p]);
        if (o.ptr != a.ptr || o.ldm != a.ldm || o.col_major != a.col_major)
            grng_emu::failf("store_matrix_sync: lanes pass different pointers or ldm");
        if (std::memcmp(o.frag, a.frag, 256 * 4) != 0)
            grng_emu::failf("store_matrix_sync: lane %d's accumulator differs from lane %d's "
                            "(fragment elements were changed per lane)",
                            p, leader(participants));
    }
    float* out = static_cast<float*>(const_cast<void*>(a.ptr));
    const float* x = static_cast<const float*>(a.frag);
    for (int r = 0; r < 16; ++r)
        for (int c = 0; c < 16; ++c)
            out[a.col_major ? size_t(r) + size_t(c) * a.ldm : size_t(r) * a.ldm + c] = x[r * 16 + c];
}

void mma_all(void* const* ctxs, unsigned participants) {
    const MmaArgs& m = *static_cast<const MmaArgs*>(ctxs[leader(participants)]);
    for (int p = 0; p < 32; ++p) {
        if (!ctxs[p]) continue;
        const MmaArgs& o = *static_cast<const MmaArgs*>(ctxs[p]);
        if (std::memcmp(o.a, m.a, 512) != 0 || std::memcmp(o.b, m.b, 512) != 0 ||
            std::memcmp(o.c, m.c, 1024) != 0)
            grng_emu::failf("mma_sync: lane %d's fragments differ from lane %d's (fragment "
                            "elements were changed per lane)",
                            p, leader(participants));
    }
    float a[256], b[256], d[256];
    for (int i = 0; i < 256; ++i) {
        a[i] = __bfloat162float(m.a[i]);
        b[i] = __bfloat162float(m.b[i]);
    }
    for (int i = 0; i < 16; ++i)
        for (int j = 0; j < 16; ++j) {
            float acc = m.c[i * 16 + j];
            for (int k = 0; k < 16; ++k) acc += a[i * 16 + k] * b[k * 16 + j];
            d[i * 16 + j] = acc;
        }
    for (int p = 0; p < 32; ++p)
        if (ctxs[p]) std::memcpy(static_cast<const MmaArgs*>(ctxs[p])->d, d, sizeof d);
}

}  // namespace detail
}  // namespace wmma
}  // namespace nvcuda
