#!/usr/bin/env bash
# Runs accel's whole test suite against LibTorch 2.6 (Debian 13's
# libtorch-dev) on any Debian machine: a Debian 13 chroot made once with
# debootstrap and kept (ACCEL_TRIXIE_ROOT, default /var/cache/accel/trixie),
# this tree copied into it, then the README's two steps inside it:
# tools/setup.sh (install what is missing) and tools/test.sh (build + ctest).
# Needs root (uses sudo otherwise) and Debian's archive.
# Usage: tools/test-libtorch2.sh [extra ctest args...]
#        tools/test-libtorch2.sh --shell      a shell in the chroot's tree
#        tools/test-libtorch2.sh --prepare    only the chroot and its packages
#          (network and disk: CI runs it while the first leg compiles)
#        tools/test-libtorch2.sh --build      the chroot, its packages and the
#          build, no tests (CI builds while the first leg's tests run)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
root=${ACCEL_TRIXIE_ROOT:-/var/cache/accel/trixie}
mirror=${ACCEL_DEBIAN_MIRROR:-http://deb.debian.org/debian}
if [[ $(id -u) -ne 0 ]]; then exec sudo --preserve-env=ACCEL_TRIXIE_ROOT,ACCEL_DEBIAN_MIRROR,ACCEL_TEST_CMAKE_ARGS,CI "$0" "$@"; fi
say() { echo "test-libtorch2: $*"; }
started=$(date +%s)

# 1. The chroot, made once: debootstrap fills a .partial folder that is
#    renamed only when complete, so an interrupted run starts over cleanly.
if [[ ! -f $root/.accel-bootstrapped ]]; then
  if ! command -v debootstrap >/dev/null; then
    say "installing debootstrap"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap
  fi
  say "creating a Debian 13 (trixie) chroot in $root (once; a few minutes)"
  rm -rf "$root.partial"
  mkdir -p "$(dirname "$root")"
  debootstrap --variant=minbase trixie "$root.partial" "$mirror" >"$root.partial.log" 2>&1 || {
    tail -n 20 "$root.partial.log"
    say "debootstrap failed (log: $root.partial.log). Check that $mirror is reachable."
    exit 1
  }
  touch "$root.partial/.accel-bootstrapped"
  rm -rf "$root"
  mv "$root.partial" "$root"
fi
cp /etc/resolv.conf "$root/etc/resolv.conf"  # apt inside the chroot resolves like the host

# 2. The tree, copied (the chroot never writes into it) with its files'
#    times kept, so the build folder inside stays incremental between runs.
src=$root/work/accel
rm -rf "$src"
mkdir -p "$src"
if git -C "$here" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  # Tracked and untracked-but-not-ignored files: what a clone plus local edits holds.
  git -C "$here" ls-files -z --cached --others --exclude-standard |
    tar -C "$here" --null --ignore-failed-read -T - -cf - 2>/dev/null | tar -C "$src" -xf -
else
  tar -C "$here" --exclude='./build*' -cf - . | tar -C "$src" -xf -
fi

# 3. Inside: a private mount namespace, so /proc, /sys and /dev are unmounted
#    when this script ends, however it ends.
inner='cd /work/accel && ./tools/setup.sh && ./tools/test.sh /work/build "$@"'
what=suite
case "${1:-}" in
  --shell) inner='cd /work/accel && exec bash -i'; shift ;;
  --prepare) inner='cd /work/accel && ./tools/setup.sh'; what=preparation; shift ;;
  --build) inner='cd /work/accel && ./tools/setup.sh && ACCEL_TEST_BUILD_ONLY=1 ./tools/test.sh /work/build'; what=build; shift ;;
esac
set +e
unshare --mount --propagation private -- bash -c '
  set -e
  root=$1; shift
  # The root a mount point, so that `ip netns exec` (cli.launch_netns) can
  # make "/" a slave mount inside the chroot.
  mount --bind "$root" "$root"
  mount -t proc proc "$root/proc"
  mount -t sysfs sys "$root/sys"
  mount --rbind /dev "$root/dev"
  exec chroot "$root" /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    HOME=/root LANG=C.UTF-8 TERM="${TERM:-dumb}" CI="${CI:-}" ACCEL_TEST_CMAKE_ARGS="${ACCEL_TEST_CMAKE_ARGS:-}" \
    CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime \
    bash -c "$0" bash "$@"' "$inner" "$root" "$@"
rc=$?
set -e
say "LibTorch 2.6 $what exited with $rc after $(( $(date +%s) - started )) s"
exit $rc
