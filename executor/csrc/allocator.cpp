// The node's CPU allocator, installed in place of libtorch's default (which it calls the same
// way, c10::alloc_cpu): every allocation made on a thread while a job's account is current is
// counted against that account, so a job's memory is bounded however it allocates: inside an
// operator, after an operator a plan could not follow, after the run (an output made
// contiguous). The account travels in each allocation's context, so a free on any thread
// credits the account that paid for it. Over the run's bound or the tenant's quota the
// allocation throws (an exception the dispatcher's caller catches), and the account records
// why for Rust to give the tenant a typed error.
//
// What it cannot see: memory libtorch takes with malloc (BLAS and oneDNN scratch), and device
// memory (CUDA's caching allocator); the executor-process issue bounds those by process.

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <atomic>
#include <cstdint>
#include <cstring>

extern "C" {
// Asks the account's owner (Rust) for `bytes` more of the tenant's quota: 1 granted, 0 not.
typedef int (*djinn_grow_fn)(void* owner, uint64_t bytes);
}

enum djinn_refusal : int32_t { REFUSED_NONE = 0, REFUSED_RUN_BOUND = 1, REFUSED_QUOTA = 2 };

struct djinn_account {
    // The Rust handle and each live allocation.
    std::atomic<int64_t> refs{1};
    // Bytes of live allocations charged here (freed on any thread).
    std::atomic<uint64_t> live{0};
    // The rest is read and written on the job's thread only, while the account is current
    // there (and by Rust on that thread before and after).
    uint64_t limit = 0;
    // Live bytes when the current graph run began: a run's bound is on what it adds.
    uint64_t baseline = 0;
    // Bytes of the tenant's quota held for the account (UINT64_MAX without a quota).
    uint64_t granted = 0;
    djinn_grow_fn grow = nullptr;
    void* owner = nullptr;
    int32_t refused = REFUSED_NONE;
    uint64_t refused_asked = 0;
    uint64_t refused_held = 0;
};

namespace {

thread_local djinn_account* current = nullptr;
// -1, or the byte every accounted allocation is filled with (the execution fuzzer's canary: an
// output still holding it was never written).
std::atomic<int> fill_byte{-1};

void unref(djinn_account* a) {
    if (a->refs.fetch_sub(1, std::memory_order_acq_rel) == 1) delete a;
}

// Each allocation starts with a header saying which account paid for it (none for the node's
// own), so that the context libtorch keeps is the data pointer itself, as its raw interface
// (raw_allocate, which oneDNN's convolutions use) requires, and a free on any thread finds the
// account without a table. 64 bytes keeps the data at c10's alignment.
struct alignas(64) Header {
    djinn_account* account;
    size_t bytes;
};
static_assert(sizeof(Header) == 64, "the header keeps the data aligned as c10::alloc_cpu does");

Header* header_of(void* data) { return static_cast<Header*>(data) - 1; }

void release(void* data) {
    if (data == nullptr) return;
    Header* header = header_of(data);
    if (djinn_account* a = header->account) {
        a->live.fetch_sub(header->bytes, std::memory_order_acq_rel);
        unref(a);
    }
    c10::free_cpu(header);
}

[[noreturn]] void refuse(djinn_account* a, int32_t why, uint64_t asked, uint64_t held) {
    if (a->refused == REFUSED_NONE) {
        a->refused = why;
        a->refused_asked = asked;
        a->refused_held = held;
    }
    C10_THROW_ERROR(OutOfMemoryError,
                    c10::str("an allocation of ", asked, " bytes refused: ",
                             why == REFUSED_RUN_BOUND ? "past the run's memory bound" : "over the tenant's memory quota"));
}

struct AccountingAllocator final : public c10::Allocator {
    c10::DataPtr allocate(size_t n) override {
        djinn_account* a = current;
        if (a != nullptr) {
            uint64_t live = a->live.load(std::memory_order_acquire);
            uint64_t added = live > a->baseline ? live - a->baseline : 0;
            if (n > a->limit || added > a->limit - n) refuse(a, REFUSED_RUN_BOUND, n, added);
            if (live + n > a->granted) {
                // Asked for in 64 KiB steps, so a job's growth takes the quota's lock now and then.
                // Exactly what is missing where the quota has no 64 KiB left.
                uint64_t need = live + n - a->granted, more = (need + 65535) & ~uint64_t{65535};
                bool granted = a->grow != nullptr && a->grow(a->owner, more) != 0;
                if (!granted && a->grow != nullptr && more != need) {
                    more = need;
                    granted = a->grow(a->owner, more) != 0;
                }
                if (!granted) refuse(a, REFUSED_QUOTA, n, live);
                a->granted += more;
            }
        }
        TORCH_CHECK_WITH(OutOfMemoryError, n <= SIZE_MAX - sizeof(Header), "an allocation of ", n, " bytes");
        auto* header = static_cast<Header*>(c10::alloc_cpu(n + sizeof(Header)));
        header->account = a;
        header->bytes = n;
        void* data = header + 1;
        if (a != nullptr) {
            int fill = fill_byte.load(std::memory_order_relaxed);
            if (fill >= 0) std::memset(data, fill, n);
            a->live.fetch_add(n, std::memory_order_acq_rel);
            a->refs.fetch_add(1, std::memory_order_relaxed);
        }
        return {data, data, &release, c10::Device(c10::DeviceType::CPU)};
    }

    c10::DeleterFnPtr raw_deleter() const override { return &release; }

    void copy_data(void* dest, const void* src, std::size_t count) const override {
        default_copy_data(dest, src, count);
    }
};

}  // namespace

extern "C" {

// Installs the allocator for the process's CPU tensors, once.
void djinn_allocator_install() {
    static AccountingAllocator* allocator = [] {
        auto* a = new AccountingAllocator();
        c10::SetCPUAllocator(a, /*priority=*/1);
        return a;
    }();
    (void)allocator;
}

// -1: no fill; else every accounted allocation is filled with this byte.
void djinn_allocator_fill(int byte) { fill_byte.store(byte, std::memory_order_relaxed); }

// An account of `limit` bytes per run, `granted` bytes of quota to begin with (UINT64_MAX for
// none), asking `grow` on `owner` for more.
djinn_account* djinn_account_new(uint64_t limit, uint64_t granted, djinn_grow_fn grow, void* owner) {
    auto* a = new djinn_account();
    a->limit = limit;
    a->granted = granted;
    a->grow = grow;
    a->owner = owner;
    return a;
}

// Makes `a` (or none) this thread's account; returns the one it replaces.
djinn_account* djinn_account_enter(djinn_account* a) {
    djinn_account* before = current;
    current = a;
    return before;
}

// A graph run begins: its bound is on what it adds to what the job holds now.
void djinn_account_begin_run(djinn_account* a) { a->baseline = a->live.load(std::memory_order_acquire); }

uint64_t djinn_account_live(const djinn_account* a) { return a->live.load(std::memory_order_acquire); }

// The first refusal (REFUSED_*), the bytes it asked for and what was held.
int32_t djinn_account_refusal(const djinn_account* a, uint64_t* asked, uint64_t* held) {
    *asked = a->refused_asked;
    *held = a->refused_held;
    return a->refused;
}

// The Rust handle goes: no more growth (its owner goes with it); the account lives on while
// allocations it paid for do.
void djinn_account_close(djinn_account* a) {
    a->grow = nullptr;
    a->owner = nullptr;
    unref(a);
}

}  // extern "C"
