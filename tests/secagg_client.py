"""``fedclient`` that kills itself with SIGKILL (as a power cut would) at one phase of secure aggregation in round 1:
the fault injection of the secure-aggregation dropout tests, kept out of the production modules.

    python -m tests.secagg_client PHASE <fedclient arguments>

PHASE is where the device dies: ``advertisement`` (before advertising its keys), ``shares`` (keys advertised, before
its sealed shares), ``masked`` (shares sent and the model trained, before its masked input) or ``unmask`` (its
masked input is in the sum, before it reveals its shares). The client is the real one (``fedclient.cli``); only
:class:`fedclient.secure.SecureClient` is wrapped. Exits 1 when the phase was never reached.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

from fedclient import secure
from fedclient.cli import main

PHASES = ("advertisement", "shares", "masked", "unmask")


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def install(phase: str) -> None:
    next_step = secure.SecureClient._next
    masked_input = secure.SecureClient.masked_input

    def dying_next(self: secure.SecureClient, r: secure.SecureRound, req: Any, want: str) -> Any:
        if r.round == 1 and req.WhichOneof("kind") == phase:
            die()
        return next_step(self, r, req, want)

    def dying_mask(self: secure.SecureClient, r: secure.SecureRound, *args: Any) -> Any:
        if r.round == 1 and phase == "masked":
            die()
        return masked_input(self, r, *args)

    secure.SecureClient._next = dying_next  # type: ignore[method-assign]
    secure.SecureClient.masked_input = dying_mask  # type: ignore[method-assign]


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in PHASES:
        sys.exit(f"usage: python -m tests.secagg_client {{{','.join(PHASES)}}} <fedclient arguments>")
    install(sys.argv[1])
    main(sys.argv[2:])
    sys.exit(1)  # the phase was never reached
