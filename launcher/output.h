// Worker output: splits a byte stream into whole lines, prefixes them, and
// writes each line with one write() so that lines from several workers never
// interleave mid-line.
//
// Contract: LineSplitter is pure (feed bytes, get complete lines; a partial
// line is held until its newline, or emitted by flush() at end of stream; a
// line longer than maxLine is cut into pieces of maxLine bytes).
// OutputRouter owns the per-rank log files of one attempt and the stderr tail
// that the failure summary shows. Single-threaded: only dtrun's monitor loop
// calls it.
#pragma once

#include <cstddef>
#include <deque>
#include <string>
#include <string_view>
#include <vector>

namespace dt::launcher {

class LineSplitter {
 public:
  explicit LineSplitter(size_t maxLine = 64 * 1024) : maxLine_(maxLine) {}
  // Appends complete lines (without their '\n') to `lines`.
  void feed(std::string_view bytes, std::vector<std::string>& lines);
  // The held partial line, if any.
  void flush(std::vector<std::string>& lines);

 private:
  size_t maxLine_;
  std::string partial_;
};

// "[rank %r] " -> "[rank 3] "
std::string expandPrefix(const std::string& format, int rank, int localRank, int nodeRank, const std::string& host);

struct StreamTarget {
  int consoleFd = -1;  // -1: not shown on the console
  int fileFd = -1;     // -1: no log file
  std::string prefix;
  bool keepTail = false;
};

class OutputStream {
 public:
  OutputStream(StreamTarget target, size_t tailLines) : target_(std::move(target)), tailLines_(tailLines) {}
  ~OutputStream();
  OutputStream(const OutputStream&) = delete;
  OutputStream& operator=(const OutputStream&) = delete;

  void write(std::string_view bytes);
  void finish();  // end of stream: flushes a partial line, closes the file
  const std::deque<std::string>& tail() const { return tail_; }

 private:
  void emit(const std::vector<std::string>& lines);
  StreamTarget target_;
  size_t tailLines_;
  LineSplitter splitter_;
  std::deque<std::string> tail_;
};

// Writes all of `data` to fd, retrying on EINTR/short writes. Best effort.
void writeAll(int fd, std::string_view data);

}  // namespace dt::launcher
