"""Which losses compare the samples of a batch with each other (program.batch_coupling)."""

import ast
from pathlib import Path

import pytest

from torchmigrate.program.batch_coupling import coupled_losses

CASES = {
    "simclr_matmul": ("def f(z, n):\n    sim = z @ z.t()\n    return ce(sim, torch.arange(n))\n", True),
    "mm_two_views": ("def f(a, b):\n    logits = torch.mm(a, b.t())\n    labels = torch.arange(a.size(0))\n"
                     "    return ce(logits, labels)\n", True),
    "einsum_rows": ("def f(a, b):\n    l = torch.einsum('nc,mc->nm', a, b)\n    return ce(l, torch.arange(len(a)))\n", True),
    "cosine_eye_mask": ("def f(z):\n    s = F.cosine_similarity(z.unsqueeze(1), z.unsqueeze(0), dim=2)\n"
                        "    mask = torch.eye(len(z))\n    return s[~mask]\n", True),
    "script_top_level": ("for z1, z2 in loader:\n    logits = z1 @ z2.t() / 0.1\n"
                         "    loss = F.cross_entropy(logits, torch.arange(z1.size(0)))\n", True),
    "batch_hard_triplet": ("def f(e):\n    d = torch.cdist(e, e)\n    d.fill_diagonal_(0)\n    return d.max(1)\n", True),
    "uniformity_pdist": ("def uniform_loss(x, t=2):\n    return torch.pdist(x, p=2).pow(2).mul(-t).exp().mean().log()\n",
                         True),
    "prototype_spread": ("class M:\n    def spread(self):\n        return F.pdist(self.prototypes).mean()\n", False),
    # a Gram matrix of one sample's channels (style transfer): no per-sample targets or masks
    "style_gram": ("def gram(x):\n    b, c, h, w = x.size()\n    f = x.view(b * c, h * w)\n"
                   "    return torch.mm(f, f.t()) / (b * c * h * w)\n", False),
    "attention": ("def fwd(q, k, t):\n    att = q @ k.transpose(-2, -1)\n    pos = torch.arange(t)\n    return att\n", False),
    "tied_weights": ("class M:\n    def forward(self, h, t):\n        pos = torch.arange(t)\n"
                     "        return h @ self.wte.weight.T\n", False),
    "queue_negatives": ("def f(q, k, queue):\n    l_neg = torch.einsum('nc,ck->nk', q, queue)\n"
                        "    labels = torch.zeros(len(q))\n    return l_neg\n", False),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_coupled_losses(name):
    source, coupled = CASES[name]
    found = coupled_losses({Path("losses.py"): ast.parse(source)})
    assert bool(found) == coupled, found
    if coupled:
        assert found.startswith("losses.py:")
