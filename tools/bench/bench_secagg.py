"""The cost of SecAgg+ secure aggregation next to plain streaming FedAvg, side by side in one run, in process.

For each model size P and number of clients K, one round of the pure core (no gRPC, no transport):

- **secagg**: the client phases of :mod:`fedcore.secagg.protocol` (``client_advertise``, ``client_share``,
  ``encode_input`` + ``client_mask``, ``client_unmask``) for every client, and the server's pure machine (``new_round``,
  every ``step``, ``key_request`` / ``mask_request`` / ``unmask_request``, the unmask in the last ``step``) with the
  default :class:`SecureAggregationConfig` (auto k and t, a third may drop; k and t are printed). Every client really
  masks, and the server sums the K real masked vectors and removes the masks; the result is checked bit for bit
  against the plain sum (column ``exact``).
- **plain**: what streaming FedAvg's server does with the same updates and weights: ``FixedPointSum.add(u, n_i)`` per
  client, then ``.value(Σ n_i)`` (:class:`fedcore.aggregation.base.StreamingFedAvg` without its validation).

Updates are ``N(0, 1) * 1e-3`` float32 vectors of P coordinates (a numpy Generator seeded from ``--seed`` and the
client's index), weights n_i integers in [1, 500]; the models are ``mlp`` (the 4,554-parameter "no-op" model) and
``cifar_cnn`` (940,362 parameters), P counted from ``fedcore.models.build_model(name, {}, seed=0)``.

Columns (all per client, averaged over the K selected clients, dropped ones included):

- ``server CPU s/cr``: ``time.process_time`` of the server's work divided by K (CPU seconds per client-round);
  ``ratio`` = secagg / plain;
- ``client CPU s``: secagg = advertise + share + encode + mask + unmask; plain = the float32 -> bytes serialization of
  the update (``ndarray.tobytes``) only, the rest of a plain client's round being no aggregation work at all;
- ``up B`` / ``down B``: payload bytes (every bytes field's length, ids as UTF-8, 8 bytes per integer, the masked
  vector's 16 bytes per coordinate: two uint64 limbs; no framing) of what a client sends (advertisement, sealed
  shares + commitment, masked vector, revealed shares) and receives (key request with the neighbours'
  advertisements, mask request with the shares sealed for it, unmask request with the survivors and the reveal lists)
  **plus the 4 B/param model** both variants send down; plain = 4 B/param up (the float32 update) and down.

``drop``: the fraction of clients that drop after sharing (they send no masked vector: the server reconstructs their
mask keys and removes their pairwise masks from their neighbours' vectors). The rounds with different ``--dropouts``
share the advertise and share phases and the survivors' masked vectors (identical up to the drop: the client costs of
those phases are measured once); the server's work and the unmask phase are run and timed per dropout fraction, and
so are the plain sums over the same survivors, in a loop of their own after the secagg round (not interleaved with
the crypto, which would evict their data from the caches). A second table splits the secagg CPU into its parts.

Budget: before each (model, K) the CPU seconds it needs are estimated from micro-measurements (AES-CTR mask words/s,
X25519 + HKDF, Ed25519 verify, Shamir split and reconstruct, fixed-point encode) and the wall/CPU ratio seen so far;
a configuration that would end past ``--budget-s`` of wall time is not run and its row says ``skipped (budget)``
(its plain FedAvg columns are still measured when they fit). The estimate and the CPU actually taken are printed as
progress lines. K = 1000 with the 940k model needs about 445 G AES-CTR mask words of client masks (K (k + 1) 2P with
k = 236), far beyond the default budget.

    python tools/bench/bench_secagg.py             # K in {10, 100, 1000}, mlp and cifar_cnn, drop 0 and 0.1 (<= 10 min)
    python tools/bench/bench_secagg.py --quick      # K in {10, 100}, mlp only
    python tools/bench/bench_secagg.py --ks 5 --params 1000 --dropouts 0,0.2   # a tiny synthetic size

Single-threaded (``--threads 1``: torch, hence FixedPointSum, on one thread; the crypto and numpy run on the calling
thread): friendly to a shared machine, and CPU seconds are those of one core. Run it with ``nice`` there; timings on a
loaded machine vary between runs.

``--federation``: the cost on real federations. For each configuration the SAME federation runs twice back to back,
plain FedAvg and then with ``aggregation.secure = "secagg+"``: ``python -m fedlaunch`` with virtual clients over gRPC
on loopback, ``--insecure`` (plaintext: fine for a benchmark, and the same in both runs; TLS is not what is compared),
one torch thread per client process, every round waiting for all K (``--min-updates K``, deadlines far off), 1
warm-up round excluded from every figure. Configurations (``--fed-runs model:trainer:K:timed-rounds``; default):
``mlp`` (4,554 parameters) with ``--trainer noop`` at K = 10 and 100, 5 timed rounds; ``cifar_cnn`` (940,362) with
``--trainer noop`` at K = 10 and 100 (CIFAR-10 shards, protocol only), 3 timed rounds; last the goal configuration:
``cifar_cnn`` at K = 100 with real local training, the project's CIFAR-10 experiment ``--config
configs/cifar10_ideal.toml`` (IID shards of 100 clients, the clients' default trainer, ``local_epochs = 1``, batch 10,
its server-side DP and central evaluation, which cost the same in both runs) with ``--private-epochs 0``, 2 timed
rounds. K = 1 to 50 run in one client process, more in two. K = 1000 is not run there (a line says why). The exact
``fedlaunch`` command of each run is printed before it runs.

Printed: per configuration the median seconds per round of each (the server's round, ``rounds.jsonl`` ``seconds``:
round start -> aggregated) and their ratio, the server's CPU seconds per client-round (``timing_seconds.server_cpu``
summed over the timed rounds / (K x rounds)), the client host processes' (the launcher's ``fedlaunch worker``
children, /proc/PID/stat, read as the warm-up row and the last row of ``rounds.jsonl`` appear; ``n/a`` when a host
was gone), and the bytes per client-round up and down, COMPUTED by the in-process part (:func:`computed_bytes`: the
same payload count, extrapolated in P), not measured on the wire. A second table says where the time goes: the wall
seconds between round completions, the plain rounds' phases (``timing_seconds``) and the SecAgg+ phases from the
server log's ``secagg.phase`` events (advertise -> share -> masked -> unmask -> close), and whether the two final
models are bit-identical.

    python tools/bench/bench_secagg.py --federation --out /tmp/work/secagg_federation.txt   # ~10 min on 2 cores
    python tools/bench/bench_secagg.py --federation --fed-runs mlp:noop:10:2            # one small pair (~20 s)
    python tools/bench/bench_secagg.py --federation --fed-runs cifar_cnn:default:100:2  # the goal configuration alone

Run dirs go to ``--fed-dir`` (default /tmp/secagg_fed_runs, each replaced when its run starts -- only in a directory
the tool made, marked with ``.bench_secagg_runs``; another existing non-empty one stops the run with exit 2; the
CIFAR-10 cache beside it), each launcher's output beside its run dir (``RUN.launch.txt``). Measure on an otherwise
idle machine.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import secrets
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script
    sys.path.insert(0, str(ROOT))

from fedcore.aggregation.fixedpoint import FixedPointSum  # noqa: E402
from fedcore.secagg import crypto, prg, shamir  # noqa: E402
from fedcore.secagg.config import SecureAggregationConfig  # noqa: E402
from fedcore.secagg.graph import GraphParameters, choose_parameters  # noqa: E402
from fedcore.secagg.protocol import (  # noqa: E402
    MASKED,
    SHARE,
    UNMASK,
    ClientState,
    Completed,
    Dropped,
    EncryptedShare,
    Event,
    MaskedUpload,
    SecureSum,
    ServerState,
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

FED = "bench-secagg"
ROUND = 1
GRAPH_SEED = 11
UPDATE_SCALE = 1e-3
MODELS = ("mlp", "cifar_cnn")  # the 4,554-parameter "no-op" model and the 940,362-parameter CIFAR CNN
# Parts of the secagg CPU (second table).
SERVER_PARTS = ("steps", "masked sum", "requests", "unmask")
CLIENT_PARTS = ("advertise", "share", "encode", "mask", "unmask")

F32 = npt.NDArray[np.float32]


def cpu() -> float:
    return time.process_time()


def payload_bytes(obj: Any) -> int:
    """Bytes of a message's payload: bytes fields by length, strings as UTF-8, 8 per integer or float, arrays by
    ``nbytes``, tuples and dataclasses as the sum of their parts (no framing, no field tags)."""
    if isinstance(obj, bytes | bytearray):
        return len(obj)
    if isinstance(obj, str):
        return len(obj.encode("utf-8"))
    if isinstance(obj, bool | int | float):
        return 8
    if isinstance(obj, np.ndarray):
        return int(obj.nbytes)
    if isinstance(obj, tuple | list):
        return sum(payload_bytes(x) for x in obj)
    if is_dataclass(obj) and not isinstance(obj, type):
        return sum(payload_bytes(getattr(obj, name)) for name in _field_names(type(obj)))
    raise TypeError(f"no payload size for {type(obj).__name__}")


@functools.cache
def _field_names(cls: type[Any]) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


def model_params(name: str) -> int:
    """Float parameters of registered model ``name`` (its state dict's floating tensors)."""
    from fedcore.models import build_model

    model = build_model(name, {}, seed=0)
    return sum(int(v.numel()) for v in model.state_dict().values() if v.dtype.is_floating_point)


def client_ids(k: int) -> list[str]:
    return [f"c{i:04d}" for i in range(k)]


def update(seed: int, index: int, p: int) -> F32:
    """Client ``index``'s update: float32 ``N(0, 1) * 1e-3`` from a Generator seeded by (seed, index)."""
    rng = np.random.default_rng([seed, index])
    out: F32 = rng.standard_normal(p, dtype=np.float32)
    out *= np.float32(UPDATE_SCALE)
    return out


def weights(seed: int, k: int) -> list[float]:
    rng = np.random.default_rng([seed, k, 1])
    return [float(w) for w in rng.integers(1, 501, size=k)]


def dropped_sets(seed: int, ids: Sequence[str], fractions: Sequence[float], g: GraphParameters) -> list[frozenset[str]]:
    """For each fraction f, floor(f K) clients (seeded) that drop after sharing; raises ValueError beyond what the
    round tolerates."""
    out = []
    for f in fractions:
        n = math.floor(f * len(ids) + 1e-9)
        if n > g.max_dropped:
            raise ValueError(f"--dropouts {f}: {n} of {len(ids)} clients dropping exceeds the {g.max_dropped} a "
                             f"round of {len(ids)} tolerates")
        rng = np.random.default_rng([seed, len(ids), 2])
        out.append(frozenset(ids[i] for i in rng.permutation(len(ids))[:n].tolist()))
    return out


# ---- results ----

@dataclass
class Row:
    """One (model, K, drop) line of the tables: totals over the round (divide by ``clients``)."""

    model: str
    params: int
    clients: int
    neighbours: int
    threshold: int
    drop: float
    dropped: int
    skipped: str = ""  # why secagg was not run ("" = it was)
    plain_skipped: str = ""
    server: dict[str, float] = field(default_factory=lambda: dict.fromkeys(SERVER_PARTS, 0.0))
    client: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CLIENT_PARTS, 0.0))
    plain_server: float = 0.0
    plain_client: float = 0.0
    up: int = 0
    down: int = 0
    exact: bool | None = None
    secure: SecureSum | None = None  # kept for checks (run_unit(keep=True))
    plain: FixedPointSum | None = None

    @property
    def server_s(self) -> float:
        return sum(self.server.values()) / self.clients

    @property
    def client_s(self) -> float:
        return sum(self.client.values()) / self.clients

    @property
    def plain_server_s(self) -> float:
        return self.plain_server / self.clients


