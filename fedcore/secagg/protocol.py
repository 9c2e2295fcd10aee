"""SecAgg+ secure aggregation of fixed-point updates: the client's phases and the server's pure state machine.

Each participant u of a round (Bonawitz et al. CCS 2017, with the neighbour graph of Bell et al. CCS 2020):

1. ADVERTISE: draws two X25519 key pairs, c (sealing shares) and s (pairwise masks), and sends the public keys
   signed over (federation, round, client id, c_pk, s_pk) by the transport's identity key
   (:func:`client_advertise`).
2. SHARE: given the participants U1, the graph parameters and its neighbours' signed advertisements, it checks the
   signatures and the parameters, draws its self-mask seed b_u and Shamir-shares b_u and s_u's private key among
   its k neighbours (threshold t), each pair of shares sealed for its neighbour (:func:`client_share`).
3. MASKED: given the sealed shares of its neighbours that shared (U2), it sends its encoded input (:func:`encode_input`:
   the two fixed-point limbs of ``[update * multiplier, extras]`` of :mod:`fedcore.aggregation.fixedpoint`, as 2N
   words modulo 2^64) plus PRG(b_u) plus, for each neighbour v in U2, ``+PRG(s_uv)`` if u < v else ``-PRG(s_uv)``
   (:func:`client_mask`).
4. UNMASK: for each neighbour v it holds shares of, it reveals the share of b_v if the server lists v as a survivor
   (v's masked input is in the sum, U3) or the share of s_v's private key if v dropped after sharing -- never both,
   and never b_v for a v it knows dropped (:func:`client_unmask` refuses such a request, and a second one).

The server (:func:`step`) sums the masked inputs of U3 modulo 2^64 (it keeps the running sum only, never an
individual vector, masked or not), reconstructs b_u for u in U3 and s_v for v in U2 \\ U3 from t shares each,
checks each against u's commitment or v's advertised key, and removes the masks. The result
(:class:`SecureSum`) is the two limbs' sums over U3: loaded into a :class:`FixedPointSum` they are, bit for bit,
the accumulators of ``add(u_i, m_i)`` over the survivors, so the mean equals plain streaming FedAvg's.

Dropouts: up to ``max_dropped`` participants (``floor(max_dropout * K)``, see :mod:`fedcore.secagg.graph`) may drop in
any phase after advertising. A round is abandoned, with a named reason and never with a wrong sum, when fewer than
``min_clients`` advertise (:data:`TOO_FEW_CLIENTS`), when fewer than ``K - max_dropped`` participants remain in the
sum (:data:`TOO_MANY_DROPOUTS`), when some secret has fewer than t holders left (:data:`BELOW_THRESHOLD`), or when a
reconstructed secret does not match its commitment or public key (:data:`BAD_SHARE`).

Round binding: every message carries the federation id and the round; anything else is refused. Advertisements are
verified (replayed from another round, forged or re-using another participant's keys: refused) by the server and by
each client; sealed shares authenticate the federation, round, sender and recipient.

The server machine follows :mod:`fedcore.rounds`: frozen observations (the clients' messages, :class:`Dropped`,
:class:`Deadline`) in, events out, ``step(state, obs, verify) -> (new state, events)`` with no clock and no
randomness; the state is frozen and serializes with :meth:`ServerState.to_dict`. It holds no client secret: public
keys, sealed shares, commitments, the masked sum, and the shares revealed to it for unmasking.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import hmac
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from fedcore.aggregation.fixedpoint import ADD_LIMIT, FixedPointSum, encode
from fedcore.secagg import crypto, prg, shamir
from fedcore.secagg.config import SecureAggregationConfig
from fedcore.secagg.crypto import KeyPair, Signer, Verifier
from fedcore.secagg.graph import GraphParameters, choose_parameters, neighbour_graph

ADVERTISE, SHARE, MASKED, UNMASK, DONE, ABANDONED = "advertise", "share", "masked", "unmask", "done", "abandoned"
ACTIVE = (ADVERTISE, SHARE, MASKED, UNMASK)

# Why a round was abandoned.
TOO_FEW_CLIENTS = "too_few_clients"
TOO_MANY_DROPOUTS = "too_many_dropouts"
BELOW_THRESHOLD = "below_threshold"
BAD_SHARE = "bad_share"

SECRET_BYTES = 32
COMMITMENT_BYTES = 32
_SEALED_SHARES_BYTES = crypto.NONCE_BYTES + 2 * shamir.SHARE_BYTES + 16

Words = npt.NDArray[np.uint64]


class RequestRefused(ValueError):
    """A client refuses a server request (wrong round, bad signature, a reveal it must not make, ...)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


# ---- messages: client -> server ----

@dataclass(frozen=True)
class Advertisement:
    """Phase 1: a participant's public keys, signed over (federation, round, client id, c_pk, s_pk)."""

    federation_id: str
    round: int
    client_id: str
    c_pk: bytes
    s_pk: bytes
    signature: bytes

    def message(self) -> bytes:
        return crypto.advertisement_message(self.federation_id, self.round, self.client_id, self.c_pk, self.s_pk)


@dataclass(frozen=True)
class EncryptedShare:
    """The sender's shares of its self-mask seed and of its mask key, sealed for the recipient."""

    sender: str
    recipient: str
    ciphertext: bytes


