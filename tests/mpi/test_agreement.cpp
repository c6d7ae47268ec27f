// agreed_error over a Comm: every rank gets the message of the lowest failing rank, whatever
// its length, or "" when none failed.
#include <gtest/gtest.h>
#include <mpi.h>

#include <string>

#include "comm/comm.hpp"
#include "comm/runtime.hpp"
#include "support/mpi_gtest.hpp"

using namespace shardtrain;
using shardtrain::testing::all_ranks;

TEST(Agreement, EveryRankGetsTheLowestFailingRanksMessage) {
  auto comm = make_mpi_comm(MPI_COMM_WORLD, nullptr);
  const int n = comm->size(), r = comm->rank();
  EXPECT_TRUE(all_ranks(agreed_error("", *comm).empty()));
  // Ranks from the middle up fail, with messages of different lengths.
  const int first = n / 2;
  const std::string mine = r >= first ? "rank " + std::to_string(r) + std::string(r * 1000, '!') : "";
  const std::string expected = "rank " + std::to_string(first) + std::string(first * 1000, '!');
  EXPECT_TRUE(all_ranks(agreed_error(mine, *comm) == expected)) << "rank " << r;
  // Only the last rank fails.
  const std::string last = r == n - 1 ? "the last one" : "";
  EXPECT_TRUE(all_ranks(agreed_error(last, *comm) == "the last one")) << "rank " << r;
}
