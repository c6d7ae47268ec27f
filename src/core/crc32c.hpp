// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), the checksum of TFRecord framing.
#pragma once

#include <cstddef>
#include <cstdint>

namespace shardtrain {

// The CRC-32C of `size` bytes; pass an earlier result as `crc` to continue it over more bytes.
uint32_t crc32c(const void* data, size_t size, uint32_t crc = 0);

}  // namespace shardtrain