@dataclass
class Branch:
    """One dropout fraction's continuation of the round after the share phase."""

    row: Row
    dropped: frozenset[str]
    server: ServerState
    events: list[Event] = field(default_factory=list)


# ---- one (model, K): all dropout fractions ----

def run_unit(model: str, p: int, clients: int, fractions: Sequence[float], seed: int, secure: bool = True,
             keep: bool = False, config: SecureAggregationConfig | None = None, plain_reps: int = 3) -> list[Row]:
    """One round of K clients with P parameters for each dropout fraction: secagg (unless ``secure`` is False),
    then plain FedAvg over the same survivors in a loop of its own, and the check that the two sums agree bit for
    bit; ``keep``: leave the secure and plain sums in the rows."""
    config = config or SecureAggregationConfig()
    ids = client_ids(clients)
    g = choose_parameters(clients, config)
    drops = dropped_sets(seed, ids, fractions, g)
    weight = dict(zip(ids, weights(seed, clients), strict=True))
    rows = [Row(model, p, clients, g.neighbours, g.threshold, f, len(d)) for f, d in zip(fractions, drops, strict=True)]
    results = _secagg(rows, drops, ids, weight, seed, config) if secure else [None for _ in rows]
    sums = _plain(rows, drops, ids, weight, seed, plain_reps)
    for row, d, res, (fps, total) in zip(rows, drops, results, sums, strict=True):
        if res is not None:
            secure_sum = res.params(1)
            survivors = tuple(c for c in ids if c not in d)
            row.exact = (res.survivors == survivors and secure_sum.count == fps.count
                         and torch.equal(secure_sum.hi, fps.hi) and torch.equal(secure_sum.lo, fps.lo)
                         and secure_sum.value(total).numpy().tobytes() == fps.value(total).numpy().tobytes())
        if keep:
            row.secure, row.plain = res, fps
    return rows


