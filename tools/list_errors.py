#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Generates docs/errors.md: every compile-time (static_assert) and run-time
"accel: ..." message in include/ and tools/, grouped by area, each with the fix
its own text gives (accel's messages read "accel: <what is wrong>. <what to do
instead>.").

Usage:
  tools/list_errors.py            # rewrite docs/errors.md
  tools/list_errors.py --check    # exit 1 if docs/errors.md is out of date
  tools/list_errors.py --stdout   # print instead of writing

Expressions spliced into a message are shown as <expression>.
"""
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "errors.md"
SOURCES = ["include", "tools"]
EXTENSIONS = {".hpp", ".cpp", ".h"}

AREA_TITLES = {
    "core": "Accelerator and prepare() (include/accel/*.hpp)",
    "backend": "Backends",
    "precision": "Precision",
    "shard": "Sharding and gradient synchronisation",
    "runtime": "Runtime: process discovery, rendezvous, collectives",
    "ops": "Collectives on the Accelerator",
    "data": "Data loading",
    "checkpoint": "Checkpoints and safetensors",
    "launch": "Launching and config files",
    "sched": "Schedulers",
    "tracking": "Trackers and progress",
    "logging": "Logging (get_logger)",
    "prepared": "Prepared objects",
    "cli": "The accel command",
}


def area_of(path):
    rel = path.relative_to(ROOT).parts
    if rel[0] == "tools":
        return "cli"
    if len(rel) == 3:  # include/accel/x.hpp
        return "core"
    return rel[2]


def skip_string(text, i):
    """i at an opening quote; returns the index after the closing quote."""
    quote = text[i]
    i += 1
    while text[i] != quote:
        i += 2 if text[i] == "\\" else 1
    return i + 1


def unescape(lit):
    body = lit[1:-1]
    return re.sub(r'\\(["\\\'])', r"\1", body).replace("\\n", " ")


def extract(text, start):
    """From the literal at start, the message expression up to the end of the
    enclosing call or statement, as (rendered message, end index)."""
    # std::string("accel: ") + x: start before std::string( so it is not cut.
    m = re.search(r"std::string\(\s*$", text[:start])
    if m:
        start = m.start()
    parts, depth, i, current = [], 0, start, ""
    while i < len(text):
        c = text[i]
        if c == '"':
            j = skip_string(text, i)
            if current.replace("<<", "").strip(" \t\n,+()"):
                parts.append(("expr", current))
            current = ""
            parts.append(("lit", unescape(text[i:j])))
            i = j
            continue
        if c == "'":
            j = skip_string(text, i)
            current += text[i:j]
            i = j
            continue
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth < 0:
                break
        elif c in ";{" and depth <= 0:
            break
        elif c == "," and depth == 0 and current.strip() and not current.strip().startswith("std::string"):
            pass
        current += c
        i += 1
    if current.replace("<<", "").strip(" \t\n,+()"):
        parts.append(("expr", current))
    out = ""
    for kind, value in parts:
        if kind == "lit":
            out += value
        else:
            e = " ".join(value.replace("<<", " ").split()).strip(" ,+")
            e = re.sub(r"^std::string\(\s*", "", e)
            e = re.sub(r"^std::to_string\((.*)\)$", r"\1", e)
            for _ in range(8):  # peel separators and unbalanced parentheses off both ends
                e = e.strip(" ,+")
                if e.startswith(")") or (e.startswith("(") and e.count("(") > e.count(")")):
                    e = e[1:]
                elif e.endswith("(") or (e.endswith(")") and e.count(")") > e.count("(")):
                    e = e[:-1]
            if e == "std::string":
                continue
            e = re.sub(r"\.(string|str|count|c_str)\(\)$", "", e)
            if e and not out.endswith("<" + e + ">"):
                out += "<" + e + ">"
    return " ".join(out.split()), i


def in_comment(text, pos):
    line_start = text.rfind("\n", 0, pos) + 1
    return "//" in text[line_start:pos]


# Fixes for messages whose text wraps another error or states no remedy,
# keyed by the start of the message.
EXTRA_FIXES = {
    "accel: invalid Accelerator<": "Read the static_assert printed just before it: it names the policy at fault and what to use instead.",
    "accel: not a Checkpointable type": "Pass register_for_checkpointing() an object with state_dict()/load_state_dict() (or save()/load() with torch::serialize archives); see docs/checkpoints.md.",
    "accel: process <rank> failed": "The text after 'failed:' is that rank's own error (its exception, exit status or signal); fix that. The other ranks were stopped.",
    "accel: parameter <k> has no gradient accumulator": "Prepare models whose trainable parameters are leaf tensors (not views or results of other operations).",
    "accel: <backend> <op> failed on rank": "The text after the colon is the backend's own error. A peer that crashed or left shows up here: look at the other ranks' messages first.",
    "accel: all_gather output has": "Give all_gather an output of world size x input elements (Communicator is a low-level API; prefer accelerator.gather()).",
    "accel: reduce_scatter input has": "Give reduce_scatter an input of world size x output elements.",
    "accel: the checkpoint file": "Load a directory that save_state() wrote completely (every file of docs/checkpoints.md present), or save again.",
    "accel: received <": "Nothing to fix: accel launch was interrupted (Ctrl-C or SIGTERM) and stopped every process.",
    "accel: rank <w.rank> (pid <w.pid>) failed": "The text after 'failed:' is that rank's error or exit status; fix that. accel launch stopped the other ranks.",
    "accel: warning: <file>:<line>: key": "Remove or correct the key named; the program goes on without it.",
}


def split_fix(msg):
    body = msg[len("accel: "):] if msg.startswith("accel: ") else msg
    # The first sentence end that is followed by more text (not "e.g. ", "..").
    for m in re.finditer(r"(?<![.e][.g])\. (?=[A-Z(`'\"<a-z])", body):
        rest = body[m.end():].strip()
        if rest:
            return "accel: " + body[: m.start() + 1], rest
    return msg, ""


def collect():
    static, runtime, warnings = {}, {}, {}
    for top in SOURCES:
        for path in sorted((ROOT / top).rglob("*")):
            if path.suffix not in EXTENSIONS or not path.is_file():
                continue
            text = path.read_text(encoding="utf-8", errors="replace")
            for m in re.finditer(r'"accel: ', text):
                here = line_of(text, m.start())
                # Profiling span names ("accel: ..." in a trace) are labels, not messages.
                if in_comment(text, m.start()) or "CLI::App" in here or "Span" in here:
                    continue
                msg, _ = extract(text, m.start())
                if not re.sub(r"<[^>]*>", "", msg[len("accel: "):]).strip(" .:"):
                    continue  # a bare "accel: <note>" line, no text of its own
                line = text.count("\n", 0, m.start()) + 1
                before = text[max(0, m.start() - 400):m.start()]
                is_static = re.search(r"static_assert\s*\([^;]*$", before) is not None
                where = "%s:%d" % (path.relative_to(ROOT), line)
                table = static if is_static else warnings if msg.startswith("accel: warning") else runtime
                table.setdefault(area_of(path), {}).setdefault(msg, []).append(where)
    return static, runtime, warnings


def line_of(text, pos):
    return text[text.rfind("\n", 0, pos) + 1:text.find("\n", pos)]


def location_key(where):
    path, line = where.rsplit(":", 1)
    return path, int(line)


def render(static, runtime, warnings):
    out = [
        "# Error catalogue",
        "",
        "Every message accel can stop you with, grouped by area, with its fix.",
        "Generated by `tools/list_errors.py` from the sources (do not edit by hand;",
        "run `tools/list_errors.py` after adding a message, `--check` tells whether",
        "this page is current). Parts shown as `<expression>` are filled in at run",
        "time (a rank, a path, a size...).",
        "",
        "All run-time errors are `accel::Error` or one of its subclasses",
        "(`accel::LaunchError`: a launched process failed, with `rank()` and",
        "`message()`; `accel::ConfigError`: a config file or value is wrong, naming",
        "the key and line; `accel::TimeoutError`: a collective or rendezvous did not",
        "finish within `AcceleratorOptions::timeout`). Catch `accel::Error` to catch",
        "them all.",
        "",
    ]

    def section(title, table, kind):
        n = sum(len(v) for v in table.values())
        out.append("## %s (%d)" % (title, n))
        out.append("")
        for area in sorted(table, key=lambda a: list(AREA_TITLES).index(a) if a in AREA_TITLES else 99):
            out.append("### %s: %s" % (kind, AREA_TITLES.get(area, area)))
            out.append("")
            for msg, wheres in sorted(table[area].items(), key=lambda kv: location_key(kv[1][0])):
                problem, fix = split_fix(msg)
                if not fix:
                    fix = next((f for k, f in EXTRA_FIXES.items() if msg.startswith(k)), "")
                out.append("- `%s`" % problem.replace("`", "'"))
                out.append("  - **Fix:** %s" % (fix if fix else "not stated in the message; it names what is wrong."))
                out.append("  - *%s*" % ", ".join(wheres))
            out.append("")

    section("Compile-time errors (static_assert)", static, "Compile time")
    out.append("A compile-time message is printed by the compiler as `error: static assertion")
    out.append("failed: accel: ...`; when a second error follows (for prepare(), the position")
    out.append("and type of the argument), read both.")
    out.append("")
    section("Run-time errors (accel::Error and subclasses)", runtime, "Run time")
    section("Warnings (printed to stderr, the program goes on)", warnings, "Warning")
    return "\n".join(out).rstrip() + "\n"


def main():
    text = render(*collect())
    if "--stdout" in sys.argv:
        sys.stdout.write(text)
        return 0
    if "--check" in sys.argv:
        current = OUT.read_text(encoding="utf-8") if OUT.exists() else ""
        if current != text:
            print("docs/errors.md is out of date: run tools/list_errors.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
