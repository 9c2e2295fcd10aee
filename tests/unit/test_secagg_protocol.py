"""SecAgg+ end to end through the pure server machine and the client phases, without a transport.

The central property: the unmasked sum equals, bit for bit, plain streaming FedAvg's FixedPointSum over the same
survivors, with no dropouts and with dropouts in every phase after advertisement; and a round that cannot be
unmasked is abandoned with a named reason, never summed wrongly.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fedcore.aggregation.fixedpoint import FixedPointSum, encode
from fedcore.secagg import crypto, protocol, shamir
from fedcore.secagg.config import SecureAggregationConfig
from fedcore.secagg.protocol import (
    ABANDONED,
    ADVERTISE,
    BELOW_THRESHOLD,
    DONE,
    MASKED,
    SHARE,
    TOO_FEW_CLIENTS,
    TOO_MANY_DROPOUTS,
    UNMASK,
    Abandoned,
    Advertisement,
    ClientState,
    Completed,
    Deadline,
    Dropped,
    EncryptedShare,
    PhaseStarted,
    Refused,
    RequestRefused,
    SecureSum,
    ServerState,
    UnmaskRequest,
    client_advertise,
    client_mask,
    client_share,
    client_unmask,
    encode_input,
    key_request,
    mask_request,
    new_round,
    step,
    unmask_request,
)

FED = "fed-test"
CONFIG = SecureAggregationConfig()  # auto k and t, a third may drop


def _ids(n: int) -> list[str]:
    return [f"c{i:03d}" for i in range(n)]


@dataclass
class Fleet:
    """Clients with Ed25519 identities, their inputs, and the server's verifier."""

    ids: list[str]
    updates: dict[str, npt.NDArray[np.float32]]
    weights: dict[str, float]
    keys: dict[str, Ed25519PrivateKey] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.keys = {c: Ed25519PrivateKey.generate() for c in self.ids}
        self.verify = crypto.ed25519_verifier({c: k.public_key() for c, k in self.keys.items()})

    def encoded(self, c: str, extras: bool = False) -> npt.NDArray[np.uint64]:
        u, m = self.updates[c], self.weights[c]
        ex = (m, m * float(np.dot(u.astype(np.float64), u.astype(np.float64)))) if extras else ()
        return encode_input(u, m, ex)


def _fleet(n: int, p: int, seed: int) -> Fleet:
    rng = np.random.default_rng(seed)
    ids = _ids(n)
    updates = {c: rng.normal(0, 1e-2, size=p).astype(np.float32) for c in ids}
    weights = {c: float(rng.integers(1, 500)) for c in ids}
    return Fleet(ids, updates, weights)


@dataclass
class Run:
    server: ServerState
    events: list[protocol.Event]
    clients: dict[str, ClientState]
    uploads: dict[str, protocol.MaskedUpload]


def _feed(run: Run, obs: protocol.Observation, verify: crypto.Verifier) -> None:
    run.server, ev = step(run.server, obs, verify)
    run.events.extend(ev)


def run_round(fleet: Fleet, drop_at: Mapping[str, str] | None = None, config: SecureAggregationConfig = CONFIG,
              extras: bool = False, round_: int = 1, graph_seed: int = 11) -> Run:
    """One round: each client in ``drop_at`` goes silent at that phase (the transport reports it)."""
    drop_at = drop_at or {}
    p = next(iter(fleet.updates.values())).shape[0]
    server, events = new_round(FED, round_, fleet.ids, config, graph_seed, p, 2 if extras else 0)
    run = Run(server, list(events), {}, {})
    for c in fleet.ids:
        if drop_at.get(c) == ADVERTISE:
            _feed(run, Dropped(round_, c), fleet.verify)
            continue
        run.clients[c], adv = client_advertise(FED, round_, c, crypto.ed25519_signer(fleet.keys[c]))
        _feed(run, adv, fleet.verify)
    def act(phase: str, c: str) -> tuple[ClientState, protocol.ShareUpload | protocol.MaskedUpload
                                         | protocol.UnmaskUpload]:
        if phase == SHARE:
            return client_share(run.clients[c], key_request(run.server, c), fleet.verify, config)
        if phase == MASKED:
            return client_mask(run.clients[c], mask_request(run.server, c), fleet.encoded(c, extras))
        return client_unmask(run.clients[c], unmask_request(run.server, c))

    for phase in (SHARE, MASKED, UNMASK):
        if run.server.phase != phase:
            break
        for c in protocol._expected(run.server):
            if drop_at.get(c) == phase:
                _feed(run, Dropped(round_, c), fleet.verify)
                continue
            run.clients[c], upload = act(phase, c)
            if isinstance(upload, protocol.MaskedUpload):
                run.uploads[c] = upload
            _feed(run, upload, fleet.verify)
    return run


