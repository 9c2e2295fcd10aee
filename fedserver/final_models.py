"""The finished federation's models in the run directory: ``final_model.fgt`` (fedguard's tensor format), and
the global model and each DistFL cluster's as safetensors + JSON sidecar (:mod:`fedcore.outputs`, what
``fedguard.load_model`` reads).

Written once, when the round machine reports the federation finished; a separate part so the coordinator only
says *when*.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedcore import outputs
from fedcore.config import ServerConfig, redacted
from fedcore.serialization import save_state
from fedserver.global_models import GLOBAL, GlobalModels

FINAL_MODEL = "final_model.fgt"


def write_final_models(config: ServerConfig, models: GlobalModels, rounds: int, log: Any) -> Path:
    """Write every final model; returns the path of ``final_model.fgt``. A safetensors file that cannot be written
    is logged (``outputs.write_failed``) and skipped: ``final_model.fgt`` and the state store have the model."""
    run_dir = Path(config.server.run_dir)
    path = run_dir / FINAL_MODEL
    save_state(path, models.get(), {"rounds": rounds, "fingerprint": models.fingerprint, "model": config.model.name})
    sha = outputs.config_hash(redacted(config))
    for model_id in models.ids():
        try:
            written = outputs.write_model(run_dir, models.get(model_id), model_name=config.model.name,
                                          model_kwargs=config.model.kwargs, round_=rounds, config_sha=sha,
                                          cluster=None if model_id == GLOBAL else model_id)
        except (OSError, ValueError) as e:
            log.error("outputs.write_failed", model_id=model_id, reason=str(e))
            continue
        log.info("outputs.written", model_id=model_id, path=str(written))
    return path
