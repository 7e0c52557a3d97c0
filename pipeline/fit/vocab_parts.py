"""The vocabularies of a fit by the partitioned count shuffle (counts.py): one part per hash range.

Part q holds, for every vocabulary column, the values whose hash falls in range q, with their hashes,
global ids and a hash index (vocab.py's structures, per part). `Parts` holds a fit's parts, as Ray
objects, files or in memory, and loads each on its first lookup; `PartedVocabulary` is one column's
vocabulary over them, sending each looked-up value to its range's part. Saved, the parts are
`vocab-<digest>/part-<q>.arrow` and `.index.arrow`, memory-mapped when loaded.
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from typing import Any, Iterator, Sequence

import numpy as np
import pyarrow as pa

from ..errors import PipelineError
from .vocab import _SHARED_LOCK, Vocabulary, _ray_job, index_size, partition_of


PARTS_FORMAT = "pipeline.VocabularyParts/1"


class Parts:
    """The P parts of a fit's vocabularies, shared by its columns. Part q holds, for every vocabulary
    column, the values whose hash falls in range q: {column: (values, hashes, ids int32, index)}.

    Each part is, in this order of preference: a Ray object (the reducer that built it returned it,
    so it lives in the object store of the node it ran on; a process maps its node's copy, and
    pickling sends the reference); a part file (a saved fit, memory-mapped when local); or the part
    itself (a fit without Ray). A part is loaded on the first lookup of one of its values."""

    __slots__ = ("sources", "job", "backup", "_loaded", "_lock", "__weakref__")

    def __init__(self, sources: Sequence, job: str | None = None, backup: Sequence | None = None):
        self.sources = list(sources)
        # the Ray job whose object store holds the parts (sources are ObjectRefs)
        self.job = job if job is not None or not any(_is_ref(s) for s in self.sources) else _ray_job()
        # what stands in for the Ray objects once their session has ended (keep_beyond_session): per part its
        # file, or the part itself where the parts are small; None: nothing (the plan must be saved before)
        self.backup = list(backup) if backup is not None else None
        self._loaded: dict[int, dict] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.sources)

    @property
    def live(self) -> bool:
        """The parts' Ray objects can be read here: their job is the one this process is connected to."""
        return self.job is not None and self.job == _ray_job()

    def source(self, q: int):
        """Where part q is read from: its Ray object while that session lives, else what was kept beside it."""
        s = self.sources[q]
        if not _is_ref(s) or self.live:
            return s
        if self.backup is None:
            raise PipelineError(
                "the vocabularies of this plan (or fitted state) lived in the object store of a Ray session that has "
                "ended, and no copy was kept: they cannot be read any more. Save the plan (plan.save) or the fitted "
                "state (plan.fitted.save) before ray.shutdown(), or prepare again")
        return self.backup[q]

    def part(self, q: int) -> dict:
        got = self._loaded.get(q)
        if got is None or (got[0] and not self.live):  # read from a Ray object whose session has ended: read again
            with self._lock:
                got = self._loaded.get(q)
                if got is None or (got[0] and not self.live):
                    source = self.source(q)
                    got = self._loaded[q] = (_is_ref(source), _load_part(source))
        return got[1]

    def share(self) -> "Parts":
        """The parts in Ray's object store (once per Ray session): pickling then sends references. Needs a
        connected Ray."""
        if not self.live:
            import ray

            before = [self.source(q) for q in range(len(self))]  # files, parts, or another session's stand-ins
            self.sources = [ray.put(self.part(q)) for q in range(len(self))]
            self.job = _ray_job()
            if self.backup is None:
                self.backup = before
        return self

    def keep_beyond_session(self, folder_uri: str, names: Sequence[str], tag: str, inline: bool) -> None:
        """While Ray is up: keep what stands in for the parts' Ray objects once the session ends (a notebook
        saves the plan for serving after ray.shutdown()). inline (small parts): fetched into this process, a
        copy that travels with the plan; else written to part files in folder_uri (by a task on this node:
        this process never holds them), which the plan then names."""
        if self.backup is not None or not any(_is_ref(s) for s in self.sources) or not self.live:
            return
        if inline:
            import pickle

            import ray

            # a copy by value: what ray.get returns may point into the object store, which ends with the session
            self.backup = [pickle.loads(pickle.dumps(dict(p))) for p in ray.get(self.sources)]
            return
        self.write(folder_uri, names, tag)
        from .. import storage

        self.backup = [storage.join(folder_uri, f"part-{q:05d}") for q in range(len(self))]

    def unshared(self) -> "Parts":
        """The parts themselves (for a plan pickled to a file), or their files."""
        return Parts([s if isinstance(s, str) else self.part(q) for q, s in enumerate(self.sources)])

    def __reduce__(self):
        if self.job is not None and not self.live:  # references outside their session: what stands in for them
            return Parts, ([b if isinstance(b, str) else self.part(q) for q, b in
                            enumerate(self.backup or [None] * len(self))],)
        files = self.backup if self.backup is not None and all(isinstance(b, str) for b in self.backup) else None
        return Parts, (self.sources, self.job, files)  # inline copies stay here: tasks read the Ray objects

    def write(self, folder_uri: str, names: Sequence[str], tag: str) -> None:
        """Every part as two Arrow IPC files in folder_uri: part-<q>.arrow (one record batch {value, hash,
        id} per column) and part-<q>.index.arrow (the hash indexes). Under Ray a part in the object
        store is written by a task on this node, so this process never holds it."""
        from .. import storage

        paths = [storage.join(folder_uri, f"part-{q:05d}") for q in range(len(self))]
        refs = [q for q, s in enumerate(self.sources) if _is_ref(s)] if self.live else []
        if refs:
            import ray
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
            task = ray.remote(num_cpus=0, max_retries=3)(write_part).options(scheduling_strategy=here)
            ray.get([task.remote(paths[q], self.sources[q], list(names), tag) for q in refs])
        for q in sorted(set(range(len(self))) - set(refs)):
            write_part(paths[q], self.part(q), list(names), tag)


