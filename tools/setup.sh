#!/usr/bin/env bash
# Installs the Debian packages accel needs that are missing (idempotent: a
# second run installs nothing). Debian 12 (LibTorch 1.13) and Debian 13
# (LibTorch 2.6, see tools/test-libtorch2.sh). Usage: tools/setup.sh [--bench]
#   --bench  also Debian's python3-torch (PyTorch's own DDP, for bench/)
set -euo pipefail
codename=$( (. /etc/os-release && echo "${VERSION_CODENAME:-}") 2>/dev/null || true)
case "$codename" in
  trixie) clang_rt=libclang-rt-19-dev ;;  # Debian 13: clang 19
  *) clang_rt=libclang-rt-14-dev ;;       # Debian 12: clang 14
esac
packages=(
  build-essential cmake ninja-build ccache python3 clang "$clang_rt"
  libtorch-dev libgloo-dev            # LibTorch (CPU) with c10d: 1.13 on Debian 12, 2.6 on 13; Gloo's headers
  libopenblas0-pthread                # without it LibTorch falls back to the slow reference BLAS
  libopenmpi-dev openmpi-bin          # backend::Mpi
  libboost-dev catch2 nlohmann-json3-dev libyaml-cpp-dev libcli11-dev libstb-dev libfmt-dev
  libspdlog-dev                       # accel::get_logger (logging/), linked as its compiled library
  protobuf-compiler procps xxhash     # tests: protoc reads TensorBoard files, pgrep finds leftover
                                      # processes, xxhsum checks checkpoint checksums,
  iproute2                            # ip and tc make cli.launch_netns's two-machine network
)
if [[ "${1:-}" == "--bench" ]]; then packages+=(python3-torch hyperfine); fi

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]} == 0)); then
  echo "setup: all ${#packages[@]} packages are installed"
  exit 0
fi
echo "setup: installing ${missing[*]}"
sudo_cmd=()
if [[ $(id -u) -ne 0 ]]; then sudo_cmd=(sudo); fi
"${sudo_cmd[@]}" apt-get update -qq
DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
