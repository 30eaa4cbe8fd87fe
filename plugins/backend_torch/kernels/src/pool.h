// Threads kept for the kernels' products (pool.cpp).
#pragma once

#include <cstdint>

namespace laya {

// Runs task(args, i) for every i in [0, tasks) on the calling thread and the kept workers
// (threads - 1 of them, or more if an earlier call asked for more), and returns when all
// are done; at most 65,535 tasks a call. Tasks are claimed one at a time in order, so
// a worker that is late (asleep, or not yet started) leaves its share to the others and the
// call never waits for it to wake. A task must not depend on which thread runs it.
//
// A product of a decode step lasts 10 to 100 us and a step makes about 120 of them: a
// thread started for each (tens of microseconds) would cost as much as the work. The
// workers spin for a while after each call, then sleep until the next (a futex). One call
// at a time: the callers are the backend's step, which runs one at a time.
using Task = void (*)(const void* args, int64_t i);
void run_tasks(Task task, const void* args, int64_t tasks, int64_t threads);

}  // namespace laya
