// Uses a little of every installed module, so a broken export or a missing
// header fails this build.
#include <iostream>

#include "common/config.h"
#include "common/errors.h"
#include "common/strings.h"
#include "store/store.h"

int main() {
  try {
    throw dt::InvalidArgument(dt::str("value ", 42));
  } catch (const dt::Error& e) {
    if (dt::describe(e) != "dt::InvalidArgument: value 42") return 1;
  }
  std::cout << "dtrain " << DT_VERSION_STRING << " (cuda=" << DT_HAVE_CUDA << ", gloo=" << DT_HAVE_GLOO
            << ") store timeout " << dt::Store::defaultTimeout().count() << " ms\n";
  std::cout << "consumer ok\n";
  return 0;
}
