"""Models: the registry of names (:mod:`.registry`, torch-free), building and loading (:mod:`.build`), the zoo
(:mod:`.zoo`). A model is built by name, or from a user factory given as "pkg.mod:factory"."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedcore.lazy import exported_names, lazy_exports

if TYPE_CHECKING:
    from fedcore.models.build import (
        build_model as build_model,
    )
    from fedcore.models.build import (
        load_weights as load_weights,
    )
    from fedcore.models.build import (
        logreg as logreg,
    )
    from fedcore.models.build import (
        mlp as mlp,
    )
    from fedcore.models.build import (
        model_fingerprint as model_fingerprint,
    )
    from fedcore.models.build import (
        model_manifest as model_manifest,
    )
    from fedcore.models.build import (
        resolve_factory as resolve_factory,
    )
    from fedcore.models.registry import (
        MODELS as MODELS,
    )
    from fedcore.models.registry import (
        InputShape as InputShape,
    )
    from fedcore.models.registry import (
        ModelError as ModelError,
    )
    from fedcore.models.registry import (
        ModelFactory as ModelFactory,
    )
    from fedcore.models.registry import (
        ModelInput as ModelInput,
    )
    from fedcore.models.registry import (
        available_models as available_models,
    )
    from fedcore.models.registry import (
        check_model_kwargs as check_model_kwargs,
    )
    from fedcore.models.registry import (
        is_registered_model as is_registered_model,
    )
    from fedcore.models.registry import (
        model_input as model_input,
    )
    from fedcore.models.registry import (
        register_model as register_model,
    )

# What each submodule gives the package, imported on first use (fedcore.lazy): importing one submodule
# loads no other.
_EXPORTS = {
    "fedcore.models.build": (
        "build_model", "load_weights", "logreg", "mlp", "model_fingerprint", "model_manifest", "resolve_factory"
    ),
    "fedcore.models.registry": (
        "MODELS", "InputShape", "ModelError", "ModelFactory", "ModelInput", "available_models", "check_model_kwargs",
        "is_registered_model", "model_input", "register_model"
    ),
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = exported_names(_EXPORTS)
