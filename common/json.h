// A small JSON value with a parser and a writer, for the files dtrain reads and writes itself
// (safetensors headers, checkpoint manifests), not a general-purpose JSON library.
//
// Contract:
//  * Value holds null, a boolean, a number, a string, an array or an object. Numbers keep
//    their text as written ("1e-3", "0.10000000000000001"), so a value read and written again
//    is the same text and no precision is lost on the way; asInt()/asDouble() convert.
//    Objects keep their members in insertion order (what a file had, or the order set()
//    added them), and keys are unique: set() replaces an existing member in place.
//  * parse(text, what) reads exactly one value (whitespace around it allowed) and throws
//    InvalidArgument "<what> is corrupt at byte N: <problem>" for anything else: a
//    truncated text, a trailing character, a bad escape, nesting deeper than 64. \uXXXX
//    escapes become UTF-8 (surrogate pairs joined).
//  * The accessors that name a kind (asString, asInt, items, ...) throw InvalidArgument
//    "<what>: \"<key>\" is <kind>, not <wanted>" where the caller passes `what` and the key
//    it read; get() throws "<what> has no \"<key>\"" when a member is missing.
//  * dump() writes compact JSON, or one member per line indented by `indent` spaces.
//  * Thread-compatible: no shared state; a Value is a plain value type.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace dt::json {

class Value {
 public:
  enum class Kind { Null, Bool, Number, String, Array, Object };

  Value() = default;
  Value(bool b) : kind_(Kind::Bool), bool_(b) {}  // NOLINT: implicit by design, like JSON literals
  Value(int64_t n) : kind_(Kind::Number), text_(std::to_string(n)) {}
  Value(int n) : Value(static_cast<int64_t>(n)) {}
  Value(uint64_t n) : kind_(Kind::Number), text_(std::to_string(n)) {}
  Value(std::string s) : kind_(Kind::String), text_(std::move(s)) {}
  Value(const char* s) : Value(std::string(s)) {}
  // A number from its JSON text ("0.5", "-3e7"); the text is not checked.
  static Value numberText(std::string text);
  static Value array() { return Value(Kind::Array); }
  static Value object() { return Value(Kind::Object); }

  Kind kind() const { return kind_; }
  bool isNull() const { return kind_ == Kind::Null; }
  bool isObject() const { return kind_ == Kind::Object; }
  bool isArray() const { return kind_ == Kind::Array; }
  bool isString() const { return kind_ == Kind::String; }
  bool isNumber() const { return kind_ == Kind::Number; }

  // Scalars. `what` names the document and `key` the member for the error message.
  bool asBool(const std::string& what = "JSON", std::string_view key = "") const;
  int64_t asInt(const std::string& what = "JSON", std::string_view key = "") const;
  double asDouble(const std::string& what = "JSON", std::string_view key = "") const;
  const std::string& asString(const std::string& what = "JSON", std::string_view key = "") const;
  // A number's text as written, or a string's characters.
  const std::string& text() const { return text_; }

  // Arrays.
  const std::vector<Value>& items(const std::string& what = "JSON", std::string_view key = "") const;
  Value& push(Value item);

  // Objects.
  const std::vector<std::pair<std::string, Value>>& members(const std::string& what = "JSON",
                                                             std::string_view key = "") const;
  const Value* find(std::string_view key) const;
  const Value& get(std::string_view key, const std::string& what = "JSON") const;
  Value& set(std::string key, Value value);

  std::string dump(int indent = -1) const;

 private:
  explicit Value(Kind kind) : kind_(kind) {}
  [[noreturn]] void wrongKind(const std::string& what, std::string_view key, const char* wanted) const;
  void write(std::string& out, int indent, int depth) const;

  Kind kind_ = Kind::Null;
  bool bool_ = false;
  std::string text_;  // number text or string characters
  std::vector<Value> items_;
  std::vector<std::pair<std::string, Value>> members_;
};

Value parse(std::string_view text, const std::string& what);

// The name of a kind: "null", "a boolean", "a number", "a string", "an array", "an object".
const char* kindName(Value::Kind kind);

}  // namespace dt::json