@dataclass(frozen=True)
class ShareUpload:
    """Phase 2: one sealed pair of shares per neighbour, and the commitment to the self-mask seed."""

    federation_id: str
    round: int
    client_id: str
    shares: tuple[EncryptedShare, ...]
    commitment: bytes


@dataclass(frozen=True, eq=False)
class MaskedUpload:
    """Phase 3: the masked input, 2N uint64 words (the hi limbs of the N coordinates, then the lo limbs)."""

    federation_id: str
    round: int
    client_id: str
    vector: Words


@dataclass(frozen=True)
class UnmaskUpload:
    """Phase 4: the shares revealed, as (owner id, share bytes): of self-mask seeds of survivors, of mask keys of
    participants that dropped after sharing."""

    federation_id: str
    round: int
    client_id: str
    self_mask_shares: tuple[tuple[str, bytes], ...]
    key_shares: tuple[tuple[str, bytes], ...]


# ---- requests: server -> client (built from the state by key_request, mask_request, unmask_request) ----

@dataclass(frozen=True)
class KeyRequest:
    """Start of phase 2: the participants, the graph, the vector size, and the recipient's neighbours' keys."""

    federation_id: str
    round: int
    participants: tuple[str, ...]
    neighbours: int
    threshold: int
    min_survivors: int
    graph_seed: int
    num_params: int
    num_extras: int
    advertisements: tuple[Advertisement, ...]


@dataclass(frozen=True)
class MaskRequest:
    """Start of phase 3: the sealed shares addressed to the recipient by its neighbours that shared."""

    federation_id: str
    round: int
    recipient: str
    shares: tuple[EncryptedShare, ...]


@dataclass(frozen=True)
class UnmaskRequest:
    """Start of phase 4: the survivors (whose masked inputs are summed) and which shares to reveal."""

    federation_id: str
    round: int
    recipient: str
    survivors: tuple[str, ...]
    reveal_self_mask: tuple[str, ...]
    reveal_key: tuple[str, ...]


# ---- other observations ----

@dataclass(frozen=True)
class Dropped:
    """The transport lost the client (disconnected, timed out): it is not waited for any more this round."""

    round: int
    client_id: str


@dataclass(frozen=True)
class Deadline:
    """The phase's deadline passed: whoever has not answered is dropped and the phase closes."""

    round: int
    phase: str


Observation = Advertisement | ShareUpload | MaskedUpload | UnmaskUpload | Dropped | Deadline


# ---- result and events ----

@dataclass(frozen=True, eq=False)
class SecureSum:
    """The unmasked sums over the survivors: ``hi`` and ``lo`` (uint64 ``[P + E]``) are the limbs of
    :class:`FixedPointSum` after one ``add`` per survivor (the first ``num_params`` the update's, the rest the extra
    scalars')."""

    survivors: tuple[str, ...]
    num_params: int
    hi: Words
    lo: Words

    @property
    def num_extras(self) -> int:
        return int(self.hi.shape[0]) - self.num_params

    def params(self, workers: int | None = None) -> FixedPointSum:
        """The parameters' sum as a :class:`FixedPointSum` (``.value(divisor)`` gives the mean)."""
        fps = FixedPointSum(self.num_params, workers)
        fps.add_encoded(self.hi[: self.num_params], self.lo[: self.num_params], len(self.survivors))
        return fps

    def extras(self) -> tuple[Fraction, ...]:
        """The extra scalars' exact sums."""
        if self.num_extras == 0:
            return ()
        fps = FixedPointSum(self.num_extras, 1)
        fps.add_encoded(self.hi[self.num_params:], self.lo[self.num_params:], len(self.survivors))
        return tuple(fps.exact(i) for i in range(self.num_extras))


@dataclass(frozen=True)
class Refused:
    """A message was refused (the state is unchanged)."""

    client_id: str
    round: int
    reason: str


@dataclass(frozen=True)
class PhaseStarted:
    """A phase began: send each listed client its request (:func:`key_request`, :func:`mask_request`,
    :func:`unmask_request`)."""

    round: int
    phase: str
    clients: tuple[str, ...]


@dataclass(frozen=True)
class Abandoned:
    round: int
    phase: str
    reason: str
    detail: str


@dataclass(frozen=True, eq=False)
class Completed:
    round: int
    result: SecureSum


Event = Refused | PhaseStarted | Abandoned | Completed


# ---- input encoding ----