def _secagg(rows: list[Row], drops: list[frozenset[str]], ids: list[str], weight: dict[str, float], seed: int,
            config: SecureAggregationConfig) -> list[SecureSum | None]:
    """The secagg round, one server branch per dropout fraction after the share phase: costs and bytes into
    ``rows``; the unmasked sums."""
    p = rows[0].params
    # Identities of the transport (not part of the round: untimed).
    identity = {c: Ed25519PrivateKey.generate() for c in ids}
    verify = crypto.ed25519_verifier({c: key.public_key() for c, key in identity.items()})
    server_pre = dict.fromkeys(SERVER_PARTS, 0.0)
    client_pre = dict.fromkeys(CLIENT_PARTS, 0.0)
    up_pre = down_pre = 0

    t = cpu()
    server, _ = new_round(FED, ROUND, ids, config, GRAPH_SEED + seed, p)
    server_pre["steps"] += cpu() - t
    states: dict[str, ClientState] = {}
    for c in ids:
        t = cpu()
        states[c], adv = client_advertise(FED, ROUND, c, crypto.ed25519_signer(identity[c]))
        client_pre["advertise"] += cpu() - t
        t = cpu()
        server, _ = step(server, adv, verify)
        server_pre["steps"] += cpu() - t
        up_pre += payload_bytes(adv)
    if server.phase != SHARE:
        raise RuntimeError(f"advertise phase did not close: {server.phase} {server.reason} {server.detail}")
    for c in server.participants:
        t = cpu()
        kreq = key_request(server, c)
        server_pre["requests"] += cpu() - t
        t = cpu()
        states[c], shares = client_share(states[c], kreq, verify, config)
        client_pre["share"] += cpu() - t
        t = cpu()
        server, _ = step(server, shares, verify)
        server_pre["steps"] += cpu() - t
        down_pre += payload_bytes(kreq)
        up_pre += payload_bytes(shares)
    if server.phase != MASKED:
        raise RuntimeError(f"share phase did not close: {server.phase} {server.reason} {server.detail}")

    branches = []
    for row, d in zip(rows, drops, strict=True):
        row.server, row.client = dict(server_pre), dict(client_pre)
        row.up, row.down = up_pre, down_pre + 4 * p * len(ids)  # + the model, as in plain FedAvg
        branches.append(Branch(row, d, server))
    # Masked phase: a client's masked vector is computed once (identical in every branch where it survives) and
    # fed to each branch's server.
    masked_states: dict[str, ClientState] = {}
    for i, c in enumerate(ids):
        reqs = []
        for b in branches:
            t = cpu()
            reqs.append(mask_request(b.server, c))
            b.row.server["requests"] += cpu() - t
            b.row.down += payload_bytes(reqs[-1])
        upload: MaskedUpload | None = None
        t_enc = t_mask = 0.0
        if any(c not in b.dropped for b in branches):
            u = update(seed, i, p)
            t = cpu()
            enc = encode_input(u, weight[c])
            t_enc = cpu() - t
            t = cpu()
            masked_states[c], upload = client_mask(states[c], reqs[0], enc)
            t_mask = cpu() - t
        for b in branches:
            if c in b.dropped:
                t = cpu()
                b.server, _ = step(b.server, Dropped(ROUND, c), verify)
                b.row.server["steps"] += cpu() - t
                continue
            assert upload is not None
            b.row.client["encode"] += t_enc
            b.row.client["mask"] += t_mask
            b.row.up += payload_bytes(upload)
            t = cpu()
            b.server, _ = step(b.server, upload, verify)
            b.row.server["masked sum"] += cpu() - t
    out: list[SecureSum | None] = []
    for b in branches:
        _unmask_phase(b, masked_states, verify)
        done = [e for e in b.events if isinstance(e, Completed)]
        if len(done) != 1:
            raise RuntimeError(f"round did not complete: {b.server.phase} {b.server.reason} {b.server.detail}")
        out.append(done[0].result)
    return out


def _unmask_phase(b: Branch, states: dict[str, ClientState], verify: crypto.Verifier) -> None:
    if b.server.phase != UNMASK:
        raise RuntimeError(f"masked phase did not close: {b.server.phase} {b.server.reason} {b.server.detail}")
    for c in sorted(b.server.masked):
        t = cpu()
        req = unmask_request(b.server, c)
        b.row.server["requests"] += cpu() - t
        t = cpu()
        _, reveal = client_unmask(states[c], req)
        b.row.client["unmask"] += cpu() - t
        t = cpu()
        b.server, events = step(b.server, reveal, verify)
        spent = cpu() - t
        b.row.server["unmask" if any(isinstance(e, Completed) for e in events) else "steps"] += spent
        b.events.extend(events)
        b.row.down += payload_bytes(req)
        b.row.up += payload_bytes(reveal)


def _plain(rows: list[Row], drops: list[frozenset[str]], ids: list[str], weight: dict[str, float], seed: int,
           reps: int) -> list[tuple[FixedPointSum, float]]:
    """Plain streaming FedAvg over each branch's survivors, ``reps`` times (the median is kept: one pass is noisy
    on a loaded machine): the clients' serialization and the server's ``add`` per update and ``value`` (CPU into
    ``rows``); the sums and their divisors (Σ n_i)."""
    p = rows[0].params
    sums = [[FixedPointSum(p) for _ in range(reps)] for _ in rows]
    spent = [[0.0] * reps for _ in rows]
    totals = [0.0 for _ in rows]
    for i, c in enumerate(ids):
        u = update(seed, i, p)  # generated untimed: it is the client's training output
        t = cpu()
        u.tobytes()
        serialize = cpu() - t
        ut = torch.from_numpy(u)
        for j, (row, d) in enumerate(zip(rows, drops, strict=True)):
            row.plain_client += serialize
            if c in d:
                continue
            totals[j] += weight[c]
            for rep in range(reps):
                t = cpu()
                sums[j][rep].add(ut, weight[c])
                spent[j][rep] += cpu() - t
    for j, row in enumerate(rows):
        for rep in range(reps):
            t = cpu()
            sums[j][rep].value(totals[j])
            spent[j][rep] += cpu() - t
        row.plain_server = float(np.median(spent[j]))
    return [(fps[0], total) for fps, total in zip(sums, totals, strict=True)]


# ---- the budget: CPU estimates from micro-measurements ----

@dataclass(frozen=True)
class Rates:
    """Seconds per unit of work on this machine now (:func:`calibrate`)."""

    prg_word: float  # one mask word generated and added (apply_masks, AES-CTR)
    x25519: float  # one agreement + HKDF (crypto.mask_seed / share_key)
    verify: float  # one Ed25519 verify
    split_term: float  # one (holder, coefficient) step of shamir.split
    rec_term: float  # one t^2 step of shamir.reconstruct
    encode_coord: float  # encode_input per coordinate
    add_coord: float  # FixedPointSum.add per coordinate
    gen_coord: float  # generating an update, per coordinate
    sum_word: float  # one uint64 word of the server's masked sum (np.add into a new array)
    py_iter: float  # one inner iteration of mask_request's comprehension (Python bookkeeping)
    py_scan: float  # one element of a membership test on a tuple of ids (the server's pending check)
    wall_per_cpu: float  # wall seconds per CPU second of the calibration (machine load)


