"""A hostile graph-cache directory: links, FIFOs, devices, huge, malformed and unkeyed files,
foreign owners and modes. Nothing may hang, nothing outside the directory may change, and no
payload that did not verify may reach a deserializer."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import struct
import threading
import time

import pytest

from cudnn_attn.graphs import cache as cache_mod
from cudnn_attn import trusted_files
from cudnn_attn.graphs.cache import MAGIC, SUFFIX, GraphCache, UnsafeCacheDir, clear_dir

ENV = {"gpu_name": "Test GPU", "compute_capability": "9.0", "sm_count": 132,
       "cudnn_backend": 92800, "cudnn_frontend": "1.32.0"}
KIND = "test-hostile"
CALLS: list[bytes] = []  # every payload the deserializer saw


class Recorded:
    serial_kind = KIND

    def __init__(self, data: bytes):
        self.data = data

    def serialize(self) -> bytes:
        return self.data


def record(data: bytes) -> Recorded:
    CALLS.append(data)
    return Recorded(data)


cache_mod.register_deserializer(KIND, record)


@pytest.fixture(autouse=True)
def isolated(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("CUDNN_ATTN_CACHE_KEY_FILE",
                       str(tmp_path_factory.mktemp("config") / "graph-cache.key"))
    CALLS.clear()


def run_with_timeout(fn, seconds: float = 20.0):
    """``fn()`` in a daemon thread; fails (instead of hanging the suite) if it does not return."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as exc:  # re-raised below, in the test's thread
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{fn} did not return within {seconds} s (it hangs)"
    if "error" in box:
        raise box["error"]
    return box["value"]


def snapshot(directory):
    """Name -> (bytes, mtime) of every regular file under ``directory``."""
    out = {}
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            if os.path.isfile(path) and not os.path.islink(path):
                with open(path, "rb") as fh:
                    out[path] = (fh.read(), os.stat(path).st_mtime_ns)
    return out


def good_cache(n: int = 2) -> GraphCache:
    cache = GraphCache(environment=lambda: dict(ENV))
    for i in range(n):
        cache.get_or_build(("good", i), lambda i=i: Recorded(b"plan-%d" % i))
    return cache


def raw_file(header: object, payload: bytes = b"payload", digest: bytes | None = None,
             header_bytes: bytes | None = None) -> bytes:
    """A file with an arbitrary header, checksummed the way the old, unkeyed format did."""
    text = json.dumps(header).encode() if header_bytes is None else header_bytes
    body = MAGIC + struct.pack("<II", 1, len(text)) + text + payload
    return body + (hashlib.sha256(body).digest() if digest is None else digest)


def header(**changes) -> dict:
    base = {"format": 1, "environment": dict(ENV), "kind": KIND,
            "key": cache_mod.encode_key(("crafted",)), "payload_bytes": 7}
    return {**base, **changes}


# --------------------------------------------------------------------------------------------


@pytest.fixture
def outside(tmp_path):
    victim = tmp_path / "outside"
    victim.mkdir()
    (victim / "precious.txt").write_bytes(b"do not touch")
    return victim


def test_save_never_writes_through_a_planted_link(tmp_path, outside, monkeypatch):
    directory = tmp_path / "graphs"
    cache = good_cache(1)
    assert cache.save(directory) == 1
    (final,) = [p.name for p in directory.iterdir()]
    target = outside / "precious.txt"
    # Links at the final name and at every predictable temporary name the old code used.
    os.unlink(directory / final)
    os.symlink(target, directory / final)
    for suffix in (f".tmp{os.getpid()}.{threading.get_ident()}", ".tmp"):
        os.symlink(target, directory / (final + suffix))
    before = snapshot(outside)
    assert run_with_timeout(lambda: cache.save(directory)) == 1
    assert snapshot(outside) == before
    assert not os.path.islink(directory / final) and os.path.isfile(directory / final)
    # The temporary name is random and created exclusively: even a guessed one is not followed.
    monkeypatch.setattr(trusted_files.secrets, "token_hex", lambda n: "guessed")
    os.symlink(target, directory / f".{final}.tmpguessed")
    with pytest.raises(FileExistsError):
        cache.save(directory)
    assert snapshot(outside) == before