def _is_ref(s) -> bool:
    return type(s).__name__ == "ObjectRef"


_PARTS: "weakref.WeakValueDictionary[Any, _Part]" = weakref.WeakValueDictionary()


class _Part(dict):
    """A loaded part (a dict that a weak reference can point at): one per source in a process."""


def _load_part(source) -> dict:
    if isinstance(source, dict):
        return source
    key = source.binary() if _is_ref(source) else source
    with _SHARED_LOCK:
        got = _PARTS.get(key)
        if got is None:
            if _is_ref(source):
                import ray

                got = _Part(ray.get(source))
            else:
                got = _Part(read_part(source))
            _PARTS[key] = got
    return got


def write_part(path: str, part: dict, names: list[str], tag: str) -> None:
    """One part as path.arrow and path.index.arrow, each written to a temporary name and moved."""
    from .. import storage

    fs, base = storage.filesystem(path)
    if "/" in base:
        fs.create_dir(base.rsplit("/", 1)[0], recursive=True)
    text = pa.string() if all(part[c][0].nbytes < 2**31 for c in names) else pa.large_string()
    meta = {"format": PARTS_FORMAT, "digest": tag, "columns": ",".join(names)}
    schema = pa.schema([("value", text), ("hash", pa.uint64()), ("id", pa.int32())], metadata=meta)
    index = pa.schema([("index", pa.int32())], metadata=meta)
    for suffix, sch, batch in ((".arrow", schema, lambda v: [v[0].cast(text), pa.array(v[1]), pa.array(v[2])]),
                               (".index.arrow", index, lambda v: [pa.array(v[3])])):
        try:
            with fs.open_output_stream(base + suffix + ".tmp") as out, pa.ipc.new_file(out, sch) as w:
                for c in names:
                    w.write_batch(pa.record_batch(batch(part[c]), schema=sch))
            fs.move(base + suffix + ".tmp", base + suffix)
        except OSError as e:
            size = sum(part[c][0].nbytes + 16 * len(part[c][1]) for c in names)
            raise PipelineError(f"cannot write the vocabulary part '{path}{suffix}' (about {size:,} bytes of the "
                                f"fitted state): {e}. Free space there or save the run elsewhere (run.output)") from None


def read_part(path: str) -> dict:
    """A part file's {column: (values, hashes, ids, index)}: memory-mapped when local (the pages are
    shared by every process of the machine), read whole otherwise."""
    from .. import storage

    readers = []
    for suffix in (".arrow", ".index.arrow"):
        try:
            readers.append(storage.open_arrow_file(path + suffix))
        except (OSError, pa.ArrowInvalid) as e:
            raise PipelineError(f"the vocabulary part '{path}{suffix}' cannot be read ({e}). Copy the vocabulary "
                                f"folder with the fitted state's JSON (they belong together), or fit again") from None
    names = (readers[0].schema.metadata or {}).get(b"columns", b"").decode().split(",")
    out = {}
    for i, c in enumerate(n for n in names if n):
        b, x = readers[0].get_batch(i), readers[1].get_batch(i)
        out[c] = (b.column(0), b.column(1).to_numpy(), b.column(2).to_numpy(), x.column(0).to_numpy())
    return out


def part_tag(path: str) -> str | None:
    """The digest a part file was written with (its metadata), None when it cannot be read."""
    from .. import storage

    fs, base = storage.filesystem(path)
    try:
        with fs.open_input_file(base + ".arrow") as f:
            meta = pa.ipc.open_file(f).schema.metadata or {}
    except (OSError, pa.ArrowInvalid):
        return None
    return meta.get(b"digest", b"").decode()


