"""Smoke tests of the examples with tiny settings: each ``main(argv)`` runs in-process (one also as
a real subprocess), returns 0, and prints what it promises."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture(autouse=True)
def one_thread():
    """The examples' tensors are tiny: one intra-op thread is as fast, and much faster when other
    processes compete for the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quickstart(capsys):
    assert load("quickstart").main([]) == 0
    out = capsys.readouterr().out
    assert "shapes: (2, 8, 128, 64)" in out
    assert re.search(r"torch\s+(selected|available)", out)  # the explain() table
    assert "varlen: out (18, 4, 32)" in out


def test_quickstart_as_a_script():
    done = subprocess.run([sys.executable, str(EXAMPLES / "quickstart.py")], check=False,
                          capture_output=True, text=True, timeout=120, cwd=EXAMPLES.parent)
    assert done.returncode == 0, done.stderr
    assert "sequence 3 alone differs by" in done.stdout


def _losses(out: str, label: str) -> list[float]:
    """``label``'s value on each ``step N ...`` progress line."""
    return [float(x) for x in re.findall(rf"^step +\d+ .*{label} ([0-9.]+)", out, re.MULTILINE)]


def test_train_tiny_transformer(capsys):
    argv = ["--steps", "20", "--batch-size", "8", "--context", "32", "--d-model", "32",
            "--layers", "1", "--eval-every", "5", "--sample-chars", "12", "--lr", "1e-2"]
    assert load("train_tiny_transformer").main(argv) == 0
    out = capsys.readouterr().out
    assert "mask=Causal(alignment='top_left')" in out and "num_kv_heads=2" in out
    held_out = _losses(out, "held-out loss")
    assert len(held_out) >= 4 and held_out[-1] < held_out[0] - 0.3  # visibly falls
    assert "fell by" in out and out.count("sample: 'The ") == 1


def test_bundled_text_is_there():
    text = (EXAMPLES / "data" / "public_domain.txt").read_text(encoding="utf-8")
    assert 20_000 <= len(text.encode()) <= 50_000 and text.isascii()
    assert "public domain" in (EXAMPLES / "data" / "README.md").read_text().lower()


def test_neighborhood_vision(capsys):
    argv = ["--steps", "50", "--batch-size", "32", "--layers", "1", "--eval-size", "64",
            "--eval-every", "25", "--lr", "5e-3"]
    module = load("neighborhood_vision")
    assert module.main(argv) == 0
    out = capsys.readouterr().out
    assert "8x8 tokens, 3x3 neighborhoods" in out
    held_out = _losses(out, "held-out loss")
    assert len(held_out) == 3 and held_out[-1] < held_out[0] - 0.1
    # the synthetic data: one bar per image, labels in range
    images, labels = module.make_images(8, 16, torch.Generator().manual_seed(0), noise=0.0)
    assert images.shape == (8, 1, 16, 16) and labels.max() < 4
    assert ((images > 0).flatten(1).sum(1) >= 5).all()


@pytest.mark.parametrize("page_size", [5, 16])
def test_paged_decode(capsys, page_size):
    argv = ["--steps", "7", "--batch", "3", "--heads", "4", "--kv-heads", "2", "--head-dim",
            "16", "--page-size", str(page_size), "--max-prompt", "13", "--seed", "2"]
    assert load("paged_decode").main(argv) == 0
    out = capsys.readouterr().out
    assert "matches dense attention" in out and "tokens/s" in out
    err = float(re.search(r"max \|paged - dense\| = (\S+)", out).group(1))
    assert err < 1e-4


def test_paged_cache_pages_are_shuffled_and_private():
    module = load("paged_decode")
    cache = module.PagedKVCache(40, 4, 1, 2, 3, 10, device="cpu", dtype=torch.float32, seed=0)
    for b, n in enumerate([9, 1, 14]):
        cache.extend(b, torch.full((n, 1, 2), float(b)), torch.zeros(n, 1, 2))
    for _ in range(5):
        cache.append(torch.full((3, 1, 2), 9.0), torch.zeros(3, 1, 2))
    assert cache.lens == [14, 6, 19]
    pages = [p for p in cache.block_table.flatten().tolist() if p >= 0]
    assert len(pages) == len(set(pages)) == 4 + 2 + 5  # ceil(len / 4) each, never shared
    assert pages != sorted(pages)  # taken from a shuffled free list
    # token t of sequence b is at page block_table[b, t // 4], row t % 4
    row = cache.block_table[2].tolist()
    assert cache.k[row[3], 1, 0, 0] == 2.0 and cache.k[row[4], 2, 0, 0] == 9.0
