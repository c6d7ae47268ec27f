// Text formatting shared by every layer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace shardtrain {

// A byte count for people: "512 B", "1.5 KiB", "3.2 GiB" (binary units, one decimal above bytes).
std::string human_bytes(double bytes);

// `text` for a one-line message: control and invisible characters as <U+XXXX>, invalid UTF-8 as
// <0xNN>, cut after max_chars with the full length said.
std::string printable_text(const std::string& text, size_t max_chars = 80);
// Characters a terminal shows as nothing, or that would break a one-line message.
bool invisible(uint32_t cp);
// The UTF-8 character at s[i]: its length, or 0 for an invalid sequence.
size_t utf8_char(const std::string& s, size_t i, uint32_t* cp);

}  // namespace shardtrain
