"""Typed configuration: dataclasses, loadable from TOML and overridable field by field.

One source of truth: the server's :class:`ServerConfig` holds everything the federation agrees on (model,
data, training hyper-parameters); clients receive the parts they need at join time. Every error names the
field it is about (``rounds.clients_per_round: must be >= 1, got 0``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from fedcore import buffered
from fedcore.adaptive_clip import AdaptiveClipConfig
from fedcore.aggregation.config import AggregationConfig, build_rule
from fedcore.attacks.config import AttackConfig, SimulationHarnessConfig
from fedcore.compression.config import TOPK, CompressionConfig
from fedcore.data.base import DataError, available_datasets, check_dataset
from fedcore.distfl.config import DistflConfig
from fedcore.errors import ConfigError as ConfigError  # re-exported: the old import path keeps working
from fedcore.errors import require
from fedcore.migrate import LEGACY_ATTACK_OPTIONS, LEGACY_DETECTOR_OPTIONS, LEGACY_RULE_OPTIONS
from fedcore.models.registry import check_model_kwargs
from fedcore.nfl.config import OFF, NflConfig, NflSettings, fitted
from fedcore.options import from_dict as from_dict  # re-exported
from fedcore.options import parse_override as parse_override  # re-exported
from fedcore.options import to_dict as to_dict  # re-exported
from fedcore.pipeline_config import PipelineConfig
from fedcore.privacy import DpConfig
from fedcore.rounds import RoundsConfig as RoundsConfig  # re-exported: the section lives beside the round machine
from fedcore.secagg.config import SecureAggregationConfig
from fedcore.server_opt.config import ServerOptimizerConfig
from fedcore.simulation import SimulationConfig
from fedcore.train.registry import TRAINERS
from fedcore.train.registry import RecoveryConfig as RecoveryConfig  # re-exported: beside the trainers
from fedcore.training_config import TrainingConfig as TrainingConfig  # re-exported
from fedcore.training_config import validate_training_config as validate_training_config  # re-exported


@dataclass
class ModelConfig:
    # A registered name ("mlp") or a factory import path ("mypkg.models:make_net").
    name: str = "mlp"
    # The factory's keyword arguments (e.g. {hidden = [64]} for mlp); announced to the clients.
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class DataConfig:
    # A registered dataset (fedcore.data.available_datasets(); "synthetic" is built in and needs no files).
    dataset: str = "synthetic"
    # The dataset's and its partition's options (e.g. num_clients, partition = "noniid-mixed"), announced to the
    # clients; an announcement never sets a client's paths or downloads.
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class ServerSection:
    # host:port the server listens on; port 0 picks a free one.
    address: str = "127.0.0.1:8470"
    # host:port of the framed Session transport, beside gRPC: the clients' Session streams on connections the
    # server's event loop serves itself, with the same TLS, identity checks and bounds (fedguard/framing.py).
    # "auto": server.address's host on its port + 1 (8470 -> 8471; port 0 -> a free one too); "" turns it off;
    # port 0 picks a free one. A port that cannot be bound refuses the server (exit 2), never silently. The port is
    # announced at join; a client that cannot reach it (a firewall, a proxy) uses gRPC's Session stream, after a
    # refusal at once, after a port that answers nothing in 5 s, once per join. Less server CPU per client-round
    # than gRPC's stream, and no gRPC threads in the client (docs/results/benchmark_history.md, "The framed
    # Session transport").
    framed_address: str = "auto"
    # Connections the framed port holds at once; one more is answered RESOURCE_EXHAUSTED and closed (its client
    # retries). A connection that says nothing within stream_idle_timeout_s is closed, its TLS handshake too.
    framed_max_connections: int = 20_000
    # The federation's name, announced to the clients at join and shown by GetStatus.
    federation_id: str = "fedguard"
    # Shared join secret; empty accepts any client. Never written to the run dir or printed (redacted); prefer
    # token_file (or FEDGUARD_TOKEN) so the secret is not on a command line either.
    token: str = ""
    token_file: str = ""
    # The run directory: state/ (snapshots), rounds.jsonl, config.json, final_model.fgt, final_model.safetensors
    # and its final_model.json sidecar (docs/outputs.md), server.lock.
    run_dir: str = "runs/latest"
    # Tensor chunk size on the wire, both ways (sent to the clients at join).
    chunk_bytes: int = 1 << 20
    # gRPC per-message ceiling (each chunk is one message).
    max_message_bytes: int = 8 << 20
    # Ceiling on one update's announced tensor bytes.
    max_update_bytes: int = 2 << 30
    # Longest gap between two messages of an update stream: a stalled upload is cancelled and its buffer freed.
    stream_idle_timeout_s: float = 30.0
    # Ceiling on the bytes reserved for partial updates across all clients; admission beyond it answers
    # RESOURCE_EXHAUSTED (the client retries later).
    max_buffered_bytes: int = 4 << 30
    # Calls that have arrived but the server has not yet taken up (gRPC's backlog of unrequested calls). gRPC's own
    # default (1,000, with random early cancelling up to 3,000) cancels calls of a fleet that acts at once: ten
    # thousand devices joining, or leaving when the federation ends, each answered CANCELLED before any check ran.
    # Beyond this bound a new call is cancelled (the client retries it); each pending call holds a few KiB.
    max_pending_calls: int = 20_000
    # Longest server-side wait of a PullTask long-poll. Each parked client polls again once per long-poll (the idle
    # fleet's cost: ~0.6 ms of server CPU per re-poll at 10,000 connected); liveness needs no re-poll (gRPC keepalive
    # pings, in C, drop a dead connection within 30 s) and a changed CRL ends the parked polls at once.
    long_poll_s: float = 60.0
    # Clients heartbeat this often while training.
    heartbeat_interval_s: float = 5.0
    # A client silent for this long is dropped from the available pool until it re-joins.
    heartbeat_patience_s: float = 30.0
    # A client that neither holds a poll nor was heard from for this long is not selected until it polls again,
    # and a selected client that does not come for its task within this long is not waited for (0: off): ids
    # that joined, polled once and fell silent do not stall rounds (fedcore.rounds.Limits).
    poll_grace_s: float = 3.0
    # Log lines as JSON objects (--log-json) instead of the console renderer.
    log_json: bool = False
    # "debug", "info", "warning" or "error".
    log_level: str = "info"
    # The asyncio event loop the server runs on: "auto" (uvloop where it is installed, else the standard loop),
    # "uvloop" (required: refused when it cannot be imported) or "asyncio" (the standard loop). Results are the
    # same on either; uvloop costs less CPU per message (fedserver.event_loop).
    event_loop: str = "auto"


@dataclass
class EvaluationConfig:
    # Evaluate the global model on a pooled test set (the union of the clients' test splits) every round.
    central: bool = False
    # Clients whose test splits form the pooled set; 0 uses data.options["num_clients"] (or 100).
    central_clients: int = 0
    # Where the server evaluates: "cpu", "cuda", "cuda:N" or "auto" (a GPU when torch sees one).
    device: str = "cpu"


@dataclass
class PersistenceConfig:
    # Snapshot every completed round into run_dir/state and resume from there on restart.
    enabled: bool = True
    # Snapshots kept (the newest N); an older good one is the fallback when the newest is corrupt.
    keep_snapshots: int = 3
    # fsync model files, their directory and every SQLite commit: survives a power cut, not only a crash of
    # the server process, at the cost of the disk's flush latency per round.
    fsync: bool = False
    # When the newest snapshots fail verification (a power cut without fsync, a disk error), resume from the
    # newest one that verifies, moving the unverified ones into state/quarantine/<time>/ (kept). Off by default:
    # the server then stops with exit 2 and names the snapshot and the ways on (fedserver --fall-back).
    fall_back: bool = False


@dataclass
class SecurityConfig:
    """Transport security and client authentication (see docs in fedguard/certs.py and fedguard/signing.py)."""

    # Plaintext gRPC, only with this explicit opt-in (--insecure); a warning is logged at every start.
    insecure: bool = False
    # PEM server certificate (chain) tls_cert and its private key tls_key: TLS.
    tls_cert: str = ""
    tls_key: str = ""
    # PEM CA certificate(s): clients must present a certificate it signed (mutual TLS); the client id is then
    # the certificate's identity and a client cannot join, pull or push as another id.
    client_ca: str = ""
    # Enrollment file of per-client Ed25519 public keys (fedguard-certs keygen --enroll): every request must be
    # signed by the key enrolled for its client id (works with or without mutual TLS).
    client_keys: str = ""
    # Accepted clock difference of a signed request, and how long its nonce is remembered (in memory and in the
    # run dir's replay journal, so a request captured before a restart is refused after it too).
    replay_window_s: float = 60.0
    # The operator credential: GetStatus (client ids, per-client state) answers only a caller presenting this
    # token (metadata fg-operator). A file holding it, or FEDGUARD_OPERATOR_TOKEN in the server's environment;
    # without either, GetStatus answers a client about itself only (its session) and refuses everyone else.
    operator_token_file: str = ""
    # Certificate revocation list (PEM or DER, fedguard-certs revoke): a client certificate it lists is refused
    # at its next call; the file is re-read when it changes.
    crl: str = ""
    # Joins admitted per second per credential (the join token, or the certificate/key identity;
    # join_rate_per_credential) and per peer address (join_rate_per_peer; token buckets holding two seconds'
    # worth), and the sessions one credential may hold at once (max_sessions_per_credential).
    # The defaults let a 10,000-client fleet join within a minute through one token.
    join_rate_per_credential: float = 500.0
    join_rate_per_peer: float = 500.0
    max_sessions_per_credential: int = 20_000


@dataclass
class ServerConfig:
    server: ServerSection = field(default_factory=ServerSection)
    rounds: RoundsConfig = field(default_factory=RoundsConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    aggregation: AggregationConfig = field(default_factory=AggregationConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    persistence: PersistenceConfig = field(default_factory=PersistenceConfig)
    nfl: NflConfig = field(default_factory=NflConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    distfl: DistflConfig = field(default_factory=DistflConfig)
    # The privacy budget of server-side DP: (epsilon, delta) per round and an optional budget (fedcore.privacy).
    dp: DpConfig = field(default_factory=DpConfig)
    # SIMULATION ONLY: the server-side full-knowledge adversary (fedcore.attacks.harness); refused with TLS/mTLS.
    simulation_harness: SimulationHarnessConfig = field(default_factory=SimulationHarnessConfig)
    # The server optimizer applied to every round's aggregate (fedcore.server_opt): FedAvgM, FedAdam, FedYogi,
    # FedAdagrad. Unset: none (the new global model is the aggregate, plain FedAvg).
    server_optimizer: ServerOptimizerConfig = field(default_factory=ServerOptimizerConfig)
    # Server stages added to the round's close after the built-in ones (fedserver.pipeline; docs/extending.md).
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    # Adaptive clipping for server-side DP (fedcore.adaptive_clip, docs/privacy.md): off unless enabled.
    adaptive_clip: AdaptiveClipConfig = field(default_factory=AdaptiveClipConfig)
    # Secure aggregation's parameters (SecAgg+: the neighbour graph, the threshold, the dropouts tolerated, the
    # phase deadlines), used when aggregation.secure = "secagg+" (docs/security.md).
    secagg: SecureAggregationConfig = field(default_factory=SecureAggregationConfig)
    # Compressed updates (fedcore.compression; docs/scaling.md, "Compressed updates"): what devices send instead of
    # their float32 weights, announced at join. Unset: kind = "none", the weights as they are.
    compression: CompressionConfig = field(default_factory=CompressionConfig)

    def validate(self) -> ServerConfig:
        validate_server_config(self)
        return self


@dataclass(frozen=True)
class FederationInfo:
    """What a client learns of the federation when it joins (``FederationConfig`` on the wire).

    ``model_spec`` is the model's manifest: (name, dtype, shape) per tensor, as
    :class:`fedcore.serialization.TensorMeta`.
    """

    federation_id: str
    model_name: str
    model_kwargs: dict[str, Any]
    model_fingerprint: str
    model_spec: tuple[Any, ...]
    training: TrainingConfig
    dataset: str
    data_options: dict[str, Any]
    num_rounds: int
    seed: int
    # Largest chunk the server takes in an update stream (0: the default 1 MiB).
    chunk_bytes: int = 0
    # The server's [nfl] mode, NR and c (FL-GUARD §4.3); an announcement without them: mode off.
    nfl: NflSettings = field(default_factory=lambda: NflSettings(OFF, 0, 0))
    # The server's [recovery] method and options (a client's own ``trainer`` wins).
    recovery_method: str = "flguard"
    recovery_options: dict[str, Any] = field(default_factory=dict)
    # Secure aggregation, when the server runs it (None: off): its parameters and what a device does before
    # masking (fedcore.secagg.client.SecureSettings).
    secure: Any = None
    # Compressed updates: how the device encodes its update (fedcore.compression.CompressionConfig; kind "none":
    # it sends its weights).
    compression: CompressionConfig = field(default_factory=CompressionConfig)


@dataclass
class ClientConfig:
    # The server's host:port.
    server: str = "127.0.0.1:8470"
    # Stable identity; empty derives one from the state dir or a random id.
    client_id: str = ""
    # The join secret (the server's server.token); prefer token_file or FEDGUARD_TOKEN (not on a command line).
    token: str = ""
    # A file holding the join secret (or set FEDGUARD_TOKEN): keeps it off the command line.
    token_file: str = ""
    # Plaintext gRPC, only with this explicit opt-in (--insecure); a warning is logged.
    insecure: bool = False
    # PEM CA certificate(s) that signed the server's certificate; empty uses the system's trusted roots.
    ca_cert: str = ""
    # PEM client certificate and key, for a server that requires mutual TLS.
    cert: str = ""
    key: str = ""
    # Name to check the server's certificate against when it differs from the host in ``server``.
    server_name: str = ""
    # Ed25519 private key (fedguard-certs keygen) that signs every request, for a server with enrolled keys.
    signing_key: str = ""
    # Where the client keeps its identity and private state across restarts; empty keeps nothing.
    state_dir: str = ""
    # Longest wait the client asks the server to hold a PullTask (the server holds at most its server.long_poll_s).
    long_poll_s: float = 60.0
    # Pull tasks and push updates as exchanges on one long-lived Session stream instead of two calls per round
    # (a fraction of the server's CPU per client-round). Off: the unary calls. Unused with signing_key (a stream
    # does not carry per-request signatures) and against a server without it (the client falls back by itself).
    session_stream: bool = True
    # Exchange the Session stream on the server's framed port when it announces one (server.framed_address; same
    # host as ``server``, same TLS and client certificate); off, or when the port cannot be reached: on gRPC.
    framed_session: bool = True
    # Reconnect: exponential backoff from backoff_initial_s to backoff_max_s with full jitter.
    backoff_initial_s: float = 0.2
    backoff_max_s: float = 10.0
    # Give up after this many seconds without reaching the server; 0 retries forever.
    give_up_after_s: float = 120.0
    # The client's own trainer, by registered name (fedcore.train.trainers.TRAINERS, listed under "Plugins" below);
    # empty: the method the server announces ([recovery] method, default "flguard").
    trainer: str = ""
    # The trainer's options, e.g. {l_fb = 2} for flguard's partial-layer adaptation (with ``trainer`` only).
    trainer_options: dict[str, Any] = field(default_factory=dict)
    # A vanilla holdout (FL-GUARD §4.4): never adapts, infers with the received model, still reports beta_hat_i.
    opt_out: bool = False
    # Which model the client infers with (serves, and measures beta_hat_i on) once its recovery has stopped (the
    # server cancelled its report under short-term recovery, or its own stop rule fired): "adapted" keeps v_i
    # (FL-GUARD §5.1, SPEC §6-7; the default), "global" goes back to the received global model. While recovering
    # it is always v_i; an opt-out holdout always infers with the global model (docs/embedding.md).
    infer_after_recovery: str = "adapted"
    # Simulation only: stragglers, dropouts, crashes, availability windows (fedcore.simulation).
    simulation: SimulationConfig = field(default_factory=SimulationConfig)
    # The client's own data: a registered dataset name (then the server's dataset and options are not used) ...
    dataset: str = ""
    # ... and the client's own dataset options: paths, data_dir, source, cache_dir, download. Without ``dataset``
    # they are merged over the partition options the server announces (which can never set these).
    data_options: dict[str, Any] = field(default_factory=dict)
    # Refuse an announced model with more tensor bytes than this (checked before anything is allocated).
    max_model_bytes: int = 4 << 30
    # Simulation: index of the client's shard when the server's dataset is used; -1 uses the server's.
    data_index: int = -1
    # Train a stand-alone private model for this many epochs before joining and report its test accuracy
    # P_i with every update (so the server can compute beta_i = V_i - P_i); 0 skips it. Cached in state_dir (reused
    # while the data, training settings, epochs and seed are the same).
    private_epochs: int = 0
    # Simulation only: play a data-poisoning attacker.
    attack: AttackConfig = field(default_factory=AttackConfig)
    # Torch intra-op threads; 0 keeps torch's default in an embedded FedClient (the fedclient command line makes it
    # max(1, cores // fedclient processes on this machine)).
    torch_threads: int = 0
    # Where local training, evaluation and the private model run: "cpu", "cuda", "cuda:N" or "auto" (the
    # first GPU when torch sees one, else the CPU). Updates always travel as CPU tensors.
    device: str = "cpu"
    # Log lines as JSON objects (--log-json) instead of the console renderer.
    log_json: bool = False
    # "debug", "info", "warning" or "error".
    log_level: str = "info"

    def validate(self) -> ClientConfig:
        validate_client_config(self)
        return self


# ---- validation ----

def validate_server_config(c: ServerConfig) -> None:
    s, r, t = c.server, c.rounds, c.training
    require(_valid_address(s.address), "server.address", f"expected host:port, got {s.address!r}")
    require(s.framed_address in ("", "auto") or _valid_address(s.framed_address), "server.framed_address",
            f'expected host:port, "auto" (server.address\'s host, its port + 1) or "" (off), got {s.framed_address!r}')
    require(s.framed_max_connections >= 1, "server.framed_max_connections",
            f"must be >= 1, got {s.framed_max_connections}")
    require(bool(s.federation_id), "server.federation_id", "must not be empty")
    require(s.chunk_bytes >= 1024, "server.chunk_bytes", f"must be >= 1024, got {s.chunk_bytes}")
    require(s.max_message_bytes >= s.chunk_bytes + 4096, "server.max_message_bytes",
            f"must exceed chunk_bytes ({s.chunk_bytes}) by at least 4096, got {s.max_message_bytes}")
    require(s.max_update_bytes > 0, "server.max_update_bytes", f"must be > 0, got {s.max_update_bytes}")
    require(s.long_poll_s > 0, "server.long_poll_s", f"must be > 0, got {s.long_poll_s}")
    require(s.heartbeat_interval_s > 0, "server.heartbeat_interval_s", f"must be > 0, got {s.heartbeat_interval_s}")
    require(s.heartbeat_patience_s > s.heartbeat_interval_s, "server.heartbeat_patience_s",
            f"must exceed heartbeat_interval_s ({s.heartbeat_interval_s}), got {s.heartbeat_patience_s}")
    require(math.isfinite(s.poll_grace_s) and s.poll_grace_s >= 0, "server.poll_grace_s",
            f"must be >= 0 seconds (0: off), got {s.poll_grace_s}")
    require(s.log_level in _LOG_LEVELS, "server.log_level", f"one of {sorted(_LOG_LEVELS)}, got {s.log_level!r}")
    require(s.event_loop in EVENT_LOOPS, "server.event_loop",
            f"one of {list(EVENT_LOOPS)}, got {s.event_loop!r}")
    require(s.stream_idle_timeout_s > 0, "server.stream_idle_timeout_s",
            f"must be > 0, got {s.stream_idle_timeout_s}")
    require(s.max_buffered_bytes > 0, "server.max_buffered_bytes", f"must be > 0, got {s.max_buffered_bytes}")
    require(s.max_pending_calls >= 1, "server.max_pending_calls", f"must be >= 1, got {s.max_pending_calls}")
    _check_token(s.token, s.token_file, "server.token")
    require(r.num_rounds >= 1, "rounds.num_rounds", f"must be >= 1, got {r.num_rounds}")
    require(r.clients_per_round >= 1, "rounds.clients_per_round", f"must be >= 1, got {r.clients_per_round}")
    require(r.over_select >= 1.0, "rounds.over_select", f"must be >= 1.0, got {r.over_select}")
    require(0 <= r.min_updates <= r.clients_per_round, "rounds.min_updates",
            f"must be in [0, clients_per_round={r.clients_per_round}], got {r.min_updates}")
    require(r.min_available == 0 or r.min_available >= r.effective_min_updates, "rounds.min_available",
            f"must be 0 or >= min_updates ({r.effective_min_updates}), got {r.min_available}")
    require(r.round_timeout_s > 0, "rounds.round_timeout_s", f"must be > 0, got {r.round_timeout_s}")
    require(r.sampling_timeout_s > 0, "rounds.sampling_timeout_s", f"must be > 0, got {r.sampling_timeout_s}")
    require(r.seed >= 0, "rounds.seed", f"must be >= 0, got {r.seed}")
    buffered.validate(r.mode, r.concurrency, r.max_staleness, r.staleness, r.staleness_a, r.staleness_b,
                      r.clients_per_round)
    if r.buffered:
        require(not c.distfl.enabled, "rounds.mode", "buffered rounds do not support distfl.enabled (clusters are "
                                                     "formed per synchronous round)")
        require(c.aggregation.secure == "off", "rounds.mode", "buffered rounds do not support aggregation.secure (the "
                                                         "masks bind a round's selected devices)")
        require(not c.simulation_harness.full_knowledge_adversary, "rounds.mode",
                "buffered rounds do not support simulation_harness.full_knowledge_adversary")
    else:
        require(not r.replay, "rounds.replay", "replays an arrival log of buffered rounds: set rounds.mode = "
                                               "\"buffered\"")
    validate_training_config(t)
    require(bool(c.model.name), "model.name", "must not be empty")
    check_model_kwargs(c.model.name, c.model.kwargs, "model.kwargs")  # a registered model's, by its options
    require(bool(c.data.dataset), "data.dataset", "must not be empty")
    require(c.evaluation.central_clients >= 0, "evaluation.central_clients",
            f"must be >= 0, got {c.evaluation.central_clients}")
    _check_device(c.evaluation.device, "evaluation.device")
    require(c.persistence.keep_snapshots >= 1, "persistence.keep_snapshots",
            f"must be >= 1, got {c.persistence.keep_snapshots}")
    try:
        c.aggregation.validate(r.clients_per_round, r.min_updates or None)
    except ValueError as e:
        raise aggregation_error(e) from None
    c.nfl.validate("nfl")
    c.distfl.validate("distfl")
    c.server_optimizer.validate("server_optimizer")
    require(not (c.server_optimizer.enabled and c.distfl.enabled), "server_optimizer.name",
            "a server optimizer keeps one state for the global model; DistFL aggregates a model per cluster "
            "(distfl.enabled): use one or the other")
    c.pipeline.validate("pipeline")
    c.adaptive_clip.validate_for(c.aggregation, r.clients_per_round, c.distfl.enabled)
    _validate_dp(c)
    require(c.recovery.method in TRAINERS, "recovery.method",
            f"unknown method {c.recovery.method!r}; known: {', '.join(TRAINERS.names())}")
    check_trainer_options(c.recovery.method, c.recovery.options, "recovery.options")
    sec = c.security
    if not sec.insecure:
        require(bool(sec.tls_cert and sec.tls_key), "security.tls_cert",
                "TLS needs a certificate and its key (security.tls_cert, security.tls_key; --tls-cert, "
                "--tls-key; make them with fedguard-certs); for plaintext set security.insecure = true "
                "(--insecure)")
    require(bool(sec.tls_cert) == bool(sec.tls_key), "security.tls_key", "tls_cert and tls_key go together")
    require(not (sec.client_ca and sec.insecure), "security.client_ca", "mutual TLS needs TLS: not with insecure")
    for name in ("tls_cert", "tls_key", "client_ca", "client_keys", "operator_token_file", "crl"):
        _check_file(getattr(sec, name), f"security.{name}")
    require(math.isfinite(sec.replay_window_s) and sec.replay_window_s > 0, "security.replay_window_s",
            f"must be > 0, got {sec.replay_window_s}")
    require(not sec.crl or bool(sec.client_ca), "security.crl", "a CRL revokes client certificates: it needs "
            "mutual TLS (security.client_ca)")
    for name in ("join_rate_per_credential", "join_rate_per_peer"):
        rate = getattr(sec, name)
        require(math.isfinite(rate) and rate > 0, f"security.{name}", f"must be > 0 joins per second, got {rate}")
    require(sec.max_sessions_per_credential >= 1, "security.max_sessions_per_credential",
            f"must be >= 1, got {sec.max_sessions_per_credential}")
    _validate_harness(c)
    c.compression.validate("compression")
    _validate_secure(c)


def _validate_secure(c: ServerConfig) -> None:
    """``[secagg]``'s values, and the features that need each update, which secure aggregation never shows the
    server: refused at start, naming the reason (docs/security.md, "What is refused")."""
    try:
        c.secagg.validate()
    except ConfigError as e:
        raise e.under("secagg") from None
    if c.aggregation.secure == "off":
        return
    field_path = "aggregation.secure"
    require(not c.distfl.enabled, field_path, "DistFL clusters the individual models, which secure aggregation "
                                              "never shows the server: set distfl.enabled = false or secure = \"off\"")
    require(not c.adaptive_clip.enabled, field_path,
            "adaptive clipping counts the updates over the clip norm, which secure aggregation hides: set "
            "adaptive_clip.enabled = false or secure = \"off\"")
    require(not c.simulation_harness.full_knowledge_adversary, field_path,
            "the full-knowledge test harness crafts updates from the honest ones, which secure aggregation hides")
    require(c.compression.kind != TOPK, "compression.kind",
            "top-k sends a few coordinates of each update, but secure aggregation masks every coordinate (a masked "
            "zero looks like any other word, and devices' top-k positions differ): use \"int8\", \"fp16\" or "
            "\"none\" with aggregation.secure, or secure = \"off\" (docs/security.md)")
    k = c.rounds.num_selected
    left_out, may_drop = k - c.rounds.clients_per_round, math.floor(c.secagg.max_dropout * k)
    require(left_out <= may_drop, "rounds.over_select",
            f"with secure aggregation the {left_out} devices a round selects beyond clients_per_round and leaves out "
            f"count as dropped, and at most secagg.max_dropout of the {k} selected ({may_drop}) may drop: lower "
            "over_select or raise secagg.max_dropout")
    require(k >= c.secagg.min_clients, field_path,
            f"a secure round needs at least secagg.min_clients = {c.secagg.min_clients} selected clients "
            f"(with two, either learns the other's update from the sum); rounds select {k}")


def _validate_dp(c: ServerConfig) -> None:
    """``[dp]``'s values, and a budget only where an epsilon is computed (Opacus installed, an accounted rule)."""
    import importlib.util

    from fedcore.privacy import INSTALL_HINT, not_accounted

    try:
        c.dp.validate("dp")
    except ValueError as e:
        field_name, _, message = str(e).partition(": ")
        raise ConfigError(field_name, message) from None
    if c.dp.max_epsilon is None:
        return
    require(c.dp.accounting, "dp.max_epsilon", "a budget needs dp.accounting = true")
    reason = not_accounted(c.aggregation, c.distfl.enabled, c.adaptive_clip)
    require(reason is None, "dp.max_epsilon", f"no epsilon is computed for this configuration: {reason}")
    require(importlib.util.find_spec("opacus") is not None, "dp.max_epsilon",
            f"the budget needs the privacy accountant: {INSTALL_HINT}")