def encode_input(update: torch.Tensor | npt.NDArray[np.float32], multiplier: float,
                 extras: Sequence[float] = (), norm_bound: float = 0.0) -> Words:
    """The plain input of a client: ``[hi limbs of (multiplier * update, extras), lo limbs of the same]`` (2N uint64
    words, N = P + len(extras)), each coordinate exactly as one :meth:`FixedPointSum.add` (the update, float32 ``[P]``)
    or as the float64 term itself (each extra scalar, e.g. ``m_i`` and ``m_i * ||u_i||^2`` for w_div).
    Raises ValueError for an update out of the exact range, non-finite values, or (``norm_bound > 0``) an update
    whose L2 norm exceeds ``norm_bound``."""
    arr = update.detach().contiguous().numpy() if isinstance(update, torch.Tensor) else update
    if arr.dtype != np.float32 or arr.ndim != 1:
        raise ValueError(f"expected a float32 [P] update, got {arr.dtype} {arr.shape}")
    # max |u| without a |u| temporary: numpy's max and min return NaN when any value is NaN, and so does this
    max_abs = max(float(arr.max()), -float(arr.min())) if arr.size else 0.0
    problem = FixedPointSum.range_error(max_abs, multiplier)
    if problem is not None:
        raise ValueError(problem)
    if norm_bound > 0:
        norm = float(np.linalg.norm(arr.astype(np.float64)))
        if not norm <= norm_bound:
            raise ValueError(f"update L2 norm {norm:.6g} exceeds the secure-aggregation norm bound {norm_bound:.6g}")
    ex = np.asarray(list(extras), dtype=np.float64)
    if ex.size and not bool(np.all(np.abs(ex) <= ADD_LIMIT)):
        raise ValueError(f"extra scalars must be finite and within ±{ADD_LIMIT:g}, got {ex.tolist()}")
    p, n = arr.shape[0], arr.shape[0] + ex.shape[0]
    words = np.empty(2 * n, dtype=np.uint64)  # one buffer, written in place: [hi, extras' hi, lo, extras' lo]
    encode(arr, multiplier, out=(words[:p], words[n:n + p]))
    encode(ex, 1.0, out=(words[p:n], words[n + p:]))
    return words


# ---- client ----

@dataclass(frozen=True)
class ClientState:
    """One participant's round: its keys and secrets (never printed, never serialized) and what it learned."""

    federation_id: str
    round: int
    client_id: str
    c_keys: KeyPair = field(repr=False)
    s_keys: KeyPair = field(repr=False)
    phase: str = ADVERTISE
    participants: tuple[str, ...] = ()
    neighbours: tuple[str, ...] = ()
    threshold: int = 0
    min_survivors: int = 0
    vector_length: int = 0
    peers: Mapping[str, Advertisement] = field(default_factory=dict)
    self_seed: bytes = field(default=b"", repr=False)
    # owner -> (share of its self-mask seed, share of its mask key), as received
    held: Mapping[str, tuple[bytes, bytes]] = field(default_factory=dict, repr=False)
    # neighbours that never shared with this client: dropped before masking
    known_dropped: frozenset[str] = frozenset()


def client_advertise(federation_id: str, round_: int, client_id: str, sign: Signer,
                     keys: tuple[KeyPair, KeyPair] | None = None) -> tuple[ClientState, Advertisement]:
    """Phase 1: fresh c and s key pairs (``keys``: given ones, for reproducible tests) and their signed
    advertisement."""
    c_keys, s_keys = keys if keys is not None else (KeyPair.generate(), KeyPair.generate())
    msg = crypto.advertisement_message(federation_id, round_, client_id, c_keys.public, s_keys.public)
    adv = Advertisement(federation_id, round_, client_id, c_keys.public, s_keys.public, sign(msg))
    return ClientState(federation_id, round_, client_id, c_keys, s_keys), adv


def _check_round(state: ClientState, federation_id: str, round_: int, what: str) -> None:
    if federation_id != state.federation_id:
        raise RequestRefused(f"{what} for federation {federation_id!r}, this client is in {state.federation_id!r}")
    if round_ != state.round:
        raise RequestRefused(f"{what} for round {round_}, this client is in round {state.round}")


def _advertisement_problem(adv: Advertisement, federation_id: str, round_: int, verify: Verifier) -> str | None:
    if adv.federation_id != federation_id or adv.round != round_:
        return (f"advertisement of {adv.client_id!r} is for round {adv.round} of {adv.federation_id!r}, "
                f"not round {round_} of {federation_id!r} (replayed)")
    if len(adv.c_pk) != crypto.KEY_BYTES or len(adv.s_pk) != crypto.KEY_BYTES or adv.c_pk == adv.s_pk:
        return f"advertisement of {adv.client_id!r} does not hold two distinct 32-byte public keys"
    if not verify(adv.client_id, adv.message(), adv.signature):
        return f"advertisement signature of {adv.client_id!r} does not verify"
    return None


