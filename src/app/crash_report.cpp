// See crash_report.hpp. On the main thread the handler runs on its own stack (a stack overflow is
// a SIGSEGV too; other threads' overflows die silently, as before); it calls only what is safe
// there in practice: snprintf without floating point, write, dladdr and
// backtrace (loaded before any crash, see install_crash_reporter).
#include "app/crash_report.hpp"

#include <dlfcn.h>
#include <execinfo.h>
#include <ucontext.h>
#include <unistd.h>

#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>

namespace shardtrain {
namespace {

char g_who[96] = "shardtrain";  // "[host:pid rank R]", filled before any crash

void write_text(const char* text) {
  for (size_t left = std::strlen(text); left > 0;) {
    const ssize_t n = write(STDERR_FILENO, text, left);
    if (n <= 0) return;
    text += n, left -= static_cast<size_t>(n);
  }
}

// "module+0xOFFSET (symbol)" for a code address.
void describe(const void* address, char* out, size_t size) {
  Dl_info info{};
  if (!address || !dladdr(address, &info) || !info.dli_fname) {
    std::snprintf(out, size, "%p (no module)", address);
    return;
  }
  const auto offset = reinterpret_cast<uintptr_t>(address) - reinterpret_cast<uintptr_t>(info.dli_fbase);
  std::snprintf(out, size, "%s+0x%lx%s%s%s", info.dli_fname, static_cast<unsigned long>(offset),
                info.dli_sname ? " (" : "", info.dli_sname ? info.dli_sname : "", info.dli_sname ? ")" : "");
}

const char* fault_name(int signal) {
  switch (signal) {
    case SIGSEGV: return "SIGSEGV";
    case SIGBUS: return "SIGBUS";
    case SIGILL: return "SIGILL";
    default: return "SIGFPE";
  }
}

extern "C" void report_crash(int signal, siginfo_t* info, void* context) {
  char line[1024], where[512];
  std::snprintf(line, sizeof line, "%s internal error: %s (code %d) at address %p\n", g_who, fault_name(signal),
                info->si_code, info->si_addr);
  write_text(line);
#if defined(__x86_64__)
  const auto* registers = static_cast<ucontext_t*>(context)->uc_mcontext.gregs;
  const auto* pc = reinterpret_cast<const void*>(registers[REG_RIP]);
  describe(pc, where, sizeof where);
  std::snprintf(line, sizeof line, "%s   instruction %s\n", g_who, where);
  write_text(line);
  if (reinterpret_cast<uintptr_t>(pc) < 4096) {
    // A call to a null (or nearly null) pointer: the return address is on top of the stack.
    const void* caller = *reinterpret_cast<void* const*>(registers[REG_RSP]);
    describe(caller, where, sizeof where);
    std::snprintf(line, sizeof line, "%s   a call through a null function pointer, returning to %s\n", g_who, where);
    write_text(line);
  }
#else
  (void)context;
#endif
  void* frames[64];
  const int depth = backtrace(frames, 64);
  write_text("the stack (addr2line -f -C -e MODULE OFFSET names a frame):\n");
  backtrace_symbols_fd(frames, depth, STDERR_FILENO);
  // The handler was reset (SA_RESETHAND): the signal, blocked while it runs, ends the process on return.
  raise(signal);
}

}  // namespace

void install_crash_reporter() {
  char host[64] = "";
  gethostname(host, sizeof host - 1);
  // The launchers name the rank before MPI_Init does.
  const char* rank = nullptr;
  for (const char* name : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID", "PMI_RANK"})
    if (!rank) rank = std::getenv(name);
  std::snprintf(g_who, sizeof g_who, "[%s:%d%s%s]", host, static_cast<int>(getpid()), rank ? " rank " : "",
                rank ? rank : "");
  // backtrace loads libgcc_s on first use, which a crashed process may no longer manage.
  void* warm[1];
  backtrace(warm, 1);
  static char alternate_stack[64 * 1024];
  stack_t stack{};
  stack.ss_sp = alternate_stack;
  stack.ss_size = sizeof alternate_stack;
  sigaltstack(&stack, nullptr);
  struct sigaction action {};
  action.sa_sigaction = report_crash;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_RESETHAND;
  for (int s : {SIGSEGV, SIGBUS, SIGILL, SIGFPE}) sigaction(s, &action, nullptr);
}

}  // namespace shardtrain
