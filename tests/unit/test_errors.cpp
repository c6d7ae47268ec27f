// Typed input errors survive the rank agreement (Runtime::agree_on sends kind() with the message
// and throw_input_error rebuilds the type): a UsageError thrown inside an agreement is a UsageError
// on every rank, so the code around it (resume's "skip an unusable checkpoint, never a usage error")
// decides by the type, not by where the error was raised.
#include <gtest/gtest.h>

#include <string>

#include "core/error.hpp"

using namespace shardtrain;

namespace {

template <typename Expected>
void round_trips(const InputError& original) {
  try {
    throw_input_error(original.kind(), original.what());
  } catch (const Expected& e) {
    EXPECT_EQ(std::string(e.what()), original.what());
    EXPECT_EQ(e.kind(), original.kind());
    return;
  } catch (...) {
  }
  ADD_FAILURE() << "kind '" << original.kind() << "' came back as another type";
}

}  // namespace

TEST(InputErrors, EachKindComesBackAsItsType) {
  round_trips<UsageError>(UsageError("model.n_layer=0"));
  round_trips<DataError>(DataError("data.train_file: short"));
  round_trips<CheckpointError>(CheckpointError("checkpoint 'x': damaged"));
  round_trips<InputError>(InputError("plain"));
  // The kinds are distinct: a CheckpointError is not caught as a UsageError.
  EXPECT_THROW(throw_input_error(CheckpointError("c").kind(), "c"), CheckpointError);
  EXPECT_NE(UsageError("u").kind(), CheckpointError("c").kind());
  EXPECT_NE(DataError("d").kind(), InputError("i").kind());
}
