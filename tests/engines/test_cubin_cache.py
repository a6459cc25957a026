"""CPU: the on-disk cubin cache (``fallback_kernels.cubin_cache``) behind ``_loader``.

NVRTC compiles without a GPU, so the real compile path runs here: the first compile of a program
invokes the compiler and writes one entry, a later one (with the process memo emptied, as in a
new process) reads the identical cubin, names and ptxas log from disk without invoking it. Keys
follow everything the cubin depends on; corrupt entries and symbolic links are never trusted.
"""

import os
import time

import pytest

pytest.importorskip("cupy")

from cupy.cuda import nvrtc

from cudnn_attn.fallback_kernels import _loader, cubin_cache
from cudnn_attn.fallback_kernels import unfused as U

ARCH = "sm_80"
EXPRESSIONS = ("na_neighbor_gather<float>",)  # one small instance: a compile takes ~1 s


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache directory, an empty process memo, and a count of compiler invocations."""
    directory = tmp_path / "cubins"
    monkeypatch.setenv("CUDNN_ATTN_CUBIN_CACHE", str(directory))
    _loader._PROGRAMS.clear()
    calls = []
    real = nvrtc.compileProgram

    def counting(prog, options):
        calls.append(tuple(options))
        return real(prog, options)

    monkeypatch.setattr(nvrtc, "compileProgram", counting)
    yield directory, calls
    _loader._PROGRAMS.clear()


def _compile(defines=None, arch=ARCH):
    return _loader.compile_program(U.SOURCE, U.DEFINES if defines is None else defines,
                                   EXPRESSIONS, arch)


def _entries(directory):
    return sorted(p for p in directory.iterdir() if p.name.endswith(cubin_cache.SUFFIX))


def test_second_compile_reads_the_disk(cache):
    directory, calls = cache
    t0 = time.perf_counter()
    first = _compile()
    cold = time.perf_counter() - t0
    assert len(calls) == 1 and len(_entries(directory)) == 1
    assert oct(directory.stat().st_mode & 0o777) == "0o700"

    _loader._PROGRAMS.clear()  # a new process: only the disk remains
    t0 = time.perf_counter()
    second = _compile()
    warm = time.perf_counter() - t0
    assert len(calls) == 1, "the compiler ran again"
    assert second.cubin == first.cubin and second.cubin[:4] == b"\x7fELF"
    assert second.lowered == first.lowered and second.log == first.log
    variants = [v for v in U.variants() if v.expression in EXPRESSIONS]
    assert _loader.compile_records(second, variants) == _loader.compile_records(first, variants)
    print(f"cold compile {cold:.3f} s, from disk {warm:.4f} s")
    assert warm < cold


def test_key_follows_defines_arch_options_and_nvrtc_version(cache):
    directory, calls = cache
    _compile()
    _compile(arch="sm_90")
    _compile(defines={**U.DEFINES, "NA_UNFUSED_THREADS": 128})
    assert len(calls) == 3 and len(_entries(directory)) == 3
    text = _loader.source_text(U.SOURCE, U.DEFINES)
    key = cubin_cache.program_key(text, EXPRESSIONS, ARCH, _loader.NVRTC_OPTIONS, "12.4")
    assert key != cubin_cache.program_key(text, EXPRESSIONS, ARCH, _loader.NVRTC_OPTIONS, "12.5")
    assert key != cubin_cache.program_key(text, EXPRESSIONS, ARCH, ("-std=c++17",), "12.4")
    assert key != cubin_cache.program_key(text + " ", EXPRESSIONS, ARCH, _loader.NVRTC_OPTIONS,
                                          "12.4")
    assert key == cubin_cache.program_key(text, EXPRESSIONS, ARCH, _loader.NVRTC_OPTIONS, "12.4")


@pytest.mark.parametrize("damage", ["garbage", "truncated", "flipped-byte", "empty"])
def test_corrupt_entry_is_ignored_and_rebuilt(cache, damage):
    directory, calls = cache
    good = _compile().cubin
    (entry,) = _entries(directory)
    data = entry.read_bytes()
    entry.write_bytes({"garbage": b"not a cubin at all" * 10, "truncated": data[:len(data) // 2],
                       "flipped-byte": data[:100] + bytes([data[100] ^ 1]) + data[101:],
                       "empty": b""}[damage])
    _loader._PROGRAMS.clear()
    before = cubin_cache.info()["rejected"]
    assert _compile().cubin == good
    assert len(calls) == 2
    assert cubin_cache.info()["rejected"] == before + 1
    stored = cubin_cache.load(entry.name[:-len(cubin_cache.SUFFIX)], EXPRESSIONS, directory)
    assert stored is not None and stored[0] == good  # rewritten whole


def test_symbolic_links_are_never_followed(cache, tmp_path):
    directory, calls = cache
    _compile()
    (entry,) = _entries(directory)
    # An entry replaced by a link to a valid entry elsewhere: not read, and the rewrite replaces
    # the link, leaving its target untouched.
    elsewhere = tmp_path / "elsewhere.cubin"
    planted = entry.read_bytes()
    elsewhere.write_bytes(planted)
    entry.unlink()
    entry.symlink_to(elsewhere)
    _loader._PROGRAMS.clear()
    _compile()
    assert len(calls) == 2
    assert not entry.is_symlink() and elsewhere.read_bytes() == planted
    assert cubin_cache.load(entry.name[:-len(cubin_cache.SUFFIX)], EXPRESSIONS, directory)
    # The cache directory itself a link: the cache is not used at all.
    real_dir = tmp_path / "real"
    real_dir.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real_dir, target_is_directory=True)
    os.environ["CUDNN_ATTN_CUBIN_CACHE"] = str(link)
    _loader._PROGRAMS.clear()
    _compile()
    assert len(calls) == 3 and list(real_dir.iterdir()) == []


def test_disabled_and_unwritable_caches_still_compile(cache, monkeypatch, tmp_path):
    _, calls = cache
    monkeypatch.setenv("CUDNN_ATTN_CUBIN_CACHE", "off")
    assert cubin_cache.cache_dir() is None
    _compile()
    _loader._PROGRAMS.clear()
    _compile()
    assert len(calls) == 2
    blocked = tmp_path / "file-not-dir"
    blocked.write_text("x")
    monkeypatch.setenv("CUDNN_ATTN_CUBIN_CACHE", str(blocked / "cubins"))
    _loader._PROGRAMS.clear()
    assert _compile().cubin[:4] == b"\x7fELF"


def test_default_directory_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("CUDNN_ATTN_CUBIN_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cubin_cache.cache_dir() == tmp_path / "cudnn_attn" / "cubins"


def test_clear_removes_entries(cache):
    directory, _ = cache
    _compile()
    (directory / "stale.tmp").write_bytes(b"")
    assert cubin_cache.clear(directory) == 1
    assert list(directory.iterdir()) == []
