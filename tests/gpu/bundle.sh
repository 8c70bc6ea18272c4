#!/usr/bin/env bash
# Packs what accel needs besides LibTorch into one folder that travels to the
# GPU machine (which reaches no package registry): the headers accel, its
# tests and tools include (Boost.Hana, nlohmann-json, yaml-cpp, CLI11, Catch2
# v2, stb, spdlog, fmt), yaml-cpp's source (built there with that machine's
# compiler and LibTorch's C++ ABI), and small CMake package files for them.
# Made from this Debian 12 machine's packages (tools/setup.sh installs them).
# Usage: tests/gpu/bundle.sh [DIR]     (default build-gpu-deps, git-ignored)
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:-$here/build-gpu-deps}
say() { echo "gpu bundle: $*"; }

rm -rf "$out.partial"
mkdir -p "$out.partial/include" "$out.partial/cmake"

# 1. Headers: the closure of what the dependencies' entry headers include
#    (g++ -M), not the whole of /usr/include/boost (180 MB).
probe=$out.partial/probe.cpp
cat >"$probe" <<'EOF'
#include <boost/hana.hpp>
#include <boost/version.hpp>
#include <nlohmann/json.hpp>
#include <yaml-cpp/yaml.h>
#include <CLI/CLI.hpp>
#include <catch2/catch.hpp>
#include <stb/stb_image.h>
#include <stb/stb_image_write.h>
EOF
g++ -std=c++20 -M "$probe" | tr ' \\' '\n\n' |
  grep -E '^/usr/include/(boost|nlohmann|yaml-cpp|CLI|catch2|stb)/' | sort -u >"$out.partial/headers.txt"
rm "$probe"
(cd /usr/include && sed 's|^/usr/include/||' "$out.partial/headers.txt" | tar -cf - -T -) |
  tar -C "$out.partial/include" -xf -
say "$(wc -l <"$out.partial/headers.txt") headers"
# spdlog and fmt whole (about 1 MB): users include any sink, and fmt's
# header-only mode (FMT_HEADER_ONLY, set by the fmt package below) needs
# format-inl.h, which the probe above does not reach.
(cd /usr/include && tar -cf - spdlog fmt) | tar -C "$out.partial/include" -xf -
fmt_version=$(sed -n 's/^#define FMT_VERSION \([0-9]*\)/\1/p' /usr/include/fmt/core.h)
fmt_version=$((fmt_version / 10000)).$((fmt_version / 100 % 100)).$((fmt_version % 100))
spdlog_version=$(sed -n 's/^#define SPDLOG_VER_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\)/\2/p' \
  /usr/include/spdlog/version.h | paste -sd.)
say "spdlog $spdlog_version and fmt $fmt_version headers"

