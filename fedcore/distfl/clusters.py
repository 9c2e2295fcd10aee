"""DistFL's cross-device cluster membership: a deterministic state machine over plain, serializable state.

``state, events = step(state, observation, config)``, shaped like :mod:`fedcore.rounds` and
:mod:`fedcore.nfl.detectors`. The paper (§4.3–§4.4) clusters all N uploaded models every round under full
participation; SPEC §8's cross-device adaptation ("our design, not in the paper") keeps a persistent,
per-client membership instead. After each round the shell (the server) feeds a :class:`ClusterObservation`: the
responses V_c (Eq. 5, flat floats) of the models it has this round, computed on one set of synthetic inputs, the
*probe*. The machine reads no clock, draws no randomness and holds only plain data: :class:`ClusterState`
round-trips exactly through ``to_dict``/``from_dict`` (JSON-safe). ``step`` updates the state in place and
returns it. Torch is used only inside :func:`fedcore.distfl.similarity.kl_matrix`.

Rules, for round r with warm-up R_w = ``warmup_rounds`` and period T_c = ``recluster_every``:

- Replay: a round at or below ``state.last_round`` changes nothing and emits nothing.
- Storage: every response in the observation replaces its client's stored one (the latest upload counts), with
  its shape, its probe and the round. Responses are compared only with responses on the same probe (responses to
  different synthetic inputs say nothing about each other); a probe with a different shape is an error.
- Warm-up (r <= R_w): no clusters -- every client uses the global (FedAvg) model; responses are only stored (the
  shell may send none during warm-up).
- Clustering rounds (:func:`clustering_due`): the first round after warm-up, then every round r >=
  ``clustered_round`` + T_c (T_c = 0: never again). All clients whose stored response is on the observation's
  probe are clustered together (KL matrix Eq. 6 + :func:`~fedcore.distfl.similarity.link_components` at τ) and
  :class:`ClusterFormed` lists the complete partition. A due round with no response on its probe clusters
  nothing and stays due. **Shell protocol**: on a due round, extract fresh inputs from the pre-aggregated model
  and send the responses of every client model you keep (not only this round's uploads) on them; between
  clustering rounds, keep that probe and send at least the responses of newly seen clients.
- Between clustering rounds, a client seen for the first time (no cluster yet) joins the cluster of its nearest
  clustered client on the same probe, by d(x, y) = min(KL(V_x‖V_y), KL(V_y‖V_x)) -- the symmetrisation the link
  rule uses, so d < τ exactly when clustering would have linked the two -- ties by smaller cluster id, then
  client id (:class:`ClusterAssigned`, with the distance). A newcomer with no comparable clustered client stays
  unassigned (pending; :func:`cluster_of` is None) until a later observation or the next clustering. Everyone
  else keeps their membership; a cluster absent from a round keeps its model (shell).

Cluster ids across re-clusterings. Ids are strings ``"c0"``, ``"c1"``, ... from a counter, never reused. At a
re-clustering, each new component may inherit the id of an old cluster so that its model carries over:
(component, old id) pairs are taken greedily by the number of the component's members that were in that old
cluster (most first; ties by smaller old id, then by the component's smallest member), each old id going to at
most one component and each component taking at most one id. So a cluster that stays together keeps its id, a
split leaves the id with the larger part, a merge takes the id of the larger contributor. The other components
get fresh ids (in order of smallest member). Every :class:`ClusterInfo` says which model to start the cluster
from, ``seed_from``: its own id when inherited; otherwise the old cluster most of its members came from (ties by
smaller id), as that model stood before this step -- even if that id went to another component (both halves of a
split start from the old model); None when none of its members had a cluster (the first clustering: the global
model). Old ids that no component inherited are listed in ``retired`` (their models may be dropped).

Clients that cannot be re-clustered because their stored response is on an older probe (``excluded``): an old
cluster none of whose members was re-clustered lives on unchanged; a member of an inherited cluster keeps its id;
a member of a retired cluster follows the new cluster that took most of that old cluster's re-clustered members
(ties by smaller id); a client with no cluster stays pending. ``clusters`` in :class:`ClusterFormed` is the full
membership after the step, excluded clients included.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fedcore.checks import check_known_fields
from fedcore.distfl.config import DistflConfig
from fedcore.distfl.similarity import choose_threshold, kl_matrix, link_components


def _id_key(cluster_id: str) -> tuple[int, str]:
    """Order of cluster ids: "c2" before "c10" (shorter first, then lexicographic)."""
    return len(cluster_id), cluster_id


# ---- observation and events ----

@dataclass(frozen=True)
class ClusterObservation:
    """The responses the shell computed once round ``round`` was aggregated.

    ``responses``: client id -> V_c (Eq. 5) flattened row-major (:func:`fedcore.distfl.similarity.
    flatten_response`), every one of shape ``shape`` (``(z, C)``). ``probe``: an identifier of the synthetic
    input set the responses were computed on (e.g. ``"r6"`` for inputs extracted in round 6); only responses on
    the same probe are compared.
    """

    round: int
    responses: Mapping[str, Sequence[float]]
    shape: tuple[int, ...]
    probe: str = ""


@dataclass(frozen=True)
class ClusterInfo:
    """One cluster after a (re-)clustering: its id, its members (sorted) and the cluster whose model it starts
    from (``seed_from``: an id as it stood before the step, or None for the global model; module docstring)."""

    cluster_id: str
    members: tuple[str, ...]
    seed_from: str | None

    @property
    def size(self) -> int:
        return len(self.members)


@dataclass(frozen=True)
class ClusterFormed:
    """Round ``round`` (re-)clustered the clients: ``clusters`` is the full membership after it (sorted by id),
    ``retired`` the old ids no cluster carries on, ``excluded`` the clients whose stored response was on another
    probe and so were not re-clustered (they kept or followed their old cluster), ``tau`` the threshold the link
    rule used (``DistflConfig.tau``, or the one the automatic rule chose; None when not recorded)."""

    round: int
    clusters: tuple[ClusterInfo, ...]
    retired: tuple[str, ...] = ()
    excluded: tuple[str, ...] = ()
    tau: float | None = None

    @property
    def sizes(self) -> dict[str, int]:
        return {c.cluster_id: c.size for c in self.clusters}

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "distfl.cluster_formed", **dataclasses.asdict(self)}


@dataclass(frozen=True)
class ClusterAssigned:
    """A newly seen client joined cluster ``cluster_id`` in round ``round``: ``nearest`` is the clustered client
    whose response is closest, at ``distance`` = min(KL(V_x‖V_y), KL(V_y‖V_x))."""

    round: int
    client_id: str
    cluster_id: str
    distance: float
    nearest: str

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "distfl.cluster_assigned", **dataclasses.asdict(self)}


ClusterEvent = ClusterFormed | ClusterAssigned


# ---- state ----

@dataclass
class StoredResponse:
    """A client's latest response: the flat values, their shape, the probe they were computed on, the round."""

    values: list[float]
    shape: list[int]
    probe: str
    round: int


