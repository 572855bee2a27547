"""learner/core_lending.py: the learner's intra-op threads follow its servers' state, checked at each decoder layer's
forward and before its backward."""

import pytest
import torch
from torch import nn

from learner import core_lending
from learner.core_lending import CoreLending
from qurl.supervisor.layout import LEND_CORES_ENV


class _Record(torch.autograd.Function):
    """Identity that notes the thread count its backward ran with."""

    @staticmethod
    def forward(ctx, x, seen):
        ctx.seen = seen
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.seen.append(("bwd", torch.get_num_threads()))
        return grad, None


class Probe(nn.Module):
    """A decoder layer's stand-in: a linear map that notes the thread count of its forward and backward."""

    def __init__(self, seen: list):
        super().__init__()
        self.lin, self.seen = nn.Linear(4, 4), seen

    def forward(self, x):
        self.seen.append(("fwd", torch.get_num_threads()))
        return _Record.apply(self.lin(x), self.seen)


@pytest.fixture
def threads(monkeypatch):
    monkeypatch.setattr(core_lending, "CHECK_S", 0.0)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_threads_follow_the_servers_between_forward_and_backward(threads):
    seen, state = [], {"idle": False}
    layers = nn.ModuleList([Probe(seen), Probe(seen)])
    lending = CoreLending(own=1, cores=2, idle=lambda: state["idle"])
    lending.attach(layers)
    x = torch.randn(3, 4)
    out = layers[1](layers[0](x))
    state["idle"] = True  # the servers finished the next batch while the layers ran forward
    out.sum().backward()
    assert seen == [("fwd", 1), ("fwd", 1), ("bwd", 2), ("bwd", 2)]
    lent = lending.metrics()["perf/cores_lent_frac"]
    assert 0 < lent <= 1
    state["idle"] = False  # a server has room again: the next forward is back on the learner's own share
    seen.clear()
    layers[0](x)
    assert seen == [("fwd", 1)] and torch.get_num_threads() == 1
    lending.metrics()  # the interval that ended with the return
    layers[0](x)
    assert lending.metrics()["perf/cores_lent_frac"] == 0.0  # an interval with no lending


def test_give_back_returns_the_share_until_the_next_check(threads):
    """Before an evaluation the learner returns to its own share: the servers evaluate beside it."""
    seen = []
    layers = nn.ModuleList([Probe(seen)])
    lending = CoreLending(own=1, cores=2, idle=lambda: True)
    lending.attach(layers)
    layers[0](torch.randn(2, 4))
    assert torch.get_num_threads() == 2
    lending.give_back()
    assert torch.get_num_threads() == 1
    layers[0](torch.randn(2, 4))  # the servers still wait: the next check lends again
    assert seen == [("fwd", 2), ("fwd", 2)] and 0 < lending.metrics()["perf/cores_lent_frac"] <= 1


def test_no_gradient_no_backward_hook(threads):
    seen = []
    layers = nn.ModuleList([Probe(seen)])
    CoreLending(own=1, cores=2, idle=lambda: True).attach(layers)
    with torch.no_grad():  # the proximal forward and evaluations: forward checks only
        layers[0](torch.randn(2, 4))
    assert seen == [("fwd", 2)]


def test_from_env_lends_only_more_cores_than_its_own(monkeypatch, threads):
    monkeypatch.delenv(LEND_CORES_ENV, raising=False)
    assert core_lending.from_env(lambda: True) is None
    monkeypatch.setenv(LEND_CORES_ENV, "1")  # no more than its own thread
    assert core_lending.from_env(lambda: True) is None
    monkeypatch.setenv(LEND_CORES_ENV, "4")
    lending = core_lending.from_env(lambda: True)
    assert (lending.own, lending.cores) == (1, 4)
