// Shard and replica groups from the node layout (plan_groups): groups follow the nodes however the
// launcher numbered the ranks, a node-sized group needs equal nodes, and the description names the
// hosts. The same layouts run for real on the namespace cluster (tests/cluster).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "comm/runtime.hpp"

using namespace shardtrain;

namespace {

// A layout from each rank's host name (nodes numbered by their lowest rank, as Runtime does).
NodeLayout layout_of(const std::vector<std::string>& host_of_rank) {
  NodeLayout layout;
  for (const std::string& host : host_of_rank) {
    int node = -1;
    for (int n = 0; n < layout.nodes(); n++)
      if (layout.host_of_node[n] == host) node = n;
    if (node < 0) node = layout.nodes(), layout.host_of_node.push_back(host);
    layout.node_of_rank.push_back(node);
  }
  return layout;
}

}  // namespace

TEST(Groups, BlockPlacementIsRankOverSize) {
  // srun's default: consecutive ranks per node; groups are rank / size, replicas rank % size.
  const NodeLayout layout = layout_of({"h1", "h1", "h2", "h2"});
  const GroupPlan plan = plan_groups(layout, 0);
  ASSERT_EQ(plan.error, "");
  EXPECT_EQ(plan.group_size, 2);
  EXPECT_EQ(plan.shard_of_rank, (std::vector<int>{0, 0, 1, 1}));
  EXPECT_EQ(plan.replica_of_rank, (std::vector<int>{0, 1, 0, 1}));
  EXPECT_EQ(plan.describe(layout), "2 shard groups of 2 ranks: {0 1} on h1, {2 3} on h2 | 2 replica groups: {0 2} {1 3}");
  EXPECT_TRUE(plan.straddling(layout).empty());
  // An explicit size equal to the node's is the same plan.
  EXPECT_EQ(plan_groups(layout, 2).shard_of_rank, plan.shard_of_rank);
}

TEST(Groups, MapByNodeKeepsGroupsOnHosts) {
  // mpirun --map-by node: ranks alternate between the hosts; rank / size would pair 0 (h1) with 1 (h2).
  const NodeLayout layout = layout_of({"h1", "h2", "h1", "h2"});
  for (int size : {0, 2}) {
    const GroupPlan plan = plan_groups(layout, size);
    ASSERT_EQ(plan.error, "");
    EXPECT_EQ(plan.shard_of_rank, (std::vector<int>{0, 1, 0, 1}));
    EXPECT_EQ(plan.replica_of_rank, (std::vector<int>{0, 0, 1, 1}));
    EXPECT_EQ(plan.describe(layout), "2 shard groups of 2 ranks: {0 2} on h1, {1 3} on h2 | 2 replica groups: {0 1} {2 3}");
    EXPECT_TRUE(plan.straddling(layout).empty());
  }
}

TEST(Groups, SmallerGroupsStayInsideNodes) {
  // 2 nodes x 4 ranks, cyclic placement, groups of 2: every group inside one node.
  const NodeLayout layout = layout_of({"a", "b", "a", "b", "a", "b", "a", "b"});
  const GroupPlan plan = plan_groups(layout, 2);
  ASSERT_EQ(plan.error, "");
  EXPECT_EQ(plan.shard_of_rank, (std::vector<int>{0, 2, 0, 2, 1, 3, 1, 3}));
  for (int r = 0; r < 8; r++)
    for (int q = 0; q < 8; q++)
      if (plan.shard_of_rank[r] == plan.shard_of_rank[q]) {
        EXPECT_EQ(layout.node_of_rank[r], layout.node_of_rank[q]);
      }
  // Replica group k: the k-th rank of every shard group, one from each group.
  EXPECT_EQ(plan.replica_of_rank, (std::vector<int>{0, 0, 1, 1, 0, 0, 1, 1}));
  EXPECT_TRUE(plan.straddling(layout).empty());
}

