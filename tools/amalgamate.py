#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Generates single_include/accel/accel.hpp from include/accel.

Starting from include/accel/accel.hpp, every `#include <accel/...>` is
replaced by the text of that header the first time it is reached (depth
first, so in the order a compiler would first read it) and dropped after
that; every other include (std, torch, c10, boost, nlohmann, yaml-cpp, mpi,
system) stays where it is. Headers keep their include guards and are wrapped
in `// begin <accel/x.hpp>` / `// end <accel/x.hpp>` comments.

One exception keeps the result correct: a header first inlined inside a
preprocessor conditional (say `#if ACCEL_WITH_MPI`) is inlined again where it
is next included outside that conditional, because the first copy may be
compiled out; its include guard makes the second copy a no-op when the first
one was compiled. (A copy counts as done for every later point nested in the
same #if branch.)

The output is reproducible: no timestamp, LF line endings, include order.
The script fails, naming the files, when a header under include/accel is never
reached from accel.hpp, or when an accel include outside any #if names a file
that does not exist.

Usage:
  tools/amalgamate.py [--output PATH]   write (default single_include/accel/accel.hpp)
  tools/amalgamate.py --check [--output PATH]
                                        regenerate in memory and compare with PATH
Only the standard library is used.
"""
import argparse
import difflib
import os
import re
import sys
import tempfile

BANNER = "// Generated from include/accel by tools/amalgamate.py - do not edit"
HEADER_SUFFIXES = (".hpp", ".h", ".hh", ".hxx", ".ipp", ".inl")

INCLUDE_RE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]')
IF_RE = re.compile(r"^\s*#\s*if(n?def)?\b")
ELSE_RE = re.compile(r"^\s*#\s*(else|elif|elifdef|elifndef)\b")
ENDIF_RE = re.compile(r"^\s*#\s*endif\b")
IFNDEF_RE = re.compile(r"^\s*#\s*ifndef\s+(\w+)")
DEFINE_RE = re.compile(r"^\s*#\s*define\s+(\w+)")
PRAGMA_ONCE_RE = re.compile(r"^\s*#\s*pragma\s+once\b")
VERSION_RE = re.compile(r"^\s*#\s*define\s+ACCEL_VERSION_(MAJOR|MINOR|PATCH)\s+(\d+)")


class AmalgamateError(Exception):
    pass


def read_text(path):
    with open(path, "r", encoding="utf-8", newline="") as f:
        text = f.read()
    return text.replace("\r\n", "\n").replace("\r", "\n")


def read_version(include_root):
    path = os.path.join(include_root, "accel", "version.hpp")
    parts = {}
    for line in read_text(path).split("\n"):
        m = VERSION_RE.match(line)
        if m:
            parts[m.group(1)] = m.group(2)
    if set(parts) != {"MAJOR", "MINOR", "PATCH"}:
        raise AmalgamateError(
            "%s: ACCEL_VERSION_MAJOR/MINOR/PATCH not all found" % path)
    return "%s.%s.%s" % (parts["MAJOR"], parts["MINOR"], parts["PATCH"])


def guard_line_index(lines):
    """Index of the `#ifndef G` that opens the include guard, or None.

    The guard is the first preprocessor directive, an #ifndef directly
    followed (as the next directive) by a #define of the same name.
    """
    directives = [i for i, l in enumerate(lines) if l.lstrip().startswith("#")]
    if len(directives) < 2:
        return None
    first, second = directives[0], directives[1]
    m1, m2 = IFNDEF_RE.match(lines[first]), DEFINE_RE.match(lines[second])
    if m1 and m2 and m1.group(1) == m2.group(1):
        return first
    return None


class Amalgamator:
    def __init__(self, include_root):
        self.include_root = os.path.abspath(include_root)
        # header -> conditional contexts it was inlined under; a context is the
        # tuple of enclosing #if branches, () meaning always compiled.
        self.copies = {}
        self.active = []   # headers being inlined (cycle guard)
        self.instances = 0  # numbers each inlined copy, to tell their #if frames apart
        self.repeated = []  # headers inlined twice because the first copy was conditional
        self.out = []

    def resolve(self, name, including, quoted):
        """Path of an accel header, or None when `name` is not one."""
        if quoted:
            candidate = os.path.normpath(os.path.join(os.path.dirname(including), name))
            if candidate.startswith(os.path.join(self.include_root, "accel") + os.sep):
                raise AmalgamateError(
                    '%s: #include "%s" reaches an accel header by a relative path; '
                    "write #include <accel/...> instead" % (self.rel(including), name))
            return None
        if not name.startswith("accel/"):
            return None
        return os.path.join(self.include_root, name)

    def rel(self, path):
        return os.path.relpath(path, os.path.dirname(self.include_root))

    def inline(self, path, name, context):
        self.instances += 1
        instance = self.instances
        self.active.append(path)
        self.copies.setdefault(path, []).append(context)
        lines = read_text(path).split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        guard = guard_line_index(lines)
        self.out.append("// begin <%s>" % name)
        once_guards = 0
        frames = []  # this file's open #if blocks (the guard excluded): [instance, line, branch]
        for i, line in enumerate(lines):
            if IF_RE.match(line):
                frames.append([instance, i, 0] if i != guard else None)
            elif ELSE_RE.match(line):
                if frames and frames[-1] is not None:
                    frames[-1][2] += 1
            elif ENDIF_RE.match(line):
                if frames:
                    frames.pop()
            if PRAGMA_ONCE_RE.match(line):
                # `#pragma once` would apply to the whole single header: turn it
                # into a guard so that a repeated copy (see above) stays a no-op.
                macro = "ACCEL_AMALGAMATE_ONCE_" + re.sub(r"\W", "_", name).upper()
                self.out.append("#ifndef %s" % macro)
                self.out.append("#define %s" % macro)
                once_guards += 1
                continue
            m = INCLUDE_RE.match(line)
            if m:
                target = self.resolve(m.group(2), path, m.group(1) == '"')
                if target is not None:
                    here = context + tuple(tuple(f) for f in frames if f is not None)
                    self.include(target, m.group(2), path, here)
                    continue
            self.out.append(line)
        self.out.extend(["#endif"] * once_guards)
        self.out.append("// end <%s>" % name)
        self.active.pop()

    def include(self, target, name, including, context):
        if target in self.active:
            return
        # An earlier copy made under a prefix of this context was compiled
        # whenever this point is: the include guard would skip this one.
        earlier = self.copies.get(target, [])
        if any(context[:len(c)] == c for c in earlier):
            return
        if not os.path.isfile(target):
            if context:
                # Compiled only in some configurations (e.g. a CUDA build):
                # keep the include so that such a build names what is missing.
                sys.stderr.write("amalgamate: warning: %s includes <%s>, which does not exist; "
                                 "kept as an #include (it sits inside a conditional)\n"
                                 % (self.rel(including), name))
                self.out.append("#include <%s>" % name)
                return
            raise AmalgamateError("%s includes <%s>, which does not exist"
                                  % (self.rel(including), name))
        if earlier:
            self.repeated.append(name)
        self.inline(target, name, context)

    def run(self, entry_name, version):
        entry = os.path.join(self.include_root, entry_name)
        if not os.path.isfile(entry):
            raise AmalgamateError("%s not found" % self.rel(entry))
        self.out = [
            BANNER,
            "// accel %s, single-header form of include/%s; regenerate with"
            % (version, entry_name),
            "// `python3 tools/amalgamate.py` or `cmake --build <dir> --target accel_amalgamate`.",
            "// SPDX-License-Identifier: Apache-2.0",
        ]
        self.inline(entry, entry_name, ())
        return "\n".join(self.out) + "\n"

    def unreached(self):
        reached = set(self.copies)
        missing = []
        for dirpath, dirnames, filenames in os.walk(os.path.join(self.include_root, "accel")):
            dirnames.sort()
            for f in sorted(filenames):
                p = os.path.join(dirpath, f)
                if f.endswith(HEADER_SUFFIXES) and p not in reached:
                    missing.append(os.path.relpath(p, self.include_root))
        return missing


def amalgamate(root, entry_name):
    include_root = os.path.join(root, "include")
    a = Amalgamator(include_root)
    text = a.run(entry_name, read_version(include_root))
    missing = a.unreached()
    if missing:
        raise AmalgamateError(
            "these headers are never reached from include/%s (include them from it or "
            "from a header it includes, or delete them):\n  %s"
            % (entry_name, "\n  ".join(missing)))
    return text


def write_lf(path, text):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".amalgamate.", dir=os.path.dirname(os.path.abspath(path)))
    with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
        f.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)  # readers never see a half-written header


def main(argv=None):
    root_default = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = argparse.ArgumentParser(description="Generate single_include/accel/accel.hpp.")
    p.add_argument("--output", help="where to write (default: single_include/accel/accel.hpp)")
    p.add_argument("--check", action="store_true",
                   help="do not write: fail when the output file differs from a fresh generation")
    p.add_argument("--root", default=root_default, help="repository root (default: %(default)s)")
    p.add_argument("--entry", default="accel/accel.hpp",
                   help="header to start from, relative to include/ (default: %(default)s)")
    args = p.parse_args(argv)
    output = args.output or os.path.join(args.root, "single_include", "accel", "accel.hpp")

    try:
        text = amalgamate(args.root, args.entry)
    except (AmalgamateError, OSError) as e:
        sys.stderr.write("amalgamate: error: %s\n" % e)
        return 1

    if args.check:
        if not os.path.isfile(output):
            sys.stderr.write("amalgamate: %s does not exist; generate it with tools/amalgamate.py "
                             "(or the accel_amalgamate target) and commit it\n" % output)
            return 1
        current = open(output, "r", encoding="utf-8", newline="").read()
        if current != text:
            diff = list(difflib.unified_diff(current.split("\n"), text.split("\n"),
                                             "committed", "regenerated", lineterm="", n=1))
            sys.stderr.write("amalgamate: %s is out of date with include/accel; regenerate it with "
                             "tools/amalgamate.py (or the accel_amalgamate target) and commit it. "
                             "First differences:\n%s\n" % (output, "\n".join(diff[:40])))
            return 1
        print("amalgamate: %s is up to date" % output)
        return 0

    write_lf(output, text)
    print("amalgamate: wrote %s (%d lines)" % (output, text.count("\n")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