def _validate_harness(c: ServerConfig) -> None:
    """The full-knowledge adversary is a test harness: refused with any production security setting."""
    h = c.simulation_harness
    try:
        h.validate()
    except ValueError as e:
        field_name, _, message = str(e).partition(": ")
        raise ConfigError(field_name, message) from None
    if not h.full_knowledge_adversary:
        return
    sec = c.security
    production = [name for name, on in (("TLS (security.tls_cert)", bool(sec.tls_cert)),
                                        ("mutual TLS (security.client_ca)", bool(sec.client_ca)),
                                        ("enrolled client keys (security.client_keys)", bool(sec.client_keys)))
                  if on]
    require(not production and sec.insecure, "simulation_harness.full_knowledge_adversary",
            "a simulation test harness (the server crafts the attackers' updates); refused with production "
            f"settings: it runs only on an insecure loopback/simulation server, got {', '.join(production) or 'TLS'}")
    require(not c.distfl.enabled, "simulation_harness.full_knowledge_adversary",
            "not supported with distfl.enabled (clusters aggregate their own rows)")


def resolved_rounds(c: ServerConfig) -> RoundsConfig:
    """The ``[rounds]`` section the round machine runs: ``min_updates = 0`` resolved to half of K rounded up,
    raised to the fewest updates the aggregation rule works with (Krum with f needs 2f + 3)."""
    r = c.rounds
    if r.min_updates:
        return r

    rule = build_rule(effective_aggregation(c))
    n = r.effective_min_updates
    while n < r.clients_per_round:
        try:
            rule.check(n)
            break
        except ValueError:
            n += 1
    return dataclasses.replace(r, min_updates=n)


