// The benchmarks' forked ranks and CUDA (bench/bench_common.h): CUDA does not work in a child
// forked after its parent initialised it, so a benchmark that forks ranks makes no CUDA call
// before the fork; collectives_bench asks for its device in a child of its own (inChild).
// Stand-ins for the CUDA runtime's first calls (fake_cudart.cpp, preloaded) record the pid of
// every process that makes one.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "bench/bench_common.h"
#include "common/config.h"
#include "tests/testing/testing.h"

extern char** environ;

namespace dt {
namespace {

using namespace std::chrono_literals;

std::string readFile(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

TEST(BenchFork, InChildAnswersFromAnotherProcessAndLeavesThisOneAsItWas) {
  static int touched = 0;  // what the query changes stays in the child
  const std::string answer = bench::inChild([] {
    touched = 1;
    return std::to_string(::getpid());
  });
  EXPECT_NE(answer, std::to_string(::getpid()));
  EXPECT_FALSE(answer.empty());
  EXPECT_EQ(touched, 0);
  EXPECT_EQ(bench::inChild([] { return std::string(); }), "");
  testing::expectThrowsWith<std::runtime_error>(
      [] { bench::inChild([]() -> std::string { throw std::runtime_error("no device here"); }); },
      {"inChild: the child exited with status 1", "no device here"});
}

#ifdef DT_COLLECTIVES_BENCH
// collectives_bench --backend nccl --nproc 2 with the runtime's first calls answered "no device"
// by the stand-ins (so on a GPU machine too): the bench says so in one line and exits 2, and in a
// CUDA build the device was asked for by a child only, never by the process that forks the ranks.
TEST(CollectivesBench, NcclAsksForItsDeviceInAChildNeverInTheProcessThatForksTheRanks) {
  testing::TempDir dir;
  const std::filesystem::path calls = dir.path() / "calls", err = dir.path() / "stderr";
  std::vector<std::string> env;
  const char* preloaded = std::getenv("LD_PRELOAD");
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry = *e;
    if (!entry.starts_with("LD_PRELOAD=") && !entry.starts_with("DT_FAKE_CUDART_LOG=")) env.push_back(entry);
  }
  env.push_back(std::string("LD_PRELOAD=") + DT_FAKE_CUDART +
                (preloaded != nullptr ? ":" + std::string(preloaded) : ""));
  env.push_back("DT_FAKE_CUDART_LOG=" + calls.string());
  std::vector<std::string> args = {DT_COLLECTIVES_BENCH, "--backend", "nccl", "--nproc", "2",
                                   "--sizes", "4K", "--reps", "1"};
  std::vector<char*> argv, envp;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  for (auto& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);

  const pid_t bench = ::fork();
  ASSERT_GE(bench, 0);
  if (bench == 0) {
    const int fd = ::open(err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(fd, 2);
    ::dup2(fd, 1);
    ::execve(argv[0], argv.data(), envp.data());
    ::_exit(127);
  }
  int status = 0;
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  pid_t done = 0;
  while ((done = ::waitpid(bench, &status, WNOHANG)) == 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(10ms);
  }
  if (done == 0) {
    ::kill(bench, SIGKILL);
    ::waitpid(bench, &status, 0);
    FAIL() << "collectives_bench still ran after 60 s: " << readFile(err);
  }
  const std::string output = readFile(err);
  ASSERT_TRUE(WIFEXITED(status)) << output;
  EXPECT_EQ(WEXITSTATUS(status), 2) << output;
  EXPECT_NE(output.find("collectives_bench: --backend nccl needs a CUDA device: "), std::string::npos) << output;
  std::vector<std::string> pids;
  std::istringstream lines(readFile(calls));
  for (std::string line; std::getline(lines, line);) pids.push_back(line);
#if DT_HAVE_CUDA
  EXPECT_FALSE(pids.empty()) << "no process called the stand-ins: the bench never asked for its device";
#endif
  for (const std::string& pid : pids) {
    EXPECT_NE(pid, std::to_string(bench)) << "the process that forks the ranks made a CUDA call";
  }
}
#endif

}  // namespace
}  // namespace dt
