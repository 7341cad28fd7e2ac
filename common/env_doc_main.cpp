// dt_env_doc: prints docs/env.md, the listing of every DT_* knob.
#include <iostream>

#include "common/env.h"

int main() {
  std::cout << dt::env::markdownListing();
  return 0;
}
