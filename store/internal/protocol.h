// The TcpStore wire format. Public to the tests (which speak it over raw
// sockets to split, corrupt and fuzz requests); not part of the user API.
//
// Every message is a frame: u32 body length (little-endian), then the body.
// A request body starts with a u8 Command, a reply body with a u8 Status.
// Integers are little-endian; a string is u32 length + bytes; a key list is
// u32 count + strings. The first request on a connection must be Hello:
//   u8 Hello, u32 kMagic, u16 version, string token, i32 rank, u8 flags
// and its layout never changes between versions, so that a server can always
// read a client's version and say "version mismatch" instead of "garbage".
// Hello reply: Ok + u16 server version, or VersionMismatch / AuthFailed +
// u16 server version + string message (then the server closes).
//
// Before the handshake succeeds a frame may claim at most kMaxHandshakeBytes;
// a larger claim closes the connection (an unauthenticated peer must not make
// the server reserve memory).
//
// Requests that change the store (isMutating) carry, right after the command
// byte, u64 client id + u64 request number (the "request id"). A client picks
// a random non-zero id once per client object, keeps it across reconnects and
// numbers its requests 1, 2, ...; a request it sends again after losing its
// connection or timing out keeps its number. The server remembers the reply to
// each client's latest request and answers a repeat with it instead of applying
// the request twice; an older number than the latest is refused (Error) and
// not applied. Client id 0 opts out (every request is applied).
//
// Blocking requests carry their timeout (i64 ms); the server enforces it and
// answers Timeout (u32 count + missing keys, i64 waited ms), so a timed-out
// wait costs no cancellation round trip and leaves the stream in step.
// A connection has at most one request in progress; further frames wait in
// the server's buffer until it is answered (replies keep request order).
//
// Replication (version 3): a primary server feeds a hot standby server over a
// connection it opens itself (Hello with kHelloReplica). On it the primary
// sends, in the order it applied them, every mutating request it applies,
// with the client's request id, and a blocking queuePop as the non-blocking
// pop it became; before those, a copy of its state (Set and QueuePush with
// client id 0, Remember for its remembered replies) ended by Synced. The
// standby answers each frame (but Retire) as it would a client's, and the
// primary counts the answers as acknowledgements. A standby refuses other
// clients with NotPrimary until it is promoted: when that connection is
// closed by its peer's kernel after Synced (the primary's process is gone).
#pragma once

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace dt::store_proto {

constexpr uint32_t kMagic = 0x54534444;  // "DDST" on the wire
// 2: request ids on mutating requests; 3: replication to a hot standby.
constexpr uint16_t kVersion = 3;
constexpr size_t kHeaderBytes = 4;
// Framing overhead allowed on top of the value limit in one frame.
constexpr size_t kFrameSlack = 64 * 1024;
// The largest frame a connection may claim before its handshake succeeded
// (a Hello with the longest token the server reads is about 4.1 KiB).
constexpr size_t kMaxHandshakeBytes = 8 * 1024;
constexpr uint8_t kHelloWorker = 1;   // counts towards waitForWorkers
constexpr uint8_t kHelloReplica = 2;  // a primary's replication connection to its standby

// "id" is the request id of mutating requests: u64 client id, u64 request number.
enum class Command : uint8_t {
  Hello = 1,
  Set = 2,         // id, key, value                -> Ok
  Get = 3,         // key, i64 timeout              -> Ok value | Timeout
  Add = 4,         // id, key, i64 delta            -> Ok i64
  CompareSet = 5,  // id, key, expected, desired    -> Ok value
  Wait = 6,        // keys, i64 timeout             -> Ok | Timeout
  Check = 7,       // keys                          -> Ok u8
  Delete = 8,      // id, key                       -> Ok u8
  NumKeys = 9,     //                               -> Ok i64
  Append = 10,     // id, key, value                -> Ok
  MultiGet = 11,   // keys, i64 timeout             -> Ok u32 n, values | Timeout
  MultiSet = 12,   // id, u32 n, n x (key, value)   -> Ok
  QueuePush = 13,  // id, key, value                -> Ok
  QueuePop = 14,   // id, key, u8 block, i64 timeout -> Ok u8 has, [value] | Timeout
  QueueLen = 15,   // key                           -> Ok i64
  Ping = 16,       //                               -> Ok
  // Replication. AttachStandby comes from a client; the rest only on a
  // primary's replication connection (anywhere else they close the connection).
  AttachStandby = 17,  // u16 port of a standby at the client's address -> Ok string "host:port", once synced
  Remember = 18,       // u64 client id, u64 number, string framed reply -> Ok
  Synced = 19,         //                            -> Ok (the copy of the primary's state is complete)
  Retire = 20,         //                            (no reply) the primary gave up on this standby
};
constexpr uint8_t kMaxCommand = 20;
// Bytes of a request id on the wire (u64 client id + u64 request number).
constexpr size_t kRequestIdBytes = 16;

// Whether the command changes the store (and so carries a request id).
bool isMutating(Command command);

enum class Status : uint8_t {
  Ok = 0,
  Timeout = 1,          // u32 n missing keys, i64 waited ms
  InvalidArgument = 2,  // string message
  Error = 3,            // string message
  VersionMismatch = 4,  // u16 server version, string message
  AuthFailed = 5,       // u16 server version, string message
  NotPrimary = 6,       // u16 server version, string message: a standby not (or no longer) serving
};

const char* commandName(uint8_t command);

// A frame that does not parse.
class ProtocolError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A well-formed frame with a key or value over the server's limits: refused
// with an InvalidArgument reply, the connection stays up.
class LimitError : public ProtocolError {
 public:
  using ProtocolError::ProtocolError;
};

// Appends one frame to `out`; fill the body with the put* calls, then finish().
class FrameWriter {
 public:
  explicit FrameWriter(std::string& out) : out_(out), start_(out.size()) { out_.append(kHeaderBytes, '\0'); }
  FrameWriter& u8(uint8_t v) { out_.push_back(static_cast<char>(v)); return *this; }
  FrameWriter& u16(uint16_t v) { return raw(&v, 2); }
  FrameWriter& u32(uint32_t v) { return raw(&v, 4); }
  FrameWriter& i32(int32_t v) { return raw(&v, 4); }
  FrameWriter& i64(int64_t v) { return raw(&v, 8); }
  FrameWriter& u64(uint64_t v) { return raw(&v, 8); }
  FrameWriter& bytes(std::string_view s) {
    u32(static_cast<uint32_t>(s.size()));
    out_.append(s.data(), s.size());
    return *this;
  }
  FrameWriter& keys(const std::vector<std::string>& ks) {
    u32(static_cast<uint32_t>(ks.size()));
    for (const auto& k : ks) bytes(k);
    return *this;
  }
  // Writes the length header. Little-endian hosts only (static_assert'd in protocol.cpp).
  void finish() {
    const uint32_t length = static_cast<uint32_t>(out_.size() - start_ - kHeaderBytes);
    std::memcpy(out_.data() + start_, &length, 4);
  }

 private:
  FrameWriter& raw(const void* p, size_t n) {
    out_.append(static_cast<const char*>(p), n);
    return *this;
  }
  std::string& out_;
  size_t start_;
};

// Reads a frame body; every read checks bounds and throws ProtocolError.
class FrameReader {
 public:
  explicit FrameReader(std::string_view body) : body_(body) {}
  uint8_t u8() { uint8_t v; raw(&v, 1); return v; }
  uint16_t u16() { uint16_t v; raw(&v, 2); return v; }
  uint32_t u32() { uint32_t v; raw(&v, 4); return v; }
  int32_t i32() { int32_t v; raw(&v, 4); return v; }
  int64_t i64() { int64_t v; raw(&v, 8); return v; }
  uint64_t u64() { uint64_t v; raw(&v, 8); return v; }
  // A string of at most maxBytes (ProtocolError naming `what` otherwise).
  std::string bytes(size_t maxBytes, const char* what);
  std::vector<std::string> keys(size_t maxKeyBytes);
  size_t remaining() const { return body_.size() - pos_; }
  void expectEnd() const;

 private:
  void raw(void* p, size_t n);
  std::string_view body_;
  size_t pos_ = 0;
};

inline uint32_t readLength(const char* header) {
  uint32_t length;
  std::memcpy(&length, header, 4);
  return length;
}

}  // namespace dt::store_proto