def resolved_nfl(c: ServerConfig) -> NflConfig:
    """The ``[nfl]`` section the detector and the clients run: an unset ``nr`` / ``c`` fitted to
    ``rounds.num_rounds`` (:func:`fedcore.nfl.config.fit_to_rounds`)."""
    return fitted(c.nfl, c.rounds.num_rounds)


def effective_aggregation(c: ServerConfig) -> AggregationConfig:
    """The aggregation configuration the server runs: ``[aggregation]``, with ``exact_metrics`` on when the NFL
    detector is LINDT's Δ, which needs w_div exactly (a CountSketch estimate errs by about 1%, more than ε = 0.1
    once w_div is above 10), and when the full-knowledge test harness must see the round's rows; that keeps a
    [K, P] float32 buffer for FedAvg."""
    if (c.nfl.detector == "delta" or c.simulation_harness.full_knowledge_adversary) \
            and not c.aggregation.exact_metrics and c.aggregation.secure == "off":  # secure: w_div from the sum
        return dataclasses.replace(c.aggregation, exact_metrics=True)
    return c.aggregation


def aggregation_error(e: ValueError) -> ConfigError:
    """fedcore.aggregation's messages start with the field name: re-root it under ``aggregation.``."""
    field_name, sep, message = str(e).partition(": ")
    if sep and all(part.isidentifier() for part in field_name.split(".")):  # "trim_m" or "options.trim_m"
        return ConfigError(f"aggregation.{field_name}", message)
    return ConfigError("aggregation", str(e))


