#!/usr/bin/env bash
# Lists the commits in BASE..HEAD whose subject (git's %s) is longer than 72 characters, and exits 1
# if there are any: for CI or review, e.g. `scripts/check_subjects.sh origin/main`. The same rule as
# the commit-msg hook (`make hooks`), for commits made without it.
set -euo pipefail
max=72
if [[ $# -ne 1 ]]; then
  echo "usage: $0 BASE  (checks the commits in BASE..HEAD)" >&2
  exit 2
fi
if ! git rev-parse --verify --quiet "$1^{commit}" >/dev/null; then
  echo "$0: $1 is not a commit" >&2
  exit 2
fi
bad=0
while IFS=$'\t' read -r hash subject; do
  n=$(printf %s "$subject" | LC_ALL=C.UTF-8 wc -m)
  if (( n > max )); then
    printf '%s %3d  %s\n' "$hash" "$n" "$subject"
    bad=$((bad + 1))
  fi
done < <(git log --format='%h%x09%s' "$1..HEAD")
if (( bad )); then
  echo "$bad commit subject(s) in $1..HEAD over $max characters" >&2
  exit 1
fi
