// See watchdog.hpp.
#include "comm/watchdog.hpp"

#include <mpi.h>

#include <chrono>
#include <cstdio>

namespace shardtrain {

Watchdog::Watchdog(double timeout_seconds, std::string rank_label)
    : timeout_seconds_(timeout_seconds), rank_label_(std::move(rank_label)) {
  if (timeout_seconds_ > 0) thread_ = std::thread([this] { loop(); });
}

Watchdog::~Watchdog() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
}

Watchdog::Scope::Scope(Watchdog* dog, const char* what) : dog_(dog) {
  if (!dog_) return;
  outer_what_ = dog_->current_.load();
  outer_since_ = dog_->since_.load();
  dog_->current_ = nullptr;  // never a window with the new name and the old start time
  dog_->since_ = MPI_Wtime();
  dog_->current_ = what;
}

Watchdog::Scope::~Scope() {
  if (!dog_) return;
  dog_->current_ = nullptr;
  dog_->since_ = outer_since_;
  dog_->current_ = outer_what_;
}

void Watchdog::loop() {
  while (!stop_) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    const char* what = current_.load();
    if (!what) continue;
    double waited = MPI_Wtime() - since_.load();
    if (waited > timeout_seconds_ && current_.load() == what) {
      std::fprintf(stderr,
                   "%s error: collective %s did not complete within fsdp.comm_timeout=%g s: another "
                   "rank is stalled or dead; aborting all ranks (raise fsdp.comm_timeout if steps "
                   "are legitimately this slow)\n",
                   rank_label_.c_str(), what, timeout_seconds_);
      std::fflush(stderr);
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
  }
}

}  // namespace shardtrain
