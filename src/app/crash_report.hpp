// A crash (SIGSEGV, SIGBUS, SIGILL, SIGFPE) prints where it happened before the process dies of
// the signal: the faulting instruction and, for a call through a null function pointer (where
// a backtrace has nothing to start from), its caller, each as module+offset for addr2line, then
// the backtrace. Open MPI's own handler leaves an installed one alone; a stack without unwind
// information (or a jump to address 0) stops its backtrace at the signal frame, which told us
// nothing the one time a cluster test crashed.
#pragma once

namespace shardtrain {

// Before MPI_Init. The process still ends by the signal (exit status 128 + signal, a core dump
// where enabled): launchers and Slurm report it as before.
void install_crash_reporter();

}  // namespace shardtrain
