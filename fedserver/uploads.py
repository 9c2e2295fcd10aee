"""The gate of ``PushUpdate``: the session behind an upload is heard from, a stopping server refuses it (the
client sends it again after the restart), and the rest is :mod:`fedserver.intake`'s admission and validation.

Apart from the coordinator so that the protocol's upload calls are not round-machine wiring; the intake stays
the one place that decides whether an update is taken.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from fedcore.compression.codecs import Decoder
from fedcore.compression.config import NONE
from fedcore.serialization import TensorMeta
from fedcore.update_report import UpdateReport
from fedserver.errors import ProtocolError
from fedserver.intake import UpdateIntake, UpdateTicket
from fedserver.membership import Membership
from fedserver.round_timing import RoundTimer

STOPPING = "server stopping; send the update again after it restarts"


class UploadGate:
    def __init__(self, members: Membership, intake: UpdateIntake, stopping: Callable[[], bool],
                 timing: RoundTimer | None = None) -> None:
        self.members = members
        self.intake = intake
        self._stopping = stopping
        self.timing = timing if timing is not None else RoundTimer()  # the upload phase of the round's timing

    def begin(self, session: str, round_: int, report: UpdateReport, is_delta: bool, manifest: list[TensorMeta],
              announced_bytes: int, masked: bool = False, compression: str = NONE) -> UpdateTicket:
        """Admission of an update header (the upload's first message; ``masked``: a secure-aggregation input;
        ``compression``: the encoding the header names); raises :class:`ProtocolError` (and records the
        rejection)."""
        began = self.timing.now()
        cid = self.members.touch(session)
        if self._stopping():
            raise ProtocolError("UNAVAILABLE", STOPPING)
        ticket = self.intake.begin(cid, round_, report, is_delta, manifest, announced_bytes, masked, compression)
        self.timing.upload_began(cid, round_, began)
        return ticket

    def reject_header(self, session: str, round_: int, code: str, reason: str) -> None:
        """Refuse an update whose header could not even be read (raises :class:`ProtocolError`)."""
        self.intake.reject(self.members.touch(session), round_, code, reason)

    def closed(self, ticket: UpdateTicket) -> str | None:
        """Why an update still being received can no longer be taken, or None."""
        return self.intake.closed(ticket)

    def reject_ticket(self, ticket: UpdateTicket, code: str, reason: str) -> None:
        self.intake.reject_ticket(ticket, code, reason)

    def decoder(self, ticket: UpdateTicket) -> Decoder | None:
        """A compressed update's streaming decoder (None: the tensors are reassembled as they are)."""
        return self.intake.decoder(ticket)

    def submit(self, ticket: UpdateTicket, tensors: Mapping[str, torch.Tensor] | torch.Tensor) -> None:
        if self._stopping():
            raise ProtocolError("UNAVAILABLE", STOPPING)
        self.intake.submit(ticket, tensors)
        self.timing.accepted(ticket.client_id, ticket.round)
