// Unit tests of src/data/dataset.*: data.train_file's list and glob forms, 32-bit token files,
// windows over several files (shards), and the shards and validation part `data encode
// --tokenizer` writes. Oracles written here: token files are spelled out byte by byte, the windows
// of a list of files are enumerated naively (file after file, position after position), the
// sampler's order over shards is held to the single-file order over one file that holds the same
// windows, and a hand-made tokenizer's tokens are worked out by hand.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "core/error.hpp"
#include "data/data_commands.hpp"
#include "data/dataset.hpp"
#include "data/sampler.hpp"
#include "data/token_file.hpp"

namespace shardtrain {
namespace {

class ShardedData : public ::testing::Test {
 protected:
  void SetUp() override {
    char name[] = "/tmp/shardtrain_test_shards_XXXXXX";
    ASSERT_NE(mkdtemp(name), nullptr) << std::strerror(errno);
    dir_ = name;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string path(const std::string& name) const { return dir_ + "/" + name; }
  // Writes a 32-bit token file of `tokens` (the layout spelled out here, not write_token_file).
  std::string write32(const std::string& name, const std::vector<uint32_t>& tokens) const {
    std::string bytes(1024, '\0');
    const int32_t head[3] = {20240801, 7, static_cast<int32_t>(tokens.size())};
    for (int i = 0; i < 3; i++)
      for (int b = 0; b < 4; b++) bytes[4 * i + b] = static_cast<char>((static_cast<uint32_t>(head[i]) >> (8 * b)) & 255);
    for (uint32_t t : tokens)
      for (int b = 0; b < 4; b++) bytes += static_cast<char>((t >> (8 * b)) & 255);
    std::ofstream(path(name), std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    return path(name);
  }
  // A 16-bit file whose token i is (tag * 1000 + i) % 65536.
  std::string write16(const std::string& name, size_t count, uint32_t tag) const {
    std::vector<uint16_t> tokens(count);
    for (size_t i = 0; i < count; i++) tokens[i] = static_cast<uint16_t>((tag * 1000 + i) % 65536);
    write_token_file(path(name), tokens);
    return path(name);
  }
  std::string dir_;
};

// Runs `body`, expecting an InputError of type E whose one-line message contains every needle.
template <class E>
void expect_error(const std::function<void()>& body, const std::vector<std::string>& needles) {
  try {
    body();
    ADD_FAILURE() << "no error; expected one mentioning '" << needles.front() << "'";
  } catch (const E& e) {
    const std::string message = e.what();
    for (const std::string& needle : needles) EXPECT_NE(message.find(needle), std::string::npos) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << "one line: " << message;
  }
}

// ---- 32-bit token files ----

TEST_F(ShardedData, ThirtyTwoBitFilesReadAndWriteLlmcsLayout) {
  const std::vector<uint32_t> tokens = {0, 65535, 65536, 70000, 128255, 4000000000u, 7};
  const std::string spelled = write32("spelled.bin", tokens);
  write_token_file(path("written.bin"), tokens.data(), tokens.size(), 4);
  std::ifstream a(spelled, std::ios::binary), b(path("written.bin"), std::ios::binary);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(a), {}), std::string(std::istreambuf_iterator<char>(b), {}));
  const TokenFile file(spelled);
  ASSERT_EQ(file.num_tokens(), tokens.size());
  EXPECT_EQ(file.token_bytes(), 4u);
  EXPECT_EQ(file.file_bytes(), 1024 + 4 * tokens.size());
  for (size_t i = 0; i < tokens.size(); i++) EXPECT_EQ(file.token(i), tokens[i]);
  EXPECT_EQ(file.max_token_in(0, 7), 4000000000u);
  EXPECT_EQ(file.max_token_in(0, 5), 128255u);
  std::vector<int> out(3);
  file.copy_tokens(2, 3, out.data());
  EXPECT_EQ(out, (std::vector<int>{65536, 70000, 128255}));
  // Ids beyond 16 bits against a vocabulary beyond 65,536: the first offender is named.
  EXPECT_EQ(check_token_range(TokenFile(write32("ok.bin", {1, 65536, 128255})), 128256, 0, 1), "");
  const std::string message = check_token_range(file, 128256, 0, 1);
  for (const char* needle : {"spelled.bin", "token 4000000000", "index 5", "vocab_size=128256"})
    EXPECT_NE(message.find(needle), std::string::npos) << message;
}

TEST_F(ShardedData, SixteenBitWriterNarrowsAndVersionsMatchTheirMagic) {
  const std::vector<uint32_t> tokens = {0, 1, 65535, 300};
  write_token_file(path("narrow.bin"), tokens.data(), tokens.size(), 2);
  const TokenFile file(path("narrow.bin"));
  EXPECT_EQ(file.token_bytes(), 2u);
  EXPECT_EQ(file.file_bytes(), 1024u + 8);
  for (size_t i = 0; i < tokens.size(); i++) EXPECT_EQ(file.token(i), tokens[i]);
  // llm.c pairs magic 20240801 with version 7 only, and 20240520 with version 1 only.
  std::string bytes(1024, '\0');
  const int32_t head[3] = {20240801, 1, 0};
  std::memcpy(bytes.data(), head, sizeof head);
  std::ofstream(path("v1.bin"), std::ios::binary).write(bytes.data(), 1024);
  expect_error<DataError>([&] { TokenFile f(path("v1.bin")); }, {"v1.bin", "unsupported version 1", "expected 7"});
  const std::string truncated = write32("cut.bin", {1, 2, 3});
  std::filesystem::resize_file(truncated, 1024 + 10);
  expect_error<DataError>([&] { TokenFile f(truncated); }, {"cut.bin", "truncated", "4*3"});
  EXPECT_EQ(token_bytes_for_vocab(65536), 2u);
  EXPECT_EQ(token_bytes_for_vocab(65537), 4u);
}

// ---- the list and glob forms ----

TEST_F(ShardedData, ListsAndGlobsExpandInTheirOrder) {
  for (const char* name : {"b_01.bin", "b_00.bin", "b_10.bin", "B_05.bin", "c.bin", "b_x.txt"}) write16(name, 40, 0);
  // A pattern's matches in byte order (upper case first); list entries in their order, trimmed.
  EXPECT_EQ(expand_data_files("data.train_file", path("b_*.bin")),
            (std::vector<std::string>{path("b_00.bin"), path("b_01.bin"), path("b_10.bin")}));
  EXPECT_EQ(expand_data_files("data.train_file", path("c.bin") + " , " + path("[bB]_0?.bin")),
            (std::vector<std::string>{path("c.bin"), path("B_05.bin"), path("b_00.bin"), path("b_01.bin")}));
  // A file named twice is read twice; a literal path is not checked here (opening it is).
  EXPECT_EQ(expand_data_files("o", path("c.bin") + "," + path("c.bin")).size(), 2u);
  EXPECT_EQ(expand_data_files("o", path("missing.bin")), std::vector<std::string>{path("missing.bin")});
  write16("odd[1].bin", 40, 0);
  EXPECT_EQ(expand_data_files("o", path("odd\\[1\\].bin*")), std::vector<std::string>{path("odd[1].bin")});
  expect_error<DataError>([&] { expand_data_files("data.val_file", path("z*.bin")); },
                          {"data.val_file", "z*.bin", "matches no file"});
  expect_error<DataError>([&] { expand_data_files("data.train_file", path("c.bin") + ",, " + path("c.bin")); },
                          {"data.train_file", "empty entry"});
  expect_error<DataError>([&] { expand_data_files("data.train_file", ""); }, {"data.train_file", "empty entry"});
  expect_error<DataError>([&] { TokenDataset d("data.train_file", path("c.bin") + "," + path("nope.bin"), 8); },
                          {"nope.bin", "cannot open"});
}

// ---- windows over shards ----

// The windows of files of these token counts, enumerated naively: (file, first token).
std::vector<std::pair<size_t, size_t>> naive_windows(const std::vector<size_t>& counts, size_t T) {
  std::vector<std::pair<size_t, size_t>> windows;
  for (size_t f = 0; f < counts.size(); f++)
    for (size_t start = 0; start + T + 1 <= counts[f]; start += T) windows.emplace_back(f, start);
  return windows;
}

TEST_F(ShardedData, WindowsGoFileAfterFileAndNeverCrossAFile) {
  const int T = 8;
  // Unequal shards, some shorter than a window (T + 1 tokens): 0, 5 and exactly T tokens hold none.
  const std::vector<size_t> counts = {50, 0, 9, 5, 8, 17, 100, 16};
  std::string list;
  for (size_t f = 0; f < counts.size(); f++) {
    std::vector<uint32_t> tokens(counts[f]);
    for (size_t i = 0; i < counts[f]; i++) tokens[i] = static_cast<uint32_t>(f << 20 | i);  // file and index
    list += (f ? "," : "") + write32("s" + std::to_string(f) + ".bin", tokens);
  }
  const TokenDataset data("data.train_file", list, T);
  const auto expected = naive_windows(counts, T);
  ASSERT_EQ(data.windows(), expected.size());
  std::vector<int> inputs(T + 1, -1), targets(T + 1, -1);  // one guard element each
  for (uint64_t w = 0; w < data.windows(); w++) {
    ASSERT_EQ(data.locate(w), expected[w]) << w;
    data.fill(w, inputs.data(), targets.data());
    const auto [f, start] = expected[w];
    for (int t = 0; t < T; t++) {
      ASSERT_EQ(inputs[t], static_cast<int>(f << 20 | (start + t))) << w;
      ASSERT_EQ(targets[t], static_cast<int>(f << 20 | (start + t + 1))) << w;
    }
    ASSERT_EQ(inputs[T], -1);
    ASSERT_EQ(targets[T], -1);
  }
  EXPECT_EQ(data.num_tokens(), 205u);
  const std::string warning = data.skipped_warning();
  for (const char* needle : {"data.train_file", "skipping 3 of 8 files", "train.seq_len=8", "s1.bin' (0 tokens)",
                             "s3.bin' (5 tokens)", "s4.bin' (8 tokens)"})
    EXPECT_NE(warning.find(needle), std::string::npos) << warning;
  EXPECT_EQ(warning.find("s2.bin"), std::string::npos) << warning;  // 9 tokens: one window
  EXPECT_EQ(warning.find('\n'), std::string::npos);
  EXPECT_EQ(TokenDataset("o", path("s0.bin"), T).skipped_warning(), "");
  // Tokens are checked in the files that are read, by disjoint parts; skipped files are not read.
  EXPECT_EQ(data.check_tokens(8 << 20, 0, 1), "");
  // Vocabulary (6 << 20) + 50: s6's tokens from index 50 on (its second half) and all of s7's are out.
  const std::string second = data.check_tokens((6 << 20) + 50, 1, 2), first = data.check_tokens((6 << 20) + 50, 0, 2);
  EXPECT_NE(second.find("s6.bin': token 6291506 at index 50 "), std::string::npos) << second;
  EXPECT_NE(first.find("s7.bin': token 7340032 at index 0 "), std::string::npos) << first;
}

TEST_F(ShardedData, OneFileKeepsItsWindows) {
  const int T = 64;
  std::vector<uint16_t> tokens(5 * T + 1 + 30);  // leftover tokens do not make a window
  for (size_t i = 0; i < tokens.size(); i++) tokens[i] = static_cast<uint16_t>(i * 3);  // a token encodes its index
  write_token_file(path("fill.bin"), tokens);
  const TokenDataset data("data.train_file", path("fill.bin"), T);
  ASSERT_EQ(data.windows(), 5u);
  EXPECT_EQ(data.describe(), path("fill.bin") + " (351 tokens)");
  const SequenceSampler s(11, data.windows(), 4);
  std::vector<int> inputs(T), targets(T);
  for (uint64_t step = 0; step < 3; step++)
    for (uint64_t j = 0; j < 4; j++) {
      const uint64_t w = s.window(step, j);
      data.fill(w, inputs.data(), targets.data());
      for (int t = 0; t < T; t++) {
        ASSERT_EQ(inputs[t], static_cast<int>((w * T + t) * 3));
        ASSERT_EQ(targets[t], static_cast<int>((w * T + t + 1) * 3));
      }
    }
}

// Files that overlap by one token (the last token of one is the first of the next) hold exactly the
// windows of their concatenation, in the same order: so the sampler over the shards must give, for
// every step and sequence, the tokens that the one-file sampler gives over the concatenation.
TEST_F(ShardedData, ShardsReadAsTheOneFileThatHoldsTheirWindows) {
  const int T = 16, G = 6;
  const std::vector<size_t> windows_per_shard = {7, 1, 30, 3, 12};  // unequal
  std::vector<uint16_t> whole;
  std::string list;
  size_t begin = 0;
  for (size_t f = 0; f < windows_per_shard.size(); f++) {
    const size_t n = windows_per_shard[f] * T + 1;
    std::vector<uint16_t> shard(n);
    for (size_t i = 0; i < n; i++) shard[i] = static_cast<uint16_t>((begin + i) * 7919 % 65521);
    write_token_file(path("shard" + std::to_string(f) + ".bin"), shard);
    list += (f ? "," : "") + path("shard" + std::to_string(f) + ".bin");
    whole.insert(whole.end(), shard.begin() + (f ? 1 : 0), shard.end());
    begin += n - 1;
  }
  write_token_file(path("whole.bin"), whole);
  write16("short.bin", T, 9);  // shorter than a window: skipped, and changes nothing
  const TokenDataset shards("data.train_file", path("short.bin") + "," + list, T);
  const TokenDataset one("data.train_file", path("whole.bin"), T);
  ASSERT_EQ(shards.windows(), 53u);
  ASSERT_EQ(one.windows(), 53u);
  const SequenceSampler a(99, shards.windows(), G), b(99, one.windows(), G);
  std::vector<int> in_a(T), tg_a(T), in_b(T), tg_b(T);
  for (uint64_t step = 0; step < 40; step++)  // several epochs
    for (uint64_t j = 0; j < G; j++) {
      shards.fill(a.window(step, j), in_a.data(), tg_a.data());
      one.fill(b.window(step, j), in_b.data(), tg_b.data());
      ASSERT_EQ(in_a, in_b) << step << " " << j;
      ASSERT_EQ(tg_a, tg_b) << step << " " << j;
    }
  // Ranks split a step's sequences (micro * ranks + rank) * B + b: 1, 2 and 3 ranks read the same.
  for (int ranks : {1, 2, 3}) {
    std::vector<uint64_t> read(G);
    const int B = 1, accum = G / (B * ranks);
    for (int r = 0; r < ranks; r++)
      for (int m = 0; m < accum; m++) {
        const uint64_t seq = static_cast<uint64_t>(m * ranks + r) * B;
        read[seq] = a.window(5, seq);
      }
    for (uint64_t j = 0; j < G; j++) EXPECT_EQ(read[j], a.window(5, j)) << ranks;
  }
}

TEST_F(ShardedData, TooFewWindowsNameTheFileOrTheOption) {
  write16("one.bin", 4 * 32 + 1, 0);
  const TokenDataset single("data.train_file", path("one.bin"), 32);
  EXPECT_NO_THROW(single.require_windows(4, "one batch", "fix"));
  expect_error<DataError>([&] { single.require_windows(5, "one batch of train.global_batch=5 sequences", "use more"); },
                          {"data file '" + path("one.bin") + "'", "129 tokens make 4 windows of train.seq_len=32",
                           "too short for one batch of train.global_batch=5", "needs at least 161 tokens", "use more"});
  write16("t.bin", 33, 0);
  expect_error<DataError>([&] { TokenDataset("o", path("t.bin"), 32).require_windows(2, "x", "y"); },
                          {"33 tokens make 1 window of"});  // counts of one are singular
  write16("short1.bin", 10, 0);
  write16("short2.bin", 32, 0);
  const TokenDataset all_short("data.val_file", path("short*.bin"), 32);
  EXPECT_EQ(all_short.windows(), 0u);
  expect_error<DataError>([&] { all_short.require_windows(1, "one sequence", "use more data"); },
                          {"data.val_file='" + path("short*.bin") + "'", "42 tokens make 0 windows", "in 2 files",
                           "never crosses", "too short for one sequence", "use more data"});
  EXPECT_THROW(TokenDataset("o", path("t.bin"), 0), UsageError);
  EXPECT_THROW(SequenceSampler(1, 10, 0), UsageError);
}

// ---- the identity a checkpoint records ----

TEST_F(ShardedData, IdentityNamesFilesAndSizesAndComparesByName) {
  write16("a.bin", 100, 0);
  write32("b.bin", std::vector<uint32_t>(10, 1));
  const TokenDataset data("data.train_file", path("a.bin") + "," + path("b.bin"), 8);
  const std::string identity = data.identity();
  EXPECT_EQ(identity, "1224 " + path("a.bin") + "\n1064 " + path("b.bin") + "\n");
  EXPECT_EQ(dataset_difference(identity, identity), "");
  EXPECT_EQ(dataset_difference("", ""), "");
  // The same names and sizes in another folder: the same data, moved.
  EXPECT_EQ(dataset_difference(identity, "1224 /elsewhere/a.bin\n1064 b.bin\n"), "");
  EXPECT_EQ(dataset_difference(identity, "1224 " + path("a.bin") + "\n1066 " + path("b.bin") + "\n"),
            "file 2 of 2 was '" + path("b.bin") + "' (1064 bytes), now '" + path("b.bin") + "' (1066 bytes)");
  EXPECT_EQ(dataset_difference(identity, "1064 b.bin\n1224 a.bin\n"),
            "file 1 of 2 was '" + path("a.bin") + "' (1224 bytes), now 'b.bin' (1064 bytes)");
  EXPECT_EQ(dataset_difference(identity, "1224 a.bin\n"), "'" + path("b.bin") + "' (1064 bytes) was recorded, 1 file now");
  EXPECT_EQ(dataset_difference(identity, identity + "5 c.bin\n"), "file 3 of 3 'c.bin' (5 bytes) is new (2 files recorded)");
  EXPECT_EQ(dataset_difference("", "5 v.bin\n"), "file 1 of 1 'v.bin' (5 bytes) is new (0 files recorded)");
}

// ---- data encode --tokenizer: shards and the validation part ----

// Byte-level BPE with a, b, "Ġ" (the space byte) and the merge a b; the separator's id is given.
std::string tiny_tokenizer(uint32_t separator_id) {
  return R"({"version": "1.0", "truncation": null, "padding": null,
  "added_tokens": [{"id": )" + std::to_string(separator_id) + R"(, "content": "<|endoftext|>", "single_word": false,
                    "lstrip": false, "rstrip": false, "normalized": false, "special": true}],
  "normalizer": null,
  "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
  "post_processor": null, "decoder": null,
  "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": {"a": 0, "b": 1, "Ġ": 2, "ab": 3}, "merges": ["a b"]}})";
}

