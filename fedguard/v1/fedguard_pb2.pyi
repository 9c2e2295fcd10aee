from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    FLOAT64: _ClassVar[DType]
    INT64: _ClassVar[DType]
    INT32: _ClassVar[DType]
    INT16: _ClassVar[DType]
    INT8: _ClassVar[DType]
    UINT8: _ClassVar[DType]
    BOOL: _ClassVar[DType]

class Compression(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COMPRESSION_NONE: _ClassVar[Compression]
    COMPRESSION_FP16: _ClassVar[Compression]
    COMPRESSION_INT8: _ClassVar[Compression]
    COMPRESSION_TOPK: _ClassVar[Compression]

class UpdateKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    UPDATE_KIND_UNSPECIFIED: _ClassVar[UpdateKind]
    WEIGHTS: _ClassVar[UpdateKind]
    DELTA: _ClassVar[UpdateKind]
    MASKED: _ClassVar[UpdateKind]

class FederationPhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FEDERATION_PHASE_UNSPECIFIED: _ClassVar[FederationPhase]
    FEDERATION_PHASE_SAMPLING: _ClassVar[FederationPhase]
    FEDERATION_PHASE_TRAINING: _ClassVar[FederationPhase]
    FEDERATION_PHASE_AGGREGATING: _ClassVar[FederationPhase]
    FEDERATION_PHASE_FINISHED: _ClassVar[FederationPhase]

class FederationOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FEDERATION_OUTCOME_UNSPECIFIED: _ClassVar[FederationOutcome]
    FEDERATION_OUTCOME_COMPLETED: _ClassVar[FederationOutcome]
    FEDERATION_OUTCOME_STALLED: _ClassVar[FederationOutcome]
    FEDERATION_OUTCOME_DP_BUDGET: _ClassVar[FederationOutcome]

class RoundOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROUND_OUTCOME_UNSPECIFIED: _ClassVar[RoundOutcome]
    ROUND_OUTCOME_QUORUM: _ClassVar[RoundOutcome]
    ROUND_OUTCOME_ALL_RESPONDED: _ClassVar[RoundOutcome]
    ROUND_OUTCOME_DEADLINE: _ClassVar[RoundOutcome]
    ROUND_OUTCOME_BUFFER_FULL: _ClassVar[RoundOutcome]
    ROUND_OUTCOME_REPLAYED: _ClassVar[RoundOutcome]

class NflState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NFL_STATE_UNSPECIFIED: _ClassVar[NflState]
    NFL_STATE_OFF: _ClassVar[NflState]
    NFL_STATE_ALWAYS: _ClassVar[NflState]
    NFL_STATE_WATCHING: _ClassVar[NflState]
    NFL_STATE_REPORTED: _ClassVar[NflState]

class NflMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NFL_MODE_UNSPECIFIED: _ClassVar[NflMode]
    NFL_MODE_DETECT_AND_RECOVER: _ClassVar[NflMode]
    NFL_MODE_ALWAYS_RECOVER: _ClassVar[NflMode]
    NFL_MODE_OFF: _ClassVar[NflMode]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
FLOAT16: DType
BFLOAT16: DType
FLOAT64: DType
INT64: DType
INT32: DType
INT16: DType
INT8: DType
UINT8: DType
BOOL: DType
COMPRESSION_NONE: Compression
COMPRESSION_FP16: Compression
COMPRESSION_INT8: Compression
COMPRESSION_TOPK: Compression
UPDATE_KIND_UNSPECIFIED: UpdateKind
WEIGHTS: UpdateKind
DELTA: UpdateKind
MASKED: UpdateKind
FEDERATION_PHASE_UNSPECIFIED: FederationPhase
FEDERATION_PHASE_SAMPLING: FederationPhase
FEDERATION_PHASE_TRAINING: FederationPhase
FEDERATION_PHASE_AGGREGATING: FederationPhase
FEDERATION_PHASE_FINISHED: FederationPhase
FEDERATION_OUTCOME_UNSPECIFIED: FederationOutcome
FEDERATION_OUTCOME_COMPLETED: FederationOutcome
FEDERATION_OUTCOME_STALLED: FederationOutcome
FEDERATION_OUTCOME_DP_BUDGET: FederationOutcome
ROUND_OUTCOME_UNSPECIFIED: RoundOutcome
ROUND_OUTCOME_QUORUM: RoundOutcome
ROUND_OUTCOME_ALL_RESPONDED: RoundOutcome
ROUND_OUTCOME_DEADLINE: RoundOutcome
ROUND_OUTCOME_BUFFER_FULL: RoundOutcome
ROUND_OUTCOME_REPLAYED: RoundOutcome
NFL_STATE_UNSPECIFIED: NflState
NFL_STATE_OFF: NflState
NFL_STATE_ALWAYS: NflState
NFL_STATE_WATCHING: NflState
NFL_STATE_REPORTED: NflState
NFL_MODE_UNSPECIFIED: NflMode
NFL_MODE_DETECT_AND_RECOVER: NflMode
NFL_MODE_ALWAYS_RECOVER: NflMode
NFL_MODE_OFF: NflMode

class TensorMeta(_message.Message):
    __slots__ = ("name", "dtype", "shape", "nbytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    nbytes: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., nbytes: _Optional[int] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("offset", "data")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class Capabilities(_message.Message):
    __slots__ = ("num_train_samples", "opt_out", "attacker", "version")
    NUM_TRAIN_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    OPT_OUT_FIELD_NUMBER: _ClassVar[int]
    ATTACKER_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    num_train_samples: int
    opt_out: bool
    attacker: bool
    version: str
    def __init__(self, num_train_samples: _Optional[int] = ..., opt_out: _Optional[bool] = ..., attacker: _Optional[bool] = ..., version: _Optional[str] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("client_id", "token", "capabilities", "model_fingerprint")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    token: str
    capabilities: Capabilities
    model_fingerprint: str
    def __init__(self, client_id: _Optional[str] = ..., token: _Optional[str] = ..., capabilities: _Optional[_Union[Capabilities, _Mapping]] = ..., model_fingerprint: _Optional[str] = ...) -> None: ...

class TrainingConfig(_message.Message):
    __slots__ = ("local_epochs", "batch_size", "learning_rate", "momentum", "weight_decay", "lr_decay", "grad_clip_norm", "prox_mu")
    LOCAL_EPOCHS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    LR_DECAY_FIELD_NUMBER: _ClassVar[int]
    GRAD_CLIP_NORM_FIELD_NUMBER: _ClassVar[int]
    PROX_MU_FIELD_NUMBER: _ClassVar[int]
    local_epochs: int
    batch_size: int
    learning_rate: float
    momentum: float
    weight_decay: float
    lr_decay: float
    grad_clip_norm: float
    prox_mu: float
    def __init__(self, local_epochs: _Optional[int] = ..., batch_size: _Optional[int] = ..., learning_rate: _Optional[float] = ..., momentum: _Optional[float] = ..., weight_decay: _Optional[float] = ..., lr_decay: _Optional[float] = ..., grad_clip_norm: _Optional[float] = ..., prox_mu: _Optional[float] = ...) -> None: ...

class FederationConfig(_message.Message):
    __slots__ = ("federation_id", "model_name", "model_kwargs_json", "model_fingerprint", "model_spec", "training", "dataset", "data_options_json", "num_rounds", "seed", "nfl_mode", "chunk_bytes", "nfl_nr", "nfl_c", "recovery_method", "recovery_options_json", "nfl", "secure", "compression")
    FEDERATION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MODEL_SPEC_FIELD_NUMBER: _ClassVar[int]
    TRAINING_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    DATA_OPTIONS_JSON_FIELD_NUMBER: _ClassVar[int]
    NUM_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    NFL_MODE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    NFL_NR_FIELD_NUMBER: _ClassVar[int]
    NFL_C_FIELD_NUMBER: _ClassVar[int]
    RECOVERY_METHOD_FIELD_NUMBER: _ClassVar[int]
    RECOVERY_OPTIONS_JSON_FIELD_NUMBER: _ClassVar[int]
    NFL_FIELD_NUMBER: _ClassVar[int]
    SECURE_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    federation_id: str
    model_name: str
    model_kwargs_json: str
    model_fingerprint: str
    model_spec: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    training: TrainingConfig
    dataset: str
    data_options_json: str
    num_rounds: int
    seed: int
    nfl_mode: str
    chunk_bytes: int
    nfl_nr: int
    nfl_c: int
    recovery_method: str
    recovery_options_json: str
    nfl: NflSettings
    secure: SecureAggregationSettings
    compression: CompressionSettings
    def __init__(self, federation_id: _Optional[str] = ..., model_name: _Optional[str] = ..., model_kwargs_json: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., model_spec: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., training: _Optional[_Union[TrainingConfig, _Mapping]] = ..., dataset: _Optional[str] = ..., data_options_json: _Optional[str] = ..., num_rounds: _Optional[int] = ..., seed: _Optional[int] = ..., nfl_mode: _Optional[str] = ..., chunk_bytes: _Optional[int] = ..., nfl_nr: _Optional[int] = ..., nfl_c: _Optional[int] = ..., recovery_method: _Optional[str] = ..., recovery_options_json: _Optional[str] = ..., nfl: _Optional[_Union[NflSettings, _Mapping]] = ..., secure: _Optional[_Union[SecureAggregationSettings, _Mapping]] = ..., compression: _Optional[_Union[CompressionSettings, _Mapping]] = ...) -> None: ...

class CompressionSettings(_message.Message):
    __slots__ = ("kind", "int8_chunk", "topk_fraction", "error_feedback")
    KIND_FIELD_NUMBER: _ClassVar[int]
    INT8_CHUNK_FIELD_NUMBER: _ClassVar[int]
    TOPK_FRACTION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FEEDBACK_FIELD_NUMBER: _ClassVar[int]
    kind: Compression
    int8_chunk: int
    topk_fraction: float
    error_feedback: bool
    def __init__(self, kind: _Optional[_Union[Compression, str]] = ..., int8_chunk: _Optional[int] = ..., topk_fraction: _Optional[float] = ..., error_feedback: _Optional[bool] = ...) -> None: ...

class SecureAggregationSettings(_message.Message):
    __slots__ = ("protocol", "neighbours", "threshold", "max_dropout", "corrupt_fraction", "security_bits", "correctness_bits", "min_clients", "norm_bound", "phase_timeout_s", "clip_norm", "weighted", "max_update_norm")
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    NEIGHBOURS_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    MAX_DROPOUT_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_FRACTION_FIELD_NUMBER: _ClassVar[int]
    SECURITY_BITS_FIELD_NUMBER: _ClassVar[int]
    CORRECTNESS_BITS_FIELD_NUMBER: _ClassVar[int]
    MIN_CLIENTS_FIELD_NUMBER: _ClassVar[int]
    NORM_BOUND_FIELD_NUMBER: _ClassVar[int]
    PHASE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    CLIP_NORM_FIELD_NUMBER: _ClassVar[int]
    WEIGHTED_FIELD_NUMBER: _ClassVar[int]
    MAX_UPDATE_NORM_FIELD_NUMBER: _ClassVar[int]
    protocol: str
    neighbours: int
    threshold: float
    max_dropout: float
    corrupt_fraction: float
    security_bits: int
    correctness_bits: int
    min_clients: int
    norm_bound: float
    phase_timeout_s: float
    clip_norm: float
    weighted: bool
    max_update_norm: float
    def __init__(self, protocol: _Optional[str] = ..., neighbours: _Optional[int] = ..., threshold: _Optional[float] = ..., max_dropout: _Optional[float] = ..., corrupt_fraction: _Optional[float] = ..., security_bits: _Optional[int] = ..., correctness_bits: _Optional[int] = ..., min_clients: _Optional[int] = ..., norm_bound: _Optional[float] = ..., phase_timeout_s: _Optional[float] = ..., clip_norm: _Optional[float] = ..., weighted: _Optional[bool] = ..., max_update_norm: _Optional[float] = ...) -> None: ...

class NflSettings(_message.Message):
    __slots__ = ("mode", "nr", "c")
    MODE_FIELD_NUMBER: _ClassVar[int]
    NR_FIELD_NUMBER: _ClassVar[int]
    C_FIELD_NUMBER: _ClassVar[int]
    mode: str
    nr: int
    c: int
    def __init__(self, mode: _Optional[str] = ..., nr: _Optional[int] = ..., c: _Optional[int] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("session_id", "config", "heartbeat_interval_s", "client_index", "then_pull", "framed_port", "pushed_with_answer")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    CLIENT_INDEX_FIELD_NUMBER: _ClassVar[int]
    THEN_PULL_FIELD_NUMBER: _ClassVar[int]
    FRAMED_PORT_FIELD_NUMBER: _ClassVar[int]
    PUSHED_WITH_ANSWER_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    config: FederationConfig
    heartbeat_interval_s: float
    client_index: int
    then_pull: bool
    framed_port: int
    pushed_with_answer: bool
    def __init__(self, session_id: _Optional[str] = ..., config: _Optional[_Union[FederationConfig, _Mapping]] = ..., heartbeat_interval_s: _Optional[float] = ..., client_index: _Optional[int] = ..., then_pull: _Optional[bool] = ..., framed_port: _Optional[int] = ..., pushed_with_answer: _Optional[bool] = ...) -> None: ...

class PullTaskRequest(_message.Message):
    __slots__ = ("session_id", "max_wait_s", "declined", "inline_ok")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    DECLINED_FIELD_NUMBER: _ClassVar[int]
    INLINE_OK_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    max_wait_s: float
    declined: bool
    inline_ok: bool
    def __init__(self, session_id: _Optional[str] = ..., max_wait_s: _Optional[float] = ..., declined: _Optional[bool] = ..., inline_ok: _Optional[bool] = ...) -> None: ...

class Wait(_message.Message):
    __slots__ = ("retry_after_s", "finished", "reason")
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    retry_after_s: float
    finished: bool
    reason: str
    def __init__(self, retry_after_s: _Optional[float] = ..., finished: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class TaskHeader(_message.Message):
    __slots__ = ("round", "deadline_s", "tensors", "total_bytes", "recovery", "learning_rate", "data", "attempt")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    RECOVERY_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    round: int
    deadline_s: float
    tensors: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    total_bytes: int
    recovery: bool
    learning_rate: float
    data: bytes
    attempt: int
    def __init__(self, round: _Optional[int] = ..., deadline_s: _Optional[float] = ..., tensors: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., total_bytes: _Optional[int] = ..., recovery: _Optional[bool] = ..., learning_rate: _Optional[float] = ..., data: _Optional[bytes] = ..., attempt: _Optional[int] = ...) -> None: ...

class TaskMessage(_message.Message):
    __slots__ = ("wait", "header", "chunk")
    WAIT_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    wait: Wait
    header: TaskHeader
    chunk: Chunk
    def __init__(self, wait: _Optional[_Union[Wait, _Mapping]] = ..., header: _Optional[_Union[TaskHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ...) -> None: ...

class UpdateReport(_message.Message):
    __slots__ = ("num_samples", "train_loss", "beta_hat", "test_accuracy", "test_loss", "private_accuracy", "adapting", "infers_adapted", "train_seconds", "passes", "extras")
    class ExtrasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    TRAIN_LOSS_FIELD_NUMBER: _ClassVar[int]
    BETA_HAT_FIELD_NUMBER: _ClassVar[int]
    TEST_ACCURACY_FIELD_NUMBER: _ClassVar[int]
    TEST_LOSS_FIELD_NUMBER: _ClassVar[int]
    PRIVATE_ACCURACY_FIELD_NUMBER: _ClassVar[int]
    ADAPTING_FIELD_NUMBER: _ClassVar[int]
    INFERS_ADAPTED_FIELD_NUMBER: _ClassVar[int]
    TRAIN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PASSES_FIELD_NUMBER: _ClassVar[int]
    EXTRAS_FIELD_NUMBER: _ClassVar[int]
    num_samples: int
    train_loss: float
    beta_hat: float
    test_accuracy: float
    test_loss: float
    private_accuracy: float
    adapting: bool
    infers_adapted: bool
    train_seconds: float
    passes: float
    extras: _containers.ScalarMap[str, float]
    def __init__(self, num_samples: _Optional[int] = ..., train_loss: _Optional[float] = ..., beta_hat: _Optional[float] = ..., test_accuracy: _Optional[float] = ..., test_loss: _Optional[float] = ..., private_accuracy: _Optional[float] = ..., adapting: _Optional[bool] = ..., infers_adapted: _Optional[bool] = ..., train_seconds: _Optional[float] = ..., passes: _Optional[float] = ..., extras: _Optional[_Mapping[str, float]] = ...) -> None: ...

class UpdateHeader(_message.Message):
    __slots__ = ("session_id", "round", "num_samples", "beta_hat", "train_loss", "metrics", "kind", "tensors", "total_bytes", "payload_sha256", "report", "data", "compression")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    BETA_HAT_FIELD_NUMBER: _ClassVar[int]
    TRAIN_LOSS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_SHA256_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    round: int
    num_samples: int
    beta_hat: float
    train_loss: float
    metrics: _containers.ScalarMap[str, float]
    kind: UpdateKind
    tensors: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    total_bytes: int
    payload_sha256: bytes
    report: UpdateReport
    data: bytes
    compression: Compression
    def __init__(self, session_id: _Optional[str] = ..., round: _Optional[int] = ..., num_samples: _Optional[int] = ..., beta_hat: _Optional[float] = ..., train_loss: _Optional[float] = ..., metrics: _Optional[_Mapping[str, float]] = ..., kind: _Optional[_Union[UpdateKind, str]] = ..., tensors: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., total_bytes: _Optional[int] = ..., payload_sha256: _Optional[bytes] = ..., report: _Optional[_Union[UpdateReport, _Mapping]] = ..., data: _Optional[bytes] = ..., compression: _Optional[_Union[Compression, str]] = ...) -> None: ...

class UpdateMessage(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: UpdateHeader
    chunk: Chunk
    def __init__(self, header: _Optional[_Union[UpdateHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("accepted", "reason")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("header", "chunk", "pull", "secagg", "then_pull", "pushed_with_answer")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    PULL_FIELD_NUMBER: _ClassVar[int]
    SECAGG_FIELD_NUMBER: _ClassVar[int]
    THEN_PULL_FIELD_NUMBER: _ClassVar[int]
    PUSHED_WITH_ANSWER_FIELD_NUMBER: _ClassVar[int]
    header: UpdateHeader
    chunk: Chunk
    pull: PullTaskRequest
    secagg: SecAggRequest
    then_pull: PullTaskRequest
    pushed_with_answer: bool
    def __init__(self, header: _Optional[_Union[UpdateHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ..., pull: _Optional[_Union[PullTaskRequest, _Mapping]] = ..., secagg: _Optional[_Union[SecAggRequest, _Mapping]] = ..., then_pull: _Optional[_Union[PullTaskRequest, _Mapping]] = ..., pushed_with_answer: _Optional[bool] = ...) -> None: ...

class SessionReply(_message.Message):
    __slots__ = ("wait", "header", "chunk", "pushed", "secagg")
    WAIT_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    PUSHED_FIELD_NUMBER: _ClassVar[int]
    SECAGG_FIELD_NUMBER: _ClassVar[int]
    wait: Wait
    header: TaskHeader
    chunk: Chunk
    pushed: PushReply
    secagg: SecAggReply
    def __init__(self, wait: _Optional[_Union[Wait, _Mapping]] = ..., header: _Optional[_Union[TaskHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ..., pushed: _Optional[_Union[PushReply, _Mapping]] = ..., secagg: _Optional[_Union[SecAggReply, _Mapping]] = ...) -> None: ...

class SecAggAdvertisement(_message.Message):
    __slots__ = ("client_id", "c_pk", "s_pk", "signature")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    C_PK_FIELD_NUMBER: _ClassVar[int]
    S_PK_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    c_pk: bytes
    s_pk: bytes
    signature: bytes
    def __init__(self, client_id: _Optional[str] = ..., c_pk: _Optional[bytes] = ..., s_pk: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class SealedShare(_message.Message):
    __slots__ = ("sender", "recipient", "ciphertext")
    SENDER_FIELD_NUMBER: _ClassVar[int]
    RECIPIENT_FIELD_NUMBER: _ClassVar[int]
    CIPHERTEXT_FIELD_NUMBER: _ClassVar[int]
    sender: str
    recipient: str
    ciphertext: bytes
    def __init__(self, sender: _Optional[str] = ..., recipient: _Optional[str] = ..., ciphertext: _Optional[bytes] = ...) -> None: ...

class SecAggShares(_message.Message):
    __slots__ = ("shares", "commitment")
    SHARES_FIELD_NUMBER: _ClassVar[int]
    COMMITMENT_FIELD_NUMBER: _ClassVar[int]
    shares: _containers.RepeatedCompositeFieldContainer[SealedShare]
    commitment: bytes
    def __init__(self, shares: _Optional[_Iterable[_Union[SealedShare, _Mapping]]] = ..., commitment: _Optional[bytes] = ...) -> None: ...

class RevealedShare(_message.Message):
    __slots__ = ("owner", "share")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    owner: str
    share: bytes
    def __init__(self, owner: _Optional[str] = ..., share: _Optional[bytes] = ...) -> None: ...

class SecAggUnmask(_message.Message):
    __slots__ = ("self_mask_shares", "key_shares")
    SELF_MASK_SHARES_FIELD_NUMBER: _ClassVar[int]
    KEY_SHARES_FIELD_NUMBER: _ClassVar[int]
    self_mask_shares: _containers.RepeatedCompositeFieldContainer[RevealedShare]
    key_shares: _containers.RepeatedCompositeFieldContainer[RevealedShare]
    def __init__(self, self_mask_shares: _Optional[_Iterable[_Union[RevealedShare, _Mapping]]] = ..., key_shares: _Optional[_Iterable[_Union[RevealedShare, _Mapping]]] = ...) -> None: ...

class SecAggRequest(_message.Message):
    __slots__ = ("session_id", "round", "attempt", "max_wait_s", "advertisement", "shares", "unmask", "poll")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    MAX_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    ADVERTISEMENT_FIELD_NUMBER: _ClassVar[int]
    SHARES_FIELD_NUMBER: _ClassVar[int]
    UNMASK_FIELD_NUMBER: _ClassVar[int]
    POLL_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    round: int
    attempt: int
    max_wait_s: float
    advertisement: SecAggAdvertisement
    shares: SecAggShares
    unmask: SecAggUnmask
    poll: bool
    def __init__(self, session_id: _Optional[str] = ..., round: _Optional[int] = ..., attempt: _Optional[int] = ..., max_wait_s: _Optional[float] = ..., advertisement: _Optional[_Union[SecAggAdvertisement, _Mapping]] = ..., shares: _Optional[_Union[SecAggShares, _Mapping]] = ..., unmask: _Optional[_Union[SecAggUnmask, _Mapping]] = ..., poll: _Optional[bool] = ...) -> None: ...

class SecAggKeyRequest(_message.Message):
    __slots__ = ("participants", "neighbours", "threshold", "min_survivors", "graph_seed", "num_params", "num_extras", "advertisements")
    PARTICIPANTS_FIELD_NUMBER: _ClassVar[int]
    NEIGHBOURS_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    MIN_SURVIVORS_FIELD_NUMBER: _ClassVar[int]
    GRAPH_SEED_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXTRAS_FIELD_NUMBER: _ClassVar[int]
    ADVERTISEMENTS_FIELD_NUMBER: _ClassVar[int]
    participants: _containers.RepeatedScalarFieldContainer[str]
    neighbours: int
    threshold: int
    min_survivors: int
    graph_seed: int
    num_params: int
    num_extras: int
    advertisements: _containers.RepeatedCompositeFieldContainer[SecAggAdvertisement]
    def __init__(self, participants: _Optional[_Iterable[str]] = ..., neighbours: _Optional[int] = ..., threshold: _Optional[int] = ..., min_survivors: _Optional[int] = ..., graph_seed: _Optional[int] = ..., num_params: _Optional[int] = ..., num_extras: _Optional[int] = ..., advertisements: _Optional[_Iterable[_Union[SecAggAdvertisement, _Mapping]]] = ...) -> None: ...

class SecAggMaskRequest(_message.Message):
    __slots__ = ("shares",)
    SHARES_FIELD_NUMBER: _ClassVar[int]
    shares: _containers.RepeatedCompositeFieldContainer[SealedShare]
    def __init__(self, shares: _Optional[_Iterable[_Union[SealedShare, _Mapping]]] = ...) -> None: ...

class SecAggUnmaskRequest(_message.Message):
    __slots__ = ("survivors", "reveal_self_mask", "reveal_key")
    SURVIVORS_FIELD_NUMBER: _ClassVar[int]
    REVEAL_SELF_MASK_FIELD_NUMBER: _ClassVar[int]
    REVEAL_KEY_FIELD_NUMBER: _ClassVar[int]
    survivors: _containers.RepeatedScalarFieldContainer[str]
    reveal_self_mask: _containers.RepeatedScalarFieldContainer[str]
    reveal_key: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, survivors: _Optional[_Iterable[str]] = ..., reveal_self_mask: _Optional[_Iterable[str]] = ..., reveal_key: _Optional[_Iterable[str]] = ...) -> None: ...

class SecAggReply(_message.Message):
    __slots__ = ("round", "attempt", "wait", "key_request", "mask_request", "unmask_request", "done", "abandoned")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    KEY_REQUEST_FIELD_NUMBER: _ClassVar[int]
    MASK_REQUEST_FIELD_NUMBER: _ClassVar[int]
    UNMASK_REQUEST_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    ABANDONED_FIELD_NUMBER: _ClassVar[int]
    round: int
    attempt: int
    wait: Wait
    key_request: SecAggKeyRequest
    mask_request: SecAggMaskRequest
    unmask_request: SecAggUnmaskRequest
    done: bool
    abandoned: str
    def __init__(self, round: _Optional[int] = ..., attempt: _Optional[int] = ..., wait: _Optional[_Union[Wait, _Mapping]] = ..., key_request: _Optional[_Union[SecAggKeyRequest, _Mapping]] = ..., mask_request: _Optional[_Union[SecAggMaskRequest, _Mapping]] = ..., unmask_request: _Optional[_Union[SecAggUnmaskRequest, _Mapping]] = ..., done: _Optional[bool] = ..., abandoned: _Optional[str] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("round", "finished")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    round: int
    finished: bool
    def __init__(self, round: _Optional[int] = ..., finished: _Optional[bool] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("session_id", "reason")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    reason: str
    def __init__(self, session_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class LeaveReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("session_id", "since_round")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SINCE_ROUND_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    since_round: int
    def __init__(self, session_id: _Optional[str] = ..., since_round: _Optional[int] = ...) -> None: ...

class RoundSummary(_message.Message):
    __slots__ = ("round", "selected", "accepted", "rejected", "mean_train_loss", "mean_test_accuracy", "seconds", "outcome", "outcome_name", "metrics", "attempt", "test_accuracy_benign", "central_accuracy", "beta", "beta_weighted", "beta_benign", "beta_benign_weighted", "beta_hat", "beta_hat_avg", "beta_hat_error", "adapting", "holdouts", "beta_adapting", "beta_holdout", "nfl", "nfl_name", "nfl_count", "recovery", "test_accuracy_adapting", "test_accuracy_holdout", "client_seconds", "client_passes", "clusters", "late_total", "attackers", "dp_epsilon", "dp_delta", "dp_noise_multiplier", "dp_sample_rate", "bytes_received", "wall_seconds", "staleness_min", "staleness_mean", "staleness_max")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class ClustersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SELECTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    MEAN_TRAIN_LOSS_FIELD_NUMBER: _ClassVar[int]
    MEAN_TEST_ACCURACY_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_NAME_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    TEST_ACCURACY_BENIGN_FIELD_NUMBER: _ClassVar[int]
    CENTRAL_ACCURACY_FIELD_NUMBER: _ClassVar[int]
    BETA_FIELD_NUMBER: _ClassVar[int]
    BETA_WEIGHTED_FIELD_NUMBER: _ClassVar[int]
    BETA_BENIGN_FIELD_NUMBER: _ClassVar[int]
    BETA_BENIGN_WEIGHTED_FIELD_NUMBER: _ClassVar[int]
    BETA_HAT_FIELD_NUMBER: _ClassVar[int]
    BETA_HAT_AVG_FIELD_NUMBER: _ClassVar[int]
    BETA_HAT_ERROR_FIELD_NUMBER: _ClassVar[int]
    ADAPTING_FIELD_NUMBER: _ClassVar[int]
    HOLDOUTS_FIELD_NUMBER: _ClassVar[int]
    BETA_ADAPTING_FIELD_NUMBER: _ClassVar[int]
    BETA_HOLDOUT_FIELD_NUMBER: _ClassVar[int]
    NFL_FIELD_NUMBER: _ClassVar[int]
    NFL_NAME_FIELD_NUMBER: _ClassVar[int]
    NFL_COUNT_FIELD_NUMBER: _ClassVar[int]
    RECOVERY_FIELD_NUMBER: _ClassVar[int]
    TEST_ACCURACY_ADAPTING_FIELD_NUMBER: _ClassVar[int]
    TEST_ACCURACY_HOLDOUT_FIELD_NUMBER: _ClassVar[int]
    CLIENT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_PASSES_FIELD_NUMBER: _ClassVar[int]
    CLUSTERS_FIELD_NUMBER: _ClassVar[int]
    LATE_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ATTACKERS_FIELD_NUMBER: _ClassVar[int]
    DP_EPSILON_FIELD_NUMBER: _ClassVar[int]
    DP_DELTA_FIELD_NUMBER: _ClassVar[int]
    DP_NOISE_MULTIPLIER_FIELD_NUMBER: _ClassVar[int]
    DP_SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    WALL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STALENESS_MIN_FIELD_NUMBER: _ClassVar[int]
    STALENESS_MEAN_FIELD_NUMBER: _ClassVar[int]
    STALENESS_MAX_FIELD_NUMBER: _ClassVar[int]
    round: int
    selected: int
    accepted: int
    rejected: int
    mean_train_loss: float
    mean_test_accuracy: float
    seconds: float
    outcome: RoundOutcome
    outcome_name: str
    metrics: _containers.ScalarMap[str, float]
    attempt: int
    test_accuracy_benign: float
    central_accuracy: float
    beta: float
    beta_weighted: float
    beta_benign: float
    beta_benign_weighted: float
    beta_hat: float
    beta_hat_avg: float
    beta_hat_error: float
    adapting: int
    holdouts: int
    beta_adapting: float
    beta_holdout: float
    nfl: NflState
    nfl_name: str
    nfl_count: int
    recovery: bool
    test_accuracy_adapting: float
    test_accuracy_holdout: float
    client_seconds: float
    client_passes: float
    clusters: _containers.ScalarMap[str, int]
    late_total: int
    attackers: int
    dp_epsilon: float
    dp_delta: float
    dp_noise_multiplier: float
    dp_sample_rate: float
    bytes_received: int
    wall_seconds: float
    staleness_min: float
    staleness_mean: float
    staleness_max: float
    def __init__(self, round: _Optional[int] = ..., selected: _Optional[int] = ..., accepted: _Optional[int] = ..., rejected: _Optional[int] = ..., mean_train_loss: _Optional[float] = ..., mean_test_accuracy: _Optional[float] = ..., seconds: _Optional[float] = ..., outcome: _Optional[_Union[RoundOutcome, str]] = ..., outcome_name: _Optional[str] = ..., metrics: _Optional[_Mapping[str, float]] = ..., attempt: _Optional[int] = ..., test_accuracy_benign: _Optional[float] = ..., central_accuracy: _Optional[float] = ..., beta: _Optional[float] = ..., beta_weighted: _Optional[float] = ..., beta_benign: _Optional[float] = ..., beta_benign_weighted: _Optional[float] = ..., beta_hat: _Optional[float] = ..., beta_hat_avg: _Optional[float] = ..., beta_hat_error: _Optional[float] = ..., adapting: _Optional[int] = ..., holdouts: _Optional[int] = ..., beta_adapting: _Optional[float] = ..., beta_holdout: _Optional[float] = ..., nfl: _Optional[_Union[NflState, str]] = ..., nfl_name: _Optional[str] = ..., nfl_count: _Optional[int] = ..., recovery: _Optional[bool] = ..., test_accuracy_adapting: _Optional[float] = ..., test_accuracy_holdout: _Optional[float] = ..., client_seconds: _Optional[float] = ..., client_passes: _Optional[float] = ..., clusters: _Optional[_Mapping[str, int]] = ..., late_total: _Optional[int] = ..., attackers: _Optional[int] = ..., dp_epsilon: _Optional[float] = ..., dp_delta: _Optional[float] = ..., dp_noise_multiplier: _Optional[float] = ..., dp_sample_rate: _Optional[float] = ..., bytes_received: _Optional[int] = ..., wall_seconds: _Optional[float] = ..., staleness_min: _Optional[float] = ..., staleness_mean: _Optional[float] = ..., staleness_max: _Optional[float] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("federation_id", "round", "num_rounds", "phase", "phase_name", "clients_known", "clients_alive", "selected", "accepted", "rejected", "rejected_total", "history", "finished", "outcome", "outcome_name", "resumed_from", "stopping", "nfl", "distfl")
    FEDERATION_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    NUM_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    PHASE_NAME_FIELD_NUMBER: _ClassVar[int]
    CLIENTS_KNOWN_FIELD_NUMBER: _ClassVar[int]
    CLIENTS_ALIVE_FIELD_NUMBER: _ClassVar[int]
    SELECTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_NAME_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FROM_FIELD_NUMBER: _ClassVar[int]
    STOPPING_FIELD_NUMBER: _ClassVar[int]
    NFL_FIELD_NUMBER: _ClassVar[int]
    DISTFL_FIELD_NUMBER: _ClassVar[int]
    federation_id: str
    round: int
    num_rounds: int
    phase: FederationPhase
    phase_name: str
    clients_known: int
    clients_alive: int
    selected: int
    accepted: int
    rejected: int
    rejected_total: int
    history: _containers.RepeatedCompositeFieldContainer[RoundSummary]
    finished: bool
    outcome: FederationOutcome
    outcome_name: str
    resumed_from: int
    stopping: bool
    nfl: NflStatus
    distfl: DistflStatus
    def __init__(self, federation_id: _Optional[str] = ..., round: _Optional[int] = ..., num_rounds: _Optional[int] = ..., phase: _Optional[_Union[FederationPhase, str]] = ..., phase_name: _Optional[str] = ..., clients_known: _Optional[int] = ..., clients_alive: _Optional[int] = ..., selected: _Optional[int] = ..., accepted: _Optional[int] = ..., rejected: _Optional[int] = ..., rejected_total: _Optional[int] = ..., history: _Optional[_Iterable[_Union[RoundSummary, _Mapping]]] = ..., finished: _Optional[bool] = ..., outcome: _Optional[_Union[FederationOutcome, str]] = ..., outcome_name: _Optional[str] = ..., resumed_from: _Optional[int] = ..., stopping: _Optional[bool] = ..., nfl: _Optional[_Union[NflStatus, _Mapping]] = ..., distfl: _Optional[_Union[DistflStatus, _Mapping]] = ...) -> None: ...

class DistflStatus(_message.Message):
    __slots__ = ("enabled", "clustered_round", "next_clustering", "probe", "clusters", "assignment", "pending")
    class ClustersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class AssignmentEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    CLUSTERED_ROUND_FIELD_NUMBER: _ClassVar[int]
    NEXT_CLUSTERING_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    CLUSTERS_FIELD_NUMBER: _ClassVar[int]
    ASSIGNMENT_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    clustered_round: int
    next_clustering: int
    probe: str
    clusters: _containers.ScalarMap[str, int]
    assignment: _containers.ScalarMap[str, str]
    pending: int
    def __init__(self, enabled: _Optional[bool] = ..., clustered_round: _Optional[int] = ..., next_clustering: _Optional[int] = ..., probe: _Optional[str] = ..., clusters: _Optional[_Mapping[str, int]] = ..., assignment: _Optional[_Mapping[str, str]] = ..., pending: _Optional[int] = ...) -> None: ...

class NflStatus(_message.Message):
    __slots__ = ("mode", "mode_name", "detector", "state", "state_name", "recovery", "count", "consecutive_ok", "beta_hat", "delta", "reported_round", "cancelled_round", "stopped_round")
    MODE_FIELD_NUMBER: _ClassVar[int]
    MODE_NAME_FIELD_NUMBER: _ClassVar[int]
    DETECTOR_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STATE_NAME_FIELD_NUMBER: _ClassVar[int]
    RECOVERY_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    CONSECUTIVE_OK_FIELD_NUMBER: _ClassVar[int]
    BETA_HAT_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    REPORTED_ROUND_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_ROUND_FIELD_NUMBER: _ClassVar[int]
    STOPPED_ROUND_FIELD_NUMBER: _ClassVar[int]
    mode: NflMode
    mode_name: str
    detector: str
    state: NflState
    state_name: str
    recovery: bool
    count: int
    consecutive_ok: int
    beta_hat: float
    delta: float
    reported_round: int
    cancelled_round: int
    stopped_round: int
    def __init__(self, mode: _Optional[_Union[NflMode, str]] = ..., mode_name: _Optional[str] = ..., detector: _Optional[str] = ..., state: _Optional[_Union[NflState, str]] = ..., state_name: _Optional[str] = ..., recovery: _Optional[bool] = ..., count: _Optional[int] = ..., consecutive_ok: _Optional[int] = ..., beta_hat: _Optional[float] = ..., delta: _Optional[float] = ..., reported_round: _Optional[int] = ..., cancelled_round: _Optional[int] = ..., stopped_round: _Optional[int] = ...) -> None: ...
