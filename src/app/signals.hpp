// Graceful stop on SIGUSR1, SIGTERM and SIGINT (Slurm's pre-timeout signal, preemption, ^C):
// the handler only records the signal; the training loop polls it at each step boundary, all
// ranks agree (one MAX all-reduce), save a checkpoint, leave the stop marker and exit 3. A
// second signal while saving changes nothing: the save runs to completion. Under mpirun, which
// stops relaying its ranks' output once signalled, output turns non-blocking at the first stop
// signal: lines that cannot be written are dropped, the save still happens.
#pragma once

#include <string>

namespace shardtrain {

void install_stop_signal_handlers();
// Blocks (true) or unblocks SIGUSR1, SIGTERM and SIGINT. Blocked signals stay pending across an
// exec, so the program's restart of itself (main.cpp) loses none: main unblocks them once the
// handlers are in place, and a pending one is then taken as if it had just come.
void block_stop_signals(bool block);
// The last stop signal received by this process, or 0.
int stop_signal_received();
// Under mpirun: this process is killed when mpirun dies. A second Ctrl-C makes mpirun exit at once
// without waiting for its ranks, which would otherwise run on for a second or more as orphans,
// still writing metrics and checkpoints that a restarted run is already using.
void exit_with_mpirun();
const char* signal_name(int signal);
// The signal for a message: its name, and where it came from when that is not what the user sent
// (mpirun turns a Ctrl-C into SIGTERM for its ranks).
const char* signal_origin(int signal);
// Under mpirun: the seconds its kill sequence gives the ranks after a Ctrl-C before SIGTERM and
// then SIGKILL (Open MPI's odls_base_sigkill_timeout, 1 s unless set); -1 when not under mpirun.
double mpirun_stop_grace_seconds();
// Whether `signal` came from mpirun's kill sequence (a Ctrl-C or a kill of mpirun), after which
// mpirun relays no more output: what the user should see then goes to the terminal itself.
bool stopped_by_mpirun(int signal);
// Writes `line` (and a newline) to the controlling terminal, if the process has one; never blocks,
// and nothing happens without a terminal (a batch job).
void write_to_terminal(const std::string& line);

}  // namespace shardtrain
