"""Smoke tests of the examples with tiny settings: each ``main(argv)`` runs in-process (one also as
a real subprocess), returns 0, and prints what it promises."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from common import load_script

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(autouse=True)
def one_thread():
    """The examples' tensors are tiny: one intra-op thread is as fast, and much faster when other
    processes compete for the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def load(name: str):
    return load_script(EXAMPLES / f"{name}.py", f"example_{name}")


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
            "--layers", "1", "--eval-every", "5", "--sample-chars", "12", "--lr", "1e-2",
            "--plot", ""]
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
            "--eval-every", "25", "--lr", "5e-3", "--plot", ""]
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


# --------------------------------------------------------------------------------------------
# plots: optional (matplotlib), never required
# --------------------------------------------------------------------------------------------

TINY_TRAIN = ["--steps", "4", "--batch-size", "4", "--context", "16", "--d-model", "16",
              "--layers", "1", "--eval-every", "2", "--sample-chars", "0", "--lr", "1e-2"]
TINY_VISION = ["--steps", "6", "--batch-size", "8", "--layers", "1", "--eval-size", "16",
               "--eval-every", "3", "--lr", "5e-3"]


@pytest.mark.parametrize("name, argv", [("train_tiny_transformer", TINY_TRAIN),
                                        ("neighborhood_vision", TINY_VISION),
                                        ("draw_masks", [])])
def test_examples_run_without_matplotlib(capsys, monkeypatch, tmp_path, name, argv):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    monkeypatch.chdir(tmp_path)
    out_arg = ["--out", str(tmp_path / "m.png")] if name == "draw_masks" else []
    code = load(name).main(argv + out_arg)
    assert code in (0, 1) if name == "train_tiny_transformer" else code == 0  # 4 steps may not help
    assert "matplotlib is not installed" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


@pytest.mark.parametrize("name, argv", [("train_tiny_transformer", TINY_TRAIN),
                                        ("neighborhood_vision", TINY_VISION),
                                        ("draw_masks", [])])
def test_examples_write_their_plots(tmp_path, name, argv):
    pytest.importorskip("matplotlib", reason="the [plot] extra is optional")
    path = tmp_path / f"{name}.png"
    load(name).main(argv + ["--out" if name == "draw_masks" else "--plot", str(path)])
    width, height = _png_size(path)
    assert width > 300 and height > 200


def test_vision_attention_weights_match_the_library():
    """The plotted weights are those ``ca.attention`` applies: per head, weights @ v == output."""
    import cudnn_attn as ca

    module = load("neighborhood_vision")
    torch.manual_seed(0)
    block = module.NeighborhoodBlock(16, 2, (4, 4), 3).double()
    x = torch.randn(1, 16, 16, dtype=torch.float64)
    weights = module.attention_weights(block, x, per_head=True)  # [heads, S, S]
    _, _, v = block.qkv(block.ln1(x)).unflatten(-1, (3, 2, -1)).unbind(2)
    q, k, _ = block.qkv(block.ln1(x)).unflatten(-1, (3, 2, -1)).unbind(2)
    expected = ca.attention(q, k, v, mask=block.mask, layout="bshd")[0].transpose(0, 1)
    assert torch.allclose(weights @ v[0].transpose(0, 1), expected, atol=1e-12)
    hidden = ~ca.model.geometry.neighborhood_mask((4, 4), (3, 3))
    assert torch.all(weights[:, hidden] == 0)
    assert torch.allclose(module.attention_weights(block, x), weights.mean(0))


def test_train_fp8_attention(capsys):
    argv = ["--steps", "25", "--batch-size", "8", "--d-model", "32", "--print-every", "5"]
    assert load("train_fp8_attention").main(argv) == 0
    out = capsys.readouterr().out
    pairs = re.findall(r"^step +\d+ +fp8 loss ([0-9.]+) +bf16 loss ([0-9.]+)", out, re.MULTILINE)
    assert len(pairs) >= 5
    fp8, bf16 = (float(x) for x in pairs[-1])
    assert fp8 < float(pairs[0][0]) - 0.3 and abs(fp8 - bf16) < 0.25
    assert "dP " in out and "E5M2 backward" in out
