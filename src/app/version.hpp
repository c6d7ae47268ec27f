// The program's version for `shardtrain --version`: the release, and the commit the Makefile passes as
// SHARDTRAIN_VERSION (git describe; empty outside a git checkout).
#pragma once

#define SHARDTRAIN_RELEASE "0.1.0"
#ifndef SHARDTRAIN_VERSION
#define SHARDTRAIN_VERSION ""
#endif