@dataclass
class ClusterState:
    """The membership state; plain data, JSON-safe through :meth:`to_dict` / :meth:`from_dict`.

    ``last_round``: the last round observed (0: none). ``clustered_round``: the round of the latest
    (re-)clustering (0: none yet -- everyone on the global model). ``assignment``: client id -> cluster id
    (clients without an entry use the global model before the first clustering, are pending after it).
    ``responses``: client id -> latest :class:`StoredResponse`. ``next_id``: the counter of fresh ids.
    """

    last_round: int = 0
    clustered_round: int = 0
    assignment: dict[str, str] = field(default_factory=dict)
    responses: dict[str, StoredResponse] = field(default_factory=dict)
    next_id: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ClusterState:
        """The state from :meth:`to_dict`'s output (after a JSON round trip too); :class:`ValueError` naming an
        unknown field."""
        check_known_fields(cls, d, "DistFL cluster state")
        d = dict(d)
        d["assignment"] = {str(k): str(v) for k, v in d.get("assignment", {}).items()}
        try:
            d["responses"] = {str(k): StoredResponse(values=[float(a) for a in r["values"]],
                                                     shape=[int(a) for a in r["shape"]],
                                                     probe=str(r["probe"]), round=int(r["round"]))
                              for k, r in d.get("responses", {}).items()}
        except (KeyError, TypeError) as e:
            raise ValueError(f"responses: {e}") from None
        return cls(**d)


