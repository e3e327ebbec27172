"""What a testbed is asked to be: its size, addresses, MTU, names, bottleneck and loss,
checked before anything is built."""

from __future__ import annotations

import ipaddress
from dataclasses import asdict, dataclass

from .host import check_prefix
from .loss_rules import check_probability
from .qdisc import Bottleneck
from .topology import MAX_WORKERS


@dataclass(frozen=True)
class TestbedConfig:
    """What to build. ``loss`` is the random-drop probability applied to UDP arriving at
    the server (``set_loss`` changes it, or sets it on another node, at run time)."""

    __test__ = False

    workers: int = 4
    subnet: str = "10.201.0.0/24"
    mtu: int = 1500
    prefix: str = "bl-"
    bottleneck: Bottleneck | None = None
    loss: float = 0.0

    def __post_init__(self):
        if not isinstance(self.workers, int) or not 1 <= self.workers <= MAX_WORKERS:
            raise ValueError(f"workers must be 1..{MAX_WORKERS}, got {self.workers!r}")
        try:
            net = ipaddress.ip_network(self.subnet, strict=False)
        except ValueError as e:
            raise ValueError(f"bad subnet {self.subnet!r}: {e}") from None
        if (net.version != 4 or not net.is_private or net.is_loopback or net.is_link_local
                or net.is_unspecified or net.is_multicast):
            raise ValueError(f"subnet {self.subnet} must be a private IPv4 range "
                             "(e.g. 10.201.0.0/24), not loopback or link-local; it is used "
                             "only inside our namespaces")
        if net.num_addresses - 2 < self.workers + 1:
            raise ValueError(f"subnet {self.subnet} has too few addresses for "
                             f"{self.workers} workers + 1 server")
        if not isinstance(self.mtu, int) or not 576 <= self.mtu <= 65535:
            raise ValueError(f"mtu must be 576..65535, got {self.mtu!r}")
        check_prefix(self.prefix)
        if self.bottleneck is not None:
            if not isinstance(self.bottleneck, Bottleneck):
                raise ValueError("bottleneck must be a Bottleneck or None")
            self.bottleneck.check_mtu(self.mtu)
        check_probability(self.loss)

    def to_dict(self) -> dict:
        d = asdict(self)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> TestbedConfig:
        d = dict(d)
        if d.get("bottleneck") is not None:
            d["bottleneck"] = Bottleneck(**d["bottleneck"])
        return cls(**d)
