#!/usr/bin/env bash
# Fuzzes one target, starting from its seeds (fuzz/seeds/TARGET.hex, an input per line in hex),
# its regression cases (fuzz/regressions/TARGET/) and whatever earlier runs left in
# fuzz/corpus/TARGET (not in git), where new inputs go:
#   fuzz/run.sh TARGET [SECONDS, default 600] [more libFuzzer flags]
# FUZZ_SANITIZER picks cargo-fuzz's sanitizer (default address); graph_exec wants `none`, as
# libtorch under ASan runs too slowly to fuzz.
# Needs a nightly toolchain and cargo-fuzz (`cargo install cargo-fuzz`). To refresh the seeds
# from a grown corpus, one input per coverage edge:
#   cargo +nightly fuzz run TARGET NEW_DIR corpus/TARGET -- -merge=1 -use_counters=0 -use_value_profile=0
# then write NEW_DIR's files as hex lines into seeds/TARGET.hex.
set -euo pipefail
cd "$(dirname "$0")"
target=${1:?usage: fuzz/run.sh TARGET [SECONDS]}
seconds=${2:-600}
shift $(( $# < 2 ? $# : 2 ))
mkdir -p "corpus/$target"
# Each seed as a file named by its SHA-1, as libFuzzer names its own: writing them again is a no-op.
while read -r line; do
    [[ -n "$line" ]] || continue
    name=$(printf '%s' "$line" | xxd -r -p | sha1sum | cut -d' ' -f1)
    [[ -e "corpus/$target/$name" ]] || printf '%s' "$line" | xxd -r -p > "corpus/$target/$name"
done < "seeds/$target.hex"
dirs=("corpus/$target")
[[ -d "regressions/$target" ]] && dirs+=("regressions/$target")
exec cargo +nightly fuzz run -s "${FUZZ_SANITIZER:-address}" "$target" "${dirs[@]}" -- -max_total_time="$seconds" -print_final_stats=1 "$@"
