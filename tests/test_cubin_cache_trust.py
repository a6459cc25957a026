"""CPU: a hostile cubin cache directory (``fallback_kernels.cubin_cache``, GPU code loaded as a
kernel) under the graph cache's trust model (``cudnn_attn.trusted_files``).

No compiler needed: entries are made with the module's own ``store`` (the positive control: a
signed entry of this user loads) and then forged, replaced or surrounded. Nothing unverified is
loaded, nothing blocks (each load runs under a deadline), nothing raises into the compile path.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
import threading

import pytest

from cudnn_attn import trusted_files
from cudnn_attn.fallback_kernels import cubin_cache as C

KEY = "ab" * 32
EXPRESSIONS = ("kernel<float>",)
CUBIN = b"\x7fELF" + bytes(range(256)) * 4
LOWERED = {"kernel<float>": "_Z6kernelIfEvv"}


@pytest.fixture
def directory(tmp_path, monkeypatch):
    """An empty cache directory of ours (``0700``) and a private key file outside it."""
    monkeypatch.setenv("CUDNN_ATTN_CACHE_KEY_FILE", str(tmp_path / "config" / "key"))
    d = tmp_path / "cubins"
    monkeypatch.setenv("CUDNN_ATTN_CUBIN_CACHE", str(d))
    return d


def _load(directory, key=KEY, timeout=10.0):
    """``cubin_cache.load`` under a deadline: a blocked open fails the test, never hangs it."""
    result, errors = [], []

    def run():
        try:
            result.append(C.load(key, EXPRESSIONS, directory))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout)
    assert not worker.is_alive(), "cubin_cache.load blocked"
    assert not errors, f"cubin_cache.load raised {errors[0]!r}"
    return result[0]


def _entry(directory, key=KEY):
    return directory / (key + C.SUFFIX)


def _rejected_since(before):
    return C.info()["rejected"] - before


def test_a_signed_entry_of_this_user_loads(directory):
    assert C.store(KEY, CUBIN, LOWERED, "ptxas log", directory)
    assert oct(directory.stat().st_mode & 0o777) == "0o700"
    assert _load(directory) == (CUBIN, LOWERED, "ptxas log")


def _plain_sha256_entry(key, cubin, lowered, log, version):
    """An entry as the old format wrote it: anyone who can write the directory can make one."""
    header = json.dumps({"key": key, "lowered": lowered, "log": log, "cubin_bytes": len(cubin)},
                        sort_keys=True).encode()
    body = C.MAGIC + struct.pack(">II", version, len(header)) + header + cubin
    return body + hashlib.sha256(body).digest()


@pytest.mark.parametrize("version", [1, C.FORMAT_VERSION])
def test_a_forged_entry_with_a_correct_sha256_is_not_loaded(directory, version):
    assert C.store(KEY, CUBIN, LOWERED, "", directory)
    forged = b"\x7fELF" + b"\xcc" * 1024  # not our cubin
    _entry(directory).write_bytes(_plain_sha256_entry(KEY, forged, LOWERED, "", version))
    before = C.info()["rejected"]
    assert _load(directory) is None
    assert _rejected_since(before) == 1


def test_an_entry_signed_with_another_key_is_not_loaded(directory, tmp_path, monkeypatch):
    other = tmp_path / "other"
    monkeypatch.setenv("CUDNN_ATTN_CACHE_KEY_FILE", str(tmp_path / "other-key"))
    assert C.store(KEY, b"\x7fELF other user's code", LOWERED, "", other)
    monkeypatch.setenv("CUDNN_ATTN_CACHE_KEY_FILE", str(tmp_path / "config" / "key"))
    directory.mkdir(mode=0o700)
    _entry(directory).write_bytes(_entry(other).read_bytes())
    assert _load(directory) is None


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o777])
def test_a_directory_others_may_write_is_not_used(directory, mode):
    assert C.store(KEY, CUBIN, LOWERED, "", directory)
    os.chmod(directory, mode)
    assert _load(directory) is None  # a verified entry, but others could have swapped it
    assert not C.store("cd" * 32, CUBIN, LOWERED, "", directory)
    assert C.clear(directory) == 0 and _entry(directory).exists()


def test_a_file_owned_by_another_user_is_not_loaded(directory, monkeypatch):
    assert C.store(KEY, CUBIN, LOWERED, "", directory)
    if os.geteuid() == 0:
        os.chown(_entry(directory), 12345, 12345)
    else:  # the directory stays ours; only the file's owner check sees another uid
        real = trusted_files._regular

        def foreign(fd, max_bytes, owned):
            st = os.fstat(fd)
            if owned and stat.S_ISREG(st.st_mode):
                raise trusted_files.Rejected(f"owned by uid {st.st_uid + 1}")
            return real(fd, max_bytes, owned)

        monkeypatch.setattr(trusted_files, "_regular", foreign)
    before = C.info()["rejected"]
    assert _load(directory) is None
    assert _rejected_since(before) == 1


def test_a_directory_owned_by_another_user_is_not_used(directory, monkeypatch):
    assert C.store(KEY, CUBIN, LOWERED, "", directory)
    if os.geteuid() == 0:
        os.chown(directory, 12345, 12345)
    else:
        monkeypatch.setattr(trusted_files, "_euid", lambda: os.geteuid() + 1)
    assert _load(directory) is None
    assert not C.store(KEY, CUBIN, LOWERED, "", directory)


def test_a_fifo_at_the_entry_path_neither_blocks_nor_loads(directory):
    directory.mkdir(mode=0o700)
    os.mkfifo(_entry(directory))
    before = C.info()["rejected"]
    assert _load(directory, timeout=5.0) is None
    assert _rejected_since(before) == 1
    # The compile path then stores over it (the FIFO name is replaced, never written through).
    assert C.store(KEY, CUBIN, LOWERED, "", directory)
    assert _load(directory)[0] == CUBIN


def test_a_huge_entry_is_refused_before_it_is_read(directory, monkeypatch):
    directory.mkdir(mode=0o700)
    with open(_entry(directory), "wb") as fh:
        fh.truncate(C.MAX_ENTRY_BYTES + 1)  # sparse: no disk used
    trusted_files.secret_key()  # the key file's own 32 bytes are read before this count
    reads = []
    real_read = trusted_files.read_exact
    monkeypatch.setattr(trusted_files, "read_exact",
                        lambda fd, n: reads.append(n) or real_read(fd, n))
    assert _load(directory) is None
    assert reads == [], "bytes of an oversized entry were read"


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "plain-sha256"])
def test_a_deeply_nested_header_is_rebuilt_not_a_recursion_error(directory, signed):
    """Signed with this user's key (so only the depth bound stops it), or with a correct plain
    sha256 (the old format's check)."""
    directory.mkdir(mode=0o700)
    header = b"[" * 100_000 + b"]" * 100_000
    version = C.FORMAT_VERSION if signed else 1
    body = C.MAGIC + struct.pack(">II", version, len(header)) + header + CUBIN
    digest = (trusted_files.sign(trusted_files.secret_key(), body) if signed
              else hashlib.sha256(body).digest())
    _entry(directory).write_bytes(body + digest)
    before = C.info()["rejected"]
    assert _load(directory) is None
    assert _rejected_since(before) == 1


def test_a_symbolic_link_at_the_entry_path_is_not_followed(directory, tmp_path):
    assert C.store(KEY, CUBIN, LOWERED, "", directory)
    elsewhere = tmp_path / "elsewhere.cubin"
    elsewhere.write_bytes(_entry(directory).read_bytes())  # a verified entry, reached by a link
    _entry(directory).unlink()
    _entry(directory).symlink_to(elsewhere)
    assert _load(directory) is None


def test_clear_leaves_directories_named_like_entries(directory):
    assert C.store(KEY, CUBIN, LOWERED, "", directory)
    (directory / "trap.cubin").mkdir()
    (directory / "trap.tmp").mkdir()
    (directory / "stale.tmp").write_bytes(b"")
    assert C.clear(directory) == 1
    assert sorted(p.name for p in directory.iterdir()) == ["trap.cubin", "trap.tmp"]


def test_adopt_re_signs_the_entries_a_caller_vouches_for(directory, tmp_path, monkeypatch):
    """Cubins built ahead elsewhere (another key) load only after an explicit ``adopt``, which
    still reads them as the cache reads: no FIFO, link or malformed entry gets in."""
    carried = tmp_path / "carried"
    monkeypatch.setenv("CUDNN_ATTN_CACHE_KEY_FILE", str(tmp_path / "build-machine-key"))
    assert C.store(KEY, CUBIN, LOWERED, "log", carried)
    monkeypatch.setenv("CUDNN_ATTN_CACHE_KEY_FILE", str(tmp_path / "config" / "key"))
    directory.mkdir(mode=0o700)
    assert _load(directory) is None
    (carried / ("cd" * 32 + C.SUFFIX)).write_bytes(b"not an entry")
    os.mkfifo(carried / ("ef" * 32 + C.SUFFIX))
    (carried / ("01" * 32 + C.SUFFIX)).write_bytes(_entry(carried).read_bytes())  # wrong name
    assert C.adopt(carried, directory) == 1
    assert _load(directory) == (CUBIN, LOWERED, "log")
    assert sorted(p.name for p in directory.iterdir()) == [KEY + C.SUFFIX]
