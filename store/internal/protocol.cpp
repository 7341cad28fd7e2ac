#include "store/internal/protocol.h"

#include <bit>

#include "common/strings.h"

namespace dt::store_proto {

static_assert(std::endian::native == std::endian::little, "the store protocol is written for little-endian hosts");

const char* commandName(uint8_t command) {
  switch (static_cast<Command>(command)) {
    case Command::Hello: return "hello";
    case Command::Set: return "set";
    case Command::Get: return "get";
    case Command::Add: return "add";
    case Command::CompareSet: return "compareSet";
    case Command::Wait: return "wait";
    case Command::Check: return "check";
    case Command::Delete: return "deleteKey";
    case Command::NumKeys: return "numKeys";
    case Command::Append: return "append";
    case Command::MultiGet: return "multiGet";
    case Command::MultiSet: return "multiSet";
    case Command::QueuePush: return "queuePush";
    case Command::QueuePop: return "queuePop";
    case Command::QueueLen: return "queueLen";
    case Command::Ping: return "ping";
    case Command::AttachStandby: return "attachStandby";
    case Command::Remember: return "remember";
    case Command::Synced: return "synced";
    case Command::Retire: return "retire";
  }
  return "unknown";
}

bool isMutating(Command command) {
  switch (command) {
    case Command::Set:
    case Command::Add:
    case Command::CompareSet:
    case Command::Delete:
    case Command::Append:
    case Command::MultiSet:
    case Command::QueuePush:
    case Command::QueuePop:
      return true;
    default:
      return false;
  }
}

void FrameReader::raw(void* p, size_t n) {
  if (remaining() < n) {
    throw ProtocolError(str("truncated frame: needed ", n, " more bytes at offset ", pos_, " of ", body_.size()));
  }
  std::memcpy(p, body_.data() + pos_, n);
  pos_ += n;
}

std::string FrameReader::bytes(size_t maxBytes, const char* what) {
  const uint32_t length = u32();
  if (remaining() < length) {
    throw ProtocolError(str("truncated frame: ", what, " claims ", length, " bytes, ", remaining(), " left"));
  }
  if (length > maxBytes) {
    throw LimitError(str(what, " of ", length, " bytes exceeds the limit of ", maxBytes, " bytes"));
  }
  std::string out(body_.substr(pos_, length));
  pos_ += length;
  return out;
}

std::vector<std::string> FrameReader::keys(size_t maxKeyBytes) {
  const uint32_t count = u32();
  // Each key needs at least its 4-byte length: a count beyond that is garbage.
  if (count > remaining() / 4) {
    throw ProtocolError(str("key count ", count, " does not fit in the ", remaining(), " bytes left"));
  }
  std::vector<std::string> out;
  out.reserve(count);
  for (uint32_t i = 0; i < count; ++i) out.push_back(bytes(maxKeyBytes, "key"));
  return out;
}

void FrameReader::expectEnd() const {
  if (remaining() != 0) throw ProtocolError(str(remaining(), " unexpected trailing bytes in frame"));
}

}  // namespace dt::store_proto
