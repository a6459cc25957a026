"""GraphCache: LRU order, counters, resize, concurrency, build errors, keys and persistence."""

from __future__ import annotations

import collections
import logging
import threading
import time
from pathlib import Path

import pytest
import torch

import cudnn_attn as ca
from cudnn_attn.graphs import cache as cache_mod
from cudnn_attn.graphs.cache import (
    FORMAT_VERSION,
    SUFFIX,
    GraphCache,
    clear_dir,
    cudnn_versions,
    default_cache_dir,
    encode_key,
    make_key,
    register_deserializer,
)

ENV = {"gpu_name": "Test GPU", "compute_capability": "9.0", "sm_count": 132,
       "cudnn_backend": 92800, "cudnn_frontend": "1.32.0"}
WAIT = 10.0  # seconds: generous upper bound for events that should fire at once


class Blob:
    """A small serializable value standing in for a cuDNN plan (those serialize only on a GPU)."""

    serial_kind = "test-blob"

    def __init__(self, data: bytes):
        self.data = data

    def serialize(self) -> bytes:
        return self.data

    @classmethod
    def from_bytes(cls, data: bytes) -> Blob:
        if data.startswith(b"BAD"):
            raise ValueError("unparseable blob")
        return cls(data)


register_deserializer(Blob.serial_kind, Blob.from_bytes)


class Unserializable:
    serial_kind = "test-blob"

    def serialize(self) -> bytes:
        raise RuntimeError("Graph::serialize: no built execution plan")


@pytest.fixture(autouse=True)
def private_cache_key(tmp_path_factory, monkeypatch):
    """Each test gets its own per-user cache key, outside any cache directory it uses."""
    key_dir = tmp_path_factory.mktemp("config")
    monkeypatch.setenv("CUDNN_ATTN_CACHE_KEY_FILE", str(key_dir / "graph-cache.key"))


def must_not_build():
    raise AssertionError("build_fn must not be called")


def wait_until(predicate, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.001)


# --------------------------------------------------------------------------------------------
# LRU, counters, resize
# --------------------------------------------------------------------------------------------


def test_lru_order_and_eviction():
    cache = GraphCache(maxsize=3)
    for key in "abc":
        assert cache.get_or_build(key, lambda key=key: key.upper()) == key.upper()
    assert cache.keys() == ["a", "b", "c"]
    assert cache.get_or_build("a", must_not_build) == "A"  # hit: a becomes most recent
    assert cache.keys() == ["b", "c", "a"]
    cache.get_or_build("d", lambda: "D")  # evicts b, the least recently used
    assert cache.keys() == ["c", "a", "d"]
    assert "b" not in cache and len(cache) == 3
    assert cache.get_or_build("b", lambda: "B2") == "B2"  # evicted: rebuilt
    info = cache.info()
    assert (info["hits"], info["misses"], info["builds"], info["evictions"]) == (1, 5, 5, 2)
    assert (info["size"], info["maxsize"]) == (3, 3)


def test_counters_and_build_seconds():
    cache = GraphCache()
    cache.get_or_build(("k", 1), lambda: time.sleep(0.02) or "v")
    for _ in range(4):
        assert cache.get_or_build(("k", 1), must_not_build) == "v"
    info = cache.info()
    assert info["hits"] == 4 and info["misses"] == 1 and info["builds"] == 1
    assert info["build_seconds"] >= 0.02
    assert info["maxsize"] == 256 and info["size"] == 1
    cache.reset_stats()
    assert cache.info()["hits"] == 0 and cache.info()["size"] == 1
    cache.clear()
    assert cache.info()["size"] == 0
    assert cache.get_or_build(("k", 1), lambda: "rebuilt") == "rebuilt"


