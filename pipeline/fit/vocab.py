"""A categorical column's vocabulary: its kept values in id order, their 64-bit hashes and a hash index
that maps text to ids, stored in an Arrow IPC file beside the fitted state's small JSON.

At click-through-rate scale a vocabulary is millions of values a column (Criteo 1TB keeps 178M after a
frequency threshold of 3), so it is never a Python object per value:

- values: an Arrow string array (value i has id i + 1; 0 is "unknown"), about 4 bytes of offset plus the
  text per value;
- hashes: FNV-1a 64 of each value's UTF-8 text (the `hash` encoding's function), uint64, 8 bytes a value;
- index: an open-addressing table of int32 positions, sized to the next power of two at or above twice
  the values (8 to 16 bytes a value), laid out by sorting the values by home slot so it is built
  vectorised (no per-value Python) and identically on every machine.

A lookup hashes the queried texts (vectorised), probes the table a few slots at a time for every row at
once, then compares the texts of the candidates with the queried texts, so a hash collision can never
give a wrong id. It costs about one microsecond a row at 4M values where `pyarrow.compute.index_in`
rebuilds its hash table over the whole vocabulary at every call.

Built once per process: on the driver when fitted or loaded; in Ray tasks and Ray Train workers from the
object store (`share`), so the ranks of a node map the same pages instead of each holding a copy; in
torchrun processes from the memory-mapped file. See docs/preprocessing.md for the memory a vocabulary costs.
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from typing import Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..errors import PipelineError

FILE_FORMAT = "pipeline.Vocabularies/1"
_CHUNK = 1 << 20  # values hashed at a time (a slice's text stays under 2 GiB for string offsets)


class Vocabulary(Sequence[str]):
    """A column's kept values in id order (value i has id i + 1), with the hash index of `ids`. Reads as
    a sequence of str (`len`, indexing, iteration, == a tuple); `values` is the Arrow array."""

    __slots__ = ("values", "_hashes", "_index", "_lock", "_ref", "__weakref__")

    def __init__(self, values: pa.Array | Sequence[str] = (), hashes: np.ndarray | None = None,
                 index: np.ndarray | None = None):
        if not isinstance(values, (pa.Array, pa.ChunkedArray)):
            values = pa.array(list(values), pa.string())
        if isinstance(values, pa.ChunkedArray):
            values = values.combine_chunks() if values.num_chunks != 1 else values.chunk(0)
        if pa.types.is_dictionary(values.type):
            values = values.dictionary_decode()
        if not (pa.types.is_string(values.type) or pa.types.is_large_string(values.type)):
            values = values.cast(pa.large_string() if values.nbytes >= 2**31 else pa.string())
        self.values: pa.Array = values
        self._hashes, self._index = hashes, index
        self._lock = threading.Lock()
        self._ref = None  # ray ObjectRef of (values, hashes, index) once shared

    # -- a sequence of str ---------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self.values[i].to_pylist()
        return self.values[i].as_py()

    def __iter__(self) -> Iterator[str]:
        for start in range(0, len(self.values), 65_536):
            yield from self.values.slice(start, 65_536).to_pylist()

    def __contains__(self, value: object) -> bool:
        return isinstance(value, str) and bool(self.ids(pa.array([value], pa.string()))[0])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Vocabulary):
            return len(self) == len(other) and self.values.cast(pa.large_string()).equals(
                other.values.cast(pa.large_string()))
        if isinstance(other, (tuple, list)):
            return len(self) == len(other) and list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        head = ", ".join(repr(v) for v in self[:5])
        return f"Vocabulary({len(self):,} values: {head}{', ...' if len(self) > 5 else ''})"

    # -- the index ------------------------------------------------------------------------------

    @property
    def hashes(self) -> np.ndarray:
        if self._hashes is None:
            self._hashes = value_hashes(self.values)
        return self._hashes

    @property
    def index(self) -> np.ndarray:
        """The open-addressing table (built on first use, once per process)."""
        if self._index is None:
            with self._lock:
                if self._index is None:
                    self._index = build_index(self.hashes)
        return self._index

    def ids(self, strings: pa.Array) -> np.ndarray:
        """int32 [n]: each text's id (position + 1), 0 for a null or a value not kept. strings: a
        string array (as columns.as_string gives)."""
        out = np.zeros(len(strings), np.int32)
        if not len(strings) or not len(self):
            return out
        from .transforms import fnv1a

        h, valid = fnv1a(strings)
        rows = np.flatnonzero(valid)
        every = len(rows) == len(strings)  # (a dictionary's entries: no copy)
        pos = self.positions(strings if every else strings.take(pa.array(rows)), h if every else h[rows])
        found = pos >= 0
        out[rows[found]] = pos[found] + 1
        return out

    def positions(self, strings: pa.Array, h: np.ndarray) -> np.ndarray:
        """int64 [n]: each (non-null) text's position, -1 where it is not kept; h: their FNV-1a hashes."""
        out = np.full(len(strings), -1, np.int64)
        if not len(strings) or not len(self):
            return out
        rows = np.arange(len(strings))
        slot = (h & np.uint64(index_size(len(self)) - 1)).astype(np.int64)
        while rows.size:  # rows whose hash matched a value with other text (a collision) probe on
            pos, slot = probe(self.index, self.hashes, h[rows], slot)
            found = pos >= 0
            rows, pos, slot = rows[found], pos[found], slot[found]
            if not rows.size:
                break
            got = self.values.take(pa.array(pos))
            asked = strings if len(rows) == len(strings) else strings.take(pa.array(rows))  # (every row: no copy)
            if got.type != asked.type:
                got = got.cast(asked.type)
            same = pc.equal(asked, got).to_numpy(zero_copy_only=False)
            out[rows[same]] = pos[same]
            rows, slot = rows[~same], slot[~same] + 1
        return out

    @property
    def digest(self) -> str:
        """A content digest (sizes and hashes)."""
        d = hashlib.blake2b(digest_size=16)
        d.update(len(self).to_bytes(8, "little"))
        d.update(memoryview(np.ascontiguousarray(self.hashes)).cast("B"))
        return d.hexdigest()

    @property
    def nbytes(self) -> int:
        """Bytes this vocabulary takes in memory with its index: values, hashes, table."""
        return self.values.nbytes + 8 * len(self) + 4 * index_size(len(self))

    # -- sharing through Ray's object store ------------------------------------------------------

    def share(self) -> "Vocabulary":
        """Put values, hashes and index in Ray's object store once, so that pickling this vocabulary
        (into Ray tasks and Ray Train workers) sends a reference and each process maps the node's one
        copy. Needs a connected Ray."""
        if self._ref is None:
            import ray

            self._ref = (ray.put((self.values, self.hashes, self.index)), _ray_job())
        return self

    def unshared(self) -> "Vocabulary":
        """The same values, pickled by value (for a plan saved to a file)."""
        return Vocabulary(self.values, self._hashes, self._index)

    def __reduce__(self):
        if self._ref is not None and self._ref[1] == _ray_job():  # the Ray it was put in, still connected
            return _shared, self._ref
        return Vocabulary, (self.values, self._hashes, self._index)


