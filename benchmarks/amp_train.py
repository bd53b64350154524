"""A plain single-GPU training script: the "before" that benchmarks/amp_speed.py migrates and times.

A small Transformer classifier on synthetic tokens, written the way single-GPU scripts are: a
device string, `.to(device)`, a shuffling DataLoader, `loss.backward()`, `optimizer.step()`. It
times its own training steps after a warm-up and prints one line,

    timing: steps=N ms_per_step=X samples_per_s=Y final_loss=Z

Sizes come from the command line, so the same file runs in seconds on a CPU and keeps an H100 busy.
"""
import argparse
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def get_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=30, help="timed steps")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    return parser.parse_args()


class Classifier(nn.Module):
    def __init__(self, vocab, width, layers, classes=10):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, nhead=max(1, width // 64), dim_feedforward=4 * width,
                                           dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, classes)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens)).mean(dim=1))


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def main():
    args = get_args()
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    total = args.batch * (args.warmup + args.steps)
    tokens = torch.randint(0, args.vocab, (total, args.seq))
    labels = tokens[:, 0] % 10  # learnable: the class is in the first token
    loader = DataLoader(TensorDataset(tokens, labels), batch_size=args.batch, shuffle=True, drop_last=True)

    model = Classifier(args.vocab, args.width, args.layers).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    criterion = nn.CrossEntropyLoss()
    model.train()
    step, start = 0, time.perf_counter()
    for epoch in range(1):
        for x, y in loader:
            if step == args.warmup:
                synchronize(device)
                start = time.perf_counter()
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = criterion(model(x), y)
            loss.backward()
            optimizer.step()
            step += 1
    synchronize(device)
    elapsed = time.perf_counter() - start
    timed = step - args.warmup
    print(f"timing: steps={timed} ms_per_step={1000 * elapsed / timed:.3f} "
          f"samples_per_s={timed * args.batch / elapsed:.1f} final_loss={loss.item():.4f}")
    torch.save(model.state_dict(), "model.pt")


if __name__ == "__main__":
    main()