def _plain(fleet: Fleet, survivors: tuple[str, ...]) -> FixedPointSum:
    fps = FixedPointSum(next(iter(fleet.updates.values())).shape[0])
    for c in reversed(survivors):  # any order: the sum is exact
        fps.add(torch.from_numpy(fleet.updates[c]), fleet.weights[c])
    return fps


def _assert_bit_identical(fleet: Fleet, result: SecureSum) -> None:
    plain = _plain(fleet, result.survivors)
    secure = result.params()
    assert secure.count == plain.count == len(result.survivors)
    assert torch.equal(secure.hi, plain.hi) and torch.equal(secure.lo, plain.lo)
    divisor = sum(fleet.weights[c] for c in result.survivors)
    a, b = secure.value(divisor), plain.value(divisor)
    assert a.numpy().tobytes() == b.numpy().tobytes()


def _result(run: Run) -> SecureSum:
    done = [e for e in run.events if isinstance(e, Completed)]
    assert run.server.phase == DONE and len(done) == 1, run.events[-3:]
    assert run.server.result is done[0].result
    return done[0].result


def test_no_dropouts_is_bit_identical_to_plain_fedavg() -> None:
    fleet = _fleet(9, 3001, seed=1)
    run = run_round(fleet)
    res = _result(run)
    assert res.survivors == tuple(fleet.ids)
    _assert_bit_identical(fleet, res)
    started = [e.phase for e in run.events if isinstance(e, PhaseStarted)]
    assert started == [ADVERTISE, SHARE, MASKED, UNMASK]
    assert not [e for e in run.events if isinstance(e, Refused)]


@pytest.mark.parametrize("n, drops", [
    (9, {"c001": SHARE, "c004": MASKED, "c007": UNMASK}),  # complete graph: 3 of 9 drop, one per phase
    (9, {"c002": MASKED, "c005": MASKED, "c008": MASKED}),
    (9, {"c000": UNMASK, "c003": UNMASK, "c006": SHARE}),
    (21, {"c000": SHARE, "c003": SHARE, "c007": MASKED, "c011": MASKED, "c015": UNMASK, "c020": UNMASK,
          "c019": MASKED}),  # sparse Harary graph (k = 14, t = 8): 7 of 21 drop
])
def test_dropouts_up_to_a_third_are_bit_identical(n: int, drops: dict[str, str]) -> None:
    fleet = _fleet(n, 1537, seed=n + len(drops))
    run = run_round(fleet, drops)
    res = _result(run)
    gone_before_masking = {c for c, ph in drops.items() if ph in (SHARE, MASKED)}
    assert set(res.survivors) == set(fleet.ids) - gone_before_masking  # an UNMASK drop's input is in the sum
    _assert_bit_identical(fleet, res)
    g = run.server.graph
    assert g is not None and g.max_dropped >= len(drops)
    if n == 21:
        assert not g.complete and g.neighbours < n - 1


def test_extra_scalars_are_summed_in_the_same_fixed_point() -> None:
    fleet = _fleet(7, 257, seed=3)
    run = run_round(fleet, {"c003": MASKED}, extras=True)
    res = _result(run)
    _assert_bit_identical(fleet, res)
    ref = FixedPointSum(2, 1)
    for c in res.survivors:
        u, m = fleet.updates[c], fleet.weights[c]
        ex_hi, ex_lo = encode(np.array([m, m * float(np.dot(u.astype(np.float64), u.astype(np.float64)))]), 1.0)
        ref.add_encoded(ex_hi, ex_lo)
    assert res.extras() == (ref.exact(0), ref.exact(1))
    total_w = float(res.extras()[0])
    assert total_w == sum(fleet.weights[c] for c in res.survivors)
    sq = sum(fleet.weights[c] * float(np.dot(fleet.updates[c].astype(np.float64), fleet.updates[c].astype(np.float64)))
             for c in res.survivors)
    assert abs(float(res.extras()[1]) - sq) <= 1e-9 * sq


