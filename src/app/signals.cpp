// See signals.hpp. The handler is async-signal-safe: it stores one sig_atomic_t.
#include "app/signals.hpp"

#include <csignal>
#include <initializer_list>

namespace shardtrain {
namespace {
volatile std::sig_atomic_t g_stop_signal = 0;  // the one process-wide state a signal handler may touch
extern "C" void record_stop_signal(int signal) { g_stop_signal = signal; }
}  // namespace

void install_stop_signal_handlers() {
  struct sigaction action {};
  action.sa_handler = record_stop_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;  // blocking MPI and file calls resume instead of failing with EINTR
  for (int s : {SIGUSR1, SIGTERM, SIGINT}) sigaction(s, &action, nullptr);
}

int stop_signal_received() { return g_stop_signal; }

const char* signal_name(int signal) {
  switch (signal) {
    case SIGUSR1: return "SIGUSR1";
    case SIGTERM: return "SIGTERM";
    case SIGINT: return "SIGINT";
    default: return "signal";
  }
}

}  // namespace shardtrain