def _ray_job() -> str | None:
    """The connected Ray job's id, None without Ray: a reference is only sent within its job."""
    import sys

    if "ray" not in sys.modules:
        return None
    import ray

    return ray.get_runtime_context().get_job_id() if ray.is_initialized() else None


_SHARED: "weakref.WeakValueDictionary[bytes, Vocabulary]" = weakref.WeakValueDictionary()
_SHARED_LOCK = threading.Lock()


def _shared(ref, job: str | None) -> Vocabulary:
    """A shared vocabulary in this process: one object per reference while anything here uses it, its
    arrays read without a copy from the object store."""
    key = ref.binary()
    with _SHARED_LOCK:
        v = _SHARED.get(key)
        if v is None:
            import ray

            values, hashes, index = ray.get(ref)
            v = Vocabulary(values, hashes, index)
            v._ref = (ref, job)
            _SHARED[key] = v
    return v


# ---------------------------------------------------------------------------------------------
# Hashing and the open-addressing table


def value_hashes(values: pa.Array) -> np.ndarray:
    """FNV-1a 64 of every value's text, a slice at a time."""
    from .transforms import fnv1a

    out = np.empty(len(values), np.uint64)
    for start in range(0, len(values), _CHUNK):
        part = values.slice(start, _CHUNK)
        if pa.types.is_large_string(part.type):
            part = part.cast(pa.string())
        out[start:start + len(part)] = fnv1a(part)[0]
    return out


def partition_of(h: np.ndarray, partitions: int) -> np.ndarray:
    """int64 [n]: the hash range of each 64-bit hash: floor(h * P / 2**64), on the high 32 bits (the
    low bits pick a vocabulary's index slot; see build_index): the count shuffle's ranges and the
    partitioned vocabulary's parts."""
    return (((h >> np.uint64(32)) * np.uint64(partitions)) >> np.uint64(32)).astype(np.int64)


def index_size(n: int) -> int:
    """Home slots for n values: the next power of two at or above 2n (at least 2)."""
    return 1 << max(1, int(2 * n - 1).bit_length()) if n else 2


