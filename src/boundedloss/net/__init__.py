"""I/O adapters for the sans-I/O core: real UDP sockets, a fake network with a virtual
clock, and the loss models both can apply."""

from .fake import Datagram, FakeNetwork, NodeProfile, PathProfile, Route
from .loss import (
    Bernoulli,
    Bottleneck,
    Combined,
    GilbertElliott,
    LossModel,
    Microburst,
    NoLoss,
    parse_loss_spec,
)
from .udp import UdpEndpoint

__all__ = [
    "Bernoulli",
    "Bottleneck",
    "Combined",
    "Datagram",
    "FakeNetwork",
    "GilbertElliott",
    "LossModel",
    "Microburst",
    "NoLoss",
    "NodeProfile",
    "PathProfile",
    "Route",
    "UdpEndpoint",
    "parse_loss_spec",
]