def hostile_directory(tmp_path, outside, monkeypatch):
    """Two good files among every kind of hostile entry; returns (directory, number of bad)."""
    directory = tmp_path / "graphs"
    assert good_cache(2).save(directory) == 2
    os.mkfifo(directory / ("fifo" + SUFFIX))
    os.symlink("/dev/zero", directory / ("zero" + SUFFIX))
    os.symlink(outside / "precious.txt", directory / ("link" + SUFFIX))
    os.symlink(tmp_path / "nowhere", directory / ("dangling" + SUFFIX))
    os.mkdir(directory / ("subdir" + SUFFIX))
    with open(directory / ("huge" + SUFFIX), "wb") as fh:  # sparse: 2 GiB of nothing on disk
        fh.truncate(2 << 30)
    with open(directory / ("junk" + SUFFIX), "wb") as fh:  # under the cap, junk from byte 0
        fh.write(b"J" * 4096)
        fh.truncate(64 << 20)
    crafted = {
        "env-list": raw_file(header(environment=[1, 2])),
        "env-str": raw_file(header(environment="gpu")),
        "env-int": raw_file(header(environment=7)),
        "env-nested": raw_file(header(environment={"gpu_name": {"a": 1}})),
        "kind-int": raw_file(header(kind=3)),
        "size-str": raw_file(header(payload_bytes="7")),
        "size-bool": raw_file(header(payload_bytes=True)),
        "size-negative": raw_file(header(payload_bytes=-1)),
        "size-huge": raw_file(header(payload_bytes=1 << 40)),
        "header-list": raw_file([1, 2, 3]),
        "header-bad-json": raw_file(None, header_bytes=b"{not json"),
        "header-bad-utf8": raw_file(None, header_bytes=b'{"kind": "\xff"}'),
        "deep-json": raw_file(None, header_bytes=b"[" * 30_000 + b"]" * 30_000),
        "deep-in-env": raw_file(None, header_bytes=b'{"environment": {"x": ' + b"[" * 30_000
                                + b"]" * 30_000 + b"}}"),
        "header-len-lies": MAGIC + struct.pack("<II", 1, 1 << 31) + b"{}" + b"\0" * 32,
        # a well-formed file for this environment, re-checksummed with the old unkeyed SHA-256:
        "rechecksummed": raw_file(header()),
    }
    for name, data in crafted.items():
        (directory / (name + SUFFIX)).write_bytes(data)
    # A file checksummed correctly, but with another user's key.
    mine = os.environ["CUDNN_ATTN_CACHE_KEY_FILE"]
    monkeypatch.setenv("CUDNN_ATTN_CACHE_KEY_FILE", str(tmp_path / "other.key"))
    other = GraphCache(environment=lambda: dict(ENV))
    other.get_or_build(("crafted", "other-key"), lambda: Recorded(b"evil"))
    other.save(tmp_path / "foreign")
    monkeypatch.setenv("CUDNN_ATTN_CACHE_KEY_FILE", mine)
    (foreign,) = (tmp_path / "foreign").iterdir()
    os.replace(foreign, directory / ("other-key" + SUFFIX))
    return directory, len(crafted) + 1 + 7