# 2. yaml-cpp's source from Debian's source package (deb-src lines derived
#    from this machine's apt sources, in a private apt state folder).
apt_dir=$(mktemp -d)
trap 'rm -rf "$apt_dir"' EXIT
mkdir -p "$apt_dir/parts" "$apt_dir/lists/partial"
for f in /etc/apt/sources.list.d/*.sources; do
  [[ -f $f ]] && sed 's/^Types: deb$/Types: deb-src/' "$f" >"$apt_dir/parts/$(basename "$f")"
done
if [[ -f /etc/apt/sources.list ]]; then
  sed -n 's/^deb /deb-src /p' /etc/apt/sources.list >"$apt_dir/parts/main.list"
fi
apt_opts=(-o Dir::Etc::SourceList=/dev/null -o "Dir::Etc::SourceParts=$apt_dir/parts"
          -o "Dir::State::Lists=$apt_dir/lists" -o APT::Sandbox::User=root)
apt-get "${apt_opts[@]}" update -qq >/dev/null
(cd "$apt_dir" && apt-get "${apt_opts[@]}" source --download-only -qq yaml-cpp >/dev/null)
orig=$(ls "$apt_dir"/yaml-cpp_*.orig.tar.* | head -n 1)
mkdir -p "$out.partial/src/yaml-cpp"
tar -C "$out.partial/src/yaml-cpp" --strip-components=1 -xf "$orig"
# Only what the library needs: its sources and headers (no tests, no docs).
find "$out.partial/src/yaml-cpp" -mindepth 1 -maxdepth 1 ! -name src ! -name include -exec rm -rf {} +
say "yaml-cpp source: $(basename "$orig")"

# 3. CMake package files: interface targets over the bundled headers, and
#    yaml-cpp over the library run.sh builds into lib/.
cp -r /usr/lib/cmake/Catch2 "$out.partial/cmake/Catch2"  # Catch.cmake (catch_discover_tests) too
cat >"$out.partial/cmake/Catch2/Catch2Config.cmake" <<'EOF'
# accel's GPU bundle: Catch2 v2, header-only.
get_filename_component(_root "${CMAKE_CURRENT_LIST_DIR}/../.." ABSOLUTE)
if(NOT TARGET Catch2::Catch2)
  add_library(Catch2::Catch2 INTERFACE IMPORTED)
  set_target_properties(Catch2::Catch2 PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${_root}/include")
endif()
list(APPEND CMAKE_MODULE_PATH "${CMAKE_CURRENT_LIST_DIR}")
EOF
rm -f "$out.partial"/cmake/Catch2/Catch2Targets*.cmake
catch_version=$(sed -n 's/^#define CATCH_VERSION_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\)/\2/p' \
  /usr/include/catch2/catch.hpp | paste -sd.)
cat >"$out.partial/cmake/Catch2/Catch2ConfigVersion.cmake" <<EOF
set(PACKAGE_VERSION "$catch_version")
set(PACKAGE_VERSION_COMPATIBLE TRUE)
EOF
for pkg in nlohmann_json CLI11; do
  case $pkg in
    nlohmann_json) target=nlohmann_json::nlohmann_json ;;
    CLI11) target=CLI11::CLI11 ;;
  esac
  mkdir -p "$out.partial/cmake/$pkg"
  cat >"$out.partial/cmake/$pkg/${pkg}Config.cmake" <<EOF
# accel's GPU bundle: header-only $pkg.
get_filename_component(_root "\${CMAKE_CURRENT_LIST_DIR}/../.." ABSOLUTE)
if(NOT TARGET $target)
  add_library($target INTERFACE IMPORTED)
  set_target_properties($target PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "\${_root}/include")
endif()
set(${pkg}_FOUND TRUE)
EOF
done
boost_version=$(sed -n 's/^#define BOOST_LIB_VERSION "\(.*\)"/\1/p' /usr/include/boost/version.hpp | tr _ .)
mkdir -p "$out.partial/cmake/Boost"
cat >"$out.partial/cmake/Boost/BoostConfig.cmake" <<EOF
# accel's GPU bundle: Boost's headers (Hana and what it includes) only.
get_filename_component(_root "\${CMAKE_CURRENT_LIST_DIR}/../.." ABSOLUTE)
if(NOT TARGET Boost::headers)
  add_library(Boost::headers INTERFACE IMPORTED)
  set_target_properties(Boost::headers PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "\${_root}/include")
endif()
set(Boost_VERSION "$boost_version")
set(Boost_FOUND TRUE)
EOF
# fmt header-only (no libfmt.so to carry) and spdlog's header-only target over
# it, under the names Debian's packages export (accel links
# spdlog::spdlog; header-only here).
mkdir -p "$out.partial/cmake/fmt" "$out.partial/cmake/spdlog"
cat >"$out.partial/cmake/fmt/fmt-config.cmake" <<'EOF'
# accel's GPU bundle: fmt, header-only (FMT_HEADER_ONLY).
get_filename_component(_root "${CMAKE_CURRENT_LIST_DIR}/../.." ABSOLUTE)
foreach(_t fmt::fmt fmt::fmt-header-only)
  if(NOT TARGET ${_t})
    add_library(${_t} INTERFACE IMPORTED)
    set_target_properties(${_t} PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${_root}/include"
                                           INTERFACE_COMPILE_DEFINITIONS FMT_HEADER_ONLY=1)
  endif()
endforeach()
set(fmt_FOUND TRUE)
EOF
cat >"$out.partial/cmake/spdlog/spdlogConfig.cmake" <<'EOF'
# accel's GPU bundle: spdlog, header-only, over the bundle's fmt.
get_filename_component(_root "${CMAKE_CURRENT_LIST_DIR}/../.." ABSOLUTE)
include(CMakeFindDependencyMacro)
find_dependency(Threads)
find_dependency(fmt CONFIG PATHS "${CMAKE_CURRENT_LIST_DIR}/../fmt" NO_DEFAULT_PATH)
foreach(_t spdlog::spdlog spdlog::spdlog_header_only)
  if(NOT TARGET ${_t})
    add_library(${_t} INTERFACE IMPORTED)
    set_target_properties(${_t} PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${_root}/include"
                                           INTERFACE_COMPILE_DEFINITIONS SPDLOG_FMT_EXTERNAL
                                           INTERFACE_LINK_LIBRARIES "Threads::Threads;fmt::fmt")
  endif()
endforeach()
set(spdlog_FOUND TRUE)
EOF
printf 'set(PACKAGE_VERSION "%s")\nset(PACKAGE_VERSION_COMPATIBLE TRUE)\n' "$fmt_version" \
  >"$out.partial/cmake/fmt/fmt-config-version.cmake"
printf 'set(PACKAGE_VERSION "%s")\nset(PACKAGE_VERSION_COMPATIBLE TRUE)\n' "$spdlog_version" \
  >"$out.partial/cmake/spdlog/spdlogConfigVersion.cmake"
mkdir -p "$out.partial/cmake/yaml-cpp"
cat >"$out.partial/cmake/yaml-cpp/yaml-cpp-config.cmake" <<'EOF'
# accel's GPU bundle: yaml-cpp, built by tests/gpu/run.sh into lib/.
get_filename_component(_root "${CMAKE_CURRENT_LIST_DIR}/../.." ABSOLUTE)
if(NOT TARGET yaml-cpp)
  add_library(yaml-cpp STATIC IMPORTED)
  set_target_properties(yaml-cpp PROPERTIES IMPORTED_LOCATION "${_root}/lib/libyaml-cpp.a"
                                            INTERFACE_INCLUDE_DIRECTORIES "${_root}/include")
endif()
set(yaml-cpp_FOUND TRUE)
EOF

rm -rf "$out"
mv "$out.partial" "$out"
say "$(du -sh "$out" | cut -f1) in $out"
