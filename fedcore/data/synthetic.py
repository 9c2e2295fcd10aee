"""FedProx's Synthetic(alpha, beta) federated classification task, generated per client (offline default).

Per client k (Li et al., "Federated Optimization in Heterogeneous Networks", §5.1):
u_k ~ N(0, alpha), W_k ~ N(u_k, 1), b_k ~ N(u_k, 1); B_k ~ N(0, beta), v_k ~ N(B_k, 1);
x ~ N(v_k, Sigma) with Sigma diagonal, Sigma_jj = j^-1.2; y = argmax(W_k x + b_k).
``iid=True`` shares one (W, b) and draws every client's x from N(0, Sigma) (FedProx's Synthetic-IID).
alpha controls how much local models differ, beta how much local features differ. Client sizes are
log-normal (FedProx draws lognormal(4, 2) + 50); ``max_samples`` bounds the tail.

In FedProx's task the clients' labelling functions are independent: u_k shifts every entry of W_k and b_k alike,
which adds the same u_k (1'x + 1) to every class's score and leaves the argmax unchanged, so a federation has no
concept to share, only clients to tell apart. ``shared`` = s in [0, 1] gives them one: (W_k, b_k) =
sqrt(s) (W, b) + sqrt(1 - s) (W_k', b_k'), with (W, b) ~ N(0, 1) drawn once per seed and (W_k', b_k') the
per-client draws above (the entries keep unit variance around their mean). s = 0 is FedProx's task, bit for bit;
s = 1 is one concept under the per-client feature shift (covariate shift only; with ``iid``'s (W, b)).

With the feature shift (v_k, on by default) each client's x sits in a region of its own, so clients never
disagree on the same x and a large enough global model can learn every client's concept at once.
``feature_shift=False`` draws every client's x from N(0, Sigma), as the IID task does (v_k is still drawn, so the
other draws do not move): with ``shared`` < 1 the clients then label the same inputs differently (concept shift
only), which no single model can fit -- the setting personalization is for (the demo's task).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from fedcore.data.base import ClientData, DataError, SampleShape, register_dataset, size_option
from fedcore.data.loaders import split_train_test


def synthetic_sample(options: Mapping[str, Any]) -> SampleShape:
    """``num_features`` float32 features, ``num_classes`` classes."""
    return SampleShape((size_option(options["num_features"]),), "float32", size_option(options["num_classes"]))


@register_dataset("synthetic", remote_options=(
    "alpha", "beta", "iid", "num_features", "num_classes", "mean_log_size", "sigma_log_size", "min_samples",
    "max_samples", "test_fraction", "shared", "feature_shift"), sample=synthetic_sample)
def synthetic_shard(client_index: int, seed: int, alpha: float = 0.5, beta: float = 0.5, iid: bool = False,
                    num_features: int = 60, num_classes: int = 10, mean_log_size: float = 4.0,
                    sigma_log_size: float = 1.0, min_samples: int = 50, max_samples: int = 1000,
                    test_fraction: float = 0.1, shared: float = 0.0,
                    feature_shift: bool = True) -> ClientData:
    if alpha < 0 or beta < 0:
        raise DataError(f"synthetic: alpha and beta must be >= 0, got alpha={alpha}, beta={beta}")
    if num_features < 1 or num_classes < 2:
        raise DataError("synthetic: need num_features >= 1 and num_classes >= 2")
    if not 0 < min_samples <= max_samples:
        raise DataError(f"synthetic: need 0 < min_samples <= max_samples, got {min_samples}, {max_samples}")
    if not 0.0 <= test_fraction < 1.0:
        raise DataError(f"synthetic: test_fraction must be in [0, 1), got {test_fraction}")
    if not 0.0 <= shared <= 1.0:  # also refuses NaN
        raise DataError(f"synthetic: shared must be in [0, 1], got {shared}")
    rng = np.random.default_rng([seed, client_index, 0x5EED])
    common = np.random.default_rng([seed, 0x5A5A])  # draws every client makes alike
    size = int(np.clip(rng.lognormal(mean_log_size, sigma_log_size) + min_samples, min_samples, max_samples))
    diag = np.arange(1, num_features + 1, dtype=np.float64) ** -1.2
    if iid:
        w = common.normal(0.0, 1.0, (num_classes, num_features))
        b = common.normal(0.0, 1.0, num_classes)
        v = np.zeros(num_features)
    else:
        u = rng.normal(0.0, np.sqrt(alpha)) if alpha > 0 else 0.0
        w = rng.normal(u, 1.0, (num_classes, num_features))
        b = rng.normal(u, 1.0, num_classes)
        big_b = rng.normal(0.0, np.sqrt(beta)) if beta > 0 else 0.0
        v = rng.normal(big_b, 1.0, num_features)
        if not feature_shift:  # drawn all the same, so the labels' draws do not move
            v = np.zeros(num_features)
        if shared > 0:  # the common concept: from the seed's generator, so every client draws the same (W, b)
            w_common = common.normal(0.0, 1.0, (num_classes, num_features))
            b_common = common.normal(0.0, 1.0, num_classes)
            w = np.sqrt(shared) * w_common + np.sqrt(1.0 - shared) * w
            b = np.sqrt(shared) * b_common + np.sqrt(1.0 - shared) * b
    x = rng.normal(v, np.sqrt(diag), (size, num_features))
    y = np.argmax(x @ w.T + b, axis=1)
    g = torch.Generator().manual_seed(int(rng.integers(0, 2**62)))
    return split_train_test(torch.from_numpy(x.astype(np.float32)), torch.from_numpy(y.astype(np.int64)),
                            num_classes, test_fraction, g)