def _min_cpu(fn: Callable[[int], object], reps: int = 3) -> float:
    """The least CPU seconds of ``fn(i)`` over ``reps`` calls after a warm-up call (i = 0, 1, ...)."""
    fn(0)
    best = math.inf
    for i in range(1, reps + 1):
        t = cpu()
        fn(i)
        best = min(best, cpu() - t)
    return best


def calibrate() -> Rates:
    w0, c0 = time.perf_counter(), cpu()
    vec = np.zeros(1 << 19, dtype=np.uint64)
    seeds = [secrets.token_bytes(32) for _ in range(4)]
    prg_word = _min_cpu(lambda _: prg.apply_masks(vec, seeds[:2], seeds[2:])) / (4 * vec.size)
    sum_word = _min_cpu(lambda _: np.add(vec, vec)) / vec.size
    a, b = crypto.KeyPair.generate(), crypto.KeyPair.generate()
    x25519 = _min_cpu(lambda _: [crypto.mask_seed(a.private, b.public, FED, ROUND, "a", "b")
                                 for _ in range(20)]) / 20
    key = Ed25519PrivateKey.generate()
    msg = crypto.advertisement_message(FED, ROUND, "a", a.public, b.public)
    sig, pub = key.sign(msg), key.public_key()
    verify = _min_cpu(lambda _: [pub.verify(sig, msg) for _ in range(20)]) / 20
    secret = secrets.token_bytes(32)
    split_term = _min_cpu(lambda _: shamir.split(secret, 24, list(range(1, 49)))) / (24 * 48)
    shares = shamir.split(secret, 24, list(range(1, 49)))
    # a new holder set each call: the Lagrange coefficients of a set are cached, the round's sets differ
    rec_term = _min_cpu(lambda i: shamir.reconstruct(shares[i:i + 24], 24, 32)) / (24 * 24)
    n = 1 << 16
    gen_coord = _min_cpu(lambda i: update(0, i, n)) / n
    u = update(0, 0, n)
    encode_coord = _min_cpu(lambda _: encode_input(u, 3.0)) / n
    fps, ut = FixedPointSum(n), torch.from_numpy(u)
    add_coord = _min_cpu(lambda _: fps.add(ut, 3.0)) / n
    names = client_ids(300)  # 90k shares, built in order: the loop runs from warm caches (see COLD)
    owned = {v: tuple(EncryptedShare(v, w, b"") for w in names) for v in names}
    py_iter = _min_cpu(lambda _: [es for v in names if v in owned for es in owned[v]
                                  if es.recipient == names[-1]]) / (300 * 300)
    ids, last = tuple(client_ids(1000)), str(client_ids(1000)[-1])  # equal, not identical: compared in full
    py_scan = _min_cpu(lambda _: [last in ids for _ in range(20)]) / (20 * 1000)
    wall_per_cpu = max(1.0, (time.perf_counter() - w0) / max(cpu() - c0, 1e-6))
    return Rates(prg_word, x25519, verify, split_term, rec_term, encode_coord, add_coord, gen_coord, sum_word,
                 py_iter, py_scan, wall_per_cpu)


# Empirical factors, fitted on one K = 1000 mlp round on a loaded 2-core machine: the server's mask requests visit
# k^2 shares each, with cold caches in the round (about 175 ns a share there, 8x the warm loop of calibrate()); and
# allocation, garbage collection and the Python around the modelled work (the rest was 0.7x the CPU taken).
COLD = 8.0
OVERHEAD = 1.4


def estimate_cpu(r: Rates, p: int, clients: int, fractions: Sequence[float], secure: bool, reps: int) -> float:
    """CPU seconds one (model, K) should take: the plain sums, and (``secure``) the crypto, the masks and the
    server's bookkeeping (its mask requests scan k^2 shares per client, :data:`COLD`, its pending check K^2 / 2 ids
    per masked upload, its steps about 50 Python iterations per client and neighbour), times :data:`OVERHEAD`."""
    n = len(fractions)
    plain = clients * p * (r.gen_coord + n * reps * r.add_coord)
    if not secure:
        return plain
    g = choose_parameters(clients, SecureAggregationConfig())
    k, t, words = g.neighbours, g.threshold, 2 * p
    # verify k advertisements, k + 2k key agreements (seal, open, mask seeds), split 2 secrets, k + 1 mask streams
    per_client = (k * (r.verify + 3 * r.x25519) + 2 * k * t * r.split_term + (k + 1) * words * r.prg_word
                  + p * (r.encode_coord + r.gen_coord))
    server = clients * r.verify
    for f in fractions:
        d = math.floor(f * clients + 1e-9)
        server += ((clients + d) * t * t * r.rec_term + (clients + d * k) * words * r.prg_word
                   + clients * words * r.sum_word + d * k * r.x25519
                   + r.py_iter * (COLD * clients * k * k + 50 * clients * k) + r.py_scan * clients ** 3 / 2)
    return OVERHEAD * (plain + clients * per_client + server)


# ---- output ----

def _b(x: float) -> str:
    return f"{x:,.0f}"


def _s(x: float) -> str:
    return f"{x:.3g}"