def client_share(state: ClientState, request: KeyRequest, verify: Verifier, config: SecureAggregationConfig,
                 randbytes: Callable[[int], bytes] = secrets.token_bytes) -> tuple[ClientState, ShareUpload]:
    """Phase 2: check the request (round, graph parameters against ``config``, neighbours' signatures and keys),
    draw the self-mask seed (``randbytes``; cryptographic by default) and seal the shares for each neighbour.
    Raises :class:`RequestRefused`."""
    _check_round(state, request.federation_id, request.round, "key request")
    if state.phase != ADVERTISE:
        raise RequestRefused(f"this client already shared its keys in round {state.round}")
    parts = request.participants
    if len(set(parts)) != len(parts) or list(parts) != sorted(parts) or state.client_id not in parts:
        raise RequestRefused("participants must be distinct, sorted and include this client")
    try:
        params = choose_parameters(len(parts), config)
    except ValueError as e:
        raise RequestRefused(str(e)) from None
    if (request.neighbours, request.threshold, request.min_survivors) != (
            params.neighbours, params.threshold, params.min_survivors):
        raise RequestRefused(
            f"graph parameters (k={request.neighbours}, t={request.threshold}, min survivors "
            f"{request.min_survivors}) differ from the configuration's (k={params.neighbours}, "
            f"t={params.threshold}, min survivors {params.min_survivors}) for {len(parts)} participants")
    if request.num_params < 0 or request.num_extras < 0:
        raise RequestRefused("vector sizes must be >= 0")
    neighbours = neighbour_graph(parts, params.neighbours, request.graph_seed)[state.client_id]
    peers = {a.client_id: a for a in request.advertisements}
    if len(peers) != len(request.advertisements) or set(peers) != set(neighbours):
        raise RequestRefused("the advertisements are not exactly this client's neighbours'")
    keys = {state.c_keys.public, state.s_keys.public}
    for v in neighbours:
        problem = _advertisement_problem(peers[v], state.federation_id, state.round, verify)
        if problem is not None:
            raise RequestRefused(problem)
        if peers[v].c_pk in keys or peers[v].s_pk in keys:
            raise RequestRefused(f"advertisement of {v!r} re-uses another participant's public key")
        keys.update((peers[v].c_pk, peers[v].s_pk))
    seed = randbytes(SECRET_BYTES)
    index = {u: i + 1 for i, u in enumerate(parts)}
    xs = [index[v] for v in neighbours]
    t = params.threshold
    b_shares = shamir.split(seed, t, xs)
    s_shares = shamir.split(state.s_keys.private_bytes(), t, xs)
    sealed = []
    for v, bs, ss in zip(neighbours, b_shares, s_shares, strict=True):
        try:
            key = crypto.share_key(state.c_keys.private, peers[v].c_pk, state.federation_id, state.round,
                                   state.client_id, v)
        except ValueError as e:
            raise RequestRefused(f"public key of {v!r} is unusable: {e}") from None
        aad = crypto.share_aad(state.federation_id, state.round, state.client_id, v)
        sealed.append(EncryptedShare(state.client_id, v, crypto.seal(key, bs.to_bytes() + ss.to_bytes(), aad)))
    upload = ShareUpload(state.federation_id, state.round, state.client_id, tuple(sealed),
                         crypto.commitment(state.federation_id, state.round, state.client_id, seed))
    new = replace(state, phase=SHARE, participants=parts, neighbours=neighbours, threshold=t,
                  min_survivors=params.min_survivors, vector_length=2 * (request.num_params + request.num_extras),
                  peers=peers, self_seed=seed)
    return new, upload


def client_mask(state: ClientState, request: MaskRequest, encoded: Words, *,
                in_place: bool = False) -> tuple[ClientState, MaskedUpload]:
    """Phase 3: open the neighbours' shares (each must authenticate for this round and pair) and mask ``encoded``
    (:func:`encode_input`) with the self mask and the pairwise masks of the neighbours that shared. Raises
    :class:`RequestRefused`. ``in_place``: ``encoded`` itself is masked and becomes the upload's vector (the caller
    hands it over: no 16-bytes-per-coordinate copy); by default it is left as it was."""
    _check_round(state, request.federation_id, request.round, "mask request")
    if state.phase != SHARE or request.recipient != state.client_id:
        raise RequestRefused("mask request out of order or for another client")
    if encoded.dtype != np.uint64 or encoded.shape != (state.vector_length,):
        raise ValueError(f"expected the encoded input as uint64 [{state.vector_length}], got {encoded.dtype} "
                         f"{encoded.shape}")
    u = state.client_id
    mine = state.participants.index(u) + 1
    held: dict[str, tuple[bytes, bytes]] = {}
    for es in request.shares:
        v = es.sender
        if v not in state.peers or es.recipient != u or v in held:
            raise RequestRefused(f"share from {v!r} is not one this client expects")
        key = crypto.share_key(state.c_keys.private, state.peers[v].c_pk, state.federation_id, state.round, v, u)
        try:
            plain = crypto.open_sealed(key, es.ciphertext, crypto.share_aad(state.federation_id, state.round, v, u))
        except crypto.DecryptionError as e:
            raise RequestRefused(f"share from {v!r}: {e}") from None
        b_raw, s_raw = plain[: shamir.SHARE_BYTES], plain[shamir.SHARE_BYTES:]
        try:
            bx, sx = shamir.Share.from_bytes(b_raw).x, shamir.Share.from_bytes(s_raw).x
        except shamir.ShamirError as e:
            raise RequestRefused(f"share from {v!r}: {e}") from None
        if bx != mine or sx != mine:
            raise RequestRefused(f"share from {v!r} is not for this client's point")
        held[v] = (b_raw, s_raw)
    if len(held) < state.threshold:
        raise RequestRefused(f"{BELOW_THRESHOLD}: only {len(held)} neighbours shared, {state.threshold} needed")
    add: list[bytes] = [state.self_seed]
    subtract: list[bytes] = []
    for v in held:
        seed = crypto.mask_seed(state.s_keys.private, state.peers[v].s_pk, state.federation_id, state.round, u, v)
        (add if u < v else subtract).append(seed)
    vector = encoded if in_place else encoded.copy()
    prg.apply_masks(vector, add, subtract)
    new = replace(state, phase=MASKED, held=held, known_dropped=frozenset(state.neighbours) - frozenset(held))
    return new, MaskedUpload(state.federation_id, state.round, u, vector)


