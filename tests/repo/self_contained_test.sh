#!/usr/bin/env bash
# The repository stands on its own: no file refers to a path outside it, such as a folder
# next to the checkout (dot-dot then "shared"), or one particular machine's absolute
# folders (the workspace root, root's or a user's home).
#
#   tests/repo/self_contained_test.sh SOURCE_DIR
#
# In a git checkout it reads the tracked files (git ls-files); otherwise (a source tarball,
# git missing) it walks SOURCE_DIR, leaving out .git, out/ and the build*/ folders at the
# top. Binary files are skipped. Prints every hit as file:line: text and exits 1 if there
# is one; exits 1 as well when it found no files at all (a wrong SOURCE_DIR must not pass).
set -uo pipefail
src=${1:?usage: self_contained_test.sh SOURCE_DIR}
cd "$src" || { echo "self_contained_test: cannot enter $src" >&2; exit 1; }

# The patterns are put together from pieces so that this file does not match itself.
s=/
patterns=(
  "\.\.${s}shared"
  "${s}work${s}"
  "${s}root${s}"
  "${s}home${s}"
  "${s}Users${s}"
)
regex=$(IFS='|'; echo "${patterns[*]}")

files=()
# A git checkout whose top is SOURCE_DIR itself (not a folder inside some other checkout).
if command -v git >/dev/null && [ "$(git rev-parse --show-toplevel 2>/dev/null)" = "$(pwd -P)" ]; then
  how="git ls-files"
  while IFS= read -r -d '' f; do
    [ -f "$f" ] && files+=("$f")  # tracked but deleted in the work tree: nothing to read
  done < <(git ls-files -z)
else
  how="walking $src"
  while IFS= read -r -d '' f; do
    files+=("$f")
  done < <(find . \( -path ./.git -o -path './build*' -o -path ./out \) -prune -o -type f -print0)
fi

if [ "${#files[@]}" -eq 0 ]; then
  echo "self_contained_test: no files found in $src ($how): nothing was checked" >&2
  exit 1
fi

hits=$(printf '%s\0' "${files[@]}" | xargs -0 grep -nIE -- "$regex" /dev/null)
if [ -n "$hits" ]; then
  echo "self_contained_test: these lines refer to paths outside the repository:" >&2
  printf '%s\n' "$hits" | sed 's|^\./||' >&2
  echo "self_contained_test: $(printf '%s\n' "$hits" | wc -l) line(s) in ${#files[@]} files ($how)" >&2
  exit 1
fi
echo "self_contained_test: ${#files[@]} files ($how), none refers to a path outside the repository"
