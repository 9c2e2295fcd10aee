"""The server's models, keyed by a model id: ``"global"`` today, one per cluster later (DistFL).

Every model shares the federation's manifest (names, dtypes, shapes). Aggregation works on the flattened
floating-point parameters; :meth:`GlobalModels.flat` and :meth:`GlobalModels.apply_flat` convert between the
state dict and that ``[P]`` float32 vector.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from fedcore.serialization import ReceivedTensors, TensorMeta, fingerprint, manifest_of

GLOBAL = "global"


class GlobalModels:
    def __init__(self, initial: Mapping[str, torch.Tensor]) -> None:
        state = {k: v.detach().to("cpu").clone() for k, v in initial.items()}
        self.manifest: list[TensorMeta] = manifest_of(state)
        self.fingerprint = fingerprint(self.manifest)
        self.float_names = [k for k, v in state.items() if v.is_floating_point()]
        self._float_names = tuple(self.float_names)
        self._float_set = frozenset(self.float_names)
        self.num_params = sum(state[k].numel() for k in self.float_names)
        self._models: dict[str, dict[str, torch.Tensor]] = {GLOBAL: state}
        # Each model's floating-point tensors as one [P] float32 vector, kept while the model's state dict is the
        # same object (put/apply_flat replace it): an update's u_i = w_i - w is then one subtraction.
        self._flat_of: dict[str, tuple[dict[str, torch.Tensor], torch.Tensor]] = {}

    @classmethod
    def of(cls, model: nn.Module) -> GlobalModels:
        return cls(model.state_dict())

    def ids(self) -> list[str]:
        return sorted(self._models)

    def get(self, model_id: str = GLOBAL) -> dict[str, torch.Tensor]:
        return self._models[model_id]

    def all(self) -> dict[str, dict[str, torch.Tensor]]:
        return dict(self._models)

    def put(self, model_id: str, state: Mapping[str, torch.Tensor]) -> None:
        """Set model ``model_id`` (a restored snapshot's, a new cluster's); the manifest must match."""
        got = manifest_of(state)
        if got != self.manifest:
            raise ValueError(f"model {model_id!r} does not have the federation's manifest (fingerprint "
                             f"{fingerprint(got)}, expected {self.fingerprint})")
        self._models[model_id] = dict(state)

    def drop(self, model_id: str) -> None:
        """Forget model ``model_id`` (a DistFL cluster no client belongs to any more); the global model stays."""
        if model_id == GLOBAL:
            raise ValueError("the global model cannot be dropped")
        self._models.pop(model_id, None)
        self._flat_of.pop(model_id, None)

    def flat(self, model_id: str = GLOBAL) -> torch.Tensor:
        state = self._models[model_id]
        parts = [state[k].reshape(-1).to(torch.float32) for k in self.float_names]
        return torch.cat(parts) if parts else torch.zeros(0)

    def flatten_update(self, tensors: Mapping[str, torch.Tensor], is_delta: bool,
                       model_id: str = GLOBAL, consume: bool = False) -> torch.Tensor:
        """A client's upload as the ``[P]`` float32 update u_i (weights minus the model it was handed).

        ``consume``: the caller gives ``tensors`` up (the server's received upload). When they were received into
        one buffer (:class:`fedcore.serialization.ReceivedTensors`, a :class:`~fedcore.serialization.Reassembler`
        with ``one_buffer``) and their floating-point tensors are float32 back to back in the model's order (a
        model of float32 tensors), u_i is computed in that buffer, which is returned: no second ``[P]`` vector is
        allocated, no per-tensor view is made, and the result is bit-identical to the copying path (the same
        float32 subtraction per element)."""
        base = self._models[model_id]
        run = (tensors.float32_run(self._float_names) if consume and isinstance(tensors, ReceivedTensors)
               else None)
        if run is not None:
            if not is_delta:
                run.sub_(self._base_flat(model_id))  # the same float32 subtraction per element, in one call
            return run
        # Written in place into one [P] vector: each received float32 tensor is read once (no per-tensor
        # difference and no concatenation copy).
        flat = torch.empty(self.num_params, dtype=torch.float32)
        offset = 0
        for name in self.float_names:
            t = tensors[name].reshape(-1).to(torch.float32)
            out = flat[offset : offset + t.numel()]
            if is_delta:
                out.copy_(t)
            else:
                torch.sub(t, base[name].reshape(-1).to(torch.float32), out=out)
            offset += t.numel()
        return flat

    def _base_flat(self, model_id: str) -> torch.Tensor:
        """:meth:`flat` of ``model_id``, worked out once per version of the model."""
        state = self._models[model_id]
        got = self._flat_of.get(model_id)
        if got is None or got[0] is not state:
            got = state, self.flat(model_id)
            self._flat_of[model_id] = got
        return got[1]

    def state_from_flat(self, flat: torch.Tensor, model_id: str = GLOBAL) -> dict[str, torch.Tensor]:
        """A state dict with ``flat`` as its floating-point tensors and model ``model_id``'s other tensors (e.g.
        BatchNorm's ``num_batches_tracked``)."""
        old = self._models[model_id]
        new = dict(old)
        offset = 0
        for name in self.float_names:
            t = old[name]
            n = t.numel()
            new[name] = flat[offset : offset + n].reshape(t.shape).to(t.dtype)
            offset += n
        return new

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """A ``[P]`` vector as the floating-point tensors by name, in the manifest's shapes: views of ``flat``
        (its dtype, no copy)."""
        out: dict[str, torch.Tensor] = {}
        offset = 0
        for meta in self.manifest:
            if meta.name not in self._float_set:
                continue
            n = meta.numel
            out[meta.name] = flat[offset : offset + n].view(tuple(meta.shape))
            offset += n
        return out

    def flatten(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """:meth:`unflatten`'s inverse: the floating-point tensors by name as one ``[P]`` float32 vector."""
        parts = [tensors[k].reshape(-1).to(torch.float32) for k in self.float_names]
        return torch.cat(parts) if parts else torch.zeros(0)

    def apply_flat(self, flat: torch.Tensor, model_id: str = GLOBAL) -> None:
        """Replace model ``model_id``'s floating-point tensors with ``flat`` (the others stay)."""
        self._models[model_id] = self.state_from_flat(flat, model_id)