def test_too_many_dropouts_abandon_with_a_reason() -> None:
    fleet = _fleet(9, 64, seed=4)
    run = run_round(fleet, {"c000": SHARE, "c001": SHARE, "c002": MASKED, "c003": MASKED})
    assert run.server.phase == ABANDONED and run.server.reason == TOO_MANY_DROPOUTS
    ab = [e for e in run.events if isinstance(e, Abandoned)]
    assert len(ab) == 1 and ab[0].phase == MASKED and "4 of 9" in ab[0].detail
    assert run.server.result is None and run.server.masked_sum is None


def test_round_below_threshold_is_abandoned_not_summed() -> None:
    # 4 of 9 drop at unmasking: 5 in the sum, but a survivor's seed has only 4 of t = 5 holders left.
    fleet = _fleet(9, 64, seed=5)
    drops = {"c000": UNMASK, "c001": UNMASK, "c002": UNMASK, "c003": UNMASK}
    run = run_round(fleet, drops)
    assert run.server.phase == ABANDONED and run.server.reason == BELOW_THRESHOLD
    assert run.server.graph is not None and run.server.graph.threshold == 5
    assert "5 needed" in run.server.detail
    assert not [e for e in run.events if isinstance(e, Completed)]


def test_too_few_advertisements_abandon() -> None:
    fleet = _fleet(4, 16, seed=6)
    run = run_round(fleet, {"c000": ADVERTISE, "c001": ADVERTISE})
    assert run.server.phase == ABANDONED and run.server.reason == TOO_FEW_CLIENTS


def test_deadline_drops_the_silent_and_closes_the_phase() -> None:
    fleet = _fleet(6, 16, seed=7)
    server, _ = new_round(FED, 1, fleet.ids, CONFIG, 3, 16)
    for c in fleet.ids[:5]:
        _, adv = client_advertise(FED, 1, c, crypto.ed25519_signer(fleet.keys[c]))
        server, _ = step(server, adv, fleet.verify)
    assert server.phase == ADVERTISE
    late, _ = step(server, Deadline(1, SHARE), fleet.verify)  # a stale deadline changes nothing
    assert late.phase == ADVERTISE
    server, ev = step(server, Deadline(1, ADVERTISE), fleet.verify)
    assert server.phase == SHARE and server.participants == tuple(fleet.ids[:5])
    assert server.dropped == {fleet.ids[5]: ADVERTISE}
    assert ev == [PhaseStarted(1, SHARE, tuple(fleet.ids[:5]))]


# ---- round binding and refusals ----

def _advertised(fleet: Fleet, round_: int = 2) -> tuple[ServerState, dict[str, ClientState], list[Advertisement]]:
    server, _ = new_round(FED, round_, fleet.ids, CONFIG, 5, next(iter(fleet.updates.values())).shape[0])
    clients, advs = {}, []
    for c in fleet.ids:
        clients[c], adv = client_advertise(FED, round_, c, crypto.ed25519_signer(fleet.keys[c]))
        advs.append(adv)
    return server, clients, advs


def test_replayed_advertisement_from_an_old_round_is_refused() -> None:
    fleet = _fleet(5, 8, seed=8)
    server, _, _ = _advertised(fleet, round_=2)
    _, old = client_advertise(FED, 1, "c000", crypto.ed25519_signer(fleet.keys["c000"]))
    s2, ev = step(server, old, fleet.verify)
    assert isinstance(ev[0], Refused) and "round 1" in ev[0].reason and "replayed" in ev[0].reason
    assert s2.advertisements == {}
    # relabelled to the current round, the signature no longer verifies
    s3, ev = step(server, dataclasses.replace(old, round=2), fleet.verify)
    assert isinstance(ev[0], Refused) and "signature" in ev[0].reason and s3.advertisements == {}