std::vector<uint32_t> file_tokens(const std::string& path) {
  const TokenFile file(path);
  std::vector<uint32_t> tokens(file.num_tokens());
  for (size_t i = 0; i < tokens.size(); i++) tokens[i] = file.token(i);
  return tokens;
}

std::vector<uint32_t> slice(const std::vector<uint32_t>& v, size_t begin, size_t end) {
  return std::vector<uint32_t>(v.begin() + static_cast<std::ptrdiff_t>(begin), v.begin() + static_cast<std::ptrdiff_t>(end));
}

class EncodeLayoutTest : public ShardedData {
 protected:
  void SetUp() override {
    ShardedData::SetUp();
    // Document k is "ab" and k times " ab": <|endoftext|>, ab, then k times Ġ, ab: 2 + 2k tokens.
    std::ofstream docs(path("docs.jsonl"));
    for (int k = 0; k < 10; k++) {
      std::string text = "ab";
      for (int i = 0; i < k; i++) text += " ab";
      docs << "{\"text\": \"" << text << "\"}\n";
    }
  }
  std::vector<uint32_t> expected(uint32_t sep) const {
    std::vector<uint32_t> all;
    for (uint32_t k = 0; k < 10; k++) {
      all.insert(all.end(), {sep, 3});
      for (uint32_t i = 0; i < k; i++) all.insert(all.end(), {2, 3});
    }
    return all;  // 110 tokens
  }
  void encode(const EncodeLayout& layout, uint32_t sep = 9) {
    std::ofstream(path("tok.json")) << tiny_tokenizer(sep);
    ::testing::internal::CaptureStdout();
    try {
      data_encode_tokenized(path("docs.jsonl"), path("tok.json"), path("c_train.bin"), layout, "");
    } catch (...) {
      ::testing::internal::GetCapturedStdout();
      throw;
    }
    printed_ = ::testing::internal::GetCapturedStdout();
  }
  std::string printed_;
};

