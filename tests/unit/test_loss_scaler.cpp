// fp16 dynamic loss scaling (app/loss_scaler.hpp) against GradScaler's rules, step by step.
#include <gtest/gtest.h>

#include "app/loss_scaler.hpp"

using namespace shardtrain;

TEST(LossScaler, HalvesOnOverflowAndDoublesAfterTheGrowthInterval) {
  LossScaler s(true);
  EXPECT_EQ(s.scale(), 65536.0);
  EXPECT_TRUE(s.update(false));  // overflow: skipped, halved, the count restarts
  EXPECT_EQ(s.scale(), 32768.0);
  for (int i = 1; i < LossScaler::GROWTH_INTERVAL; i++) EXPECT_FALSE(s.update(true));
  EXPECT_EQ(s.scale(), 32768.0);
  EXPECT_FALSE(s.update(true));  // the 200th good step in a row
  EXPECT_EQ(s.scale(), 65536.0);
  EXPECT_EQ(s.scale_log2(), 16);
  for (int i = 0; i < 150; i++) s.update(true);
  EXPECT_TRUE(s.update(false));
  EXPECT_EQ(s.good_steps(), 0);
  // A checkpoint's state comes back exactly.
  LossScaler r(true);
  r.restore(s.scale_log2(), 7);
  EXPECT_EQ(r.scale(), 32768.0);
  for (int i = 0; i < LossScaler::GROWTH_INTERVAL - 8; i++) r.update(true);
  EXPECT_EQ(r.scale(), 32768.0);
  r.update(true);
  EXPECT_EQ(r.scale(), 65536.0);
}

TEST(LossScaler, DisabledIsOneAndSkipsNothing) {
  LossScaler s(false);
  EXPECT_FALSE(s.update(false));
  EXPECT_FALSE(s.update(true));
  s.restore(10, 3);
  EXPECT_EQ(s.scale(), 1.0);
  EXPECT_EQ(s.scale_log2(), 0);
}
