#!/usr/bin/env bash
# Does each feature's test fail when the feature is switched off? tests/mutations/NAME.patch switches one off (its
# first line says what); its `# unit:` and `# engine:` lines name the tests that claim the feature. For each patch:
# a scratch copy of the working tree, the patch applied there, those tests run on it; the mutation must make at least
# one of them fail ("killed by" names the first). A surviving mutation, or one whose tests could not run, fails the
# script.
#   bash scripts/mutations.sh [--unit | --engine | --all] [NAME ...]
#   --unit (default): the unit tests (seconds each; CI runs these: tests/unit/test_mutations.py)
#   --engine: the real-engine tests (minutes each: a Ray cluster and vLLM engines per mutation)
# Uses the repository's .venv when there is one (the test command makes it), else python3.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
repo=$PWD
levels=(unit)
names=()
for arg in "$@"; do
  case "$arg" in
  --unit) levels=(unit) ;;
  --engine) levels=(engine) ;;
  --all) levels=(unit engine) ;;
  -*) echo "unknown option $arg" >&2; exit 2 ;;
  *) names+=("$arg") ;;
  esac
done
[ ${#names[@]} -gt 0 ] || for p in tests/mutations/*.patch; do names+=("$(basename "$p" .patch)"); done
py=python3
[ -x .venv/bin/python ] && py=$repo/.venv/bin/python
scratch_root=$(mktemp -d "${TMPDIR:-/tmp}/summit-mutations.XXXXXX")
trap 'rm -rf "$scratch_root"' EXIT

bad=0
for name in "${names[@]}"; do
  patch=$repo/tests/mutations/$name.patch
  [ -f "$patch" ] || { echo "mutation $name: no such patch ($patch)"; bad=1; continue; }
  for level in "${levels[@]}"; do
    # shellcheck disable=SC2207 # word splitting wanted: the patch lists test paths separated by spaces
    tests=($(sed -n "s/^# $level: //p" "$patch"))
    if [ ${#tests[@]} -eq 0 ]; then
      echo "mutation $name ($level): no tests named"
      continue
    fi
    copy=$scratch_root/$name-$level
    mkdir -p "$copy"
    # the working tree as it is (tracked and new files, not what git ignores), then the mutation
    git ls-files -z --cached --others --exclude-standard | (cd "$repo" && xargs -0 cp --parents -t "$copy" 2>/dev/null)
    if ! (cd "$copy" && git apply "$patch"); then
      echo "mutation $name ($level): the patch no longer applies: update tests/mutations/$name.patch"
      bad=1
      continue
    fi
    log=$copy.log
    (cd "$copy" && PYTHONPATH=$copy SUMMIT_MUTATION=$name "$py" -m pytest -x -q -rfE -p no:cacheprovider \
      "${tests[@]}" >"$log" 2>&1)
    rc=$?
    case $rc in
    1) echo "mutation $name ($level): killed by $(sed -n 's/^\(FAILED\|ERROR\) \(tests\/[^ ]*\).*/\2 (\1)/p' "$log" | head -1)" ;;
    0) echo "mutation $name ($level): SURVIVED: ${tests[*]} pass with it"; bad=1 ;;
    *) echo "mutation $name ($level): the tests did not run (pytest exit $rc):"; tail -20 "$log"; bad=1 ;;
    esac
  done
done
exit $bad