def test_resize_evicts_least_recently_used():
    cache = GraphCache(maxsize=5)
    for i in range(5):
        cache.get_or_build(i, lambda i=i: i)
    cache.get_or_build(0, must_not_build)  # 0 is now the most recent
    cache.resize(2)
    assert cache.keys() == [4, 0] and cache.info()["evictions"] == 3 and cache.maxsize == 2
    cache.resize(0)  # storing disabled: values are still returned
    assert len(cache) == 0 and cache.get_or_build(7, lambda: 7) == 7 and 7 not in cache
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="maxsize"):
            cache.resize(bad)
    with pytest.raises(ValueError, match="maxsize"):
        GraphCache(maxsize=-2)


def test_unhashable_key_is_a_type_error():
    with pytest.raises(TypeError, match="hashable"):
        GraphCache().get_or_build(["list"], lambda: 1)


def test_hits_never_build():
    # The lookup's cost is measured by benchmarks/cpu.py; here: many hits, one build, same value.
    cache = GraphCache()
    key = make_key(("sdpa_fwd", 2, 8, 1024, 1024, 128, torch.bfloat16), "cpu")
    value = cache.get_or_build(key, lambda: object())
    assert all(cache.get_or_build(key, must_not_build) is value for _ in range(100))
    assert cache.info()["hits"] == 100 and cache.info()["builds"] == 1


# --------------------------------------------------------------------------------------------
# concurrency
# --------------------------------------------------------------------------------------------


def test_concurrent_misses_build_once_per_key():
    cache = GraphCache()
    keys, per_key = 6, 8
    release = threading.Event()
    builds = collections.Counter()
    lock = threading.Lock()
    results = []

    def build(key):
        with lock:
            builds[key] += 1
        assert release.wait(WAIT)
        return ("graph", key)

    def worker(key):
        value = cache.get_or_build(key, lambda: build(key))
        with lock:
            results.append((key, value))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(keys)
               for _ in range(per_key)]
    for t in threads:
        t.start()
    # Every thread is either building (one per key) or waiting for that build.
    wait_until(lambda: cache.info()["waits"] == keys * (per_key - 1), "all waiters")
    assert cache.info()["building"] == keys
    release.set()
    for t in threads:
        t.join(WAIT)
    assert not any(t.is_alive() for t in threads)
    assert builds == {k: 1 for k in range(keys)}
    assert sorted(results) == sorted((k, ("graph", k)) for k in range(keys) for _ in range(per_key))
    info = cache.info()
    assert (info["misses"], info["builds"], info["waits"], info["size"]) == (
        keys, keys, keys * (per_key - 1), keys)
    assert info["building"] == 0


def test_slow_build_does_not_block_other_keys():
    cache = GraphCache()
    cache.get_or_build("ready", lambda: "R")
    started, release = threading.Event(), threading.Event()

    def slow():
        started.set()
        assert release.wait(WAIT)
        return "S"

    builder = threading.Thread(target=lambda: cache.get_or_build("slow", slow))
    builder.start()
    try:
        assert started.wait(WAIT)
        answers = {}

        def other_lookups():  # a hit and a miss on other keys, while "slow" is building
            answers["hit"] = cache.get_or_build("ready", must_not_build)
            answers["miss"] = cache.get_or_build("other", lambda: "O")

        other = threading.Thread(target=other_lookups)
        other.start()
        other.join(WAIT)
        assert not other.is_alive(), "lookups of other keys waited for an unrelated build"
        assert answers == {"hit": "R", "miss": "O"} and not release.is_set()
        assert cache.info()["building"] == 1
    finally:
        release.set()
        builder.join(WAIT)
    assert cache.get_or_build("slow", must_not_build) == "S"


