"""A run's models in a format other tools read: safetensors with a JSON sidecar, and :func:`load_model`.

When a federation finishes, the server writes next to ``final_model.fgt`` (fedguard's own format, kept):

- ``final_model.safetensors``: the global model's state dict (safetensors: a JSON header and raw little-endian
  tensors, readable by ``safetensors``, PyTorch, JAX, Rust, ... without running code from the file);
- ``final_model.json``: the sidecar: the model's registered name and constructor options (so it can be rebuilt),
  the round, a hash of the federation's configuration, the fedguard version, the parameter fingerprint (names,
  dtypes and shapes, in name order);
- ``final_clusters/<cluster>.safetensors`` and ``.json``: one pair per DistFL cluster model.

Each file appears whole or not at all (temp name + rename); the weights are written before their sidecar, so a
sidecar always describes the weights beside it. :func:`load_model` rebuilds the model from the model zoo by the
sidecar's name (a registered model, never an import path read from a file) and loads the weights.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fedcore import __version__, jsonio
from fedcore.serialization import atomic_write, fingerprint, manifest_of

MODEL_FILE = "final_model.safetensors"
SIDECAR_FILE = "final_model.json"
CLUSTER_DIR = "final_clusters"
FORMAT = "fedguard-model"
FORMAT_VERSION = 1
_SAFE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")

__all__ = ["CLUSTER_DIR", "MODEL_FILE", "SIDECAR_FILE", "ModelFileError", "config_hash", "load_model",
           "model_paths", "read_model", "write_model"]


class ModelFileError(ValueError):
    """A model file or its sidecar is absent, damaged or not loadable here; the message names the file."""


def config_hash(config: Mapping[str, Any]) -> str:
    """SHA-256 of a (redacted) configuration dict as canonical strict JSON (sorted keys)."""
    text = jsonio.dumps(config, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def model_paths(run_dir: str | os.PathLike[str], cluster: str | None = None) -> tuple[Path, Path]:
    """The (weights, sidecar) paths of the run's global model, or of DistFL cluster ``cluster``."""
    run = Path(run_dir)
    if cluster is None:
        return run / MODEL_FILE, run / SIDECAR_FILE
    if not _SAFE_ID.fullmatch(cluster):
        raise ModelFileError(f"cluster: {cluster!r} is not a cluster id (letters, digits, '_', '.', '-')")
    return run / CLUSTER_DIR / f"{cluster}.safetensors", run / CLUSTER_DIR / f"{cluster}.json"


def write_model(run_dir: str | os.PathLike[str], state: Mapping[str, torch.Tensor], *, model_name: str,
                model_kwargs: Mapping[str, Any], round_: int, config_sha: str, cluster: str | None = None) -> Path:
    """Write ``state`` as safetensors plus its sidecar (each atomically, weights first); returns the weights path."""
    from safetensors.torch import save

    weights, sidecar = model_paths(run_dir, cluster)
    weights.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()}
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "model": model_name,
            "model_kwargs": dict(model_kwargs), "round": int(round_), "cluster": cluster,
            "config_hash": config_sha, "fedguard_version": __version__,
            "fingerprint": _fingerprint(tensors), "weights": weights.name}
    header = {k: (v if isinstance(v, str) else jsonio.dumps(v)) for k, v in meta.items()}
    data = save(tensors, metadata=header)
    with atomic_write(weights) as f:
        f.write(data)
    with atomic_write(sidecar) as f:
        f.write((jsonio.dumps(meta, indent=2, sort_keys=True) + "\n").encode())
    return weights