class PartedVocabulary(Sequence[str]):
    """A categorical column's vocabulary as P parts by hash range (see counts.py): its ids are global
    (most frequent first, ties by hash), each part holds its values with their ids. A lookup hashes the
    texts, sends each to its range's part and looks it up in that part's index; only the parts a
    lookup touches are loaded.

    Reads as a sequence of str in id order like Vocabulary, but that gathers every part into this
    process: meant for small vocabularies, tests and inspection."""

    __slots__ = ("name", "parts", "sizes", "_digest", "_whole")

    def __init__(self, name: str, parts: Parts, sizes: Sequence[int], digest: str):
        self.name, self.parts, self.sizes, self._digest = name, parts, tuple(int(n) for n in sizes), digest
        self._whole: Vocabulary | None = None

    def __len__(self) -> int:
        return sum(self.sizes)

    @property
    def partitions(self) -> int:
        return len(self.sizes)

    @property
    def digest(self) -> str:
        return self._digest

    def ids(self, strings: pa.Array) -> np.ndarray:
        from .transforms import fnv1a

        out = np.zeros(len(strings), np.int32)
        if not len(strings) or not len(self):
            return out
        h, valid = fnv1a(strings)
        rows = np.flatnonzero(valid)
        q = partition_of(h[rows], self.partitions)
        order = np.argsort(q, kind="stable")
        rows, q = rows[order], q[order]
        bounds = np.searchsorted(q, np.arange(self.partitions + 1))
        for p in np.flatnonzero(np.diff(bounds)):
            if not self.sizes[p]:
                continue
            r = rows[bounds[p]:bounds[p + 1]]
            values, hashes, ids, index = self.parts.part(int(p))[self.name]
            every = len(r) == len(strings)  # one part holds them all (P = 1, no null): no copy of the texts
            pos = Vocabulary(values, hashes, index).positions(strings if every else strings.take(pa.array(r)),
                                                              h if every else h[r])
            found = pos >= 0
            out[r[found]] = ids[pos[found]]
        return out

    @property
    def nbytes(self) -> int:
        return sum(n * 16 + 4 * index_size(n) for n in self.sizes)  # about: text, offsets, hash, id, index

    # -- as a sequence (gathers the parts) -------------------------------------------------------

    def whole(self) -> Vocabulary:
        """Every value in id order, in one Vocabulary."""
        if self._whole is None:
            got = [self.parts.part(q)[self.name] for q, n in enumerate(self.sizes) if n]
            if not got:
                self._whole = Vocabulary()
            else:
                values = pa.concat_arrays([g[0].cast(pa.large_string()) for g in got])
                order = np.argsort(np.concatenate([g[2] for g in got]), kind="stable")
                self._whole = Vocabulary(values.take(pa.array(order)), np.concatenate([g[1] for g in got])[order])
        return self._whole

    @property
    def values(self) -> pa.Array:
        return self.whole().values

    @property
    def hashes(self) -> np.ndarray:
        return self.whole().hashes

    def __getitem__(self, i):
        return self.whole()[i]

    def __iter__(self) -> Iterator[str]:
        return iter(self.whole())

    def __contains__(self, value: object) -> bool:
        return isinstance(value, str) and bool(self.ids(pa.array([value], pa.string()))[0])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PartedVocabulary) and other.digest == self.digest:
            return True
        if isinstance(other, (PartedVocabulary, Vocabulary, tuple, list)):
            return len(self) == len(other) and self.whole() == (other.whole() if isinstance(other, PartedVocabulary)
                                                                  else other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"PartedVocabulary({self.name!r}: {len(self):,} values in {self.partitions} parts)"

    def share(self) -> "PartedVocabulary":
        self.parts.share()
        return self

    def unshared(self) -> "PartedVocabulary":
        return PartedVocabulary(self.name, self.parts.unshared(), self.sizes, self._digest)

    def __reduce__(self):
        return PartedVocabulary, (self.name, self.parts, self.sizes, self._digest)


INLINE_BYTES = 32 * 2**20  # vocabularies up to this size are copied into the plan when Ray's session ends


def keep_beyond_session(vocabs: Sequence, tag: str) -> None:
    """For a fit whose vocabulary parts are Ray objects: keep a stand-in for them that outlives the Ray
    session (see Parts.keep_beyond_session): in the plan up to INLINE_BYTES, else part files in a folder of
    this machine's temporary directory named by the fit's digest (pipeline-vocab/vocab-<digest>)."""
    import os
    import tempfile

    parted = [v for v in vocabs if isinstance(v, PartedVocabulary) and len(v)]
    for parts in {id(v.parts): v.parts for v in parted}.values():
        mine = [v for v in parted if v.parts is parts]
        folder = os.path.join(tempfile.gettempdir(), "pipeline-vocab", f"vocab-{tag}")
        parts.keep_beyond_session(folder, [v.name for v in mine], tag, sum(v.nbytes for v in mine) <= INLINE_BYTES)


def column_digest(partitions: int, part_digests: Sequence[str]) -> str:
    d = hashlib.blake2b(digest_size=16)
    d.update(partitions.to_bytes(8, "little"))
    for x in part_digests:
        d.update(x.encode())
    return d.hexdigest()


def as_vocabularies(items: Any) -> tuple:
    return tuple(v if isinstance(v, (Vocabulary, PartedVocabulary)) else Vocabulary(v) for v in items)
