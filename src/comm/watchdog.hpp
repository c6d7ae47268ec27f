// Turns a collective that does not finish within fsdp.comm_timeout into an abort with a message.
//
// The communicating thread marks the start and end of every blocking collective (Scope); a
// background thread checks the mark every few milliseconds. A rank stuck in compute is not
// itself flagged: its peers, waiting for it inside a collective, are, and their MPI_Abort takes
// the whole job down. timeout <= 0 disables the watchdog.
#pragma once

#include <atomic>
#include <string>
#include <thread>

namespace shardtrain {

class Watchdog {
 public:
  Watchdog(double timeout_seconds, std::string rank_label);
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  double timeout_seconds() const { return timeout_seconds_; }

  // Marks one blocking collective (or a collective phase, e.g. a checkpoint save) for its
  // lifetime. `what` must outlive the scope (a literal). Scopes nest: an inner one restores the
  // outer one's mark when it ends.
  class Scope {
   public:
    Scope(Watchdog* dog, const char* what);
    ~Scope();

   private:
    Watchdog* dog_;
    const char* outer_what_ = nullptr;
    double outer_since_ = 0;
  };

 private:
  void loop();

  double timeout_seconds_;
  std::string rank_label_;
  std::atomic<const char*> current_{nullptr};
  std::atomic<double> since_{0.0};
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace shardtrain
