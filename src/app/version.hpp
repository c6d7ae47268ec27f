// The program's version for `shardtrain --version`: the release, the commit the Makefile passes as
// SHARDTRAIN_VERSION (git describe; empty outside a git checkout), and the CPU the code was compiled
// for, SHARDTRAIN_MARCH (OPT's -march: x86-64-v3 by default, native with NATIVE=1).
#pragma once

#define SHARDTRAIN_RELEASE "0.1.0"
#ifndef SHARDTRAIN_VERSION
#define SHARDTRAIN_VERSION ""
#endif
#ifndef SHARDTRAIN_MARCH
#define SHARDTRAIN_MARCH "unknown"
#endif
