#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
"""Reads a TensorBoard event file with the standard library only, independently
of accel's C++ writer: checks every TFRecord's two masked CRC32C values and
decodes the tf.Event fields (wall_time 1, step 2, file_version 3, summary 5 ->
Summary.value 1 -> Value{tag 1, simple_value 2}) that TensorBoard's scalar
dashboard reads. Prints one JSON object per event; exits 1 on any corruption.
(Debian has no tensorboard package, so TensorBoard itself cannot read it here.)

Usage: read_tfevents.py FILE | read_tfevents.py --selftest
"""
import json
import struct
import sys


def _crc32c_table():
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc32c_table()


def crc32c(data):
    crc = 0xFFFFFFFF
    for b in data:
        crc = _TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked(data):
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def varint(buf, pos):
    shift = result = 0
    while True:
        if pos >= len(buf):
            raise ValueError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def fields(buf):
    """Yields (field number, wire type, value) of a protobuf message."""
    pos = 0
    while pos < len(buf):
        key, pos = varint(buf, pos)
        num, wt = key >> 3, key & 7
        if wt == 0:
            val, pos = varint(buf, pos)
        elif wt == 1:
            val, pos = buf[pos:pos + 8], pos + 8
        elif wt == 2:
            n, pos = varint(buf, pos)
            val, pos = buf[pos:pos + n], pos + n
        elif wt == 5:
            val, pos = buf[pos:pos + 4], pos + 4
        else:
            raise ValueError("unsupported wire type %d" % wt)
        if pos > len(buf):
            raise ValueError("field %d runs past the message" % num)
        yield num, wt, val


def decode_event(data):
    event = {}
    for num, wt, val in fields(data):
        if num == 1 and wt == 1:
            event["wall_time"] = struct.unpack("<d", val)[0]
        elif num == 2 and wt == 0:
            event["step"] = val - (1 << 64) if val >= 1 << 63 else val
        elif num == 3 and wt == 2:
            event["file_version"] = val.decode()
        elif num == 5 and wt == 2:
            values = {}
            for vnum, vwt, v in fields(val):
                if vnum != 1 or vwt != 2:
                    continue
                tag, simple = None, None
                for f, fwt, x in fields(v):
                    if f == 1 and fwt == 2:
                        tag = x.decode()
                    elif f == 2 and fwt == 5:
                        simple = struct.unpack("<f", x)[0]
                values[tag] = simple
            event["values"] = values
    return event


def read_records(path):
    with open(path, "rb") as f:
        buf = f.read()
    pos = 0
    while pos < len(buf):
        if pos + 12 > len(buf):
            raise ValueError("truncated record header at byte %d" % pos)
        header = buf[pos:pos + 8]
        (length,) = struct.unpack("<Q", header)
        (len_crc,) = struct.unpack("<I", buf[pos + 8:pos + 12])
        if masked(header) != len_crc:
            raise ValueError("bad length CRC at byte %d" % pos)
        data = buf[pos + 12:pos + 12 + length]
        if len(data) != length or pos + 16 + length > len(buf):
            raise ValueError("truncated record at byte %d" % pos)
        (data_crc,) = struct.unpack("<I", buf[pos + 12 + length:pos + 16 + length])
        if masked(data) != data_crc:
            raise ValueError("bad data CRC at byte %d" % pos)
        yield data
        pos += 16 + length


def main():
    if sys.argv[1:] == ["--selftest"]:
        # The CRC-32C check value of the iSCSI standard (RFC 3720, B.4).
        assert crc32c(b"123456789") == 0xE3069283
        print("ok")
        return 0
    try:
        for data in read_records(sys.argv[1]):
            print(json.dumps(decode_event(data), sort_keys=True))
    except ValueError as e:
        # The events read so far first: the caller reads the error as the last line.
        sys.stdout.flush()
        print("error: %s" % e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
