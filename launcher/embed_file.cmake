# Writes OUTPUT, a C++ file defining dt::launcher::<SYMBOL>Data (the bytes of INPUT) and
# <SYMBOL>Size, so that dtrun carries its status page and stands alone. Run as a build step:
#   cmake -DINPUT=... -DOUTPUT=... -DSYMBOL=kStatusPage -P embed_file.cmake
file(READ "${INPUT}" hex HEX)
string(LENGTH "${hex}" digits)
math(EXPR size "${digits} / 2")
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," bytes "${hex}")
# Lines of 16 bytes: a compiler error inside the data names a readable line.
string(REGEX REPLACE "((0x[0-9a-f][0-9a-f],){16})" "\\1\n" bytes "${bytes}")
get_filename_component(name "${INPUT}" NAME)
file(WRITE "${OUTPUT}.tmp"
  "// Generated from ${name} by launcher/embed_file.cmake at build time; edit the source file.\n"
  "#include <cstddef>\n\nnamespace dt::launcher {\n"
  "extern const unsigned char ${SYMBOL}Data[] = {\n${bytes}0};\n"
  "extern const size_t ${SYMBOL}Size = ${size};\n}  // namespace dt::launcher\n")
file(RENAME "${OUTPUT}.tmp" "${OUTPUT}")
