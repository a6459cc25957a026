"""A small 2-D neighborhood-attention classifier on synthetic images of oriented bars.

Each 16x16 image holds one noisy bar at a random place, horizontal, vertical or on one of the two
diagonals; the model names the orientation (4 classes, chance = 25 %). 2x2 patches become an 8x8
token grid, and every block attends with ``cudnn_attn.attention(..., mask=Neighborhood((8, 8), 3))``:
each token sees the 3x3 tokens around it (NATTEN semantics: the window shifts, not shrinks, at the
borders). Prints held-out loss and accuracy as they improve; exits 1 if the loss did not fall.

    python examples/neighborhood_vision.py                 # 200 steps, ~30 s on a CPU
    python examples/neighborhood_vision.py --steps 20      # a smoke run
    python examples/neighborhood_vision.py --steps 1000 --image-size 32 --kernel 5  # a longer run

Writes ``neighborhood_vision.png`` (``--plot PATH``; ``--plot ''``: none) when matplotlib is
installed (``pip install 'cudnn-attn[plot]'``): a held-out image, the 3x3 neighborhoods of a
few tokens, and where the trained first block's attention goes for those tokens.

Runs on CUDA when available, else on the CPU.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import cudnn_attn as ca
from cudnn_attn.model.geometry import neighborhood_mask

try:  # run as a script: examples/ is on sys.path; imported from elsewhere: load by path
    import plots
except ImportError:
    import importlib.util as _util

    _spec = _util.spec_from_file_location("plots", Path(__file__).resolve().parent / "plots.py")
    plots = _util.module_from_spec(_spec)
    _spec.loader.exec_module(plots)

# (dy, dx) of each class: horizontal, diagonal, vertical, anti-diagonal
DIRECTIONS = ((0.0, 1.0), (math.sqrt(0.5), math.sqrt(0.5)), (1.0, 0.0),
              (math.sqrt(0.5), -math.sqrt(0.5)))


def make_images(n: int, size: int, gen: torch.Generator, noise: float = 0.2):
    """``n`` images ``[n, 1, size, size]`` with one bar each, and their orientation labels."""
    labels = torch.randint(0, len(DIRECTIONS), (n,), generator=gen)
    half = torch.randint(size // 5, size // 3 + 1, (n,), generator=gen).float()  # half-length
    margin = size // 3
    cy = torch.randint(margin, size - margin, (n,), generator=gen).float()
    cx = torch.randint(margin, size - margin, (n,), generator=gen).float()
    d = torch.tensor(DIRECTIONS)[labels]  # [n, 2]
    t = torch.linspace(-1.0, 1.0, 4 * size)[None] * half[:, None]  # [n, T] positions on the bar
    ys = (cy[:, None] + t * d[:, :1]).round().long().clamp(0, size - 1)
    xs = (cx[:, None] + t * d[:, 1:]).round().long().clamp(0, size - 1)
    images = torch.zeros(n, size * size)
    images.scatter_(1, ys * size + xs, 1.0)
    images = images.view(n, 1, size, size) * (0.6 + 0.4 * torch.rand(n, 1, 1, 1, generator=gen))
    return images + noise * torch.randn(images.shape, generator=gen), labels


class NeighborhoodBlock(nn.Module):
    """Pre-LayerNorm transformer block whose attention is 2-D neighborhood attention."""

    def __init__(self, dim: int, heads: int, grid: tuple[int, int], kernel: int):
        super().__init__()
        self.heads = heads
        self.mask = ca.Neighborhood(grid, kernel)
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):  # [B, S, C], S = H * W tokens in row-major order
        q, k, v = self.qkv(self.ln1(x)).unflatten(-1, (3, self.heads, -1)).unbind(2)
        a = ca.attention(q, k, v, mask=self.mask, layout="bshd")  # [B, S, heads, C / heads]
        x = x + self.proj(a.flatten(2))
        return x + self.mlp(self.ln2(x))


class NAClassifier(nn.Module):
    def __init__(self, size: int, patch: int, dim: int, heads: int, layers: int, kernel: int,
                 classes: int):
        super().__init__()
        grid = (size // patch, size // patch)
        self.embed = nn.Conv2d(1, dim, patch, stride=patch)
        self.pos = nn.Parameter(0.02 * torch.randn(grid[0] * grid[1], dim))
        self.blocks = nn.Sequential(*(NeighborhoodBlock(dim, heads, grid, kernel)
                                      for _ in range(layers)))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, images):  # [B, 1, H, W] -> logits [B, classes]
        x = self.embed(images).flatten(2).transpose(1, 2) + self.pos  # [B, grid tokens, dim]
        return self.head(self.ln(self.blocks(x)).mean(1))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200, help="optimizer steps (default 200)")
    p.add_argument("--batch-size", type=int, default=64, help="images per step (default 64)")
    p.add_argument("--image-size", type=int, default=16, help="image side in pixels (default 16)")
    p.add_argument("--patch", type=int, default=2, help="patch size (tokens = (size / patch)^2)")
    p.add_argument("--kernel", type=int, default=3, help="neighborhood size per axis")
    p.add_argument("--dim", type=int, default=32, help="model width (default 32)")
    p.add_argument("--heads", type=int, default=2, help="attention heads (default 2)")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    p.add_argument("--eval-every", type=int, default=50, help="steps between evaluations (default 50)")
    p.add_argument("--eval-size", type=int, default=256, help="held-out images")
    p.add_argument("--seed", type=int, default=0, help="seed of data and weights (default 0)")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default 1: tiny tensors)")
    p.add_argument("--plot", default="neighborhood_vision.png", type=plots.output_file,
                   help="PNG of the pattern and the learned attention ('' for none; matplotlib)")
    return p.parse_args(argv)


@torch.no_grad()
def evaluate(model, images, labels) -> tuple[float, float]:
    model.eval()
    logits = model(images)
    model.train()
    return F.cross_entropy(logits, labels).item(), (logits.argmax(1) == labels).float().mean().item()


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.image_size % args.patch:
        raise SystemExit(f"--image-size {args.image_size} must be a multiple of --patch {args.patch}")
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else ("cpu" if args.device == "auto" else args.device))
    torch.manual_seed(args.seed)
    plots.cpu_threads(args.threads, device)
    gen = torch.Generator().manual_seed(args.seed)
    test_x, test_y = (t.to(device) for t in make_images(args.eval_size, args.image_size, gen))
    model = NAClassifier(args.image_size, args.patch, args.dim, args.heads, args.layers,
                         args.kernel, len(DIRECTIONS)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    grid = args.image_size // args.patch
    print(f"{grid}x{grid} tokens, {args.kernel}x{args.kernel} neighborhoods, "
          f"{sum(p.numel() for p in model.parameters())} parameters, device {device}")
    q = torch.zeros(1, grid * grid, args.heads, args.dim // args.heads, device=device)
    print("attention engine:", ca.explain(q, q, q, mask=model.blocks[0].mask,
                                          layout="bshd").selected)

    first_loss, first_acc = evaluate(model, test_x, test_y)
    print(f"step {0:5d}  held-out loss {first_loss:.3f}  accuracy {first_acc:6.1%}")
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = (t.to(device) for t in make_images(args.batch_size, args.image_size, gen))
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % args.eval_every == 0 or step == args.steps:
            val_loss, acc = evaluate(model, test_x, test_y)
            print(f"step {step:5d}  held-out loss {val_loss:.3f}  accuracy {acc:6.1%}  "
                  f"({time.perf_counter() - t0:.1f} s)")
    last_loss, last_acc = evaluate(model, test_x, test_y)
    fell = last_loss < first_loss
    print(f"held-out loss {first_loss:.3f} -> {last_loss:.3f}, accuracy {first_acc:.1%} -> "
          f"{last_acc:.1%} ({'improved' if fell else 'DID NOT IMPROVE'})")
    if args.plot:
        plot_attention(model, test_x[:1], grid, args.plot)
    return 0 if fell else 1


@torch.no_grad()
def attention_weights(block: NeighborhoodBlock, x, per_head: bool = False) -> torch.Tensor:
    """``[S, S]`` softmax weights of ``block`` on tokens ``x`` [1, S, C], mean over heads
    (``[heads, S, S]`` with ``per_head``): the float64 brute force of what ``ca.attention``
    computes with the block's mask."""
    q, k, _ = block.qkv(block.ln1(x)).unflatten(-1, (3, block.heads, -1)).unbind(2)
    q, k = q[0].transpose(0, 1).double(), k[0].transpose(0, 1).double()  # [heads, S, D]
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    visible = neighborhood_mask(block.mask.spatial_shape, block.mask.kernel_size).to(x.device)
    weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1)
    return weights if per_head else weights.mean(0)