def check_data_config(c: ServerConfig) -> None:
    """Refuse, before the server listens, a dataset clients cannot load (unknown name, an option it does not
    take) and a K or ``min_available`` above the number of clients the data has (no round could ever start)."""
    if c.data.dataset not in available_datasets():
        raise ConfigError("data.dataset", f"unknown dataset {c.data.dataset!r}; known: "
                                          f"{', '.join(available_datasets())}")
    try:
        shards = check_dataset(c.data.dataset, c.data.options)
    except ConfigError:  # a partition option, named by its field (data.options.alpha)
        raise
    except DataError as e:
        raise ConfigError("data.options", str(e)) from None
    if shards is None:
        return
    r = c.rounds
    where = f"data.options num_clients = {shards}" if "num_clients" in c.data.options else \
        f"{c.data.dataset} makes {shards} clients unless data.options sets num_clients"
    require(r.clients_per_round <= shards, "rounds.clients_per_round",
            f"K = {r.clients_per_round} is more than the {shards} clients the data has ({where})")
    require(r.min_available <= shards, "rounds.min_available",
            f"{r.min_available} is more than the {shards} clients the data has ({where})")


def check_trainer_options(name: str, options: Mapping[str, Any], field_path: str) -> None:
    """Build trainer ``name`` with ``options`` so that the trainer validates them; its errors are re-rooted under
    ``field_path`` (``recovery.options.l_fb: ...``; a trainer that takes no options names the table itself)."""
    try:
        TRAINERS.get(name)(options)
    except ConfigError as e:
        raise (ConfigError(field_path, str(e).partition(": ")[2]) if e.field == "trainer"
               else e.under(field_path)) from None