TEST_F(EncodeLayoutTest, ValidationIsTheLastWholeDocuments) {
  EncodeLayout layout;
  layout.val_fraction = 0.25;  // floor(10 * 0.25) = 2 documents: the last two, 18 + 20 tokens
  encode(layout);
  const std::vector<uint32_t> all = expected(9);
  EXPECT_EQ(file_tokens(path("c_train.bin")), slice(all, 0, 72));
  EXPECT_EQ(file_tokens(path("c_val.bin")), slice(all, 72, 110));
  EXPECT_EQ(TokenFile(path("c_train.bin")).token_bytes(), 2u);
  EXPECT_NE(printed_.find("encoded 10 documents"), std::string::npos) << printed_;
  // One document (a text file): the last floor(tokens * fraction) tokens.
  std::ofstream(path("one.txt")) << "ab ab ab ab";  // <|endoftext|> ab Ġ ab Ġ ab Ġ ab: 8 tokens
  ::testing::internal::CaptureStdout();
  data_encode_tokenized(path("one.txt"), path("tok.json"), path("one.bin"), layout, "");
  ::testing::internal::GetCapturedStdout();
  EXPECT_EQ(file_tokens(path("one.bin")), (std::vector<uint32_t>{9, 3, 2, 3, 2, 3}));
  EXPECT_EQ(file_tokens(path("one_val.bin")), (std::vector<uint32_t>{2, 3}));
  layout.val_fraction = 0.1;
  expect_error<DataError>([&] { data_encode_tokenized(path("one.txt"), path("tok.json"), path("o.bin"), layout, ""); },
                          {"one.txt", "too small (1 document, 8 tokens)", "--val-fraction=0.1"});
}