def cluster_of(state: ClusterState, client_id: str) -> str | None:
    """The client's cluster id, or None (global model before the first clustering, pending after it)."""
    return state.assignment.get(client_id)


def cluster_members(state: ClusterState) -> dict[str, list[str]]:
    """Cluster id -> its members (sorted), ids in order."""
    out: dict[str, list[str]] = {}
    for cid in sorted(state.assignment):
        out.setdefault(state.assignment[cid], []).append(cid)
    return {k: out[k] for k in sorted(out, key=_id_key)}


def clustering_due(state: ClusterState, round_: int, cfg: DistflConfig) -> bool:
    """Whether :func:`step` will (re-)cluster at ``round_`` (given a response on the observation's probe): the
    first round after warm-up with none done yet, then every ``recluster_every`` rounds. The shell asks this
    before computing responses, to know when to extract fresh inputs and send every kept model's response."""
    if round_ <= state.last_round or round_ <= cfg.warmup_rounds:
        return False
    if state.clustered_round == 0:
        return True
    return cfg.recluster_every > 0 and round_ >= state.clustered_round + cfg.recluster_every


# ---- the step ----

def _check(state: ClusterState, obs: ClusterObservation) -> tuple[int, ...]:
    shape = tuple(int(s) for s in obs.shape)
    if not obs.responses:
        return shape
    if not shape or any(s < 1 for s in shape):
        raise ValueError(f"distfl: response shape must be positive sizes, got {obs.shape!r}")
    size = math.prod(shape)
    for cid, values in obs.responses.items():
        if len(values) != size:
            raise ValueError(f"distfl: response of {cid!r} has {len(values)} values, shape {shape} needs {size}")
        if not all(math.isfinite(v) and v >= 0 for v in values) or not math.fsum(values) > 0:
            raise ValueError(f"distfl: response of {cid!r} has a negative or non-finite value, or is all zeros")
    for cid, r in state.responses.items():
        if r.probe == obs.probe and tuple(r.shape) != shape and cid not in obs.responses:
            raise ValueError(f"distfl: probe {obs.probe!r} has shape {shape} but {cid!r}'s stored response on it "
                             f"has shape {tuple(r.shape)}")
    return shape


def step(state: ClusterState, obs: ClusterObservation,
         cfg: DistflConfig) -> tuple[ClusterState, list[ClusterEvent]]:
    """Apply one round's responses to ``state`` (updated in place and returned) and list the events it caused.

    Raises :class:`ValueError` on a malformed observation (before changing anything).
    """
    s = state
    if obs.round <= s.last_round:
        return s, []
    shape = _check(s, obs)
    due = clustering_due(s, obs.round, cfg)
    s.last_round = obs.round
    for cid in sorted(obs.responses):
        s.responses[cid] = StoredResponse([float(v) for v in obs.responses[cid]], list(shape), obs.probe,
                                          obs.round)
    if obs.round <= cfg.warmup_rounds:
        return s, []
    if due:
        return s, _recluster(s, obs.round, obs.probe, cfg)
    return s, _assign_newcomers(s, obs)