def validate_client_config(c: ClientConfig) -> None:
    require(_valid_address(c.server), "server", f"expected host:port, got {c.server!r}")
    require(c.long_poll_s > 0, "long_poll_s", f"must be > 0, got {c.long_poll_s}")
    require(0 < c.backoff_initial_s <= c.backoff_max_s, "backoff_initial_s",
            f"need 0 < backoff_initial_s <= backoff_max_s, got {c.backoff_initial_s} and {c.backoff_max_s}")
    require(c.give_up_after_s >= 0, "give_up_after_s", f"must be >= 0, got {c.give_up_after_s}")
    require(not c.trainer or c.trainer in TRAINERS, "trainer",
            f"unknown trainer {c.trainer!r}; known: {', '.join(TRAINERS.names())}")
    require(bool(c.trainer) or not c.trainer_options, "trainer_options",
            "options need a trainer (the server's method comes with its own options)")
    if c.trainer:
        check_trainer_options(c.trainer, c.trainer_options, "trainer_options")
    require(c.infer_after_recovery in ("adapted", "global"), "infer_after_recovery",
            f"one of 'adapted', 'global', got {c.infer_after_recovery!r}")
    require(c.max_model_bytes > 0, "max_model_bytes", f"must be > 0, got {c.max_model_bytes}")
    _check_token(c.token, c.token_file, "token")
    require(not (c.insecure and (c.ca_cert or c.cert or c.key)), "insecure",
            "plaintext (insecure) contradicts ca_cert/cert/key")
    require(bool(c.cert) == bool(c.key), "key", "cert and key go together")
    for name in ("ca_cert", "cert", "key", "signing_key"):
        _check_file(getattr(c, name), name)
    if c.dataset:
        require(c.dataset in available_datasets(), "dataset",
                f"unknown dataset {c.dataset!r}; known: {', '.join(available_datasets())}")
    c.simulation.validate("simulation")
    require(c.torch_threads >= 0, "torch_threads", f"must be >= 0, got {c.torch_threads}")
    require(c.private_epochs >= 0, "private_epochs", f"must be >= 0, got {c.private_epochs}")
    _check_device(c.device, "device")
    require(c.log_level in _LOG_LEVELS, "log_level", f"one of {sorted(_LOG_LEVELS)}, got {c.log_level!r}")


