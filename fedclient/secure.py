"""A device's side of secure aggregation (SecAgg+, :mod:`fedcore.secagg.protocol`), around its local round.

With a server that announced :class:`~fedcore.secagg.config.SecureSettings` at join, each task runs:

1. before training (:meth:`SecureClient.prepare`): advertise fresh keys, answer the key request with sealed shares,
   and receive the mask request (the neighbours' shares for this device); a round the protocol abandons, or one
   that dropped this device, is not trained;
2. after training (:meth:`SecureClient.masked_input`): ``u_i`` (the new weights minus the model received, float32,
   as the server would compute it), validated, clipped and weighted as the server would have
   (:func:`fedcore.secagg.aggregate.prepare_input`), encoded and masked; the runner uploads it as an update of kind
   MASKED;
3. after the upload (:meth:`SecureClient.unmask`): answer the unmask request (never both shares of one device).

Requests are checked by the protocol (:class:`~fedcore.secagg.protocol.RequestRefused`: a request for another
round, a forged or re-used key, a reveal this device must not make): a refused request ends the device's part in
the round, logged as ``secagg.refused``; the device's secrets live in memory only, for one round. Neighbours'
advertisements are accepted as the server relays them (the server is trusted to relay keys faithfully, not to see
updates: docs/security.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fedcore.secagg import protocol as sp
from fedcore.secagg.aggregate import prepare_input
from fedcore.secagg.config import SecureSettings, protocol_round
from fedguard import wire
from fedguard.v1 import fedguard_pb2 as pb

Exchange = Callable[[pb.SecAggRequest], pb.SecAggReply]


def accept_relayed(client_id: str, message: bytes, signature: bytes) -> bool:
    """A device's verifier of its neighbours' advertisements: the server relays them (module docstring)."""
    return True


class SecureRoundAbandoned(Exception):
    """This device takes no further part in the round (abandoned, dropped, or a request it refused)."""


@dataclass
class SecureRound:
    """One round's protocol state on the device (its secrets: memory only)."""

    round: int
    attempt: int
    state: sp.ClientState
    mask_request: sp.MaskRequest | None = None


class SecureClient:
    """The device's secure-aggregation phases; ``exchange`` sends one ``SecAggRequest`` (on the Session stream or
    the unary call) and returns the server's reply; ``sign``: the advertisement's signer."""

    def __init__(self, settings: SecureSettings, federation_id: str, client_id: str, session: Callable[[], str],
                 exchange: Exchange, sign: Callable[[bytes], bytes], log: Any, poll_s: float = 30.0) -> None:
        self.settings = settings
        self.federation_id = federation_id
        self.client_id = client_id
        self._session = session
        self._exchange = exchange
        self._sign = sign
        self.log = log
        self.poll_s = poll_s

    def _request(self, r: SecureRound, **kind: Any) -> pb.SecAggRequest:
        return pb.SecAggRequest(session_id=self._session(), round=r.round, attempt=r.attempt, max_wait_s=self.poll_s,
                                **kind)

    def _next(self, r: SecureRound, req: pb.SecAggRequest, want: str) -> pb.SecAggReply:
        """Send ``req``, then poll until the reply is ``want`` (``done`` ends with it too)."""
        reply = self._exchange(req)
        while True:
            kind = reply.WhichOneof("kind")
            if (int(reply.round), int(reply.attempt)) != (r.round, r.attempt):
                raise SecureRoundAbandoned(f"the server answered for round {reply.round} attempt {reply.attempt}")
            if kind == want or kind == "done":
                return reply
            if kind == "abandoned":
                raise SecureRoundAbandoned(reply.abandoned)
            if kind != "wait":
                raise SecureRoundAbandoned(f"expected {want}, the server sent {kind or 'nothing'}")
            reply = self._exchange(self._request(r, poll=True))

    def prepare(self, round_: int, attempt: int) -> SecureRound:
        """Phases 1 and 2, before training: keys advertised, shares sent, the mask request received. Raises
        :class:`SecureRoundAbandoned` when the device takes no part in the round."""
        proto_round = protocol_round(round_, attempt)
        state, adv = sp.client_advertise(self.federation_id, proto_round, self.client_id, self._sign)
        r = SecureRound(round_, attempt, state)
        reply = self._next(r, self._request(r, advertisement=wire.advertisement_to_pb(adv)), "key_request")
        if reply.WhichOneof("kind") != "key_request":
            raise SecureRoundAbandoned("the round ended before the keys were shared")
        request = wire.key_request_from_pb(reply.key_request, self.federation_id, proto_round)
        try:
            r.state, upload = sp.client_share(r.state, request, accept_relayed, self.settings.config)
        except sp.RequestRefused as e:
            self._refused(r, e)
        reply = self._next(r, self._request(r, shares=wire.shares_to_pb(upload)), "mask_request")
        if reply.WhichOneof("kind") != "mask_request":
            raise SecureRoundAbandoned("the round ended before masking")
        r.mask_request = wire.mask_request_from_pb(reply.mask_request, self.federation_id, proto_round,
                                                   self.client_id)
        return r

    def masked_input(self, r: SecureRound, received: Mapping[str, torch.Tensor], trained: Mapping[str, torch.Tensor],
                     num_samples: float,
                     transform: Callable[[torch.Tensor], torch.Tensor] | None = None) -> sp.Words:
        """Phase 3: u_i = trained - received over the floating-point tensors (float32, the server's arithmetic),
        ``transform``-ed (compressed updates: what the announced encoding would deliver, the device's residual
        kept), prepared as the server would aggregate it, and masked. Raises :class:`SecureRoundAbandoned` (a
        refused mask request) or ValueError (an update the server would have refused)."""
        assert r.mask_request is not None
        floats = [(k, t) for k, t in trained.items() if t.is_floating_point()]
        update = torch.empty(sum(t.numel() for _, t in floats), dtype=torch.float32)
        at = 0
        for k, t in floats:  # each tensor's difference written into its slice: no per-tensor temporaries
            n = t.numel()
            torch.sub(t.detach().reshape(-1).to(torch.float32), received[k].reshape(-1).to(torch.float32),
                      out=update[at:at + n])
            at += n
        if transform is not None:
            update = transform(update)
        words = prepare_input(update, num_samples, self.settings)
        try:  # the words are this call's own: masked in place, they are the upload
            r.state, upload = sp.client_mask(r.state, r.mask_request, words, in_place=True)
        except sp.RequestRefused as e:
            self._refused(r, e)
        return upload.vector

    def unmask(self, r: SecureRound) -> None:
        """Phase 4, after the masked input was taken: answer the unmask request; returns when the device is done."""
        reply = self._next(r, self._request(r, poll=True), "unmask_request")
        if reply.WhichOneof("kind") != "unmask_request":
            return
        request = wire.unmask_request_from_pb(reply.unmask_request, self.federation_id, r.state.round,
                                              self.client_id)
        try:
            r.state, upload = sp.client_unmask(r.state, request)
        except sp.RequestRefused as e:
            self._refused(r, e)
        self._next(r, self._request(r, unmask=wire.unmask_to_pb(upload)), "done")

    def _refused(self, r: SecureRound, e: sp.RequestRefused) -> None:
        self.log.warning("secagg.refused", client_id=self.client_id, round=r.round, attempt=r.attempt,
                         reason=e.reason)
        raise SecureRoundAbandoned(f"refused the server's request: {e.reason}")
