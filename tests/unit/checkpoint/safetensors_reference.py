#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
"""Independent safetensors writer/reader (struct + json only, no safetensors
package) used to check accel's format from outside C++.

  safetensors_reference.py write DATA_DIR SEED_DIR
        writes DATA_DIR/reference.safetensors and the fuzz seeds into SEED_DIR
        (run once from the repository root with tests/unit/checkpoint/data and
        tests/fuzz/corpus; the output is committed)
  safetensors_reference.py check FILE    checks a file accel wrote in the test
                                         "python interop" (contents fixed below)
"""
import json
import os
import struct
import sys


def pack(fmt, values):
    return struct.pack("<%d%s" % (len(values), fmt), *values)


def bf16(values):
    # bfloat16 = top 16 bits of the float32 (values below are exact in bf16)
    return b"".join(struct.pack("<f", v)[2:] for v in values)


# name -> (dtype, shape, little-endian bytes). The C++ test expects these values.
REFERENCE = [
    ("f64", "F64", [2], pack("d", [1.5, -2.25])),
    ("f32", "F32", [2, 2], pack("f", [0.0, 1.0, -3.5, 1e-3])),
    ("f16", "F16", [3], pack("e", [0.5, -1.0, 65504.0])),
    ("bf16", "BF16", [2], bf16([1.0, -0.5])),
    ("i64", "I64", [2], pack("q", [-(2**40), 7])),
    ("i32", "I32", [1, 2], pack("i", [-5, 2**31 - 1])),
    ("i16", "I16", [2], pack("h", [-32768, 123])),
    ("i8", "I8", [3], pack("b", [-128, 0, 127])),
    ("u8", "U8", [2], pack("B", [0, 255])),
    ("bool", "BOOL", [3], pack("B", [1, 0, 1])),
    ("scalar", "F32", [], pack("f", [42.0])),
    ("empty", "F32", [0, 3], b""),
]


def serialize(tensors, metadata):
    header, offset, data = {}, 0, b""
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        data += raw
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # pad to 8 like Hugging Face
    return struct.pack("<Q", len(text)) + text + data


def read(path):
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    assert 8 + n <= len(blob), "header past end"
    header = json.loads(blob[8:8 + n].decode())
    data = blob[8 + n:]
    return header, data


def check(path):
    """accel's test writes: a F32 [2,3] = 0..5, b I64 [2] = [-1, 2**40],
    c BF16 [2] = [1, -0.5], t tied to a, metadata {"format":"pt","k":"v"}."""
    header, data = read(path)
    n = struct.unpack("<Q", open(path, "rb").read(8))[0]
    assert n % 8 == 0, "header not padded to 8: %d" % n
    meta = header.pop("__metadata__")
    assert meta.get("format") == "pt" and meta.get("k") == "v", meta
    assert set(header) == {"a", "b", "c"}, sorted(header)
    spans = sorted(tuple(e["data_offsets"]) for e in header.values())
    assert spans[0][0] == 0 and spans[-1][1] == len(data), spans
    for (b0, e0), (b1, e1) in zip(spans, spans[1:]):
        assert e0 == b1, spans

    def raw(name):
        b, e = header[name]["data_offsets"]
        return data[b:e]
    assert header["a"]["dtype"] == "F32" and header["a"]["shape"] == [2, 3]
    assert struct.unpack("<6f", raw("a")) == (0.0, 1.0, 2.0, 3.0, 4.0, 5.0)
    assert header["b"]["dtype"] == "I64" and header["b"]["shape"] == [2]
    assert struct.unpack("<2q", raw("b")) == (-1, 2**40)
    assert header["c"]["dtype"] == "BF16" and raw("c") == bf16([1.0, -0.5])
    tied = [k for k, v in meta.items() if v == "a" and k != "k"]
    assert tied, "tied alias of 'a' not recorded in metadata: %r" % meta
    print("python check ok")


def write(out_dir, seeds):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "reference.safetensors"), "wb") as f:
        f.write(serialize(REFERENCE, {"format": "pt", "writer": "python struct"}))
    os.makedirs(seeds, exist_ok=True)
    samples = {
        "reference": serialize(REFERENCE, {"format": "pt"}),
        "one_f32": serialize([("w", "F32", [2], pack("f", [1.0, 2.0]))], None),
        "empty_header": serialize([], {}),
        "scalar_and_empty": serialize(REFERENCE[-2:], None),
    }
    for name, blob in samples.items():
        with open(os.path.join(seeds, name + ".safetensors"), "wb") as f:
            f.write(blob)


if __name__ == "__main__":
    if sys.argv[1:2] == ["write"] and len(sys.argv) == 4:
        write(sys.argv[2], sys.argv[3])
    elif sys.argv[1:2] == ["check"] and len(sys.argv) == 3:
        check(sys.argv[2])
    else:
        sys.exit(__doc__)