_LOG_LEVELS = {"debug", "info", "warning", "error"}
# server.event_loop's values (fedserver.event_loop).
EVENT_LOOPS = ("auto", "uvloop", "asyncio")


def _check_file(path: str, field_path: str) -> None:
    require(not path or Path(path).is_file(), field_path, f"no such file: {path}")


def _check_token(token: str, token_file: str, field_path: str) -> None:
    require(not (token and token_file), field_path, "give the token or a token_file, not both")
    _check_file(token_file, f"{field_path}_file")
    require(len(token) <= MAX_TOKEN, field_path, f"at most {MAX_TOKEN} characters")


MAX_TOKEN = 256
TOKEN_ENV = "FEDGUARD_TOKEN"
# The operator credential (GetStatus) in the server's environment; never on a command line or in the run dir.
OPERATOR_TOKEN_ENV = "FEDGUARD_OPERATOR_TOKEN"


def secret_token(token: str, token_file: str) -> str:
    """The join secret: ``token``, else the first line of ``token_file`` (an empty string: none)."""
    if token_file:
        try:
            token = Path(token_file).read_text().strip()
        except OSError as e:
            raise ConfigError("token_file", f"cannot read: {e.strerror}") from None
        require(len(token) <= MAX_TOKEN, "token_file", f"the token must be at most {MAX_TOKEN} characters")
    return token