def client_unmask(state: ClientState, request: UnmaskRequest) -> tuple[ClientState, UnmaskUpload]:
    """Phase 4: reveal, for each neighbour named, the share of its self-mask seed (a survivor) or of its mask key
    (dropped after sharing). Refuses (:class:`RequestRefused`) a second request, a request naming one device for
    both, the self-mask share of a device this client knows dropped or the server does not list as a survivor,
    the key share of a listed survivor, and a request with fewer survivors than the round's minimum."""
    _check_round(state, request.federation_id, request.round, "unmask request")
    if request.recipient != state.client_id:
        raise RequestRefused("unmask request for another client")
    if state.phase == UNMASK:
        raise RequestRefused(f"this client already answered an unmask request in round {state.round}")
    if state.phase != MASKED:
        raise RequestRefused("this client sent no masked input this round")
    survivors = set(request.survivors)
    if len(survivors) != len(request.survivors) or not survivors <= set(state.participants):
        raise RequestRefused("survivors must be distinct participants")
    if len(survivors) < state.min_survivors:
        raise RequestRefused(f"only {len(survivors)} survivors, fewer than the round's minimum "
                             f"{state.min_survivors}: the sum would expose too few inputs")
    both = set(request.reveal_self_mask) & set(request.reveal_key)
    if both:
        raise RequestRefused(f"request asks for both the self-mask share and the key share of {sorted(both)}")
    if len(set(request.reveal_self_mask)) != len(request.reveal_self_mask) or len(set(request.reveal_key)) != len(
            request.reveal_key):
        raise RequestRefused("request names a device twice")
    for v in request.reveal_self_mask:
        if v in state.known_dropped:
            raise RequestRefused(f"{v!r} dropped before masking: its self-mask share is never revealed")
        if v not in state.held:
            raise RequestRefused(f"this client holds no share of {v!r}")
        if v not in survivors:
            raise RequestRefused(f"the self-mask share of {v!r} is asked for, but {v!r} is not a survivor")
    for v in request.reveal_key:
        if v not in state.held:
            raise RequestRefused(f"this client holds no share of {v!r}")
        if v in survivors:
            raise RequestRefused(f"the key share of {v!r} is asked for, but {v!r} is a survivor")
    upload = UnmaskUpload(state.federation_id, state.round, state.client_id,
                          tuple((v, state.held[v][0]) for v in request.reveal_self_mask),
                          tuple((v, state.held[v][1]) for v in request.reveal_key))
    return replace(state, phase=UNMASK), upload


# ---- server ----

