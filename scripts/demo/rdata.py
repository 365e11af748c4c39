"""Just enough of R's serialization format to read a package's lazy-load data.

R packages installed by Debian keep their data sets in ``data/Rdata.rdx`` (an
index) and ``data/Rdata.rdb`` (the objects, each one compressed separately).
Both hold objects in R's XDR serialization format (R Internals, section 1.8).
This module decodes the subset of that format that plain data uses: vectors of
logicals, integers, doubles and strings, generic lists, pairlists and symbols,
with attributes. It exists so the demo corpus can be extracted without
installing R. Standard library only.
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import struct
import zlib
from pathlib import Path

# SEXP type codes (R Internals, "Serialization formats").
NILSXP, SYMSXP, LISTSXP, CLOSXP, ENVSXP, PROMSXP, LANGSXP = 0, 1, 2, 3, 4, 5, 6
CHARSXP, LGLSXP, INTSXP, REALSXP, CPLXSXP, STRSXP = 9, 10, 13, 14, 15, 16
VECSXP, EXPRSXP, RAWSXP = 19, 20, 24
REFSXP, NILVALUE_SXP, GLOBALENV_SXP, EMPTYENV_SXP, BASEENV_SXP = 255, 254, 253, 242, 241

NA_INTEGER = -(2**31)


class RList(list):
    """A decoded R list or vector that carries its R attributes."""

    attributes: dict

    def __init__(self, items=(), attributes=None):
        super().__init__(items)
        self.attributes = attributes or {}

    @property
    def names(self):
        return self.attributes.get("names")


class _Reader:
    def __init__(self, data: bytes):
        if data[:2] != b"X\n":
            raise ValueError(f"not an XDR-serialized R object (header {data[:2]!r})")
        self.data = data
        self.pos = 2
        self.refs: list = []
        version = self.int()
        self.int()  # R version that wrote it
        self.int()  # oldest R version that can read it
        if version == 3:
            n = self.int()
            self.pos += n  # native encoding name
        elif version != 2:
            raise ValueError(f"unsupported serialization version {version}")

    def int(self) -> int:
        (v,) = struct.unpack_from(">i", self.data, self.pos)
        self.pos += 4
        return v

    def length(self) -> int:
        n = self.int()
        if n == -1:  # long vector: two more ints
            hi, lo = self.int(), self.int()
            n = (hi << 32) | (lo & 0xFFFFFFFF)
        return n

    def item(self):
        flags = self.int()
        kind = flags & 0xFF
        has_attr = bool(flags & (1 << 9))
        has_tag = bool(flags & (1 << 10))

        if kind in (NILVALUE_SXP, NILSXP, GLOBALENV_SXP, EMPTYENV_SXP, BASEENV_SXP):
            return None
        if kind == REFSXP:
            index = flags >> 8
            if index == 0:
                index = self.int()
            return self.refs[index - 1]
        if kind == SYMSXP:
            name = self.item()
            self.refs.append(name)
            return name
        if kind == CHARSXP:
            n = self.int()
            if n == -1:
                return None  # NA_character_
            raw = self.data[self.pos : self.pos + n]
            self.pos += n
            return raw.decode("utf-8", errors="replace")
        if kind in (LISTSXP, LANGSXP, CLOSXP, PROMSXP):
            # A pairlist: attributes, tag, value, then the rest of the list.
            attrs = self.item() if has_attr else None
            tag = self.item() if has_tag else None
            value = self.item()
            rest = self.item()
            pairs = [(tag, value)]
            if isinstance(rest, _Pairlist):
                pairs.extend(rest.pairs)
            return _Pairlist(pairs, attrs)
        if kind == ENVSXP:
            self.int()  # locked flag
            env: dict = {}
            self.refs.append(env)
            self.item()  # enclosing environment
            frame = self.item()
            self.item()  # hash table
            self.item()  # attributes
            if isinstance(frame, _Pairlist):
                env.update(frame.pairs)
            return env

        if kind in (LGLSXP, INTSXP):
            n = self.length()
            values = list(struct.unpack_from(f">{n}i", self.data, self.pos))
            self.pos += 4 * n
            values = [None if v == NA_INTEGER else v for v in values]
            if kind == LGLSXP:
                values = [None if v is None else bool(v) for v in values]
            out = RList(values)
        elif kind == REALSXP:
            n = self.length()
            out = RList(struct.unpack_from(f">{n}d", self.data, self.pos))
            self.pos += 8 * n
        elif kind == RAWSXP:
            n = self.length()
            out = RList(self.data[self.pos : self.pos + n])
            self.pos += n
        elif kind in (STRSXP, VECSXP, EXPRSXP):
            n = self.length()
            out = RList(self.item() for _ in range(n))
        else:
            raise ValueError(f"unsupported R object type {kind} at byte {self.pos - 4}")
        if has_attr:
            attrs = self.item()
            if isinstance(attrs, _Pairlist):
                out.attributes = dict(attrs.pairs)
        return out


class _Pairlist:
    def __init__(self, pairs, attrs):
        self.pairs = pairs
        self.attrs = attrs


def unserialize(data: bytes):
    """Decode one XDR-serialized R object."""
    return _Reader(data).item()


def _decompress(blob: bytes, kind) -> bytes:
    # Every blob starts with the big-endian uncompressed length.
    (size,) = struct.unpack_from(">I", blob, 0)
    if kind in (True, 1):
        out = zlib.decompress(blob[4:])
    else:
        tag, body = blob[4:5], blob[5:]
        if tag == b"Z":
            out = zlib.decompress(body)
        elif tag == b"2":
            out = bz2.decompress(body)
        elif tag == b"X":
            out = lzma.decompress(body)
        elif tag == b"0":
            out = body
        else:
            raise ValueError(f"unknown compression tag {tag!r}")
    if len(out) != size:
        raise ValueError(f"decompressed {len(out)} bytes, expected {size}")
    return out


def read_rds(data: bytes):
    """Decode an ``.rds`` file's bytes (gzip, bzip2, xz or uncompressed)."""
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    elif data[:3] == b"BZh":
        data = bz2.decompress(data)
    elif data[:6] == b"\xfd7zXZ\x00":
        data = lzma.decompress(data)
    return unserialize(data)


def read_lazyload(prefix: str | Path) -> dict:
    """Read every object of a lazy-load database (``prefix.rdx`` + ``prefix.rdb``)."""
    prefix = Path(prefix)
    index = read_rds(prefix.with_suffix(".rdx").read_bytes())
    fields = dict(zip(index.names, index))
    compressed = fields["compressed"][0]
    db = prefix.with_suffix(".rdb").read_bytes()
    out = {}
    for name, (offset, length) in zip(fields["variables"].names, fields["variables"]):
        out[name] = unserialize(_decompress(db[offset : offset + length], compressed))
    return out