TEST(Groups, WholeNodeGroupsAreNotStraddling) {
  // Groups of 4 over 4 nodes of 2: each group is two whole nodes, a choice, not a misfit.
  const NodeLayout layout = layout_of({"a", "a", "b", "b", "c", "c", "d", "d"});
  const GroupPlan plan = plan_groups(layout, 4);
  ASSERT_EQ(plan.error, "");
  EXPECT_EQ(plan.shard_of_rank, (std::vector<int>{0, 0, 0, 0, 1, 1, 1, 1}));
  EXPECT_TRUE(plan.straddling(layout).empty());
  EXPECT_EQ(plan.describe(layout), "2 shard groups of 4 ranks: {0-3} on a+b, {4-7} on c+d | 4 replica groups: {0 4} {1 5} {2 6} {3 7}");
}

TEST(Groups, UnequalNodesNeedAnExplicitSize) {
  // 3 + 1 ranks: no node-sized group exists; the message names the counts and both fixes.
  const NodeLayout layout = layout_of({"h1", "h1", "h1", "h2"});
  const GroupPlan plan = plan_groups(layout, 0);
  EXPECT_NE(plan.error.find("different rank counts (h1 3 ranks, h2 1 rank)"), std::string::npos) << plan.error;
  EXPECT_NE(plan.error.find("--ntasks-per-node"), std::string::npos) << plan.error;
  EXPECT_NE(plan.error.find("fsdp.shard_group_size to a divisor of the 4 ranks"), std::string::npos) << plan.error;
  EXPECT_EQ(plan.error.find('\n'), std::string::npos);
  // 2 + 1 + 1 divides the rank count on every node, and still has no node-sized group.
  EXPECT_NE(plan_groups(layout_of({"a", "a", "b", "c"}), 0).error, "");
  // An explicit size works, and the group that takes part of h1 with h2 is reported.
  const GroupPlan explicit_size = plan_groups(layout, 2);
  ASSERT_EQ(explicit_size.error, "");
  EXPECT_EQ(explicit_size.shard_of_rank, (std::vector<int>{0, 0, 1, 1}));
  EXPECT_EQ(explicit_size.straddling(layout), (std::vector<std::string>{"{2 3} on h1+h2"}));
}

TEST(Groups, FullAndNoShardExtremes) {
  const NodeLayout layout = layout_of({"h1", "h1", "h2", "h2"});
  const GroupPlan full = plan_groups(layout, 4);
  EXPECT_EQ(full.shard_of_rank, (std::vector<int>{0, 0, 0, 0}));
  EXPECT_EQ(full.replica_of_rank, (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(full.describe(layout), "1 shard group of 4 ranks: {0-3} on h1+h2 | no replicas");
  EXPECT_TRUE(full.straddling(layout).empty());
  const GroupPlan none = plan_groups(layout, 1);
  EXPECT_EQ(none.shard_of_rank, (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(none.replica_of_rank, (std::vector<int>{0, 0, 0, 0}));
  EXPECT_EQ(none.describe(layout), "4 shard groups of 1 rank: {0} on h1, {1} on h1, {2} on h2, {3} on h2 | 1 replica group: {0-3}");
  EXPECT_NE(plan_groups(layout, 3).error, "");  // does not divide 4
}

TEST(Groups, OneNode) {
  // The 1-host reference of the cluster test: HYBRID_SHARD with shard_group_size=2 on 4 ranks.
  const NodeLayout layout = layout_of({"vm", "vm", "vm", "vm"});
  const GroupPlan plan = plan_groups(layout, 2);
  EXPECT_EQ(plan.shard_of_rank, (std::vector<int>{0, 0, 1, 1}));
  EXPECT_EQ(plan.replica_of_rank, (std::vector<int>{0, 1, 0, 1}));
  EXPECT_EQ(plan_groups(layout, 0).group_size, 4);
}

TEST(Groups, LongListsAreCut) {
  std::vector<std::string> hosts;
  for (int n = 0; n < 12; n++)
    for (int r = 0; r < 2; r++) hosts.push_back("n" + std::to_string(n));
  const NodeLayout layout = layout_of(hosts);
  const std::string text = plan_groups(layout, 0).describe(layout);
  EXPECT_NE(text.find("{14 15} on n7, ... (4 more) | 2 replica groups: {0 2 4 6 8 10 12 14 16 18 20 22}"),
            std::string::npos)
      << text;
}