# Configuration fields that hold secrets: never written to a run dir, printed or logged.
SECRET_FIELDS = ("server.token", "token")
REDACTED = "<redacted>"


# The sections whose plugin options once were flat keys, with those keys (fold_flat_options reads them today).
_PLUGIN_SECTIONS: tuple[tuple[str, type, Mapping[str, Any]], ...] = (
    ("aggregation", AggregationConfig, LEGACY_RULE_OPTIONS),
    ("nfl", NflConfig, LEGACY_DETECTOR_OPTIONS),
    ("simulation_harness.attack", AttackConfig, LEGACY_ATTACK_OPTIONS),
)


def current_shape(stored: Mapping[str, Any]) -> dict[str, Any]:
    """A configuration dict written by an older fedguard (a run dir's ``config.json``, the store's copy) in today's
    shape: a section that still holds the flat option keys of its plugin (``aggregation.trim_m``, ``nfl.warmup``,
    ``simulation_harness.attack.boost``) is read as today's loader reads it and written out again (JSON-safe), so
    that comparing it with the running configuration compares what they mean. Anything else, and a section that
    does not load, is returned unchanged."""
    out = json.loads(json.dumps(dict(stored)))
    for path, cls, flat in _PLUGIN_SECTIONS:
        *parents, leaf = path.split(".")
        node: Any = out
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        section_dict = node.get(leaf) if isinstance(node, dict) else None
        if not (isinstance(section_dict, dict) and any(key in flat for key in section_dict)):
            continue
        try:
            upgraded = to_dict(from_dict(cls, section_dict, path))
        except ValueError:
            continue
        node[leaf] = json.loads(json.dumps(upgraded))
    result: dict[str, Any] = out
    return result