def test_forged_and_duplicate_advertisements_are_refused() -> None:
    fleet = _fleet(5, 8, seed=9)
    server, _, advs = _advertised(fleet)
    forger = Ed25519PrivateKey.generate()  # not c001's identity key
    _, forged = client_advertise(FED, 2, "c001", crypto.ed25519_signer(forger))
    _, ev = step(server, forged, fleet.verify)
    assert isinstance(ev[0], Refused) and "signature" in ev[0].reason
    tampered = dataclasses.replace(advs[1], s_pk=advs[2].s_pk)  # keys swapped after signing
    _, ev = step(server, tampered, fleet.verify)
    assert isinstance(ev[0], Refused) and "signature" in ev[0].reason
    server, ev = step(server, advs[0], fleet.verify)
    assert ev == []
    _, ev = step(server, advs[0], fleet.verify)
    assert isinstance(ev[0], Refused) and "already answered" in ev[0].reason
    _, ev = step(server, dataclasses.replace(advs[0], federation_id="other"), fleet.verify)
    assert isinstance(ev[0], Refused) and "federation" in ev[0].reason
    # c001 signs an advertisement of c000's keys (replaying them as its own): refused
    msg = crypto.advertisement_message(FED, 2, "c001", advs[0].c_pk, advs[0].s_pk)
    copied = Advertisement(FED, 2, "c001", advs[0].c_pk, advs[0].s_pk, fleet.keys["c001"].sign(msg))
    _, ev = step(server, copied, fleet.verify)
    assert isinstance(ev[0], Refused) and "re-uses" in ev[0].reason


def test_client_refuses_forged_neighbour_keys_and_wrong_parameters() -> None:
    fleet = _fleet(5, 8, seed=10)
    server, clients, advs = _advertised(fleet)
    for adv in advs:
        server, _ = step(server, adv, fleet.verify)
    assert server.phase == SHARE
    req = key_request(server, "c000")
    forged = dataclasses.replace(req.advertisements[0], c_pk=bytes(range(32)))
    bad = dataclasses.replace(req, advertisements=(forged, *req.advertisements[1:]))
    with pytest.raises(RequestRefused, match="signature"):
        client_share(clients["c000"], bad, fleet.verify, CONFIG)
    with pytest.raises(RequestRefused, match="graph parameters"):
        client_share(clients["c000"], dataclasses.replace(req, threshold=1), fleet.verify, CONFIG)
    with pytest.raises(RequestRefused, match="round 3"):
        client_share(clients["c000"], dataclasses.replace(req, round=3), fleet.verify, CONFIG)


def _to_masked(fleet: Fleet, round_: int = 2) -> tuple[ServerState, dict[str, ClientState]]:
    server, clients, advs = _advertised(fleet, round_)
    for adv in advs:
        server, _ = step(server, adv, fleet.verify)
    for c in fleet.ids:
        clients[c], up = client_share(clients[c], key_request(server, c), fleet.verify, CONFIG)
        server, _ = step(server, up, fleet.verify)
    assert server.phase == MASKED
    return server, clients


def test_shares_for_the_wrong_round_are_refused() -> None:
    fleet = _fleet(5, 8, seed=11)
    server, clients = _to_masked(fleet)
    req = mask_request(server, "c000")
    # the mask request relabelled to another round: refused outright
    with pytest.raises(RequestRefused, match="round 3"):
        client_mask(clients["c000"], dataclasses.replace(req, round=3), fleet.encoded("c000"))
    # a share sealed for another round (here: relabelled sender/round context) does not open
    other_server, _ = _to_masked(fleet, round_=3)
    foreign = mask_request(other_server, "c000").shares[0]
    swapped = tuple(foreign if s.sender == foreign.sender else s for s in req.shares)
    with pytest.raises(RequestRefused, match="does not authenticate"):
        client_mask(clients["c000"], dataclasses.replace(req, shares=swapped), fleet.encoded("c000"))
    # a share re-addressed to another recipient does not open either
    moved = EncryptedShare(req.shares[0].sender, "c000", mask_request(server, "c001").shares[-1].ciphertext)
    with pytest.raises(RequestRefused, match="does not authenticate"):
        client_mask(clients["c000"], dataclasses.replace(req, shares=(moved, *req.shares[1:])), fleet.encoded("c000"))
    # the server refuses an upload for another round
    up = dataclasses.replace(_masked_upload(server, clients, fleet), round=3)
    _, ev = step(server, up, fleet.verify)
    assert isinstance(ev[0], Refused) and "round 3" in ev[0].reason


