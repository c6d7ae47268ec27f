// See watchdog.hpp.
#include "comm/watchdog.hpp"

#include <mpi.h>

#include <cstdio>

#include <unistd.h>

#include "core/clock.hpp"

namespace shardtrain {

Watchdog::Watchdog(double timeout_seconds, std::string option, std::string label, OnTimeout on_timeout)
    : timeout_seconds_(timeout_seconds),
      option_(std::move(option)),
      label_(std::move(label)),
      on_timeout_(std::move(on_timeout)) {
  if (!on_timeout_)
    on_timeout_ = [this](const char* what, double) {
      std::fprintf(stderr, "%s\n", message(label_, what, option_, timeout_seconds_).c_str());
      std::fflush(stderr);
      int initialized = 0, finalized = 0;
      MPI_Initialized(&initialized);
      MPI_Finalized(&finalized);
      if (initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, EXIT_CODE_INTERNAL);
      _exit(EXIT_CODE_INTERNAL);  // inside MPI_Init, or MPI_Abort came back: the launcher ends the job
    };
  if (timeout_seconds_ > 0) thread_ = std::thread([this] { loop(); });
}

std::string Watchdog::message(const std::string& label, const char* what, const std::string& option, double seconds) {
  // A command without a timeout option of its own (plan, inspect) runs with the default.
  const std::string within = option.empty() ? strprintf("%g s", seconds) : strprintf("%s=%g s", option.c_str(), seconds);
  return strprintf("%s error: collective %s did not complete within %s: another rank is stalled or dead; aborting all "
                   "ranks%s",
                   label.c_str(), what, within.c_str(),
                   option.empty() ? "" : (" (raise " + option + " if this is legitimately this slow)").c_str());
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