def _ratio(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


SKIPPED = "skipped (budget)"


def main_table(rows: Sequence[Row]) -> str:
    head = ("| model | P | K | k | t | drop | server CPU s/cr secagg | plain | ratio | client CPU s secagg "
            "| plain (serialize) | up B secagg | plain | down B secagg | plain | exact |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        first = (f"| {r.model} | {r.params:,} | {r.clients} | {r.neighbours} | {r.threshold} | "
                 f"{r.drop:g} ({r.dropped}) |")
        plain_s = SKIPPED if r.plain_skipped else _s(r.plain_server_s)
        plain_c = SKIPPED if r.plain_skipped else _s(r.plain_client / r.clients)
        plain_b = _b(4 * r.params)
        if r.skipped:
            lines.append(f"{first} {r.skipped} | {plain_s} | - | - | {plain_c} | - | {plain_b} | - | {plain_b} "
                         f"| - |")
            continue
        ratio = "-" if r.plain_skipped or r.plain_server <= 0 else _ratio(r.server_s / r.plain_server_s)
        lines.append(f"{first} {_s(r.server_s)} | {plain_s} | {ratio} | {_s(r.client_s)} | {plain_c} | "
                     f"{_b(r.up / r.clients)} | {plain_b} | {_b(r.down / r.clients)} | {plain_b} | "
                     f"{'yes' if r.exact else 'NO'} |")
    return "\n".join(lines)


def parts_table(rows: Sequence[Row]) -> str:
    head = ("| model | K | drop | " + " | ".join(f"server {p}" for p in SERVER_PARTS) + " | "
            + " | ".join(f"client {p}" for p in CLIENT_PARTS) + " |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        if r.skipped:
            continue
        cells = [_s(r.server[p] / r.clients) for p in SERVER_PARTS] + [_s(r.client[p] / r.clients)
                                                                      for p in CLIENT_PARTS]
        lines.append(f"| {r.model} | {r.clients} | {r.drop:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---- --federation: the same federation run plain and with SecAgg+, over gRPC on loopback ----

WARMUP = 1  # untimed first round of every federation (start-up, first connections, caches)
CIFAR_CONFIG = ROOT / "configs" / "cifar10_ideal.toml"  # the project's CIFAR-10 experiment (IID, no attackers)
SECURE_SET = 'aggregation.secure="secagg+"'
FED_TRAINERS = ("noop", "default")
NOT_MEASURED = "n/a"


@dataclass(frozen=True)
class FedSpec:
    """One configuration of ``--federation``: ``trainer`` is ``noop`` (clients return the received model at once:
    the protocol only) or ``default`` (the clients' default trainer on real data: cifar_cnn only, from
    :data:`CIFAR_CONFIG`); ``rounds`` are the timed rounds, after :data:`WARMUP`."""

    model: str
    clients: int
    trainer: str
    rounds: int

    @property
    def procs(self) -> int:
        """Client host processes: one for a small K, two (one per core of a 2-core machine) for more."""
        return 1 if self.clients <= 50 else 2

    @property
    def name(self) -> str:
        return f"{self.model}-K{self.clients}-{self.trainer}"


DEFAULT_FED = (FedSpec("mlp", 10, "noop", 5), FedSpec("mlp", 100, "noop", 5),
               FedSpec("cifar_cnn", 10, "noop", 3), FedSpec("cifar_cnn", 100, "noop", 3),
               FedSpec("cifar_cnn", 100, "default", 2))  # the goal configuration last


def parse_fed_specs(text: str) -> list[FedSpec]:
    """``model:trainer:K:rounds`` items, comma-separated (``--fed-runs``)."""
    out = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        parts = item.split(":")
        if len(parts) != 4:
            raise ValueError(f"--fed-runs {item!r}: expected model:trainer:K:rounds")
        model, trainer, k, rounds = parts
        if model not in MODELS or trainer not in FED_TRAINERS:
            raise ValueError(f"--fed-runs {item!r}: model one of {MODELS}, trainer one of {FED_TRAINERS}")
        if trainer == "default" and model != "cifar_cnn":
            raise ValueError(f"--fed-runs {item!r}: real training is the CIFAR-10 experiment (cifar_cnn) only")
        spec = FedSpec(model, int(k), trainer, int(rounds))
        if spec.clients < SecureAggregationConfig().min_clients or spec.rounds < 1:
            raise ValueError(f"--fed-runs {item!r}: K >= {SecureAggregationConfig().min_clients}, rounds >= 1")
        out.append(spec)
    return out


def launch_command(spec: FedSpec, secure: bool, run_dir: Path, seed: int, cache_dir: Path) -> list[str]:
    """The ``python -m fedlaunch`` command line of one run: virtual clients on loopback, plaintext gRPC
    (``--insecure``: the same in both runs; TLS is not what is compared), every round waiting for all K
    (``--min-updates K``, a deadline far off), one torch thread per client process."""
    k = spec.clients
    cmd = [sys.executable, "-m", "fedlaunch", "--clients", str(k), "-k", str(k), "--min-updates", str(k),
           "--rounds", str(spec.rounds + WARMUP), "--round-timeout", "3600", "--virtual", "--procs", str(spec.procs),
           "--torch-threads", "1", "--insecure", "--seed", str(seed), "--run-dir", str(run_dir)]
    cache = f'cache_dir="{cache_dir}"'
    if spec.trainer == "noop":
        cmd += ["--trainer", "noop"]
        if spec.model == "cifar_cnn":
            cmd += ["--server-set", 'model.name="cifar_cnn"', "--server-set", 'data.dataset="cifar10"',
                    "--server-set", f'data.options={{num_clients={max(100, k)}, partition="iid", pool="train", '
                                    f'{cache}}}']
        elif spec.model != "mlp":
            cmd += ["--server-set", f'model.name="{spec.model}"']
    else:  # the experiment file, its private models off (they are not part of a round)
        cmd += ["--config", str(CIFAR_CONFIG), "--private-epochs", "0",
                "--server-set", f"data.options.{cache}"]
    if secure:
        # Each exchange phase's deadline far off too: a slow machine must not turn cost into dropouts.
        cmd += ["--server-set", SECURE_SET, "--server-set", "secagg.phase_timeout_s=3600.0"]
    return cmd


def _proc_stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()
    except OSError:
        return None


def child_pids(parent: int, marker: bytes) -> list[int]:
    """The processes whose parent is ``parent`` and whose command line holds ``marker`` (Linux /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        stat = _proc_stat(int(entry))
        if stat is None or int(stat[1]) != parent:
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if marker in f.read():
                    out.append(int(entry))
        except OSError:
            continue
    return sorted(out)


def proc_cpu(pids: Sequence[int]) -> float | None:
    """User + system CPU seconds of ``pids`` together (/proc/PID/stat); None when one is gone."""
    total = 0
    for pid in pids:
        stat = _proc_stat(pid)
        if stat is None:
            return None
        total += int(stat[11]) + int(stat[12])
    return total / os.sysconf("SC_CLK_TCK")


def complete_rows(path: Path) -> int:
    """Complete lines of ``path`` so far (0 before it exists)."""
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return -1


@dataclass
class FedRun:
    """One federation's figures over its timed rounds (the rounds after :data:`WARMUP`)."""

    seconds: list[float] = field(default_factory=list)  # rounds.jsonl "seconds": start -> aggregated
    server_cpu: float = 0.0  # the server's CPU seconds over the timed rounds (timing_seconds.server_cpu summed)
    client_cpu: float | None = None  # the client host processes' CPU seconds over the same span (/proc)
    wall: float = 0.0  # wall seconds per round between round completions (server.log)
    phases: dict[str, float] = field(default_factory=dict)  # median seconds per phase
    total_wall: float = 0.0  # the whole launch, start-up included
    error: str = ""

    @property
    def median(self) -> float:
        return float(np.median(self.seconds)) if self.seconds else math.nan


def _stamp(event: dict[str, Any]) -> float:
    from datetime import datetime

    return datetime.fromisoformat(str(event["timestamp"]).replace("Z", "+00:00")).timestamp()


SECURE_PHASES = ("advertise", "share", "masked", "unmask", "close")
PLAIN_PHASES = ("hand_out", "turnaround", "upload", "aggregation", "report")


def secure_phases(events: Sequence[dict[str, Any]], rounds: Sequence[int]) -> dict[str, float]:
    """Median seconds of each SecAgg+ phase over ``rounds`` from the server's log: advertise = round.started ->
    the share phase opens, share -> masked, masked (hand-out of the model, training, masking, upload) -> unmask,
    unmask (shares revealed, masks removed) -> secagg.completed, close = -> round.completed (aggregate, report).
    The last attempt of a round counts (an abandoned attempt's time is in its round's ``seconds`` only)."""
    per: dict[str, list[float]] = {p: [] for p in SECURE_PHASES}
    for r in rounds:
        marks: dict[str, float] = {}
        for e in events:
            if e.get("round") != r:
                continue
            name = e["event"]
            key = ("started" if name == "round.started" else f"open:{e.get('phase')}" if name == "secagg.phase"
                   else "unmasked" if name == "secagg.completed" else "completed" if name == "round.completed"
                   else "")
            if key:
                marks[key] = _stamp(e)  # the last attempt's stamp wins
        order = ["started", "open:share", "open:masked", "open:unmask", "unmasked", "completed"]
        if all(m in marks for m in order):
            for phase, a, b in zip(SECURE_PHASES, order, order[1:], strict=False):
                per[phase].append(marks[b] - marks[a])
    return {p: float(np.median(v)) for p, v in per.items() if v}


# Written into --fed-dir when this tool creates it: only a directory that carries it has run dirs the tool may replace.
FED_DIR_MARK = ".bench_secagg_runs"


def claim_fed_dir(fed_dir: Path) -> None:
    """Make ``fed_dir`` this tool's (created with its mark), or check that it already is; anything else -- an existing
    directory without the mark, a file -- stops the run with exit 2 before anything in it is touched."""
    mark = fed_dir / FED_DIR_MARK
    if fed_dir.is_dir() and mark.is_file():
        return
    if fed_dir.exists() and (not fed_dir.is_dir() or any(fed_dir.iterdir())):
        raise SystemExit(f"--fed-dir {fed_dir}: exists and was not made by this tool (no {FED_DIR_MARK} in it); "
                         "its run dirs would be replaced: name a new or empty directory, or remove it yourself")
    fed_dir.mkdir(parents=True, exist_ok=True)
    mark.write_text("run dirs of tools/bench/bench_secagg.py --federation: replaced run by run\n")


def run_federation(spec: FedSpec, secure: bool, run_dir: Path, seed: int, cache_dir: Path,
                   timeout_s: float) -> FedRun:
    """Launch one federation, follow its ``rounds.jsonl`` (the client hosts' CPU is read from /proc as the warm-up
    row and the last row appear), and reduce its rows and server log to a :class:`FedRun`."""
    import json
    import shutil
    import signal
    import subprocess

    if run_dir.exists():  # a run dir of this tool's (claim_fed_dir checked its parent's mark)
        if not (run_dir.parent / FED_DIR_MARK).is_file():
            raise SystemExit(f"{run_dir}: not in a directory made by tools/bench/bench_secagg.py; not replaced")
        shutil.rmtree(run_dir)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    total = spec.rounds + WARMUP
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    shared = ROOT.parent / "shared" / "data"
    if "FEDGUARD_DATA_DIR" not in env and shared.is_dir():
        env["FEDGUARD_DATA_DIR"] = str(shared)
    cmd = launch_command(spec, secure, run_dir, seed, cache_dir)
    out = run_dir.with_name(run_dir.name + ".launch.txt")
    result = FedRun()
    began = time.monotonic()
    hosts: list[int] = []
    marks: dict[int, float | None] = {}
    seen = 0
    size = -1
    next_scan = 0.0
    with open(out, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            while proc.poll() is None:
                now = time.monotonic()
                if now - began > timeout_s:
                    result.error = f"timed out after {timeout_s:.0f} s"
                    break
                if len(hosts) < spec.procs and now >= next_scan:
                    hosts = child_pids(proc.pid, b"worker")
                    next_scan = now + 0.2
                if (now_size := _size(run_dir / "rounds.jsonl")) != size:  # a stat per poll, a read per change
                    size = now_size
                    n = complete_rows(run_dir / "rounds.jsonl")
                    if n != seen:
                        seen = n
                        marks[n] = proc_cpu(hosts) if len(hosts) == spec.procs else None
                time.sleep(0.01)
        finally:
            if proc.poll() is None:  # a timeout or an interrupt: the launcher stops its children
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    result.total_wall = time.monotonic() - began
    if proc.returncode != 0 and not result.error:
        tail = out.read_text(errors="replace").strip().splitlines()[-3:]
        result.error = f"launcher exit {proc.returncode}: " + " / ".join(tail)
    rows = [json.loads(x) for x in (run_dir / "rounds.jsonl").read_text().splitlines() if x.strip()] \
        if (run_dir / "rounds.jsonl").exists() else []
    if len(rows) < total:
        result.error = result.error or f"{len(rows)} of {total} rounds completed"
        return result
    timed = rows[WARMUP:total]
    result.seconds = [float(r["seconds"]) for r in timed]
    result.server_cpu = sum(float(r["timing_seconds"]["server_cpu"]) for r in timed)
    first, last = marks.get(WARMUP), marks.get(total)
    result.client_cpu = last - first if first is not None and last is not None else None
    events = [json.loads(x) for x in (run_dir / "server.log").read_text(errors="replace").splitlines()
              if x.startswith("{")]
    done = {int(e["round"]): _stamp(e) for e in events if e.get("event") == "round.completed"}
    if WARMUP in done and total in done:
        result.wall = (done[total] - done[WARMUP]) / spec.rounds
    numbers = [int(r["round"]) for r in timed]
    if secure:
        result.phases = secure_phases(events, numbers)
    else:
        result.phases = {p: float(np.median([r["timing_seconds"][p] for r in timed])) for p in PLAIN_PHASES}
    return result


# Two small sizes the in-process round runs at: its payload bytes are affine in P (16 B per masked coordinate up, the
# 4 B/param model down), so they are extrapolated from these to the model's P.
BYTES_P = (8, 16)


@functools.cache
def _bytes_at(clients: int, p: int, seed: int) -> tuple[int, int]:
    row = run_unit("bytes", p, clients, [0.0], seed, plain_reps=1)[0]
    if not row.exact:
        raise RuntimeError(f"the in-process round at K={clients}, P={p} did not unmask the plain sum")
    return row.up, row.down


def computed_bytes(p: int, clients: int, seed: int = 0) -> tuple[float, float]:
    """SecAgg+'s payload bytes per client-round up and down (the in-process part's :func:`payload_bytes` of every
    message of a round of K clients, no dropout, down including the 4 B/param model), for P parameters: the round is
    run in process at the two sizes :data:`BYTES_P` and the totals extrapolated (they are affine in P)."""
    (u0, d0), (u1, d1) = (_bytes_at(clients, q, seed) for q in BYTES_P)
    span = BYTES_P[1] - BYTES_P[0]
    up = u0 + (u1 - u0) * (p - BYTES_P[0]) / span
    down = d0 + (d1 - d0) * (p - BYTES_P[0]) / span
    return up / clients, down / clients


@dataclass
class FedPair:
    spec: FedSpec
    params: int
    plain: FedRun
    secure: FedRun
    up: float = 0.0
    down: float = 0.0
    same_model: bool | None = None


def same_final_model(a: Path, b: Path) -> bool | None:
    """Whether two runs' final models are bit-identical (None when either is missing)."""
    from fedcore.serialization import load_state

    if not (a / "final_model.fgt").exists() or not (b / "final_model.fgt").exists():
        return None
    x, _ = load_state(a / "final_model.fgt")
    y, _ = load_state(b / "final_model.fgt")
    return x.keys() == y.keys() and all(x[k].numpy().tobytes() == y[k].numpy().tobytes() for k in x)


def _per_cr(x: float | None, run: FedRun, spec: FedSpec) -> str:
    if run.error:
        return "-"
    if x is None:
        return NOT_MEASURED
    return f"{x / (spec.clients * spec.rounds):.3g}"


def _secs(run: FedRun) -> str:
    return f"failed ({run.error})" if run.error else f"{run.median:.3g}"


def federation_table(pairs: Sequence[FedPair]) -> str:
    head = ("| model | P | K | trainer | timed rounds | plain median s/round | secagg median s/round | ratio "
            "| plain server CPU s/cr | secagg server CPU s/cr | plain clients' CPU s/cr | secagg clients' CPU s/cr "
            "| up B/cr plain (computed) | secagg (computed) | down B/cr plain (computed) | secagg (computed) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for x in pairs:
        s, p, q = x.spec, x.plain, x.secure
        ratio = "-" if p.error or q.error else f"{q.median / p.median:.3g}"
        lines.append(f"| {s.model} | {x.params:,} | {s.clients} | {s.trainer} | {s.rounds} | {_secs(p)} | "
                     f"{_secs(q)} | {ratio} | {_per_cr(p.server_cpu, p, s)} | {_per_cr(q.server_cpu, q, s)} | "
                     f"{_per_cr(p.client_cpu, p, s)} | {_per_cr(q.client_cpu, q, s)} | {_b(4 * x.params)} | "
                     f"{_b(x.up)} | {_b(4 * x.params)} | {_b(x.down)} |")
    return "\n".join(lines)


def phases_table(pairs: Sequence[FedPair]) -> str:
    head = ("| model | K | trainer | wall s/round plain | secagg | plain: " + " | ".join(PLAIN_PHASES)
            + " | secagg: " + " | ".join(SECURE_PHASES) + " | same final model |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for x in pairs:
        s, p, q = x.spec, x.plain, x.secure
        cells = [f"{p.wall:.3g}" if not p.error else "-", f"{q.wall:.3g}" if not q.error else "-"]
        cells += [f"{p.phases[n]:.3g}" if n in p.phases else "-" for n in PLAIN_PHASES]
        cells += [f"{q.phases[n]:.3g}" if n in q.phases else "-" for n in SECURE_PHASES]
        same = "-" if x.same_model is None else "yes" if x.same_model else "NO"
        lines.append(f"| {s.model} | {s.clients} | {s.trainer} | " + " | ".join(cells) + f" | {same} |")
    return "\n".join(lines)


class Tee:
    """Print, and append the same line to ``path`` (when given)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("")

    def __call__(self, text: str = "") -> None:
        print(text, flush=True)
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(text + "\n")


def federation_main(specs: Sequence[FedSpec], fed_dir: Path, seed: int, budget_s: float, timeout_s: float,
                    out: Path | None) -> int:
    """Each configuration twice back to back, plain then SecAgg+, and the tables."""
    claim_fed_dir(fed_dir)
    say = Tee(out)
    began = time.perf_counter()
    cache_dir = fed_dir.with_name(fed_dir.name + "_cache")
    say(f"SecAgg+ vs plain FedAvg on real federations: fedlaunch, virtual clients over gRPC on loopback "
        f"(--insecure: plaintext, the same in both runs), {os.cpu_count()} CPUs, torch threads 1 per client "
        f"process, seed {seed}, {WARMUP} warm-up round excluded from every figure; run dirs under {fed_dir}/")
    pairs: list[FedPair] = []
    failed = False
    for spec in specs:
        left = budget_s - (time.perf_counter() - began)
        if left <= 0:
            say(f"  {spec.name}: not run (--fed-budget-s {budget_s:g} spent)")
            continue
        params = model_params(spec.model)
        runs = []
        for secure in (False, True):
            variant = "secagg" if secure else "plain"
            cmd = launch_command(spec, secure, fed_dir / f"{spec.name}-{variant}", seed, cache_dir)
            say(f"  {spec.name} {variant}: {spec.rounds} timed rounds + {WARMUP} warm-up, "
                f"{spec.procs} client process(es): python {shlex.join(cmd[1:])}")
            run = run_federation(spec, secure, fed_dir / f"{spec.name}-{variant}", seed, cache_dir,
                                 min(timeout_s, max(60.0, budget_s - (time.perf_counter() - began))))
            runs.append(run)
            what = (f"FAILED: {run.error}" if run.error else
                    f"median {run.median:.3f} s/round (rounds {', '.join(f'{x:.3f}' for x in run.seconds)}), "
                    f"server CPU {run.server_cpu:.2f} s, clients' CPU "
                    f"{NOT_MEASURED if run.client_cpu is None else f'{run.client_cpu:.2f} s'} over the timed rounds")
            say(f"    {what}; launch {run.total_wall:.0f} s wall")
            failed = failed or bool(run.error)
        pair = FedPair(spec, params, runs[0], runs[1])
        pair.up, pair.down = computed_bytes(params, spec.clients, seed)
        pair.same_model = same_final_model(fed_dir / f"{spec.name}-plain", fed_dir / f"{spec.name}-secagg")
        pairs.append(pair)
    say()
    say(federation_table(pairs))
    say()
    say("Where the time goes (medians over the timed rounds, seconds): wall s/round = between round completions "
        "(server.log); plain phases = rounds.jsonl timing_seconds (fedserver/round_timing.py: hand_out, turnaround = "
        "model written out + client receive + training + upload call, upload, aggregation, report incl. any "
        "central evaluation); secagg phases from the server.log events: advertise = round.started -> "
        "secagg.phase share, share -> masked, masked (model hand-out, training, masking, upload) -> unmask, "
        "unmask (reveal shares, reconstruct, remove masks) -> secagg.completed, close -> round.completed "
        "(aggregate, report).")
    say()
    say(phases_table(pairs))
    say()
    g = {k: choose_parameters(k, SecureAggregationConfig()) for k in sorted({x.spec.clients for x in pairs})}
    say("s/round: the server's round (rounds.jsonl \"seconds\": round start -> aggregated), median over the timed "
        "rounds; ratio = secagg / plain. server CPU s/cr: the server process's CPU seconds over the timed rounds "
        "(timing_seconds.server_cpu, all threads, user + system) / (K x timed rounds). clients' CPU s/cr: the client "
        "host processes' CPU (/proc/PID/stat of the launcher's 'fedlaunch worker' children, user + system, read "
        "when the warm-up row and the last row of rounds.jsonl appeared) / (K x timed rounds); n/a where a host "
        "was gone before the last row was read. B/cr: COMPUTED, not measured on the wire: the in-process part's "
        "payload bytes (payload_bytes of every message of a round, no framing, no gRPC/HTTP2 overhead, the 4 "
        "extra scalars of the real masked vector not counted) per client for K clients with no dropout, "
        f"extrapolated in P from P = {BYTES_P[0]} and {BYTES_P[1]}; plain = the 4 B/param float32 update up and "
        "model down. SecAgg+ degree k / threshold t: "
        + ", ".join(f"K={k}: k={v.neighbours}, t={v.threshold}" for k, v in g.items()) + ".")
    say("K = 1000: not run on real federations: the machine has 2 cores, and 1,000 virtual clients each masking "
        "with k = 236 neighbours (cifar_cnn: ~445 G mask words a round) is far beyond this measurement's budget; "
        "see the in-process part (python tools/bench/bench_secagg.py) for its per-client costs.")
    say(f"{time.perf_counter() - began:,.0f} s wall in all")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="K in {10, 100} with the 4.5k-parameter model only")
    ap.add_argument("--ks", default="10,100,1000", help="comma-separated K values")
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated registered model names")
    ap.add_argument("--params", default="", help="comma-separated synthetic sizes P instead of --models")
    ap.add_argument("--dropouts", default="0,0.1",
                    help="comma-separated fractions of clients dropping after sharing (a row each)")
    ap.add_argument("--budget-s", type=float, default=600.0,
                    help="wall seconds for the whole run: a configuration estimated to end later is skipped")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (FixedPointSum's add workers)")
    ap.add_argument("--plain-reps", type=int, default=3,
                    help="plain FedAvg sums per configuration (the median CPU is reported)")
    ap.add_argument("--seed", type=int, default=0)
    fed = ap.add_argument_group("--federation: real federations (fedlaunch, virtual clients, gRPC on loopback)")
    fed.add_argument("--federation", action="store_true",
                     help="run each --fed-runs configuration twice, plain then SecAgg+, and print their rounds side "
                          "by side (instead of the in-process round)")
    fed.add_argument("--fed-runs", default=",".join(f"{s.model}:{s.trainer}:{s.clients}:{s.rounds}"
                                                    for s in DEFAULT_FED),
                     help="comma-separated model:trainer:K:timed-rounds (trainer noop, or default: the CIFAR-10 "
                          "experiment's real training); default %(default)s")
    fed.add_argument("--fed-dir", type=Path, default=Path("/tmp/secagg_fed_runs"),
                     help="where the run dirs go (replaced run by run; the CIFAR-10 cache beside it, DIR_cache)")
    fed.add_argument("--fed-budget-s", type=float, default=2400.0,
                     help="wall seconds for all the federations: a configuration is not started past it")
    fed.add_argument("--fed-timeout-s", type=float, default=1200.0, help="wall seconds one launch may take")
    fed.add_argument("--out", type=Path, help="--federation: also write the printed output to this file")
    args = ap.parse_args(argv)
    if args.federation:
        try:
            specs = parse_fed_specs(args.fed_runs)
        except ValueError as e:
            ap.error(str(e))
        if not specs:
            ap.error("--fed-runs: no configuration")
        return federation_main(specs, args.fed_dir, args.seed, args.fed_budget_s, args.fed_timeout_s, args.out)
    began = time.perf_counter()
    torch.set_num_threads(max(1, args.threads))

    ks = [10, 100] if args.quick else [int(float(x)) for x in args.ks.split(",") if x.strip()]
    fractions = [float(x) for x in args.dropouts.split(",") if x.strip()]
    if args.params:
        sizes = [(f"P={int(float(x)):,}", int(float(x))) for x in args.params.split(",") if x.strip()]
    else:
        names = [MODELS[0]] if args.quick else [m.strip() for m in args.models.split(",") if m.strip()]
        sizes = [(m, model_params(m)) for m in names]
    rates = calibrate()
    print(f"SecAgg+ vs plain streaming FedAvg, in process: torch {torch.__version__}, numpy {np.__version__}, "
          f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, budget {args.budget_s:g} s wall; "
          f"masks (AES-CTR) {1e-6 / rates.prg_word:,.0f} M words/s, X25519+HKDF {rates.x25519 * 1e6:.0f} us, "
          f"wall/CPU {rates.wall_per_cpu:.2f}", flush=True)

    units = [(name, p, k) for name, p in sizes for k in ks]
    order = sorted(units, key=lambda u: estimate_cpu(rates, u[1], u[2], fractions, True, args.plain_reps))
    results: dict[tuple[str, int, int], list[Row]] = {}
    cpu_done = wall_done = 0.0
    for name, p, k in order:
        ratio = max(1.0, wall_done / cpu_done if cpu_done > 2.0 else rates.wall_per_cpu)
        left = args.budget_s - (time.perf_counter() - began)
        est = estimate_cpu(rates, p, k, fractions, True, args.plain_reps)
        est_plain = estimate_cpu(rates, p, k, fractions, False, args.plain_reps)
        secure = est * ratio <= left
        if not secure and est_plain * ratio > left:
            g = choose_parameters(k, SecureAggregationConfig())
            results[(name, p, k)] = [Row(name, p, k, g.neighbours, g.threshold, f, math.floor(f * k + 1e-9),
                                         skipped=SKIPPED, plain_skipped=SKIPPED)
                                     for f in fractions]
            print(f"  {name} K={k}: skipped (budget): needs ~{est:,.0f} CPU s (est.), ~{est * ratio:,.0f} s wall, "
                  f"{left:,.0f} s left", flush=True)
            continue
        w0, c0 = time.perf_counter(), cpu()
        rows = run_unit(name, p, k, fractions, args.seed, secure=secure, plain_reps=args.plain_reps)
        spent_w, spent_c = time.perf_counter() - w0, cpu() - c0
        wall_done += spent_w
        cpu_done += spent_c
        if not secure:
            for r in rows:
                r.skipped = SKIPPED
        results[(name, p, k)] = rows
        what = (f"plain only, secagg skipped (budget: needs ~{est:,.0f} CPU s (est.), ~{est * ratio:,.0f} s wall, "
                f"{left:,.0f} s left)" if not secure else "secagg + plain")
        print(f"  {name} K={k}: {what}: est ~{est if secure else est_plain:,.1f} CPU s, took {spent_c:,.1f} CPU s "
              f"({spent_w:,.1f} s wall)", flush=True)
    rows = [r for u in units for r in results[u]]
    print()
    print(main_table(rows))
    print()
    print("Secagg CPU seconds per client by part (server: steps = advertisement, share and reveal steps (signature "
          "checks, bookkeeping), masked sum = the masked-vector steps, requests = key/mask/unmask requests built, "
          "unmask = the last step: Shamir reconstruction + removing the masks):")
    print()
    print(parts_table(rows))
    print()
    print("server CPU s/cr: process CPU seconds of the server's work / K; client CPU s: per client (plain: only "
          "float32 -> bytes); B: payload bytes per client, secagg down includes the 4 B/param model; drop: fraction "
          "(count) dropping after sharing; exact: the unmasked secure sum equals the plain FixedPointSum bit for bit; "
          f"{time.perf_counter() - began:,.0f} s wall in all")
    bad = [r for r in rows if not r.skipped and not r.exact]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