def test_masking_in_place_gives_the_same_upload_and_only_then_consumes_the_input() -> None:
    fleet = _fleet(6, 8, seed=13)
    server, clients = _to_masked(fleet)
    req = mask_request(server, "c000")
    encoded = fleet.encoded("c000")
    kept = encoded.copy()
    state, up = client_mask(clients["c000"], req, encoded)
    assert np.array_equal(encoded, kept) and not np.shares_memory(up.vector, encoded)
    state_in_place, up_in_place = client_mask(clients["c000"], req, encoded, in_place=True)
    assert up_in_place.vector is encoded and np.array_equal(up_in_place.vector, up.vector)
    assert state_in_place == state and not np.array_equal(up.vector, kept)


def _masked_upload(server: ServerState, clients: dict[str, ClientState], fleet: Fleet) -> protocol.MaskedUpload:
    _, up = client_mask(clients["c000"], mask_request(server, "c000"), fleet.encoded("c000"))
    return up


def _to_unmask(fleet: Fleet, dropped: str) -> tuple[ServerState, dict[str, ClientState]]:
    server, clients = _to_masked(fleet)
    for c in fleet.ids:
        if c == dropped:
            server, _ = step(server, Dropped(2, c), fleet.verify)
            continue
        clients[c], up = client_mask(clients[c], mask_request(server, c), fleet.encoded(c))
        server, _ = step(server, up, fleet.verify)
    assert server.phase == UNMASK
    return server, clients


def test_client_refuses_to_reveal_both_shares_of_one_device() -> None:
    fleet = _fleet(6, 8, seed=12)
    server, clients = _to_unmask(fleet, dropped="c005")
    req = unmask_request(server, "c000")
    assert "c005" in req.reveal_key and "c001" in req.reveal_self_mask
    both = dataclasses.replace(req, reveal_key=(*req.reveal_key, "c001"))
    with pytest.raises(RequestRefused, match="both"):
        client_unmask(clients["c000"], both)
    # a key share of a listed survivor
    with pytest.raises(RequestRefused, match="is a survivor"):
        client_unmask(clients["c000"], dataclasses.replace(req, reveal_key=("c001",), reveal_self_mask=()))
    # answered once (c005's key share revealed), a second request calling c005 a survivor and asking for its
    # self-mask share is refused: never both shares of one device, across requests either
    clients["c000"], _ = client_unmask(clients["c000"], req)
    lying = UnmaskRequest(FED, 2, "c000", tuple(fleet.ids), (*req.reveal_self_mask, "c005"), ())
    with pytest.raises(RequestRefused, match="already answered"):
        client_unmask(clients["c000"], lying)


def test_client_refuses_the_self_mask_share_of_a_device_it_knows_dropped() -> None:
    fleet = _fleet(6, 8, seed=13)
    server, clients, advs = _advertised(fleet)
    for adv in advs:
        server, _ = step(server, adv, fleet.verify)
    for c in fleet.ids:
        if c == "c004":  # drops before sharing: nobody holds its shares, nobody masks with it
            server, _ = step(server, Dropped(2, c), fleet.verify)
            continue
        clients[c], up = client_share(clients[c], key_request(server, c), fleet.verify, CONFIG)
        server, _ = step(server, up, fleet.verify)
    for c in sorted(server.shares):
        clients[c], masked = client_mask(clients[c], mask_request(server, c), fleet.encoded(c))
        server, _ = step(server, masked, fleet.verify)
    assert server.phase == UNMASK and "c004" in clients["c000"].known_dropped
    req = unmask_request(server, "c000")
    evil = dataclasses.replace(req, survivors=(*req.survivors, "c004"),
                               reveal_self_mask=(*req.reveal_self_mask, "c004"))
    with pytest.raises(RequestRefused, match="dropped before masking"):
        client_unmask(clients["c000"], evil)
    few = dataclasses.replace(req, survivors=req.survivors[:3])
    with pytest.raises(RequestRefused, match="fewer than the round's minimum"):
        client_unmask(clients["c000"], few)