def test_build_error_reaches_every_waiter_and_is_not_cached():
    cache = GraphCache()
    release = threading.Event()
    calls = []

    class Declined(RuntimeError):
        pass

    def failing():
        calls.append(1)
        assert release.wait(WAIT)
        raise Declined("no engine")

    errors = []

    def worker():
        try:
            cache.get_or_build("k", failing)
        except Declined as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(5)]
    for t in threads:
        t.start()
    wait_until(lambda: cache.info()["waits"] == 4, "the waiters")
    release.set()
    for t in threads:
        t.join(WAIT)
    assert len(errors) == 5 and len(calls) == 1
    info = cache.info()
    assert info["build_errors"] == 1 and info["size"] == 0 and info["building"] == 0
    assert "k" not in cache
    assert cache.get_or_build("k", lambda: "ok") == "ok"  # the failure was not cached
    assert cache.info()["builds"] == 2


def test_build_that_asks_for_its_own_key_raises_instead_of_deadlocking():
    cache = GraphCache()
    release = threading.Event()
    seen: dict = {}

    def recursive():
        try:
            cache.get_or_build("self", lambda: "inner")
        except RuntimeError as exc:
            seen["inner"] = exc
        assert release.wait(WAIT)  # hold the build while another thread waits on it
        return "outer"

    results: dict = {}

    def run(name):
        results[name] = cache.get_or_build("self", recursive)

    owner = threading.Thread(target=run, args=("owner",), daemon=True)
    owner.start()
    wait_until(lambda: "inner" in seen, "the recursive lookup to fail")
    waiter = threading.Thread(target=run, args=("waiter",), daemon=True)
    waiter.start()
    wait_until(lambda: cache.info()["waits"] == 1, "another thread to wait on the key")
    release.set()
    for t in (owner, waiter):
        t.join(WAIT)
        assert not t.is_alive(), "get_or_build deadlocked"
    assert "'self'" in str(seen["inner"]) and "its own key" in str(seen["inner"])
    assert results == {"owner": "outer", "waiter": "outer"}
    assert cache.info()["builds"] == 1 and cache.get_or_build("self", must_not_build) == "outer"
    # uncaught, the error reaches the caller (and the key is not cached)
    fresh = GraphCache()
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("r", _catch(
        lambda: fresh.get_or_build("k", lambda: fresh.get_or_build("k", lambda: 1)))), daemon=True)
    t.start()
    t.join(WAIT)
    assert not t.is_alive(), "get_or_build deadlocked"
    assert isinstance(box["r"], RuntimeError) and "k" not in fresh


def _catch(fn):
    try:
        return fn()
    except Exception as exc:
        return exc


# --------------------------------------------------------------------------------------------
# keys
# --------------------------------------------------------------------------------------------


def problem_key(mask=None, dtype=torch.float16, seq=64):
    q = torch.empty(1, 2, seq, 64, dtype=dtype)
    return ca.AttnProblem.from_tensors(q, q, q, mask=mask).plan_key


def test_make_key_adds_device_and_versions():
    pk = problem_key(ca.Causal())
    key = make_key(pk, "cpu")
    assert key == (pk, torch.device("cpu"), cudnn_versions())
    assert make_key(pk, "cuda") == make_key(pk, "cuda:0")  # on a 1-GPU (or no-GPU) process
    assert make_key(pk, "cuda:1") != make_key(pk, "cuda:0")
    assert make_key(pk, "cpu", versions=(1, "x")) != make_key(pk, "cpu", versions=(2, "x"))
    with pytest.raises(TypeError, match="problem_key"):
        make_key([1, 2], "cpu")
    backend, frontend = cudnn_versions()
    assert backend is None or isinstance(backend, int)
    assert frontend is None or isinstance(frontend, str)


def test_encode_key_is_canonical_and_distinguishing():
    keys = [problem_key(), problem_key(ca.Causal()), problem_key(ca.Causal("bottom_right")),
            problem_key(ca.SlidingWindow(8, 0)), problem_key(dtype=torch.bfloat16),
            problem_key(seq=128), (1,), (1.0,), (True,), ("1",), (None,), (frozenset({1, 2}),)]
    texts = [encode_key(make_key(k, "cpu")) for k in keys]
    assert len(set(texts)) == len(texts)
    assert encode_key(make_key(problem_key(ca.Causal()), "cpu")) == texts[1]  # deterministic
    assert encode_key((float("nan"), float("inf"))) == encode_key((float("nan"), float("inf")))
    with pytest.raises(TypeError, match="cannot encode"):
        encode_key((object(),))


