"""Which outputs of a module's forward are losses summed over the batch (`summing_outputs`)."""

from __future__ import annotations

import ast
import textwrap

from torchmigrate.program.summing_modules import WHOLE, summing_outputs


def outputs(source: str):
    klass = next(n for n in ast.parse(textwrap.dedent(source)).body if isinstance(n, ast.ClassDef))
    return summing_outputs(klass)


def test_a_forward_returning_one_summed_loss_is_whole():
    assert outputs("""
        class Diffusion(nn.Module):
            def forward(self, x):
                loss = F.mse_loss(self.net(x), x, reduction="sum")
                return 0.5 * loss
    """) == {WHOLE}


def test_tuple_items_accumulated_over_steps_from_the_class_own_summing_helpers():
    assert outputs("""
        class VRNN(nn.Module):
            def forward(self, x):
                kld = 0
                nll = 0
                for t in range(x.size(0)):
                    kld += self._kld(x[t])
                    nll += self._nll(x[t])
                return kld, nll, (x, x)

            def _kld(self, m):
                return 0.5 * torch.sum(m.pow(2))

            def _nll(self, p):
                return -torch.sum(p.log())
    """) == {0, 1}


def test_means_and_other_values_are_not_sums():
    assert outputs("""
        class Mean(nn.Module):
            def forward(self, x):
                kld = 0
                kld += x.sum() / x.size(0)
                rec = self._rec(x)
                return kld, rec, x.sum()

            def _rec(self, x):
                return x.mean()
    """) == {2}
    # an accumulator that starts from a tensor of the program's, or tuples of different lengths
    assert outputs("""
        class Odd(nn.Module):
            def forward(self, x, short=False):
                total = self.start
                total += x.sum()
                if short:
                    return (x.sum(),)
                return total, x.sum()
    """) == frozenset()
    assert outputs("class NoForward(nn.Module):\n    def step(self, x):\n        return x.sum()\n") == frozenset()