def read_model(run_dir: str | os.PathLike[str], cluster: str | None = None) -> tuple[dict[str, torch.Tensor],
                                                                                     dict[str, Any]]:
    """The weights and the sidecar of the run's (or cluster's) model; :class:`ModelFileError` naming the file."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    weights, sidecar = model_paths(run_dir, cluster)
    meta = _read_sidecar(sidecar, run_dir, cluster)
    try:
        data = weights.read_bytes()
    except FileNotFoundError:
        raise ModelFileError(f"{weights}: no such file (the sidecar {sidecar.name} names it)") from None
    except OSError as e:
        raise ModelFileError(f"{weights}: cannot be read ({e.strerror or e})") from None
    try:
        tensors = load(data)
    except (SafetensorError, ValueError, RuntimeError) as e:
        raise ModelFileError(f"{weights}: not a readable safetensors file ({e})") from None
    got = _fingerprint(tensors)
    if got != meta.get("fingerprint"):
        raise ModelFileError(f"{weights}: its tensors (fingerprint {got}) are not the ones {sidecar} describes "
                             f"({meta.get('fingerprint')})")
    return tensors, meta


def _fingerprint(tensors: Mapping[str, torch.Tensor]) -> str:
    """The parameter fingerprint (names, dtypes, shapes) of ``tensors`` taken in name order (a safetensors file
    keeps no order)."""
    return fingerprint(manifest_of(dict(sorted(tensors.items()))))


def _read_sidecar(path: Path, run_dir: str | os.PathLike[str], cluster: str | None) -> dict[str, Any]:
    try:
        meta = jsonio.loads(path.read_text())
    except FileNotFoundError:
        what = f"cluster {cluster!r}" if cluster is not None else "the federation"
        hint = (f"; clusters: {', '.join(p.stem for p in sorted((Path(run_dir) / CLUSTER_DIR).glob('*.json')))}"
                if cluster is not None and (Path(run_dir) / CLUSTER_DIR).is_dir() else
                " (the server writes it when the federation finishes)")
        raise ModelFileError(f"{path}: no such file: no final model of {what} in {run_dir}{hint}") from None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:  # RecursionError: nested too deeply
        raise ModelFileError(f"{path}: not a readable model sidecar ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ModelFileError(f"{path}: not a fedguard model sidecar (format {FORMAT!r} expected)")
    version = meta.get("format_version", 0)
    if not isinstance(version, int) or isinstance(version, bool):
        raise ModelFileError(f"{path}: format_version {version!r:.40} is not an integer")
    if version > FORMAT_VERSION:
        raise ModelFileError(f"{path}: format_version {meta.get('format_version')} is newer than this fedguard "
                             f"({__version__}) reads ({FORMAT_VERSION})")
    if not isinstance(meta.get("model"), str) or not isinstance(meta.get("model_kwargs"), dict):
        raise ModelFileError(f"{path}: the sidecar lacks the model's name or options")
    return meta


def load_model(run_dir: str | os.PathLike[str], cluster: str | None = None, *,
               model: nn.Module | None = None) -> nn.Module:
    """The run's final global model (or DistFL cluster ``cluster``'s) as an ``nn.Module`` in eval mode.

    The module is built from the model zoo by the sidecar's registered name and options; a model the federation
    built from an import path is never imported from what a file says: pass your own instance as ``model`` (its
    weights are replaced). Raises :class:`ModelFileError` naming the file when one is absent, damaged or does not
    fit the model.
    """
    from fedcore.models import ModelError, build_model, is_registered_model

    tensors, meta = read_model(run_dir, cluster)
    _, sidecar = model_paths(run_dir, cluster)
    if model is None:
        name = meta["model"]
        if not is_registered_model(name):
            raise ModelFileError(f"{sidecar}: model {name!r} is not a registered model; fedguard never imports a "
                                 "factory a file names: build it yourself and pass it as load_model(..., model=...)")
        try:  # first without memory (the meta device): the sidecar's options must give the weights' tensors
            with torch.device("meta"):
                shapes = build_model(name, meta["model_kwargs"], seed=0)
        except (ModelError, TypeError, ValueError, RuntimeError, OverflowError) as e:
            raise ModelFileError(f"{sidecar}: cannot build model {name!r} with {meta['model_kwargs']} ({e})") from None
        if _fingerprint(shapes.state_dict()) != _fingerprint(tensors):
            raise ModelFileError(f"{sidecar}: model {name!r} with {meta['model_kwargs']} does not have the tensors of "
                                 f"{Path(run_dir) / MODEL_FILE if cluster is None else cluster} (not built)")
        try:
            model = build_model(name, meta["model_kwargs"], seed=0)
        except (ModelError, TypeError, ValueError, RuntimeError) as e:
            raise ModelFileError(f"{sidecar}: cannot build model {name!r} with {meta['model_kwargs']} ({e})") from None
    try:
        model.load_state_dict(tensors, strict=True)
    except RuntimeError as e:
        raise ModelFileError(f"{Path(run_dir)}: the weights do not fit the model: {e}") from None
    return model.eval()
