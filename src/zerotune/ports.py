"""A free TCP port on the loopback interface, for the processes zerotune starts on this machine (torchrun's
rendezvous, lm-evaluation-harness's server); the kernel picks it, so two runs on one node don't collide."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
