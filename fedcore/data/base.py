"""Client data containers and the dataset registry, torch-free.

The built-in datasets are declared here by name (known without importing them: ``--help``, configuration checks);
the module that registers one (:func:`register_dataset`) is imported when the dataset is first looked up.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

from fedcore.registry import Registry

if TYPE_CHECKING:
    import torch


class DataError(ValueError):
    """Unknown dataset, bad options, or data that does not fit the model."""


@dataclass
class ClientData:
    """One client's local data, already split into train and test with the same distribution."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int

    def __post_init__(self) -> None:
        if len(self.x_train) != len(self.y_train) or len(self.x_test) != len(self.y_test):
            raise DataError("features and labels differ in length")
        if len(self.x_train) == 0:
            raise DataError("a client needs at least one training sample")

    @property
    def num_train(self) -> int:
        return len(self.y_train)


@dataclass(frozen=True)
class SampleShape:
    """What one sample of a dataset is, declared without loading any: ``shape`` (no batch dimension), ``dtype``
    (``"float32"`` or ``"int64"``, as torch names them without ``torch.``) and ``num_classes`` (None: only the data
    tells, e.g. a folder of images)."""

    shape: tuple[int, ...]
    dtype: str = "float32"
    num_classes: int | None = None


# A dataset's declared sample: one shape for every option, or a function of its options (given with the loader's
# defaults filled in) that returns the shape, or None where only the data tells (a user's own files).
SampleDeclaration: TypeAlias = SampleShape | Callable[[Mapping[str, Any]], SampleShape | None]


def size_option(value: Any) -> int:
    """An option that sets a size (``num_features``, ``seq_len``) as an int >= 1; ValueError otherwise (a
    declaration that cannot read its options declares nothing: the loader's own check names the option)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"not a size: {value!r}")
    return value


ShardLoader = Callable[..., ClientData]
DATASETS: Registry[ShardLoader] = Registry("dataset", DataError)
DATASETS.declare("synthetic", "fedcore.data.synthetic", summary="seeded synthetic clients (built in, no files)")
DATASETS.declare("mnist", "fedcore.data.mnist", summary="MNIST digits (28x28 grey)")
DATASETS.declare("cifar10", "fedcore.data.cifar10", summary="CIFAR-10 images (32x32 colour, 10 classes)")
DATASETS.declare("har", "fedcore.data.har", summary="UCI HAR activity windows (9 channels x 128 steps)")
DATASETS.declare("shakespeare", "fedcore.data.shakespeare", summary="LEAF Shakespeare characters, one client per role")
DATASETS.declare("npz", "fedcore.data.files", summary="your own arrays in a .npz file")
DATASETS.declare("imagefolder", "fedcore.data.files", summary="your own images, one folder per class")
# Per dataset, the options a remote party (the server's announcement) may set: never a path, a download or a
# file format; the client's own configuration sets those.
_REMOTE_OPTIONS: dict[str, frozenset[str]] = {}
OptionsCheck = Callable[[Mapping[str, Any]], "int | None"]
_CHECKS: dict[str, OptionsCheck] = {}
# Per dataset, its declared sample and the defaults of its options (the keyword defaults of the function that
# takes them), so that :func:`sample_shape` reads the options as the loader will.
_SAMPLES: dict[str, tuple[SampleDeclaration, dict[str, Any]]] = {}


def keyword_defaults(function: Callable[..., Any]) -> dict[str, Any]:
    """The keyword parameters of ``function`` that have a default, with it."""
    try:
        params = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return {}
    return {n: p.default for n, p in params.items() if p.default is not inspect.Parameter.empty
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def declare_sample(name: str, sample: SampleDeclaration, defaults: Mapping[str, Any] | None = None) -> None:
    """Declare what one sample of dataset ``name`` is (see :func:`sample_shape`); ``defaults``: its options'
    defaults, handed to a declaration that is a function."""
    _SAMPLES[name] = (sample, dict(defaults or {}))


def register_dataset(name: str, remote_options: Collection[str] = (),
                     check: OptionsCheck | None = None,
                     sample: SampleDeclaration | None = None) -> Callable[[ShardLoader], ShardLoader]:
    """Register a shard loader; ``remote_options`` are the options a server may announce for it.

    ``check(options)`` validates options without loading data and returns the number of clients the data will
    have when the options fix it (see :func:`check_dataset`); without one, the loader's keyword parameters are
    its options and the number of clients is open. ``sample`` declares what one sample is (:func:`sample_shape`;
    a function is given the options with the loader's keyword defaults filled in).
    """

    def deco(loader: ShardLoader) -> ShardLoader:
        DATASETS.add(name, loader)
        _REMOTE_OPTIONS[name] = frozenset(remote_options)
        if check is not None:
            _CHECKS[name] = check
        if sample is not None:
            declare_sample(name, sample, keyword_defaults(loader))
        else:
            _SAMPLES.pop(name, None)
        return loader

    return deco


def check_dataset(dataset: str, options: Mapping[str, Any] | None = None) -> int | None:
    """Check a dataset name and its options before any data is loaded (a server checks them before it listens).

    Raises :class:`DataError` for an unknown dataset or an option it does not take; returns the number of client
    shards the data will have when the options fix it, None when it is open (seeded synthetic clients) or known
    only once the data is read (natural partitions).
    """
    loader = DATASETS.get(dataset)
    opts = dict(options or {})
    check = _CHECKS.get(dataset)
    if check is not None:
        return check(opts)
    params = inspect.signature(loader).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        known = sorted(set(params) - {"client_index", "seed"})
        unknown = sorted(set(opts) - set(known))
        if unknown:
            raise DataError(f"dataset {dataset!r}: unknown option {unknown[0]!r}; known: {', '.join(known)}")
    return None


def sample_shape(dataset: str, options: Mapping[str, Any] | None = None) -> SampleShape | None:
    """What one sample of ``dataset`` is under ``options``, from its declaration alone (no data is read); None for
    an unknown dataset, one that declares nothing, or options the declaration cannot read (the loader will say)."""
    if dataset not in DATASETS:
        return None
    DATASETS.get(dataset)  # a declared dataset registers its sample when imported
    entry = _SAMPLES.get(dataset)
    if entry is None:
        return None
    declared, defaults = entry
    if isinstance(declared, SampleShape):
        return declared
    try:
        found = declared({**defaults, **dict(options or {})})
    except (TypeError, ValueError, KeyError):
        return None
    return found if isinstance(found, SampleShape) else None


def remote_options(dataset: str) -> frozenset[str]:
    """The options of ``dataset`` a server may announce (:class:`DataError` for an unknown dataset)."""
    DATASETS.get(dataset)
    return _REMOTE_OPTIONS.get(dataset, frozenset())


def available_datasets() -> list[str]:
    return DATASETS.names()


def load_client_data(dataset: str, client_index: int, seed: int,
                     options: Mapping[str, Any] | None = None) -> ClientData:
    """The shard of client ``client_index``: deterministic in (dataset, options, seed, index)."""
    loader = DATASETS.get(dataset)
    if client_index < 0:
        raise DataError(f"client index must be >= 0, got {client_index}")
    try:
        return loader(client_index=client_index, seed=seed, **dict(options or {}))
    except TypeError as e:
        raise DataError(f"dataset {dataset!r} rejected its options {dict(options or {})}: {e}") from None


def dataset_summaries() -> dict[str, str]:
    """Each dataset's one line, by name (no dataset is imported)."""
    return DATASETS.summaries()
