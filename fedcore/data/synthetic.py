"""FedProx's Synthetic(alpha, beta) federated classification task, generated per client (offline default).

Per client k (Li et al., "Federated Optimization in Heterogeneous Networks", §5.1):
u_k ~ N(0, alpha), W_k ~ N(u_k, 1), b_k ~ N(u_k, 1); B_k ~ N(0, beta), v_k ~ N(B_k, 1);
x ~ N(v_k, Sigma) with Sigma diagonal, Sigma_jj = j^-1.2; y = argmax(W_k x + b_k).
``iid=True`` shares one (W, b) and draws every client's x from N(0, Sigma) (FedProx's Synthetic-IID).
alpha controls how much local models differ, beta how much local features differ. Client sizes are
log-normal (FedProx draws lognormal(4, 2) + 50); ``max_samples`` bounds the tail.
"""

from __future__ import annotations

import numpy as np
import torch

from fedcore.data.base import ClientData, DataError, register_dataset, split_train_test


@register_dataset("synthetic", remote_options=(
    "alpha", "beta", "iid", "num_features", "num_classes", "mean_log_size", "sigma_log_size", "min_samples",
    "max_samples", "test_fraction"))
def synthetic_shard(client_index: int, seed: int, alpha: float = 0.5, beta: float = 0.5, iid: bool = False,
                    num_features: int = 60, num_classes: int = 10, mean_log_size: float = 4.0,
                    sigma_log_size: float = 1.0, min_samples: int = 50, max_samples: int = 1000,
                    test_fraction: float = 0.1) -> ClientData:
    if alpha < 0 or beta < 0:
        raise DataError(f"synthetic: alpha and beta must be >= 0, got alpha={alpha}, beta={beta}")
    if num_features < 1 or num_classes < 2:
        raise DataError("synthetic: need num_features >= 1 and num_classes >= 2")
    if not 0 < min_samples <= max_samples:
        raise DataError(f"synthetic: need 0 < min_samples <= max_samples, got {min_samples}, {max_samples}")
    if not 0.0 <= test_fraction < 1.0:
        raise DataError(f"synthetic: test_fraction must be in [0, 1), got {test_fraction}")
    rng = np.random.default_rng([seed, client_index, 0x5EED])
    shared = np.random.default_rng([seed, 0x5A5A])
    size = int(np.clip(rng.lognormal(mean_log_size, sigma_log_size) + min_samples, min_samples, max_samples))
    diag = np.arange(1, num_features + 1, dtype=np.float64) ** -1.2
    if iid:
        w = shared.normal(0.0, 1.0, (num_classes, num_features))
        b = shared.normal(0.0, 1.0, num_classes)
        v = np.zeros(num_features)
    else:
        u = rng.normal(0.0, np.sqrt(alpha)) if alpha > 0 else 0.0
        w = rng.normal(u, 1.0, (num_classes, num_features))
        b = rng.normal(u, 1.0, num_classes)
        big_b = rng.normal(0.0, np.sqrt(beta)) if beta > 0 else 0.0
        v = rng.normal(big_b, 1.0, num_features)
    x = rng.normal(v, np.sqrt(diag), (size, num_features))
    y = np.argmax(x @ w.T + b, axis=1)
    g = torch.Generator().manual_seed(int(rng.integers(0, 2**62)))
    return split_train_test(torch.from_numpy(x.astype(np.float32)), torch.from_numpy(y.astype(np.int64)),
                            num_classes, test_fraction, g)
