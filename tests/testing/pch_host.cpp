// The target that owns the tests' precompiled header (tests/CMakeLists.txt, DT_TEST_PCH): the
// tests reuse it, so it must compile with their flags. It has nothing of its own to run.
int main() { return 0; }
