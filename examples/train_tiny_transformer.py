"""Train a tiny character-level transformer with cudnn_attn.nn.MultiheadAttention.

Causal self-attention with GQA and ALiBi (no position embeddings), pre-LayerNorm blocks, trained
on the public-domain text in examples/data/ (see its README). Prints the training loss and the
held-out loss as they fall, then samples some text. Exits 1 if the loss did not fall.

    python examples/train_tiny_transformer.py                    # 300 steps, ~25 s on a CPU
    python examples/train_tiny_transformer.py --steps 20 --d-model 32 --layers 1   # a smoke run
    python examples/train_tiny_transformer.py --steps 2000 --d-model 128 --layers 4  # a longer run

Writes the training curves to ``train_tiny_transformer.png`` (``--plot PATH``; ``--plot ''``: no
plot) when matplotlib is installed (``pip install 'cudnn-attn[plot]'``).

Runs on CUDA when available (bfloat16 autocast there, so the cuDNN engine can take the
attention), else on the CPU in float32.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import cudnn_attn as ca
from cudnn_attn.nn import MultiheadAttention

try:  # run as a script: examples/ is on sys.path; imported from elsewhere: load by path
    import plots
except ImportError:  # pragma: no cover - the tests import this file by path
    import importlib.util as _util

    _spec = _util.spec_from_file_location("plots", Path(__file__).resolve().parent / "plots.py")
    plots = _util.module_from_spec(_spec)
    _spec.loader.exec_module(plots)

DATA = Path(__file__).resolve().parent / "data" / "public_domain.txt"


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int, kv_heads: int, dropout: float):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = MultiheadAttention(d_model, heads, num_kv_heads=kv_heads, mask=ca.Causal(),
                                       alibi=True, dropout=dropout, out_dropout=dropout)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(),
                                 nn.Linear(4 * d_model, d_model), nn.Dropout(dropout))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, d_model: int, heads: int, kv_heads: int, layers: int,
                 dropout: float):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.blocks = nn.Sequential(*(Block(d_model, heads, kv_heads, dropout)
                                      for _ in range(layers)))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, tokens):  # [B, S] -> logits [B, S, vocab]
        return self.head(self.ln(self.blocks(self.embed(tokens))))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per step (default 32)")
    p.add_argument("--context", type=int, default=64, help="characters per training sequence")
    p.add_argument("--d-model", type=int, default=64, help="model width (default 64)")
    p.add_argument("--heads", type=int, default=4, help="query heads (default 4)")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads (GQA)")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    p.add_argument("--dropout", type=float, default=0.0, help="attention dropout (default 0)")
    p.add_argument("--lr", type=float, default=5e-3, help="AdamW learning rate (default 5e-3)")
    p.add_argument("--eval-every", type=int, default=50, help="steps between loss reports")
    p.add_argument("--sample-chars", type=int, default=160, help="characters to generate (0: none)")
    p.add_argument("--seed", type=int, default=0, help="seed of batches and weights (default 0)")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda")
    p.add_argument("--text", type=plots.existing_file, default=DATA,
                   help="training text, UTF-8 (default: the bundled public-domain text)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default 1: tiny tensors)")
    p.add_argument("--plot", default="train_tiny_transformer.png", type=plots.output_file,
                   help="PNG of the loss curves ('' for none; needs matplotlib)")
    return p.parse_args(argv)


def batches(data: torch.Tensor, batch: int, context: int, gen: torch.Generator):
    starts = torch.randint(0, len(data) - context - 1, (batch,), generator=gen)
    idx = starts[:, None] + torch.arange(context + 1)
    chunk = data[idx]
    return chunk[:, :-1], chunk[:, 1:]


@torch.no_grad()
def held_out_loss(model, data, context, device, autocast, batches_=4) -> float:
    model.eval()
    gen = torch.Generator().manual_seed(1234)  # the same held-out windows every time
    losses = []
    for _ in range(batches_):
        x, y = (t.to(device) for t in batches(data, 16, context, gen))
        with autocast():
            logits = model(x)
        losses.append(F.cross_entropy(logits.float().flatten(0, 1), y.flatten()).item())
    model.train()
    return sum(losses) / len(losses)


@torch.no_grad()
def sample(model, prompt: str, n: int, stoi, itos, context, device, autocast, gen) -> str:
    model.eval()
    tokens = torch.tensor([[stoi[c] for c in prompt]], device=device)
    for _ in range(n):
        with autocast():
            logits = model(tokens[:, -context:])[0, -1].float()
        probs = torch.softmax(logits / 0.8, -1).cpu()
        nxt = torch.multinomial(probs, 1, generator=gen).to(device)
        tokens = torch.cat([tokens, nxt[None]], 1)
    model.train()
    return "".join(itos[i] for i in tokens[0].tolist())


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else ("cpu" if args.device == "auto" else args.device))
    torch.manual_seed(args.seed)
    plots.cpu_threads(args.threads, device)
    if device.type == "cuda":
        def autocast():
            return torch.autocast("cuda", dtype=torch.bfloat16)
    else:
        autocast = contextlib.nullcontext

    text = args.text.read_text(encoding="utf-8")
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    itos = dict(enumerate(chars))
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    blocks = data.split(1024)  # every tenth 1 KiB block is held out: same mix of texts
    train = torch.cat([blk for i, blk in enumerate(blocks) if i % 10 != 9])
    val = torch.cat(blocks[9::10])

    model = TinyLM(len(chars), args.d_model, args.heads, args.kv_heads, args.layers,
                   args.dropout).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / max(args.steps, 1))))
    params = sum(p.numel() for p in model.parameters())
    print(f"{len(text)} characters, vocabulary {len(chars)}, {params} parameters, device "
          f"{device}\nattention: MultiheadAttention({model.blocks[0].attn.extra_repr()})")

    gen = torch.Generator().manual_seed(args.seed)
    first = held_out_loss(model, val, args.context, device, autocast)
    print(f"step {0:5d}  held-out loss {first:.3f}  (uniform guess: {math.log(len(chars)):.3f})")
    curves = {"step": [0], "held-out": [first], "train": [float("nan")]}
    window, start_train, t0 = [], None, time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = (t.to(device) for t in batches(train, args.batch_size, args.context, gen))
        with autocast():
            logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        window.append(loss.item())
        if start_train is None:
            start_train = window[0]
        if step % args.eval_every == 0 or step == args.steps:
            val_loss = held_out_loss(model, val, args.context, device, autocast)
            print(f"step {step:5d}  train loss {sum(window) / len(window):.3f}  "
                  f"held-out loss {val_loss:.3f}  ({time.perf_counter() - t0:.1f} s)")
            for name, value in (("step", step), ("held-out", val_loss),
                                ("train", sum(window) / len(window))):
                curves[name].append(value)
            window = []
    last = held_out_loss(model, val, args.context, device, autocast)
    fell = last < first
    print(f"held-out loss {first:.3f} -> {last:.3f} "
          f"({'fell' if fell else 'DID NOT FALL'} by {first - last:.3f})")
    if args.sample_chars > 0:
        prompt = "The "
        print("sample:", repr(sample(model, prompt, args.sample_chars, stoi, itos, args.context,
                                     device, autocast, torch.Generator().manual_seed(args.seed))))
    if args.plot:
        plot_curves(curves, math.log(len(chars)), args.plot)
    return 0 if fell else 1


def plot_curves(curves: dict, uniform: float, path: str) -> None:
    """Training and held-out loss against the step, with the uniform-guess line."""
    plt = plots.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot(curves["step"][1:], curves["train"][1:], "o-", label="train (mean since last)")
    ax.plot(curves["step"], curves["held-out"], "s-", label="held-out")
    ax.axhline(uniform, color="gray", ls=":", label="uniform guess")
    ax.set(xlabel="step", ylabel="cross-entropy (nats/char)", title="tiny transformer")
    ax.legend()
    plots.save(fig, path)


if __name__ == "__main__":
    raise SystemExit(main())
