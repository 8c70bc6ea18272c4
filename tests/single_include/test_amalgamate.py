#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Self-test of tools/amalgamate.py on small throw-away trees (stdlib only).

Run: python3 tests/single_include/test_amalgamate.py   (ctest: amalgamate.selftest)
"""
import contextlib
import io
import os
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tools"))
import amalgamate  # noqa: E402

VERSION = ("#ifndef ACCEL_VERSION_HPP\n#define ACCEL_VERSION_HPP\n#define ACCEL_VERSION_MAJOR 3\n"
           "#define ACCEL_VERSION_MINOR 1\n#define ACCEL_VERSION_PATCH 4\n#endif\n")


class Tree:
    def __init__(self, files):
        self.tmp = tempfile.TemporaryDirectory()
        self.root = self.tmp.name
        files = dict(files)
        files.setdefault("accel/version.hpp", VERSION)
        for name, text in files.items():
            path = os.path.join(self.root, "include", name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", newline="") as f:
                f.write(text)
        self.output = os.path.join(self.root, "single_include", "accel", "accel.hpp")

    def run(self, *args):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = amalgamate.main(["--root", self.root] + list(args))
        return rc, err.getvalue()

    def text(self):
        with open(self.output, newline="") as f:
            return f.read()


def guarded(guard, *body):
    return "#ifndef %s\n#define %s\n%s\n#endif\n" % (guard, guard, "\n".join(body))


class AmalgamateTest(unittest.TestCase):
    def test_inlines_each_header_once_in_first_use_order(self):
        t = Tree({
            "accel/accel.hpp": guarded("A", "#include <accel/version.hpp>", "#include <accel/b.hpp>",
                                       "#include <vector>", "#include <accel/c.hpp>"),
            "accel/b.hpp": guarded("B", "#include <accel/c.hpp>", "#include <torch/torch.h>", "int b;"),
            "accel/c.hpp": guarded("C", "#include <accel/b.hpp>", "int c;"),
        })
        self.assertEqual(t.run()[0], 0)
        text = t.text()
        self.assertTrue(text.startswith(amalgamate.BANNER + "\n"))
        self.assertIn("accel 3.1.4", text.split("\n")[1])
        for h in ("accel.hpp", "version.hpp", "b.hpp", "c.hpp"):
            self.assertEqual(text.count("// begin <accel/%s>" % h), 1, h)
            self.assertEqual(text.count("// end <accel/%s>" % h), 1, h)
        self.assertLess(text.index("// begin <accel/b.hpp>"), text.index("// begin <accel/c.hpp>"))
        self.assertLess(text.index("// begin <accel/c.hpp>"), text.index("int b;"))
        self.assertNotIn("#include <accel/", text)
        self.assertIn("#include <torch/torch.h>", text)
        self.assertIn("#include <vector>", text)
        self.assertIn("#ifndef B\n#define B\n", text)  # guards kept
        self.assertNotIn("\r", text)

    def test_reproducible_and_check_mode(self):
        t = Tree({"accel/accel.hpp": guarded("A", "#include <accel/version.hpp>")})
        self.assertEqual(t.run()[0], 0)
        first = t.text()
        self.assertEqual(t.run()[0], 0)
        self.assertEqual(t.text(), first)
        self.assertEqual(t.run("--check")[0], 0)
        with open(t.output, "a") as f:
            f.write("// edited\n")
        rc, err = t.run("--check")
        self.assertEqual(rc, 1)
        self.assertIn("out of date", err)
        os.remove(t.output)
        rc, err = t.run("--check")
        self.assertEqual(rc, 1)
        self.assertIn("does not exist", err)

    def test_crlf_becomes_lf(self):
        t = Tree({"accel/accel.hpp": "#ifndef A\r\n#define A\r\n#include <accel/version.hpp>\r\n#endif\r\n"})
        self.assertEqual(t.run()[0], 0)
        self.assertNotIn("\r", t.text())

    def test_unreached_headers_are_named(self):
        t = Tree({"accel/accel.hpp": guarded("A", "#include <accel/version.hpp>"),
                  "accel/lost.hpp": guarded("L"), "accel/deep/gone.hpp": guarded("G")})
        rc, err = t.run()
        self.assertEqual(rc, 1)
        self.assertIn("accel/lost.hpp", err)
        self.assertIn("accel/deep/gone.hpp", err)
        self.assertFalse(os.path.exists(t.output))

    def test_missing_include_fails_unless_conditional(self):
        t = Tree({"accel/accel.hpp": guarded("A", "#include <accel/version.hpp>",
                                             "#include <accel/nope.hpp>")})
        rc, err = t.run()
        self.assertEqual(rc, 1)
        self.assertIn("<accel/nope.hpp>, which does not exist", err)
        t = Tree({"accel/accel.hpp": guarded("A", "#include <accel/version.hpp>", "#ifdef CUDA",
                                             "#include <accel/nope.hpp>", "#endif")})
        rc, err = t.run()
        self.assertEqual(rc, 0)
        self.assertIn("#include <accel/nope.hpp>", t.text())

    def test_conditional_first_copy_is_repeated_where_needed(self):
        t = Tree({
            "accel/accel.hpp": guarded("A", "#include <accel/version.hpp>", "#if X",
                                       "#include <accel/c.hpp>", "#include <accel/c.hpp>",
                                       "#endif", "#include <accel/c.hpp>", "#include <accel/c.hpp>"),
            "accel/c.hpp": "#pragma once\nint c;\n",
        })
        self.assertEqual(t.run()[0], 0)
        text = t.text()
        # once inside #if X, once after it; never a third time
        self.assertEqual(text.count("// begin <accel/c.hpp>"), 2)
        self.assertNotIn("#pragma once", text)
        self.assertEqual(text.count("#ifndef ACCEL_AMALGAMATE_ONCE_ACCEL_C_HPP"), 2)

    def test_relative_accel_include_is_rejected(self):
        t = Tree({"accel/accel.hpp": guarded("A", "#include <accel/version.hpp>", '#include "b.hpp"'),
                  "accel/b.hpp": guarded("B")})
        rc, err = t.run()
        self.assertEqual(rc, 1)
        self.assertIn('#include "b.hpp"', err)


if __name__ == "__main__":
    unittest.main()
