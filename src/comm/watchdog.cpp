// See watchdog.hpp.
#include "comm/watchdog.hpp"

#include <mpi.h>

#include <cstdio>

#include "core/clock.hpp"

namespace shardtrain {

Watchdog::Watchdog(double timeout_seconds, std::string label, OnTimeout on_timeout)
    : timeout_seconds_(timeout_seconds), label_(std::move(label)), on_timeout_(std::move(on_timeout)) {
  if (!on_timeout_)
    on_timeout_ = [this](const char* what, double) {
      std::fprintf(stderr,
                   "%s error: collective %s did not complete within fsdp.comm_timeout=%g s: another rank is "
                   "stalled or dead; aborting all ranks (raise fsdp.comm_timeout if steps are legitimately "
                   "this slow)\n",
                   label_.c_str(), what, timeout_seconds_);
      std::fflush(stderr);
      MPI_Abort(MPI_COMM_WORLD, EXIT_CODE_INTERNAL);
    };
  if (timeout_seconds_ > 0) thread_ = std::thread([this] { loop(); });
}

Watchdog::~Watchdog() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
}

void Watchdog::mark(const char* what) {
  generation_.fetch_add(1);  // odd: being rewritten
  what_ = what;
  since_ = now_seconds();
  generation_.fetch_add(1);
}

Watchdog::Scope::Scope(Watchdog* dog, const char* what) : dog_(dog) {
  if (!dog_) return;
  outer_what_ = dog_->what_.load();
  dog_->mark(what);
}

Watchdog::Scope::~Scope() {
  if (dog_) dog_->mark(outer_what_);
}

void Watchdog::loop() {
  uint64_t reported = 1;  // odd: no generation reported yet
  while (!stop_) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    const uint64_t generation = generation_.load();
    if (generation % 2 || generation == reported) continue;
    const char* what = what_.load();
    const double since = since_.load();
    const double now = now_seconds();
    // Unchanged generation: `what` began at `since` and was still open after `now` was read.
    if (generation_.load() != generation || !what || now - since <= timeout_seconds_) continue;
    reported = generation;
    on_timeout_(what, now - since);
  }
}

}  // namespace shardtrain