@dataclass(frozen=True, eq=False)
class ServerState:
    """One secure-aggregation round on the server (see the module docstring). Sets: U1 = ``participants``
    (advertised), U2 = keys of ``shares`` (shared), U3 = ``masked`` (in the sum), U4 = keys of ``revealed``."""

    federation_id: str
    round: int
    selected: tuple[str, ...]
    config: SecureAggregationConfig
    graph_seed: int
    num_params: int
    num_extras: int = 0
    phase: str = ADVERTISE
    advertisements: Mapping[str, Advertisement] = field(default_factory=dict)
    graph: GraphParameters | None = None
    participants: tuple[str, ...] = ()
    shares: Mapping[str, tuple[EncryptedShare, ...]] = field(default_factory=dict)
    commitments: Mapping[str, bytes] = field(default_factory=dict)
    masked: tuple[str, ...] = ()
    masked_sum: Words | None = field(default=None, repr=False)
    revealed: Mapping[str, UnmaskUpload] = field(default_factory=dict, repr=False)
    dropped: Mapping[str, str] = field(default_factory=dict)
    reason: str = ""
    detail: str = ""
    result: SecureSum | None = field(default=None, repr=False)
    # The sealed shares by recipient, fixed when sharing closes (derived from ``shares``; not serialized).
    share_index: Mapping[str, tuple[EncryptedShare, ...]] = field(default_factory=dict, repr=False)

    @property
    def vector_length(self) -> int:
        return 2 * (self.num_params + self.num_extras)

    @functools.cached_property
    def masked_set(self) -> frozenset[str]:
        """``masked`` as a set (worked out once per state: membership tests stay O(1) as inputs arrive)."""
        return frozenset(self.masked)

    def shares_by_recipient(self) -> Mapping[str, tuple[EncryptedShare, ...]]:
        """The sealed shares by recipient: ``share_index`` once sharing closed (every mask request reads it), else
        worked out now."""
        return self.share_index or _index_shares(self.shares)

    def neighbours(self) -> Mapping[str, tuple[str, ...]]:
        """The round's neighbour graph (after advertisement)."""
        if self.graph is None:
            raise ValueError("the neighbour graph is fixed when advertisement closes")
        return neighbour_graph(self.participants, self.graph.neighbours, self.graph_seed)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data (bytes and arrays as base64); :meth:`from_dict` reads it back."""
        return {
            "federation_id": self.federation_id, "round": self.round, "selected": list(self.selected),
            "config": dataclasses.asdict(self.config), "graph_seed": self.graph_seed,
            "num_params": self.num_params, "num_extras": self.num_extras, "phase": self.phase,
            "advertisements": {c: [_b64(a.c_pk), _b64(a.s_pk), _b64(a.signature)]
                               for c, a in self.advertisements.items()},
            "graph": None if self.graph is None else dataclasses.asdict(self.graph),
            "participants": list(self.participants),
            "shares": {c: [[s.recipient, _b64(s.ciphertext)] for s in ss] for c, ss in self.shares.items()},
            "commitments": {c: _b64(v) for c, v in self.commitments.items()},
            "masked": list(self.masked),
            "masked_sum": None if self.masked_sum is None else _words_b64(self.masked_sum),
            "revealed": {c: [[[o, _b64(b)] for o, b in r.self_mask_shares], [[o, _b64(b)] for o, b in r.key_shares]]
                         for c, r in self.revealed.items()},
            "dropped": dict(self.dropped), "reason": self.reason, "detail": self.detail,
            "result": None if self.result is None else {
                "survivors": list(self.result.survivors), "num_params": self.result.num_params,
                "hi": _words_b64(self.result.hi), "lo": _words_b64(self.result.lo)},
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ServerState:
        fed, rnd = str(d["federation_id"]), int(d["round"])
        result = d.get("result")
        state = cls(
            federation_id=fed, round=rnd, selected=tuple(d["selected"]),
            config=SecureAggregationConfig(**d["config"]), graph_seed=int(d["graph_seed"]),
            num_params=int(d["num_params"]), num_extras=int(d["num_extras"]), phase=str(d["phase"]),
            advertisements={c: Advertisement(fed, rnd, c, _unb64(a[0]), _unb64(a[1]), _unb64(a[2]))
                            for c, a in d["advertisements"].items()},
            graph=None if d["graph"] is None else GraphParameters(**d["graph"]),
            participants=tuple(d["participants"]),
            shares={c: tuple(EncryptedShare(c, r, _unb64(ct)) for r, ct in ss) for c, ss in d["shares"].items()},
            commitments={c: _unb64(v) for c, v in d["commitments"].items()},
            masked=tuple(d["masked"]),
            masked_sum=None if d["masked_sum"] is None else _b64_words(d["masked_sum"]),
            revealed={c: UnmaskUpload(fed, rnd, c, tuple((o, _unb64(b)) for o, b in r[0]),
                                      tuple((o, _unb64(b)) for o, b in r[1])) for c, r in d["revealed"].items()},
            dropped=dict(d["dropped"]), reason=str(d["reason"]), detail=str(d["detail"]),
            result=None if result is None else SecureSum(tuple(result["survivors"]), int(result["num_params"]),
                                                         _b64_words(result["hi"]), _b64_words(result["lo"])),
        )
        return state if state.phase in (ADVERTISE, SHARE) else replace(state, share_index=_index_shares(state.shares))


def _index_shares(shares: Mapping[str, tuple[EncryptedShare, ...]]) -> Mapping[str, tuple[EncryptedShare, ...]]:
    out: dict[str, list[EncryptedShare]] = {}
    for v in sorted(shares):
        for es in shares[v]:
            out.setdefault(es.recipient, []).append(es)
    return {r: tuple(x) for r, x in out.items()}


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode("ascii")


def _unb64(s: str) -> bytes:
    return base64.b64decode(s.encode("ascii"), validate=True)


def _words_b64(a: Words) -> str:
    return _b64(a.astype("<u8").tobytes())


def _b64_words(s: str) -> Words:
    return np.frombuffer(_unb64(s), dtype="<u8").astype(np.uint64)


def new_round(federation_id: str, round_: int, selected: Sequence[str], config: SecureAggregationConfig,
              graph_seed: int, num_params: int, num_extras: int = 0) -> tuple[ServerState, list[Event]]:
    """A round in phase ADVERTISE: ask ``selected`` to advertise. ``graph_seed`` (>= 0) fixes the neighbour graph
    (derive it from the federation seed, the round and the attempt); the input is ``num_params`` update coordinates
    and ``num_extras`` extra scalars."""
    config.validate()
    ids = tuple(sorted(set(selected)))
    if len(ids) != len(selected):
        raise ValueError("selected client ids must be distinct")
    if graph_seed < 0 or num_params < 0 or num_extras < 0:
        raise ValueError("graph_seed, num_params and num_extras must be >= 0")
    state = ServerState(federation_id, round_, ids, config, graph_seed, num_params, num_extras)
    return state, [PhaseStarted(round_, ADVERTISE, ids)]


def _expected(s: ServerState) -> tuple[str, ...]:
    if s.phase == ADVERTISE:
        return s.selected
    if s.phase == SHARE:
        return s.participants
    if s.phase == MASKED:
        return tuple(sorted(s.shares))
    if s.phase == UNMASK:
        return tuple(sorted(s.masked))
    return ()


def _answered(s: ServerState, client_id: str) -> bool:
    if s.phase == ADVERTISE:
        return client_id in s.advertisements
    if s.phase == SHARE:
        return client_id in s.shares
    if s.phase == MASKED:
        return client_id in s.masked_set
    return client_id in s.revealed


def _pending(s: ServerState) -> list[str]:
    return [c for c in _expected(s) if c not in s.dropped and not _answered(s, c)]


_PHASE_OF = {Advertisement: ADVERTISE, ShareUpload: SHARE, MaskedUpload: MASKED, UnmaskUpload: UNMASK}


def _refusal(s: ServerState, obs: Advertisement | ShareUpload | MaskedUpload | UnmaskUpload,
             verify: Verifier) -> str | None:
    """Why the server refuses a client's message, or None."""
    c = obs.client_id
    if obs.federation_id != s.federation_id:
        return f"message for federation {obs.federation_id!r}, this is {s.federation_id!r}"
    if obs.round != s.round:
        return f"message for round {obs.round}, the current round is {s.round} (replayed or late)"
    if s.phase not in ACTIVE:
        return f"round {s.round} is over ({s.phase})"
    want = _PHASE_OF[type(obs)]
    if want != s.phase:
        return f"a {want} message, but the round is in phase {s.phase}"
    if c in s.dropped:
        return f"client was counted as dropped in phase {s.dropped[c]}"
    if c not in _expected(s):
        return f"client is not expected in phase {s.phase}"
    if _answered(s, c):
        return f"client already answered phase {s.phase}"
    if isinstance(obs, Advertisement):
        problem = _advertisement_problem(obs, s.federation_id, s.round, verify)
        if problem is not None:
            return problem
        used = {k for a in s.advertisements.values() for k in (a.c_pk, a.s_pk)}
        if obs.c_pk in used or obs.s_pk in used:
            return "advertisement re-uses another participant's public key (replayed)"
        return None
    nb = s.neighbours()
    if isinstance(obs, ShareUpload):
        recipients = [es.recipient for es in obs.shares]
        if sorted(recipients) != list(nb[c]) or any(es.sender != c for es in obs.shares):
            return "shares must be one per neighbour, from the sender"
        if any(len(es.ciphertext) != _SEALED_SHARES_BYTES for es in obs.shares):
            return "malformed sealed share"
        if len(obs.commitment) != COMMITMENT_BYTES:
            return "malformed self-mask commitment"
        return None
    if isinstance(obs, MaskedUpload):
        if obs.vector.dtype != np.uint64 or obs.vector.shape != (s.vector_length,):
            return f"masked input must be uint64 [{s.vector_length}], got {obs.vector.dtype} {obs.vector.shape}"
        return None
    ask = _reveal_lists(s, c)
    if tuple(o for o, _ in obs.self_mask_shares) != ask[0] or tuple(o for o, _ in obs.key_shares) != ask[1]:
        return "revealed shares are not the ones asked for"
    point = s.participants.index(c) + 1
    for _, raw in (*obs.self_mask_shares, *obs.key_shares):
        try:
            if shamir.Share.from_bytes(raw).x != point:
                return "revealed share is not at the responder's point"
        except shamir.ShamirError as e:
            return f"malformed share: {e}"
    return None