# --------------------------------------------------------------------------------------------
# persistence
# --------------------------------------------------------------------------------------------


def saved_cache(tmp_path: Path, n: int = 3) -> tuple[list, Path]:
    cache = GraphCache(environment=lambda: dict(ENV))
    keys = [make_key(problem_key(ca.Causal(), seq=64 * (i + 1)), "cuda:0", (92800, "1.32.0"))
            for i in range(n)]
    for i, key in enumerate(keys):
        cache.get_or_build(key, lambda i=i: Blob(b"plan-%d" % i + bytes(range(256))))
    cache.get_or_build(("plain", "int"), lambda: 42)  # no serialize(): skipped
    cache.get_or_build(("no", "gpu"), Unserializable)  # serialize() raises: skipped
    directory = tmp_path / "graphs"
    assert cache.save(directory) == n
    assert len(list(directory.glob("*" + SUFFIX))) == n
    return keys, directory


def test_save_load_round_trip(tmp_path):
    keys, directory = saved_cache(tmp_path)
    fresh = GraphCache(environment=lambda: dict(ENV))
    assert fresh.load(directory) == 3
    assert fresh.info()["stored"] == 3 and fresh.info()["size"] == 0
    for i, key in enumerate(keys):
        value = fresh.get_or_build(key, must_not_build)
        assert isinstance(value, Blob) and value.data == b"plan-%d" % i + bytes(range(256))
    info = fresh.info()
    assert (info["loads"], info["builds"], info["misses"], info["rejected_files"]) == (3, 0, 3, 0)
    assert fresh.get_or_build(keys[0], must_not_build).data.startswith(b"plan-0")
    assert fresh.info()["hits"] == 1
    # What was loaded and used can be saved again, byte for byte.
    again = tmp_path / "again"
    assert fresh.save(again) == 3
    assert sorted(p.read_bytes() for p in again.iterdir()) == sorted(
        p.read_bytes() for p in directory.iterdir())


def test_file_holds_json_header_and_no_pickle(tmp_path):
    keys, directory = saved_cache(tmp_path, n=1)
    data = next(directory.iterdir()).read_bytes()
    assert data.startswith(cache_mod.MAGIC)
    assert encode_key(keys[0]).encode() in data.replace(b'\\"', b'"')
    assert b"Test GPU" in data and b"test-blob" in data
    here = Path(cache_mod.__file__).parent
    for name in ("cache.py", "cache_files.py", "buckets.py"):
        text = (here / name).read_text()
        assert "import pickle" not in text and "pickle." not in text


def rejected(tmp_path, directory: Path, env: dict, caplog, match: str):
    """Load ``directory`` into a fresh cache: the file is rejected, and the entry is rebuilt."""
    fresh = GraphCache(environment=lambda: env)
    with caplog.at_level(logging.WARNING, logger="cudnn_attn"):
        assert fresh.load(directory) == 0
    assert fresh.info()["rejected_files"] == 1
    assert match in caplog.text and "rebuilt" in caplog.text
    return fresh


@pytest.mark.parametrize("damage, match", [
    (lambda d: d[:-40], "checksum"),  # truncated
    (lambda d: d[:20], "truncated"),
    (lambda d: d[:-100] + bytes([d[-100] ^ 1]) + d[-99:], "checksum"),  # payload bit flip
    (lambda d: d[:-1] + bytes([d[-1] ^ 0xFF]), "checksum"),  # digest damaged
    (lambda d: b"X" + d[1:], "bad magic"),
    (lambda d: d[:16] + (FORMAT_VERSION + 1).to_bytes(4, "little") + d[20:], "format version"),
    (lambda d: b"", "bad magic"),
])
def test_corrupt_files_are_rejected_and_rebuilt(tmp_path, caplog, damage, match):
    keys, directory = saved_cache(tmp_path, n=1)
    path = next(directory.iterdir())
    path.write_bytes(damage(path.read_bytes()))
    fresh = rejected(tmp_path, directory, dict(ENV), caplog, match)
    assert fresh.get_or_build(keys[0], lambda: "rebuilt") == "rebuilt"
    assert fresh.info()["builds"] == 1 and fresh.info()["loads"] == 0