TEST_F(EncodeLayoutTest, ShardsOfAChosenSizeAndTheLastShardAsValidation) {
  EncodeLayout layout;
  layout.val_fraction = 0.25;
  layout.shard_tokens = 25;
  encode(layout);
  const std::vector<uint32_t> all = expected(9);
  EXPECT_EQ(shard_path(path("c_train.bin"), 2), path("c_train_000002.bin"));
  EXPECT_EQ(shard_path("x", 12), "x_000012");
  EXPECT_EQ(file_tokens(path("c_train_000000.bin")), slice(all, 0, 25));
  EXPECT_EQ(file_tokens(path("c_train_000001.bin")), slice(all, 25, 50));
  EXPECT_EQ(file_tokens(path("c_train_000002.bin")), slice(all, 50, 72));
  EXPECT_FALSE(std::filesystem::exists(path("c_train_000003.bin")));
  EXPECT_FALSE(std::filesystem::exists(path("c_train.bin")));
  EXPECT_EQ(file_tokens(path("c_val.bin")), slice(all, 72, 110));
  // The shards read back as one stream of their windows.
  EXPECT_EQ(TokenDataset("data.train_file", path("c_train_*.bin"), 8).windows(), 3u + 3 + 2);

  layout.val_fraction = 0;
  layout.val_last_shard = true;  // 110 tokens: shards of 25 x 4, the last 10 tokens validation
  encode(layout);
  for (size_t i = 0; i < 4; i++) EXPECT_EQ(file_tokens(shard_path(path("c_train.bin"), i)), slice(all, 25 * i, 25 * i + 25));
  EXPECT_EQ(file_tokens(path("c_val.bin")), slice(all, 100, 110));
  layout.shard_tokens = 110;
  expect_error<DataError>([&] { encode(layout); }, {"docs.jsonl", "one shard of --shard-tokens=110"});
  layout.shard_tokens = 0;
  EXPECT_THROW(encode(layout), UsageError);  // --val-shard without shards
}

TEST_F(EncodeLayoutTest, IdsBeyondSixteenBitsWriteThirtyTwoBitFiles) {
  EncodeLayout layout;
  layout.val_fraction = 0.25;
  encode(layout, 70000);  // the separator's id: a vocabulary of 70001
  const std::vector<uint32_t> all = expected(70000);
  EXPECT_EQ(TokenFile(path("c_train.bin")).token_bytes(), 4u);
  EXPECT_EQ(file_tokens(path("c_train.bin")), slice(all, 0, 72));
  EXPECT_EQ(file_tokens(path("c_val.bin")), slice(all, 72, 110));
  EXPECT_NE(printed_.find("needs model.vocab_size >= 70001; 32-bit tokens"), std::string::npos) << printed_;
}

}  // namespace
}  // namespace shardtrain
