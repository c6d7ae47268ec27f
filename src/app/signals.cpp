// See signals.hpp. The handler is async-signal-safe: it stores one sig_atomic_t.
#include "app/signals.hpp"

#include <fcntl.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <initializer_list>

#include "core/error.hpp"

namespace shardtrain {
namespace {
volatile std::sig_atomic_t g_stop_signal = 0;  // the one process-wide state a signal handler may touch
// Set before the handlers are installed, read only by them.
volatile std::sig_atomic_t g_output_unblocks_on_stop = 0;

extern "C" void record_stop_signal(int signal) {
  g_stop_signal = signal;
  if (!g_output_unblocks_on_stop) return;
  // mpirun stops reading its ranks' output as soon as it is signalled, so rank 0 blocks in a
  // write to the full pty and never reaches the step boundary to save. The interrupted write
  // restarts (SA_RESTART) as a non-blocking one: log lines are dropped instead. fcntl is
  // async-signal-safe; the pty is this process's alone, so no other program sees the flag.
  for (int fd : {STDOUT_FILENO, STDERR_FILENO}) {
    const int flags = fcntl(fd, F_GETFL);
    if (flags != -1) fcntl(fd, F_SETFL, flags | O_NONBLOCK);
  }
}

bool launched_by_mpirun() { return std::getenv("OMPI_MCA_orte_local_daemon_uri") != nullptr; }
}  // namespace

void install_stop_signal_handlers() {
  g_output_unblocks_on_stop = launched_by_mpirun();
  struct sigaction action {};
  action.sa_handler = record_stop_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;  // blocking MPI and file calls resume instead of failing with EINTR
  for (int s : {SIGUSR1, SIGTERM, SIGINT}) sigaction(s, &action, nullptr);
}

void block_stop_signals(bool block) {
  sigset_t stops;
  sigemptyset(&stops);
  for (int s : {SIGUSR1, SIGTERM, SIGINT}) sigaddset(&stops, s);
  sigprocmask(block ? SIG_BLOCK : SIG_UNBLOCK, &stops, nullptr);
}

int stop_signal_received() { return g_stop_signal; }

void exit_with_mpirun() {
  // Open MPI's launcher (mpirun or its orted) is our parent and says so in the environment.
  if (!launched_by_mpirun()) return;
  const pid_t launcher = getppid();
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != launcher) std::_Exit(EXIT_CODE_INTERNAL);  // it died before the line above
}

double mpirun_stop_grace_seconds() {
  if (!launched_by_mpirun()) return -1;
  // mpirun hands its MCA settings (--mca or the environment) to its ranks as OMPI_MCA_ variables.
  const char* value = std::getenv("OMPI_MCA_odls_base_sigkill_timeout");
  char* end = nullptr;
  const double seconds = value ? std::strtod(value, &end) : 1;
  return value && (end == value || *end != '\0') ? 1 : seconds;
}

bool stopped_by_mpirun(int signal) { return launched_by_mpirun() && (signal == SIGTERM || signal == SIGINT); }

void write_to_terminal(const std::string& line) {
  const int fd = ::open("/dev/tty", O_WRONLY | O_NOCTTY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return;
  const std::string text = line + "\n";
  const ssize_t written = ::write(fd, text.data(), text.size());
  (void)written;  // a full or gone terminal: the line is lost, the run is not
  ::close(fd);
}

const char* signal_origin(int signal) {
  // Under mpirun a Ctrl-C reaches the ranks as mpirun's SIGTERM: say so, the user pressed no kill.
  if (signal == SIGTERM && launched_by_mpirun()) return "SIGTERM (from mpirun: Ctrl-C, or a kill of mpirun)";
  return signal_name(signal);
}

const char* signal_name(int signal) {
  switch (signal) {
    case SIGUSR1: return "SIGUSR1";
    case SIGTERM: return "SIGTERM";
    case SIGINT: return "SIGINT";
    default: return "signal";
  }
}

}  // namespace shardtrain