@pytest.mark.parametrize("field, value", [("gpu_name", "Other GPU"), ("compute_capability", "8.0"),
                                          ("sm_count", 114), ("cudnn_backend", 91000),
                                          ("cudnn_frontend", "1.31.0")])
def test_foreign_files_are_rejected(tmp_path, caplog, field, value):
    keys, directory = saved_cache(tmp_path, n=1)
    fresh = rejected(tmp_path, directory, {**ENV, field: value}, caplog, field)
    assert "another environment" in caplog.text
    assert fresh.get_or_build(keys[0], lambda: "rebuilt") == "rebuilt"


def test_header_tampering_with_a_valid_checksum_is_still_foreign(tmp_path, caplog):
    _, directory = saved_cache(tmp_path, n=1)
    path = next(directory.iterdir())
    secret = cache_mod.secret_key()
    kind, key_text, payload = cache_mod.decode_file(path.read_bytes(), ENV, secret)
    path.write_bytes(cache_mod.encode_file({**ENV, "sm_count": 1}, kind, key_text, payload, secret))
    rejected(tmp_path, directory, dict(ENV), caplog, "sm_count")


def test_failing_or_unknown_deserializer_rebuilds(tmp_path, caplog):
    cache = GraphCache(environment=lambda: dict(ENV))
    cache.get_or_build("bad", lambda: Blob(b"BAD payload"))

    class Orphan(Blob):
        serial_kind = "never-registered"

    cache.get_or_build("orphan", lambda: Orphan(b"x"))
    assert cache.save(tmp_path) == 2
    fresh = GraphCache(environment=lambda: dict(ENV))
    assert fresh.load(tmp_path) == 2  # both files are sound; the values fail at first use
    with caplog.at_level(logging.WARNING, logger="cudnn_attn"):
        assert fresh.get_or_build("bad", lambda: "rebuilt") == "rebuilt"
        assert fresh.get_or_build("orphan", lambda: "rebuilt2") == "rebuilt2"
    assert "unparseable blob" in caplog.text and "never-registered" in caplog.text
    assert fresh.info()["rejected_files"] == 2 and fresh.info()["builds"] == 2


def test_load_of_missing_dir_and_clear_dir(tmp_path):
    assert GraphCache().load(tmp_path / "absent") == 0
    _, directory = saved_cache(tmp_path, n=2)
    (directory / "notes.txt").write_text("keep me")
    assert clear_dir(directory) == 2
    assert [p.name for p in directory.iterdir()] == ["notes.txt"]
    assert clear_dir(tmp_path / "absent") == 0


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDNN_ATTN_CACHE_DIR", str(tmp_path / "explicit"))
    assert default_cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("CUDNN_ATTN_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "cudnn_attn" / "graphs"


def test_process_wide_cache_exists():
    assert isinstance(cache_mod.graph_cache, GraphCache)
    assert set(cache_mod.graph_cache.info()) >= {"hits", "misses", "evictions", "size", "maxsize",
                                                 "build_seconds"}


def test_clear_caches_empties_the_process_wide_graph_cache():
    from cudnn_attn.core.caches import clear_caches
    from cudnn_attn.graphs.cache import graph_cache

    key = ("test-clear-caches", 1)
    graph_cache.get_or_build(key, lambda: "built")
    assert key in graph_cache
    clear_caches()
    assert key not in graph_cache
