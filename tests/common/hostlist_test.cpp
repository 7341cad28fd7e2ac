#include "common/hostlist.h"

#include <gtest/gtest.h>

#include "common/errors.h"
#include "tests/testing/testing.h"

namespace dt {
namespace {

using Hosts = std::vector<std::string>;

TEST(Hostlist, PlainNamesAndCommas) {
  EXPECT_EQ(expandHostlist("node1"), Hosts({"node1"}));
  EXPECT_EQ(expandHostlist("a,b,c"), Hosts({"a", "b", "c"}));
  EXPECT_EQ(expandHostlist(" host.example.org "), Hosts({"host.example.org"}));
}

TEST(Hostlist, RangesKeepZeroPadding) {
  EXPECT_EQ(expandHostlist("gpu-a[01-04,07],gpu-b3"),
            Hosts({"gpu-a01", "gpu-a02", "gpu-a03", "gpu-a04", "gpu-a07", "gpu-b3"}));
  EXPECT_EQ(expandHostlist("n[8-11]"), Hosts({"n8", "n9", "n10", "n11"}));
  EXPECT_EQ(expandHostlist("n[098-101]"), Hosts({"n098", "n099", "n100", "n101"}));
  EXPECT_EQ(expandHostlist("n[0-1]"), Hosts({"n0", "n1"}));
}

TEST(Hostlist, SeveralBracketGroupsAndSuffixes) {
  EXPECT_EQ(expandHostlist("rack[1-2]n[3-4]"), Hosts({"rack1n3", "rack1n4", "rack2n3", "rack2n4"}));
  EXPECT_EQ(expandHostlist("gpu[1,3]-ib,cpu[01-02]"), Hosts({"gpu1-ib", "gpu3-ib", "cpu01", "cpu02"}));
}

TEST(Hostlist, FirstHost) {
  EXPECT_EQ(firstHostInHostlist("gpu-a[01-04,07],gpu-b3"), "gpu-a01");
  EXPECT_EQ(firstHostInHostlist("rack[2-3]n[07-09]"), "rack2n07");
  EXPECT_EQ(firstHostInHostlist("solo"), "solo");
  // Not expanded: a huge range costs nothing.
  EXPECT_EQ(firstHostInHostlist("n[0-999999999]"), "n0");
}

TEST(Hostlist, MalformedInputNamesThePosition) {
  testing::expectThrowsWith<InvalidArgument>([] { expandHostlist("gpu[01-04"); }, {"gpu[01-04", "'[' without ']'"});
  testing::expectThrowsWith<InvalidArgument>([] { expandHostlist("gpu01]"); }, {"']' without '['"});
  testing::expectThrowsWith<InvalidArgument>([] { expandHostlist("gpu[4-1]"); }, {"runs backwards"});
  testing::expectThrowsWith<InvalidArgument>([] { expandHostlist("gpu[a-b]"); }, {"position 4"});
  testing::expectThrowsWith<InvalidArgument>([] { expandHostlist("a,,b"); }, {"empty host name"});
  testing::expectThrowsWith<InvalidArgument>([] { expandHostlist(""); }, {"empty hostlist"});
  testing::expectThrowsWith<InvalidArgument>([] { expandHostlist("n[]"); }, {"empty brackets"});
  testing::expectThrowsWith<InvalidArgument>([] { expandHostlist("n[0-999999999]", 1000); }, {"more than 1000"});
  testing::expectThrowsWith<InvalidArgument>([] { firstHostInHostlist("n[x]"); }, {"expected digits"});
}

TEST(Hostlist, SlurmDerivedPort) {
  EXPECT_EQ(slurmDerivedPort("0"), 20000);
  EXPECT_EQ(slurmDerivedPort("12345"), 22345);
  EXPECT_EQ(slurmDerivedPort("9999"), 29999);
  EXPECT_EQ(slurmDerivedPort("10000"), 20000);
  testing::expectThrowsWith<InvalidArgument>([] { slurmDerivedPort("12a"); }, {"SLURM_JOB_ID", "MASTER_PORT"});
  testing::expectThrowsWith<InvalidArgument>([] { slurmDerivedPort(""); }, {"SLURM_JOB_ID"});
}

}  // namespace
}  // namespace dt