def _advertised_list(fleet: Fleet, clients: dict[str, ClientState]) -> list[Advertisement]:
    out = []
    for c in fleet.ids:
        st = clients[c]
        msg = crypto.advertisement_message(FED, st.round, c, st.c_keys.public, st.s_keys.public)
        out.append(Advertisement(FED, st.round, c, st.c_keys.public, st.s_keys.public, fleet.keys[c].sign(msg)))
    return out


def test_a_tampered_revealed_share_abandons_the_round_instead_of_a_wrong_sum() -> None:
    fleet = _fleet(5, 32, seed=18)
    server, clients = _to_masked(fleet)
    for c in fleet.ids:
        clients[c], masked = client_mask(clients[c], mask_request(server, c), fleet.encoded(c))
        server, _ = step(server, masked, fleet.verify)
    for c in fleet.ids:
        clients[c], up = client_unmask(clients[c], unmask_request(server, c))
        if c == "c000":  # a well-formed share at c000's point, with a wrong value
            owner, raw = up.self_mask_shares[0]
            bad = shamir.Share(1, (shamir.Share.from_bytes(raw).y + 1) % shamir.PRIME).to_bytes()
            up = dataclasses.replace(up, self_mask_shares=((owner, bad), *up.self_mask_shares[1:]))
        server, ev = step(server, up, fleet.verify)
    assert server.phase == ABANDONED and server.reason == protocol.BAD_SHARE and server.result is None
    assert isinstance(ev[-1], Abandoned) and "c001" in ev[-1].detail


def test_server_refuses_out_of_phase_and_unselected_messages() -> None:
    fleet = _fleet(5, 8, seed=14)
    server, clients = _to_masked(fleet)
    _, ev = step(server, _advertised_list(fleet, clients)[0], fleet.verify)
    assert isinstance(ev[0], Refused) and "phase masked" in ev[0].reason
    up = _masked_upload(server, clients, fleet)
    _, ev = step(server, dataclasses.replace(up, client_id="intruder"), fleet.verify)
    assert isinstance(ev[0], Refused) and "not expected" in ev[0].reason
    _, ev = step(server, dataclasses.replace(up, vector=up.vector[:-1]), fleet.verify)
    assert isinstance(ev[0], Refused) and "uint64" in ev[0].reason


# ---- the masked vector, serialization, purity ----

def test_masked_vector_bytes_are_uniform_chi_square() -> None:
    """A masked all-zero update: its bytes must look uniform (chi-square over the 256 byte values, 255 dof, below
    the 0.999 critical value 330.5). Keys and seeds are fixed so that the figure is reproducible."""
    ids = _ids(5)
    fleet = Fleet(ids, {c: np.zeros(50_000, np.float32) for c in ids}, dict.fromkeys(ids, 1.0))
    server, _ = new_round(FED, 1, ids, CONFIG, 2, 50_000)
    clients: dict[str, ClientState] = {}

    def det(tag: str) -> crypto.KeyPair:
        return crypto.KeyPair.from_private_bytes(hashlib.sha256(tag.encode()).digest())

    for c in ids:
        clients[c], adv = client_advertise(FED, 1, c, crypto.ed25519_signer(fleet.keys[c]),
                                           keys=(det(c + "/c"), det(c + "/s")))
        server, _ = step(server, adv, fleet.verify)
    def seed_of(c: str) -> Callable[[int], bytes]:
        return lambda n: hashlib.sha256((c + "/b").encode()).digest()[:n]

    for c in ids:
        clients[c], up = client_share(clients[c], key_request(server, c), fleet.verify, CONFIG, randbytes=seed_of(c))
        server, _ = step(server, up, fleet.verify)
    _, masked = client_mask(clients["c000"], mask_request(server, "c000"), fleet.encoded("c000"))
    data = masked.vector.view(np.uint8)
    counts = np.bincount(data, minlength=256).astype(np.float64)
    expected = data.size / 256.0
    chi2 = float(np.sum((counts - expected) ** 2 / expected))
    print(f"chi-square of the masked vector's {data.size} bytes: {chi2:.1f} (255 dof, 0.999 critical 330.5)")
    assert chi2 < 330.5
    plain = fleet.encoded("c000").view(np.uint8)
    assert float(np.sum((np.bincount(plain, minlength=256) - expected) ** 2 / expected)) > 1e6  # unmasked: far off