def build_index(hashes: np.ndarray) -> np.ndarray:
    """int32 table: slot -> position of the value there, -1 empty. Value i's home slot is its hash
    modulo the (power of two) size; values are placed in order of home slot (ties by position), each in
    the first free slot at or after its home, which sorting makes one cumulative maximum: slot_k =
    k + max_{j<=k}(home_j - j). The table runs past the last home slot by the longest displacement
    instead of wrapping around, so a probe never wraps either."""
    n = len(hashes)
    size = index_size(n)
    home = (hashes & np.uint64(size - 1)).astype(np.int64)
    order = np.lexsort((np.arange(n), home))
    k = np.arange(n, dtype=np.int64)
    slot = np.maximum.accumulate(home[order] - k) + k if n else k
    table = np.full(max(size, int(slot[-1]) + 1 if n else 0) + 1, -1, np.int32)  # one empty slot at the end
    table[slot] = order.astype(np.int32)
    return table


def probe(table: np.ndarray, hashes: np.ndarray, h: np.ndarray, slot: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(position, slot) int64 [n]: linear probing from `slot` to the first value whose hash equals h
    (position -1 where an empty slot comes first), and the slot it was found in."""
    # The first step for every row at once, without the bookkeeping of the rows still probing (most
    # rows end here: the table is at most half full)
    at = table[slot]
    filled = at >= 0
    hit = filled & (hashes[np.where(filled, at, 0)] == h)
    pos = np.where(hit, at, -1).astype(np.int64)
    at_slot = slot.copy()
    todo = np.flatnonzero(filled & ~hit)
    slot = slot[todo] + 1
    while todo.size:
        at = table[slot]
        filled = at >= 0
        hit = filled & (hashes[np.where(filled, at, 0)] == h[todo])
        pos[todo[hit]], at_slot[todo[hit]] = at[hit], slot[hit]
        go_on = filled & ~hit
        todo, slot = todo[go_on], slot[go_on] + 1
    return pos, at_slot


# ---------------------------------------------------------------------------------------------
# The file: one record batch {value, hash} per categorical column, in column order


def digest(vocabs: Sequence) -> str:
    """A content digest of the vocabularies (each one's digest): names the file and ties the JSON to it.
    (Before version 5 it hashed the sizes and hashes directly; a saved fit keeps the digest it was saved
    with, so older files still load.)"""
    d = hashlib.blake2b(digest_size=16)
    for v in vocabs:
        d.update(v.digest.encode())
    return d.hexdigest()


def write(uri: str, vocabs: Sequence[Vocabulary], names: Sequence[str], tag: str) -> None:
    """The vocabularies as an Arrow IPC file (uncompressed, so it can be memory-mapped), written to a
    temporary name and moved into place."""
    from .. import storage

    fs, path = storage.filesystem(uri)
    text = pa.string() if all(v.values.nbytes < 2**31 for v in vocabs) else pa.large_string()  # as read: no cast
    schema = pa.schema([("value", text), ("hash", pa.uint64())],
                       metadata={"format": FILE_FORMAT, "digest": tag, "columns": ",".join(names)})
    tmp = f"{path}.tmp"
    if "/" in path:
        fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
    with fs.open_output_stream(tmp) as out, pa.ipc.new_file(out, schema) as w:
        for v in vocabs:
            w.write_batch(pa.record_batch([v.values.cast(text), pa.array(v.hashes, pa.uint64())], schema=schema))
    fs.move(tmp, path)


def read(uri: str, sizes: Sequence[int], tag: str, json_uri: str) -> tuple[Vocabulary, ...]:
    """The vocabularies of a saved fit: memory-mapped when the file is local (the pages are shared by
    every process of the machine that reads it), read whole otherwise. Refused in one paragraph when
    the file is missing or belongs to another fit."""
    from .. import storage

    try:
        reader = storage.open_arrow_file(uri)
    except (OSError, pa.ArrowInvalid) as e:
        raise PipelineError(f"'{json_uri}' keeps its vocabularies in '{uri}', which cannot be read ({e}). Copy the "
                            f"file with the JSON (they belong together), or fit again") from None
    meta = {k.decode(): v.decode() for k, v in (reader.schema.metadata or {}).items()}
    if meta.get("digest") != tag or reader.num_record_batches != len(sizes):
        raise PipelineError(f"'{uri}' holds other vocabularies (digest {meta.get('digest')!r}) than '{json_uri}' was "
                            f"saved with ({tag!r}): the ids would be wrong. Copy the vocabulary file saved with that "
                            f"JSON beside it, or fit again")
    out = []
    for i, n in enumerate(sizes):
        b = reader.get_batch(i)
        if b.num_rows != n:
            raise PipelineError(f"'{uri}' holds {b.num_rows:,} values for categorical column {i}, where '{json_uri}' "
                                f"says {n:,}: the file is damaged or from another fit; fit again")
        out.append(Vocabulary(b.column(0), b.column(1).to_numpy()))
    return tuple(out)


def file_name(tag: str) -> str:
    return f"vocab-{tag}.arrow"