def redacted(config: Any) -> dict[str, Any]:
    """``to_dict(config)`` with every secret field replaced by ``<redacted>`` (left empty when unset)."""
    d = to_dict(config)
    for path in SECRET_FIELDS:
        *parents, leaf = path.split(".")
        node: Any = d
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and node.get(leaf):
            node[leaf] = REDACTED
    return d


def _check_device(device: str, path: str) -> None:
    require(re.fullmatch(r"cpu|auto|cuda(:\d+)?", device) is not None, path,
            f"one of 'cpu', 'cuda', 'cuda:N', 'auto', got {device!r}")


def _valid_address(addr: str) -> bool:
    host, sep, port = addr.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 <= int(port) < 65536)


# ---- loading: dicts and TOML into dataclasses, with the field path in every error ----

T = TypeVar("T")


def load_toml(path: str | Path) -> dict[str, Any]:
    """A configuration file as a dict: TOML, or JSON when the name ends in ``.json``."""
    p = Path(path)
    try:
        if p.suffix == ".json":
            data = json.loads(p.read_text())
            if not isinstance(data, dict):
                raise ConfigError("--config", f"{p} must hold a JSON object")
            return data
        with open(p, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError("--config", f"file not found: {p}") from None
    except json.JSONDecodeError as e:
        raise ConfigError("--config", f"{p} is not valid JSON: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError("--config", f"{p} is not valid TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError("--config", f"{p} is not UTF-8 text ({e})") from None
    except RecursionError:
        raise ConfigError("--config", f"{p} nests arrays or tables too deeply") from None


def toml_literal(value: Any) -> str:
    """``value`` written as a TOML literal (for ``--set key=VALUE`` on a command line)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k} = {toml_literal(v)}" for k, v in value.items()) + "}"
    if isinstance(value, Sequence):
        return "[" + ", ".join(toml_literal(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def merge_override(data: dict[str, Any], keys: list[str], value: Any) -> None:
    node = data
    for k in keys[:-1]:
        child = node.setdefault(k, {})
        if not isinstance(child, dict):
            raise ConfigError(".".join(keys), f"{k} is not a table")
        node = child
    node[keys[-1]] = value


def build_config(cls: type[T], toml_path: str | Path | None = None,
                 overrides: Sequence[tuple[list[str], Any]] = ()) -> T:
    """Defaults <- TOML file <- overrides (later wins), then the dataclass's ``validate()`` if it has one."""
    data: dict[str, Any] = load_toml(toml_path) if toml_path else {}
    for keys, value in overrides:
        merge_override(data, keys, value)
    cfg = from_dict(cls, data)
    validate = getattr(cfg, "validate", None)
    if callable(validate):
        validate()
    return cfg
