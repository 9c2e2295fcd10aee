"""NFL detection and recovery decisions (FL-GUARD): server-side detectors and client-side individual measures.

The server side is re-exported here: :class:`NflConfig` (the ``[nfl]`` section) and the detector state machine
of :mod:`fedcore.nfl.detectors` (``state = init(config)``; ``state, events = step(state, observation, config)``).
"""

from fedcore.nfl.config import (
    ALWAYS_RECOVER,
    DETECT_AND_RECOVER,
    LONG_TERM,
    MODES,
    OFF,
    RECOVERY_STRATEGIES,
    SHORT_TERM,
    NflConfig,
    validate_nfl_config,
)
from fedcore.nfl.detectors import (
    CANCELLED,
    DETECTORS,
    EVENT_KINDS,
    REPORTED,
    STOPPED,
    CusumOptions,
    DetectorStep,
    NflEvent,
    NflObservation,
    NflRecord,
    NflState,
    PlateauOptions,
    WarmupOptions,
    detector_names,
    init,
    register_detector,
    step,
)

__all__ = [
    "ALWAYS_RECOVER",
    "CANCELLED",
    "DETECTORS",
    "DETECT_AND_RECOVER",
    "EVENT_KINDS",
    "LONG_TERM",
    "MODES",
    "OFF",
    "RECOVERY_STRATEGIES",
    "REPORTED",
    "SHORT_TERM",
    "STOPPED",
    "CusumOptions",
    "DetectorStep",
    "NflConfig",
    "NflEvent",
    "NflObservation",
    "NflRecord",
    "NflState",
    "PlateauOptions",
    "WarmupOptions",
    "detector_names",
    "init",
    "register_detector",
    "step",
    "validate_nfl_config",
]