def _recluster(s: ClusterState, round_: int, probe: str, cfg: DistflConfig) -> list[ClusterEvent]:
    candidates = sorted(cid for cid, r in s.responses.items() if r.probe == probe)
    if not candidates:
        return []
    p = kl_matrix([s.responses[c].values for c in candidates]).tolist()
    tau = choose_threshold(p, cfg.threshold, cfg.tau)
    groups = [[candidates[i] for i in comp] for comp in link_components(p, tau)]
    old = dict(s.assignment)
    reclustered = set(candidates)

    # Which old cluster each group's members came from; inherit ids greedily by that overlap (module docstring).
    origin = [Counter(old[c] for c in g if c in old) for g in groups]
    pairs = sorted((-n, _id_key(oid), gi, oid) for gi, counts in enumerate(origin) for oid, n in counts.items())
    inherited: dict[int, str] = {}
    taken: set[str] = set()
    for _, _, gi, oid in pairs:
        if gi not in inherited and oid not in taken:
            inherited[gi] = oid
            taken.add(oid)
    ids: list[str] = []
    seed_of: dict[str, str | None] = {}
    for gi, counts in enumerate(origin):
        if gi in inherited:
            cid = inherited[gi]
            seed_of[cid] = cid
        else:
            cid = f"c{s.next_id}"
            s.next_id += 1
            seed_of[cid] = min(counts, key=lambda oid: (-counts[oid], _id_key(oid))) if counts else None
        ids.append(cid)
    assignment = {c: ids[gi] for gi, g in enumerate(groups) for c in g}

    # Clients that could not be re-clustered (stored response on another probe).
    excluded = sorted(c for c in set(old) | set(s.responses) if c not in reclustered)
    reclustered_old = {old[c] for c in candidates if c in old}
    for c in excluded:
        prev = old.get(c)
        if prev is None:
            continue  # never clustered: stays pending
        if prev in taken or prev not in reclustered_old:
            assignment[c] = prev  # inherited by a group, or none of its members re-clustered: lives on
            seed_of.setdefault(prev, prev)
        else:  # retired: follow the group that took most of its re-clustered members
            share = Counter(assignment[m] for m in candidates if old.get(m) == prev)
            assignment[c] = min(share, key=lambda nid: (-share[nid], _id_key(nid)))
    retired = {oid for oid in set(old.values()) if oid not in set(assignment.values())}

    s.assignment = {c: assignment[c] for c in sorted(assignment)}
    s.clustered_round = round_
    members = cluster_members(s)
    clusters = tuple(ClusterInfo(cid, tuple(m), seed_of.get(cid)) for cid, m in members.items())
    return [ClusterFormed(round_, clusters, tuple(sorted(retired, key=_id_key)), tuple(excluded), tau)]


def _assign_newcomers(s: ClusterState, obs: ClusterObservation) -> list[ClusterEvent]:
    newcomers = sorted(c for c in obs.responses if c not in s.assignment)
    if not newcomers:
        return []
    clustered = sorted(c for c, r in s.responses.items() if c in s.assignment and r.probe == obs.probe)
    if not clustered:
        return []
    ids = newcomers + clustered
    p = kl_matrix([s.responses[c].values for c in ids]).tolist()
    events: list[ClusterEvent] = []
    n = len(newcomers)
    joined: dict[str, str] = {}
    for i, x in enumerate(newcomers):
        # Nearest by the link rule's symmetrisation; ties by smaller cluster id, then client id.
        distance, _, nearest = min((min(p[i][n + j], p[n + j][i]), _id_key(s.assignment[y]), y)
                                   for j, y in enumerate(clustered))
        joined[x] = s.assignment[nearest]
        events.append(ClusterAssigned(obs.round, x, joined[x], float(distance), nearest))
    s.assignment.update(joined)  # after the loop: newcomers are compared with clustered clients only
    s.assignment = {c: s.assignment[c] for c in sorted(s.assignment)}
    return events