def test_state_round_trips_through_json_at_every_phase() -> None:
    fleet = _fleet(6, 33, seed=15)
    run = run_round(fleet, {"c002": MASKED})
    states = [run.server]
    # rebuild the states along the way from a partial run
    partial = run_round(fleet, {"c002": MASKED, "c003": UNMASK})
    states.append(partial.server)
    server, clients = _to_masked(fleet)
    states.append(server)
    for s in states:
        d = s.to_dict()
        again = ServerState.from_dict(json.loads(json.dumps(d)))
        assert again.to_dict() == d
    # a restored mid-round state carries on to the same result
    server, clients = _to_masked(fleet)
    for c in fleet.ids[:3]:
        clients[c], up = client_mask(clients[c], mask_request(server, c), fleet.encoded(c))
        server, _ = step(server, up, fleet.verify)
    server = ServerState.from_dict(json.loads(json.dumps(server.to_dict())))
    for c in fleet.ids[3:]:
        clients[c], up = client_mask(clients[c], mask_request(server, c), fleet.encoded(c))
        server, _ = step(server, up, fleet.verify)
    for c in fleet.ids:
        clients[c], up2 = client_unmask(clients[c], unmask_request(server, c))
        server, _ = step(server, up2, fleet.verify)
    assert server.phase == DONE and server.result is not None
    _assert_bit_identical(fleet, server.result)


def test_step_never_mutates_its_input() -> None:
    fleet = _fleet(5, 40, seed=16)
    server, clients = _to_masked(fleet)
    for c in fleet.ids:
        before = copy.deepcopy(server.to_dict())
        sum_before = None if server.masked_sum is None else server.masked_sum.copy()
        clients[c], up = client_mask(clients[c], mask_request(server, c), fleet.encoded(c))
        new, _ = step(server, up, fleet.verify)
        assert new is not server
        assert server.to_dict() == before
        if sum_before is not None:
            assert server.masked_sum is not None and np.array_equal(server.masked_sum, sum_before)
        assert new.masked_sum is not up.vector
        server = new
    before = copy.deepcopy(server.to_dict())
    refused, ev = step(server, dataclasses.replace(up, round=9), fleet.verify)
    assert isinstance(ev[0], Refused) and server.to_dict() == before and refused is not server
    dropped, _ = step(server, Dropped(2, "c001"), fleet.verify)
    assert server.dropped == {} and dropped.dropped == {"c001": UNMASK}
    with pytest.raises(dataclasses.FrozenInstanceError):
        server.phase = DONE  # type: ignore[misc]


def test_server_state_holds_no_client_secret() -> None:
    fleet = _fleet(5, 16, seed=17)
    server, clients = _to_masked(fleet)
    text = json.dumps(server.to_dict())
    for st in clients.values():
        for secret in (st.c_keys.private_bytes(), st.s_keys.private_bytes(), st.self_seed):
            assert base64.b64encode(secret).decode() not in text
            assert secret.hex() not in text
        assert "private" not in repr(st) and st.self_seed.hex() not in repr(st)


def test_encode_input_refuses_out_of_range_and_norm() -> None:
    u = np.ones(10, np.float32)
    with pytest.raises(ValueError, match="exact-aggregation range"):
        encode_input(u, 2.0**31)
    with pytest.raises(ValueError, match="norm bound"):
        encode_input(u, 1.0, norm_bound=3.0)
    for bad in ([np.nan], [1.0, np.nan, -1.0], [-np.inf, 0.0], [0.0, np.inf]):
        with pytest.raises(ValueError, match="range"):
            encode_input(np.array(bad, np.float32), 1.0)
    with pytest.raises(ValueError, match="exact-aggregation range"):  # the largest |u| may be a negative value
        encode_input(np.array([1.0, -(2.0**31)], np.float32), 1.0)
    with pytest.raises(ValueError, match="extra"):
        encode_input(u, 1.0, (float("inf"),))
    hi, lo = encode(u, 3.0)
    v = encode_input(u, 3.0, norm_bound=3.17)
    assert np.array_equal(v[:10], hi) and np.array_equal(v[10:], lo)
