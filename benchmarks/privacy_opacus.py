"""Opacus' ghost clipping against its own non-private step, on the shapes of privacy.py.

Runs in a Python that has torch and Opacus (not this project's environment):
`benchmarks/privacy.py` calls it where `GRADACCUM_OPACUS_PYTHON` names one. Each model
runs a forward and backward pass on one batch, as `clipped_grad` does: plain PyTorch
(`loss.backward()`), and Opacus' `grad_sample_mode="ghost"` (per-sample norms from
activations and output gradients, then a second backward pass of the clipped loss;
Opacus' "fast gradient clipping"). Threads: as many as cores, as JAX uses.
Prints one JSON row per model.

    python benchmarks/privacy_opacus.py [--quick] [--reps N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from opacus import PrivacyEngine
from opacus.validators import ModuleValidator
from torch import nn


class MLP(nn.Module):
    def __init__(self, width: int = 512):
        super().__init__()
        layers, last = [], 256
        for _ in range(3):
            layers += [nn.Linear(last, width), nn.ReLU()]
            last = width
        self.net = nn.Sequential(*layers, nn.Linear(last, 10))

    def forward(self, x):
        return self.net(x)


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(1, 16, 3, padding=1)
        self.c2 = nn.Conv2d(16, 32, 3, stride=2, padding=1)
        self.out = nn.Linear(32 * 14 * 14, 10)

    def forward(self, x):
        x = torch.relu(self.c2(torch.relu(self.c1(x))))
        return self.out(x.flatten(1))


class Attention(nn.Module):
    """Causal self-attention of Linear layers (batch first), which Opacus' ghost mode
    takes as they are (its DPMultiheadAttention takes sequence-first inputs, which its
    ghost norms read as batch-first)."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))

    def forward(self, x):
        b, t, d = x.shape

        def split(y):
            return y.view(b, t, self.heads, d // self.heads).transpose(1, 2)

        out = nn.functional.scaled_dot_product_attention(
            split(self.q(x)), split(self.k(x)), split(self.v(x)), is_causal=True
        )
        return self.o(out.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, width: int, heads: int = 4, hidden: int = 512):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = Attention(width, heads)
        self.mlp = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))

    def forward(self, x):
        x = x + self.attn(self.n1(x))
        return x + self.mlp(self.n2(x))


class LM(nn.Module):
    def __init__(self, vocab: int = 256, width: int = 128):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.Sequential(Block(width), Block(width))
        self.norm, self.out = nn.LayerNorm(width), nn.Linear(width, vocab)

    def forward(self, tokens):
        return self.out(self.norm(self.blocks(self.embed(tokens))))


def setup(name: str, quick: bool):
    g = torch.Generator().manual_seed(0)
    if name == "mlp":
        model, b = (MLP(32), 16) if quick else (MLP(), 256)
        x, y = torch.randn(b, 256, generator=g), torch.randint(0, 10, (b,), generator=g)
    elif name == "cnn":
        model, b = CNN(), 8 if quick else 128
        x, y = torch.randn(b, 1, 28, 28, generator=g), torch.randint(0, 10, (b,), generator=g)
    else:
        model, b, t = (LM(32, 16), 4, 8) if quick else (LM(), 64, 64)
        tokens = torch.randint(0, 32 if quick else 256, (b, t + 1), generator=g)
        x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    return model, x, y


def steps(name: str, quick: bool):
    """`(plain step, ghost step)`: one forward and backward pass each."""
    model, x, y = setup(name, quick)
    criterion = nn.CrossEntropyLoss()

    def plain():
        model.zero_grad()
        logits = model(x)
        criterion(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()

    private = ModuleValidator.fix(setup(name, quick)[0])
    optimizer = torch.optim.SGD(private.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=x.shape[0]
    )
    private, optimizer, dp_criterion, _ = PrivacyEngine().make_private(
        module=private,
        optimizer=optimizer,
        data_loader=loader,
        criterion=nn.CrossEntropyLoss(),
        noise_multiplier=0.0,
        max_grad_norm=1.0,
        grad_sample_mode="ghost",
        poisson_sampling=False,
    )

    def ghost():
        optimizer.zero_grad()
        logits = private(x)
        shape = logits.shape if logits.ndim == 3 else None
        flat = logits.reshape(-1, logits.shape[-1])
        dp_criterion(flat, y.reshape(-1), shape=shape).backward()

    return plain, ghost


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reps", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    for name in ("mlp", "cnn", "transformer"):
        plain, ghost = steps(name, args.quick)
        for fn in (plain, ghost):
            fn()
        times: dict[str, list[float]] = {"plain": [], "ghost": []}
        for i in range(args.reps):
            order = [("plain", plain), ("ghost", ghost)]
            for key, fn in order if i % 2 == 0 else order[::-1]:
                start = time.perf_counter()
                fn()
                times[key].append(time.perf_counter() - start)
        ratios = sorted(a / b for a, b in zip(times["ghost"], times["plain"], strict=True))
        row = {
            "benchmark": "privacy",
            "model": name,
            "measure": "opacus_ghost",
            "candidate": "opacus ghost",
            "ms": 1e3 * statistics.median(times["ghost"]),
            "ms_reference": 1e3 * statistics.median(times["plain"]),
            "ratio": statistics.median(ratios),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
        }
        print(json.dumps(row))


if __name__ == "__main__":
    main()
