// Unit tests of the tokenizer's parts: the BPE merge loop on hand-made vocabularies (ranks, ties,
// stale queue entries, duplicate merges), Python's errors="replace" UTF-8 decoding (expected values
// from CPython), and a hand-written tokenizer.json. The e2e test compares whole files against the
// tokenizers package.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "data/bpe.hpp"
#include "data/tokenizer.hpp"

namespace shardtrain {
namespace {

// Ids: a=0 b=1 c=2 d=3, merged tokens from 10 up.
enum : uint32_t { A = 0, B = 1, C = 2, D = 3, AB = 10, BC = 11, ABC = 12, CD = 13, AA = 14, AAAA = 15 };

std::vector<uint32_t> merged(const BpeMerges& merges, std::vector<uint32_t> symbols) {
  merges.apply(symbols);
  return symbols;
}

TEST(TokenizerBpe, LowestRankFirst) {
  BpeMerges m;
  m.add(B, C, BC);  // rank 0
  m.add(A, B, AB);  // rank 1
  m.add(AB, C, ABC);
  EXPECT_EQ(merged(m, {A, B, C}), (std::vector<uint32_t>{A, BC}));
  EXPECT_EQ(merged(m, {A, B, D, A, B, C}), (std::vector<uint32_t>{AB, D, A, BC}));
}

TEST(TokenizerBpe, MergedTokensMergeAgain) {
  BpeMerges m;
  m.add(A, B, AB);
  m.add(AB, C, ABC);
  m.add(C, D, CD);  // queued at the start, stale once c is inside abc
  EXPECT_EQ(merged(m, {A, B, C, D}), (std::vector<uint32_t>{ABC, D}));
  EXPECT_EQ(merged(m, {C, D, A, B, C}), (std::vector<uint32_t>{CD, ABC}));
}

TEST(TokenizerBpe, TiesGoLeftmost) {
  BpeMerges m;
  m.add(A, A, AA);
  m.add(AA, AA, AAAA);
  EXPECT_EQ(merged(m, {A, A, A}), (std::vector<uint32_t>{AA, A}));
  EXPECT_EQ(merged(m, {A, A, A, A}), (std::vector<uint32_t>{AAAA}));
  EXPECT_EQ(merged(m, {A, A, A, A, A}), (std::vector<uint32_t>{AAAA, A}));
  EXPECT_EQ(merged(m, {}), (std::vector<uint32_t>{}));
  EXPECT_EQ(merged(m, {A}), (std::vector<uint32_t>{A}));
}

TEST(TokenizerBpe, DuplicateMergeKeepsTheLaterRank) {
  BpeMerges m;
  m.add(A, B, AB);  // rank 0, replaced by rank 2 below
  m.add(B, C, BC);  // rank 1
  m.add(A, B, AB);
  EXPECT_EQ(m.size(), 2u);
  EXPECT_EQ(merged(m, {A, B, C}), (std::vector<uint32_t>{A, BC}));
}

TEST(TokenizerUtf8, ReplacesAsPythonDoes) {
  const std::string r = "\xEF\xBF\xBD";
  EXPECT_EQ(utf8_with_replacements("plain ascii"), "plain ascii");
  EXPECT_EQ(utf8_with_replacements("\xE2\x82\xAC\xF0\x9F\x98\x80"), "\xE2\x82\xAC\xF0\x9F\x98\x80");
  EXPECT_EQ(utf8_with_replacements("\xFF"), r);
  EXPECT_EQ(utf8_with_replacements("\xE0\x80"), r + r);          // E0 needs A0..BF next
  EXPECT_EQ(utf8_with_replacements("\xF0\x9F\x98"), r);          // a truncated sequence is one
  EXPECT_EQ(utf8_with_replacements("\xF0\x9F\x98x"), r + "x");
  EXPECT_EQ(utf8_with_replacements("\xED\xA0\x80"), r + r + r);  // surrogates
  EXPECT_EQ(utf8_with_replacements("a\xC3"), "a" + r);
  EXPECT_EQ(utf8_with_replacements("\xC0\xAF"), r + r);          // overlong
  EXPECT_EQ(utf8_with_replacements("\xF4\x90\x80\x80"), r + r + r + r);  // beyond U+10FFFF
}

// A tokenizer file holding `text`, removed when the object goes.
struct TempTokenizerFile {
  explicit TempTokenizerFile(const std::string& text) {
    char name[] = "/tmp/shardtrain_test_tokenizer_XXXXXX.json";
    const int fd = mkstemps(name, 5);
    EXPECT_GE(fd, 0) << std::strerror(errno);
    if (fd >= 0) close(fd);
    path = name;
    std::ofstream(path) << text;
  }
  ~TempTokenizerFile() { std::remove(path.c_str()); }
  std::string path;
};

// "Ġ" is the ByteLevel character of the space byte.
const char* kTiny = R"({
  "version": "1.0", "truncation": null, "padding": null,
  "added_tokens": [{"id": 9, "content": "<|endoftext|>", "single_word": false, "lstrip": false,
                    "rstrip": false, "normalized": false, "special": true}],
  "normalizer": null,
  "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
  "post_processor": null, "decoder": null,
  "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": {"a": 0, "b": 1, "Ġ": 2, "ab": 3, "Ġab": 4, "!": 5},
            "merges": ["a b", ["Ġ", "ab"]]}
})";

TEST(TokenizerFile, EncodesWordsAndAddedTokens) {
  TempTokenizerFile file(kTiny);
  Tokenizer t(file.path);
  std::vector<uint32_t> ids;
  t.encode("ab ab<|endoftext|>ba!", ids);
  EXPECT_EQ(ids, (std::vector<uint32_t>{3, 4, 9, 1, 0, 5}));
  ids.clear();
  t.encode("xab", ids);  // x is not in the vocabulary and there is no unk_token: dropped
  EXPECT_EQ(ids, (std::vector<uint32_t>{3}));
  EXPECT_EQ(t.vocab_size(), 10u);
  EXPECT_FALSE(t.adds_special_tokens());
  EXPECT_EQ(t.token_id("<|endoftext|>"), 9u);
  EXPECT_TRUE(t.is_special("<|endoftext|>"));
}

TEST(TokenizerFile, RefusesWithThePosition) {
  std::string bad = kTiny;
  bad.replace(bad.find("\"a b\""), 5, "\"a q\"");
  TempTokenizerFile file(bad), truncated("{\"model\": ");
  try {
    Tokenizer t(file.path);
    FAIL() << "no error";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("/model/merges/0"), std::string::npos) << e.what();
  }
  EXPECT_THROW(Tokenizer(truncated.path), DataError);
}

}  // namespace
}  // namespace shardtrain