def plot_attention(model: NAClassifier, image, grid: int, path: str) -> None:
    """The image, the neighborhoods of a few query tokens, and the learned weights there."""
    plt = plots.pyplot()
    if plt is None:
        return
    model.eval()
    tokens = model.embed(image).flatten(2).transpose(1, 2) + model.pos
    weights = attention_weights(model.blocks[0], tokens).float().cpu()
    model.train()
    queries = [0, grid // 2 * grid + grid // 2, grid * (grid - 1) + grid // 3]  # corner, centre, edge
    visible = neighborhood_mask(model.blocks[0].mask.spatial_shape,
                                model.blocks[0].mask.kernel_size).float()
    pattern, learned = torch.zeros(grid * grid), torch.zeros(grid * grid)
    for i, query in enumerate(queries, 1):
        pattern = torch.maximum(pattern, visible[query] * i / len(queries))
        learned += weights[query]
    fig, axes = plt.subplots(1, 3, figsize=(9, 3.2))
    axes[0].imshow(image[0, 0].cpu().numpy(), cmap="gray")
    axes[0].set_title("held-out image")
    axes[1].imshow(pattern.view(grid, grid).numpy(), cmap="Blues", vmin=0, vmax=1)
    axes[1].set_title(f"{model.blocks[0].mask.kernel_size[0]}x{model.blocks[0].mask.kernel_size[1]}"
                      " neighborhoods of 3 tokens")
    axes[2].imshow(learned.view(grid, grid).numpy(), cmap="magma")
    axes[2].set_title("learned attention (block 1)")
    for ax in axes[1:]:
        for query in queries:
            ax.plot(query % grid, query // grid, "x", color="red")
    for ax in axes:
        ax.set_xticks([])
        ax.set_yticks([])
    plots.save(fig, path)


if __name__ == "__main__":
    raise SystemExit(main())
