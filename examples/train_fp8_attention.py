"""Train a tiny character-level transformer twice: attention in FP8 (cudnn_attn.FP8Attention:
cuDNN's sdpa_fp8 forward and sdpa_fp8_backward, delayed scaling as in Transformer Engine) and
attention in BF16 (cudnn_attn.attention), from the same initial weights and batches; prints the
two losses side by side.

    python examples/train_fp8_attention.py                 # 150 steps, ~15 s on a CPU
    python examples/train_fp8_attention.py --steps 20      # a smoke run

On the CPU the torch engine computes cuDNN's FP8 semantics exactly (E4M3 forward, E5M2
backward, saturating casts at cuDNN's quantization points); on a GPU with cuDNN's FP8 support
(sm_90+, head dim 128 for the Hopper backward) the same calls run cuDNN's graphs. Only the
attention is FP8 here: the projections and the rest of the model stay in float32.
Exits 1 if the FP8 loss did not fall or ends far from the BF16 one.
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import cudnn_attn as ca

DATA = Path(__file__).resolve().parent / "data" / "public_domain.txt"


class Block(nn.Module):
    """Pre-LayerNorm causal self-attention + MLP; ``fp8`` picks the attention."""

    def __init__(self, d_model: int, heads: int, fp8: bool):
        super().__init__()
        self.heads, self.fp8 = heads, fp8
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv, self.out = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(),
                                 nn.Linear(4 * d_model, d_model))
        self.attn = ca.FP8Attention(mask=ca.Causal(), backend="auto")

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        if self.fp8:
            a = self.attn(*(t.transpose(1, 2) for t in (q, k, v)))
        else:  # BF16 attention, back to float32 for the rest of the model
            a = ca.attention(*(t.transpose(1, 2).bfloat16() for t in (q, k, v)),
                             mask=ca.Causal()).float()
        x = x + self.out(a.transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, context: int, d_model: int, heads: int, layers: int,
                 fp8: bool):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.zeros(context, d_model))
        self.blocks = nn.ModuleList(Block(d_model, heads, fp8) for _ in range(layers))
        self.head = nn.Linear(d_model, vocab)

    def forward(self, idx):
        x = self.embed(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def use_fp8(self, fp8: bool):
        for block in self.blocks:
            block.fp8 = fp8
        return self


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=150, help="training steps per model")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    p.add_argument("--context", type=int, default=32, help="tokens per sequence")
    p.add_argument("--d-model", type=int, default=64, help="model width")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--layers", type=int, default=1, help="transformer layers")
    p.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate")
    p.add_argument("--print-every", type=int, default=10, help="print the losses every N steps")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the weights and batches (both models see the same)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    text = DATA.read_text(encoding="utf-8")
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text])
    fp8_model = TinyLM(len(chars), args.context, args.d_model, args.heads, args.layers, True)
    bf16_model = copy.deepcopy(fp8_model).use_fp8(False)
    models = {"fp8": fp8_model, "bf16": bf16_model}
    opts = {n: torch.optim.AdamW(m.parameters(), lr=args.lr) for n, m in models.items()}
    gen = torch.Generator().manual_seed(args.seed)
    print(f"FP8 attention: {fp8_model.blocks[0].attn.recipe.fp8_format} recipe "
          f"(E4M3 forward, E5M2 backward), delayed scaling; BF16 attention for comparison")
    first = last = None
    for step in range(1, args.steps + 1):
        starts = torch.randint(0, len(data) - args.context - 1, (args.batch_size,),
                               generator=gen)
        x = torch.stack([data[s:s + args.context] for s in starts])
        y = torch.stack([data[s + 1:s + args.context + 1] for s in starts])
        losses = {}
        for name, model in models.items():
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            opts[name].zero_grad()
            loss.backward()
            opts[name].step()
            losses[name] = loss.item()
        first = first or losses
        last = losses
        if step % args.print_every == 0 or step == 1 or step == args.steps:
            print(f"step {step:4d}  fp8 loss {losses['fp8']:.4f}  bf16 loss {losses['bf16']:.4f}")
    amaxes = fp8_model.blocks[0].attn.amaxes
    print("last step's amaxes: " + ", ".join(f"{n} {float(a):.3g}" for n, a in amaxes.items()))
    fell = last["fp8"] < first["fp8"] - 0.3
    close = abs(last["fp8"] - last["bf16"]) < 0.25
    print(f"fp8 loss fell: {fell}; within 0.25 of bf16: {close}")
    return 0 if fell and close else 1


if __name__ == "__main__":
    raise SystemExit(main())