def _reveal_lists(s: ServerState, client_id: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    held = [v for v in s.neighbours()[client_id] if v in s.shares]
    survivors = s.masked_set
    return tuple(v for v in held if v in survivors), tuple(v for v in held if v not in survivors)


def key_request(state: ServerState, client_id: str) -> KeyRequest:
    """The SHARE-phase request for a participant: the graph and its neighbours' advertisements."""
    g = state.graph
    if g is None:
        raise ValueError("no key request before advertisement closes")
    nb = state.neighbours()[client_id]
    return KeyRequest(state.federation_id, state.round, state.participants, g.neighbours, g.threshold,
                      g.min_survivors, state.graph_seed, state.num_params, state.num_extras,
                      tuple(state.advertisements[v] for v in nb))


def mask_request(state: ServerState, client_id: str) -> MaskRequest:
    """The MASKED-phase request: the sealed shares addressed to ``client_id`` by its neighbours that shared."""
    # In the neighbours' order; only a neighbour's share reaches here (the server refuses any other recipient).
    mine = {es.sender: es for es in state.shares_by_recipient().get(client_id, ())}
    out = [mine[v] for v in state.neighbours()[client_id] if v in mine]
    return MaskRequest(state.federation_id, state.round, client_id, tuple(out))


def unmask_request(state: ServerState, client_id: str) -> UnmaskRequest:
    """The UNMASK-phase request: survivors' self-mask shares, dropped participants' key shares."""
    own, key = _reveal_lists(state, client_id)
    return UnmaskRequest(state.federation_id, state.round, client_id, tuple(sorted(state.masked)), own, key)


def step(state: ServerState, obs: Observation, verify: Verifier, *,
         in_place: bool = False) -> tuple[ServerState, list[Event]]:
    """Apply one observation: a new state and the events it caused. ``verify`` checks advertisement signatures
    (:data:`fedcore.secagg.crypto.Verifier`). Pure: no clock, no randomness, and ``state`` is never modified --
    except, with ``in_place``, its running masked sum, to which a masked input is then added without a copy (for a
    caller that keeps only the new state: the server's shell; a copy of a 15 MB sum per device was a tenth of its
    CPU per device at the 940k CNN)."""
    if isinstance(obs, Dropped | Deadline):
        if obs.round != state.round or state.phase not in ACTIVE:
            return replace(state), []
        if isinstance(obs, Deadline):
            if obs.phase != state.phase:
                return replace(state), []
            gone = _pending(state)
        else:
            known = obs.client_id in state.selected and obs.client_id not in state.dropped
            gone = [obs.client_id] if known else []
        if not gone:
            return replace(state), []
        s = replace(state, dropped={**state.dropped, **dict.fromkeys(gone, state.phase)})
        if isinstance(obs, Deadline):
            return _close(s)
        return _advance(s)
    reason = _refusal(state, obs, verify)
    if reason is not None:
        return replace(state), [Refused(obs.client_id, obs.round, reason)]
    c = obs.client_id
    if isinstance(obs, Advertisement):
        s = replace(state, advertisements={**state.advertisements, c: obs})
    elif isinstance(obs, ShareUpload):
        s = replace(state, shares={**state.shares, c: obs.shares}, commitments={**state.commitments, c: obs.commitment})
    elif isinstance(obs, MaskedUpload):
        if state.masked_sum is None:
            total = obs.vector.copy()
        elif in_place:
            total = np.add(state.masked_sum, obs.vector, out=state.masked_sum)
        else:
            total = np.add(state.masked_sum, obs.vector)
        s = replace(state, masked=(*state.masked, c), masked_sum=total)
    else:
        s = replace(state, revealed={**state.revealed, c: obs})
    return _advance(s)


def _advance(s: ServerState) -> tuple[ServerState, list[Event]]:
    if s.phase in ACTIVE and not _pending(s):
        return _close(s)
    return s, []


def _abandon(s: ServerState, reason: str, detail: str) -> tuple[ServerState, list[Event]]:
    return (replace(s, phase=ABANDONED, reason=reason, detail=detail, masked_sum=None),
            [Abandoned(s.round, s.phase, reason, detail)])


def _short_holders(s: ServerState, owners: Sequence[str], holders: set[str], t: int) -> str | None:
    nb = s.neighbours()
    for v in owners:
        n = sum(1 for w in nb[v] if w in holders)
        if n < t:
            return f"the secrets of {v!r} have {n} holders left, {t} needed"
    return None


def _close(s: ServerState) -> tuple[ServerState, list[Event]]:
    """Close the current phase (everyone expected answered or dropped) and open the next, or finish."""
    if s.phase == ADVERTISE:
        u1 = tuple(sorted(s.advertisements))
        if len(u1) < s.config.min_clients:
            return _abandon(s, TOO_FEW_CLIENTS, f"{len(u1)} clients advertised keys, {s.config.min_clients} needed")
        s = replace(s, participants=u1, graph=choose_parameters(len(u1), s.config), phase=SHARE)
        return s, [PhaseStarted(s.round, SHARE, u1)]
    g = s.graph
    assert g is not None
    k1 = len(s.participants)
    if s.phase == SHARE:
        u2 = tuple(sorted(s.shares))
        if k1 - len(u2) > g.max_dropped:
            return _abandon(s, TOO_MANY_DROPOUTS, f"{k1 - len(u2)} of {k1} participants dropped, at most "
                                                  f"{g.max_dropped} may")
        short = _short_holders(s, u2, set(u2), g.threshold)
        if short is not None:
            return _abandon(s, BELOW_THRESHOLD, short)
        s = replace(s, phase=MASKED, share_index=_index_shares(s.shares))
        return s, [PhaseStarted(s.round, MASKED, u2)]
    if s.phase == MASKED:
        u3 = tuple(sorted(s.masked))
        if k1 - len(u3) > g.max_dropped:
            return _abandon(s, TOO_MANY_DROPOUTS, f"{k1 - len(u3)} of {k1} participants dropped, at most "
                                                  f"{g.max_dropped} may")
        short = _short_holders(s, sorted(s.shares), set(u3), g.threshold)
        if short is not None:
            return _abandon(s, BELOW_THRESHOLD, short)
        s = replace(s, phase=UNMASK)
        return s, [PhaseStarted(s.round, UNMASK, u3)]
    return _unmask(s)


def _unmask(s: ServerState) -> tuple[ServerState, list[Event]]:
    g = s.graph
    assert g is not None and s.masked_sum is not None
    nb = s.neighbours()
    t = g.threshold
    survivors = tuple(sorted(s.masked))
    alive = set(survivors)
    dropped_after_sharing = [v for v in sorted(s.shares) if v not in alive]
    short = _short_holders(s, sorted(s.shares), set(s.revealed), t)
    if short is not None:
        return _abandon(s, BELOW_THRESHOLD, short)
    own = {c: dict(r.self_mask_shares) for c, r in s.revealed.items()}
    keys = {c: dict(r.key_shares) for c, r in s.revealed.items()}

    def secret(owner: str, table: dict[str, dict[str, bytes]]) -> bytes:
        pieces = [shamir.Share.from_bytes(table[w][owner]) for w in nb[owner] if w in table and owner in table[w]]
        return shamir.reconstruct(pieces, t, length=SECRET_BYTES)

    add: list[bytes] = []
    subtract: list[bytes] = []
    try:
        for u in survivors:
            seed = secret(u, own)
            if not hmac.compare_digest(crypto.commitment(s.federation_id, s.round, u, seed), s.commitments[u]):
                return _abandon(s, BAD_SHARE, f"the self-mask seed rebuilt for {u!r} does not match its commitment")
            subtract.append(seed)
        for v in dropped_after_sharing:
            pair = KeyPair.from_private_bytes(secret(v, keys))
            if pair.public != s.advertisements[v].s_pk:
                return _abandon(s, BAD_SHARE, f"the mask key rebuilt for {v!r} does not match its advertised key")
            for u in nb[v]:
                if u in alive:  # u added +PRG(s_uv) if u < v, else -PRG(s_uv): take it back
                    seed = crypto.mask_seed(pair.private, s.advertisements[u].s_pk, s.federation_id, s.round, u, v)
                    (subtract if u < v else add).append(seed)
    except (shamir.ShamirError, ValueError) as e:
        return _abandon(s, BAD_SHARE, str(e))
    total = s.masked_sum.copy()
    prg.apply_masks(total, add, subtract)
    n = s.num_params + s.num_extras
    result = SecureSum(survivors, s.num_params, total[:n], total[n:])
    done = replace(s, phase=DONE, masked_sum=None, result=result)
    return done, [Completed(s.round, result)]

