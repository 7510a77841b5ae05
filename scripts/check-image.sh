#!/usr/bin/env bash
# Checks the Dockerfile by inspection, since this machine has no container
# engine: every COPY source exists and is not excluded by .dockerignore, the
# runtime stage runs as a non-root user with the binary as entrypoint, cargo
# accepts the manifest in the tree the builder copies, and the build command
# is the one below. With --build it also runs that command
# (a release build: minutes on a small machine).
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD_CMD='cargo build --release --locked --bin intray'
fail() { echo "check-image: $*" >&2; exit 1; }

grep -qF "RUN $BUILD_CMD" Dockerfile || fail "Dockerfile does not build with: $BUILD_CMD"

# COPY sources of the builder stage (not --from=...).
grep -E '^COPY ' Dockerfile | grep -v -- '--from=' | while read -r _ rest; do
  set -- $rest
  while [ $# -gt 1 ]; do
    [ -e "$1" ] || fail "COPY source $1 does not exist"
    while read -r pattern; do
      case "$pattern" in ''|'#'*) continue ;; esac
      p="${pattern%/}"
      [ "$1" = "$p" ] && fail "COPY source $1 is excluded by .dockerignore ($pattern)"
    done < .dockerignore
    shift
  done
done

# build.rs reads proto/ and migrations/: both must be copied.
for dir in proto migrations src; do
  grep -qE "^COPY $dir " Dockerfile || fail "Dockerfile does not copy $dir/"
done

# The builder sees only what is copied: cargo must accept the manifest
# there (it refuses one whose declared targets, such as a [[bench]], are
# missing). Read offline, without building.
tree="$(mktemp -d)"
trap 'rm -rf "$tree"' EXIT
grep -E '^COPY ' Dockerfile | grep -v -- '--from=' | while read -r _ rest; do
  set -- $rest
  dest="${!#}"
  while [ $# -gt 1 ]; do
    case "$dest" in
      ./) cp -r "$1" "$tree/" ;;
      *) mkdir -p "$tree/$dest" && cp -r "$1"/. "$tree/$dest/" ;;
    esac
    shift
  done
done
# Asking for a binary that does not exist makes cargo load the manifest and
# its targets and stop there, without building: "no bin target" means the
# manifest was accepted (cargo metadata does not check target paths).
refused="$(cd "$tree" && cargo check --offline --locked --bin __no_such_binary__ 2>&1 || true)"
case "$refused" in
  *"no bin target named"*) ;;
  *) fail "cargo refuses the manifest in the tree the Dockerfile copies: $(echo "$refused" | head -3)" ;;
esac

runtime=$(awk '/^FROM /{n++} n==2' Dockerfile)
echo "$runtime" | grep -qE '^USER [1-9][0-9]*' || fail "runtime stage must run as a numeric non-root USER"
echo "$runtime" | grep -qF 'ENTRYPOINT ["/usr/local/bin/intray"]' || fail "entrypoint is not the binary"
echo "$runtime" | grep -qF 'CMD ["serve"]' || fail "default command is not serve"

if [ "${1:-}" = "--build" ]; then
  $BUILD_CMD
  ./target/release/intray serve --help >/dev/null
  echo "check-image: release binary built with the Dockerfile's command"
fi
echo "check-image: ok"