def test_hostile_directory_loads_only_verified_files(tmp_path, outside, caplog, monkeypatch):
    directory, n_bad = hostile_directory(tmp_path, outside, monkeypatch)
    reads: list[int] = []
    real_read = trusted_files.read_exact
    monkeypatch.setattr(trusted_files, "read_exact",
                        lambda fd, n: reads.append(n) or real_read(fd, n))
    before = snapshot(tmp_path / "outside")
    fresh = GraphCache(environment=lambda: dict(ENV))
    with caplog.at_level(logging.WARNING, logger="cudnn_attn"):
        loaded = run_with_timeout(lambda: fresh.load(directory))
    assert loaded == 2
    assert fresh.info()["rejected_files"] == n_bad
    assert sum(reads) < 1 << 20, "junk was read past its magic"
    for what in ("symbolic link", "not a regular file", "over the", "bad magic", "environment",
                 "nests deeper", "payload_bytes", "checksum", "must be strings"):
        assert what in caplog.text, what
    assert snapshot(tmp_path / "outside") == before
    # Only the two verified payloads ever reach the deserializer; the crafted keys rebuild.
    for i in range(2):
        assert fresh.get_or_build(("good", i), lambda: pytest.fail("rebuilt")).data == b"plan-%d" % i
    assert fresh.get_or_build(("crafted",), lambda: "rebuilt") == "rebuilt"
    assert fresh.get_or_build(("crafted", "other-key"), lambda: "rebuilt") == "rebuilt"
    assert sorted(CALLS) == [b"plan-0", b"plan-1"]


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757])
def test_directory_others_can_write_is_refused(tmp_path, caplog, mode):
    directory = tmp_path / "graphs"
    cache = good_cache(1)
    assert cache.save(directory) == 1
    os.chmod(directory, mode)
    with pytest.raises(UnsafeCacheDir, match="lets others write it; run: chmod go-w"):
        cache.save(directory)
    fresh = GraphCache(environment=lambda: dict(ENV))
    with caplog.at_level(logging.WARNING, logger="cudnn_attn"):
        assert fresh.load(directory) == 0
    assert "chmod go-w" in caplog.text and CALLS == []
    os.chmod(directory, 0o1777)  # sticky, like /tmp: nobody can replace our files
    assert fresh.load(directory) == 1


def test_directory_of_another_user_is_refused(tmp_path, caplog, monkeypatch):
    directory = tmp_path / "graphs"
    cache = good_cache(1)
    assert cache.save(directory) == 1
    if os.geteuid() == 0:
        os.chown(directory, 12345, 12345)
    else:
        monkeypatch.setattr(trusted_files, "_euid", lambda: os.geteuid() + 1)
    with pytest.raises(UnsafeCacheDir, match="owned by uid"):
        cache.save(directory)
    with caplog.at_level(logging.WARNING, logger="cudnn_attn"):
        assert GraphCache(environment=lambda: dict(ENV)).load(directory) == 0
    assert "owned by uid" in caplog.text and CALLS == []


def test_key_file_is_private_and_outside_the_directory(tmp_path, monkeypatch):
    key_path = tmp_path / "config" / "graph-cache.key"
    monkeypatch.setenv("CUDNN_ATTN_CACHE_KEY_FILE", str(key_path))
    directory = tmp_path / "graphs"
    assert good_cache(1).save(directory) == 1
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600 and key_path.stat().st_size == 32
    assert not any(p.name.endswith(".key") for p in directory.iterdir())
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    # default location: the user's config dir, not the cache dir
    monkeypatch.delenv("CUDNN_ATTN_CACHE_KEY_FILE")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert trusted_files.secret_key_path() == tmp_path / "xdg" / "cudnn_attn" / "graph-cache.key"
    # a key others can read is refused, as is a link
    for bad in ("readable", "link"):
        path = tmp_path / bad / "graph-cache.key"
        path.parent.mkdir()
        if bad == "readable":
            path.write_bytes(b"k" * 32)
            os.chmod(path, 0o644)
        else:
            path.symlink_to(key_path)
        monkeypatch.setenv("CUDNN_ATTN_CACHE_KEY_FILE", str(path))
        with pytest.raises(UnsafeCacheDir):
            good_cache(1).save(directory)
        assert GraphCache(environment=lambda: dict(ENV)).load(directory) == 0


def test_clear_dir_removes_only_graph_files_and_never_follows_links(tmp_path, outside,
                                                                     monkeypatch):
    directory, _ = hostile_directory(tmp_path, outside, monkeypatch)
    (directory / "notes.txt").write_text("keep")
    before = snapshot(outside)
    removed = run_with_timeout(lambda: clear_dir(directory))
    assert removed > 2
    assert sorted(p.name for p in directory.iterdir()) == ["notes.txt", "subdir" + SUFFIX]
    assert snapshot(outside) == before


def test_save_and_load_take_no_time_on_a_fifo(tmp_path):
    directory = tmp_path / "graphs"
    directory.mkdir()
    os.mkfifo(directory / ("a" + SUFFIX))
    start = time.monotonic()
    assert run_with_timeout(lambda: GraphCache().load(directory), 10) == 0
    assert time.monotonic() - start < 10
