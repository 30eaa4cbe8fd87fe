#include "pool.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <mutex>
#include <sched.h>
#include <thread>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace laya {
namespace {

inline void relax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

// After a call a worker spins this long for the next one (a decode step's products are tens
// of microseconds apart), yielding its CPU to any other thread that wants it after the
// first kPauseSpin, then sleeps.
constexpr auto kPauseSpin = std::chrono::microseconds(50);
constexpr auto kSpin = std::chrono::microseconds(1000);
constexpr int64_t kMaxWorkers = 63;

// The call in progress. ``claim`` packs its epoch (32 bits), its task count and the next
// unclaimed task (16 bits each), so that a worker still in an earlier call can never claim
// a task of this one: its compare-and-swap carries the old epoch. The task and its args are
// read before the claim and used only if the claim succeeds, that is while the call that
// wrote them is still waiting for its tasks.
struct Pool {
  std::atomic<uint64_t> claim{0};
  std::atomic<Task> task{nullptr};
  std::atomic<const void*> args{nullptr};
  alignas(64) std::atomic<int64_t> done{0};
  alignas(64) std::atomic<uint32_t> epoch{0};  // the workers' futex word
  std::atomic<int> sleepers{0};
  std::mutex calling;  // one call at a time; a second caller runs its tasks alone
  int64_t workers = 0;
  pid_t owner = 0;  // the process that started the workers (a fork's child has none)
};

Pool* pool() {
  static Pool* p = new Pool;  // never destroyed: its workers are detached
  return p;
}

long futex(std::atomic<uint32_t>* word, int op, uint32_t value) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op | FUTEX_PRIVATE_FLAG, value,
                 nullptr, nullptr, 0);
}

// Claims and runs tasks of the call ``epoch`` until none is left; false if another call
// has begun.
bool work(Pool& p, uint32_t epoch) {
  for (;;) {
    uint64_t c = p.claim.load(std::memory_order_acquire);
    if (static_cast<uint32_t>(c >> 32) != epoch) return false;
    const uint64_t next = c & 0xffff, count = (c >> 16) & 0xffff;
    if (next >= count) return true;
    const Task task = p.task.load(std::memory_order_relaxed);
    const void* args = p.args.load(std::memory_order_relaxed);
    if (!p.claim.compare_exchange_weak(c, c + 1, std::memory_order_acq_rel)) continue;
    task(args, static_cast<int64_t>(next));
    p.done.fetch_add(1, std::memory_order_release);
  }
}

void worker(Pool* p) {
  uint32_t seen = p->epoch.load(std::memory_order_acquire);
  for (;;) {
    const auto start = std::chrono::steady_clock::now();
    for (int64_t i = 0; p->epoch.load(std::memory_order_acquire) == seen; ++i) {
      if (i % 64 != 63) {
        relax();
        continue;
      }
      const auto spent = std::chrono::steady_clock::now() - start;
      if (spent < kPauseSpin) continue;
      if (spent < kSpin) {
        sched_yield();
        continue;
      }
      p->sleepers.fetch_add(1);
      if (p->epoch.load() == seen) futex(&p->epoch, FUTEX_WAIT, seen);
      p->sleepers.fetch_sub(1);
    }
    seen = p->epoch.load(std::memory_order_acquire);
    work(*p, seen);
  }
}

void run_alone(Task task, const void* args, int64_t tasks) {
  for (int64_t i = 0; i < tasks; ++i) task(args, i);
}

}  // namespace

void run_tasks(Task task, const void* args, int64_t tasks, int64_t threads) {
  Pool& p = *pool();
  threads = std::min({threads, tasks, kMaxWorkers + 1});
  std::unique_lock<std::mutex> lock(p.calling, std::try_to_lock);
  if (threads <= 1 || tasks > 0xffff || !lock.owns_lock()) {
    run_alone(task, args, tasks);
    return;
  }
  if (p.owner != getpid()) {  // first call here (or in a forked child): no workers yet
    p.owner = getpid();
    p.workers = 0;
    p.sleepers.store(0);
  }
  for (; p.workers < threads - 1; ++p.workers) std::thread(worker, &p).detach();
  p.task.store(task, std::memory_order_relaxed);
  p.args.store(args, std::memory_order_relaxed);
  p.done.store(0, std::memory_order_relaxed);
  const uint32_t epoch = p.epoch.load(std::memory_order_relaxed) + 1;
  p.claim.store((uint64_t{epoch} << 32) | (static_cast<uint64_t>(tasks) << 16),
                std::memory_order_release);
  p.epoch.store(epoch, std::memory_order_seq_cst);
  if (p.sleepers.load() > 0) futex(&p.epoch, FUTEX_WAKE, INT_MAX);
  work(p, epoch);
  while (p.done.load(std::memory_order_acquire) < tasks) relax();
}

}  // namespace laya
