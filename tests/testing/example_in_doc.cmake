# Fails when the page DOC does not show the file EXAMPLE verbatim inside a
# ```cpp block, so the documented example is the one that compiles and runs.
file(READ ${EXAMPLE} example)
file(READ ${DOC} doc)
string(FIND "${doc}" "```cpp\n${example}```" at)
if(at EQUAL -1)
  message(FATAL_ERROR "${DOC} does not show ${EXAMPLE} as it is; paste the file's content into its ```cpp block")
endif()
