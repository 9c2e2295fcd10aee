"""DistFL (Liu et al., IMWUT 2021): distribution-aware clustering of client models -- the functional core.

No gRPC and no server code here; the server shell pre-aggregates, times, and aggregates inside clusters. Paper
sections (and SPEC §8) to functions:

- §4.2 Distribution extraction, Eq. 2/4 (BN-statistics matching on the top-E% channels by |γ|, §4.2.2):
  :func:`synthesize` / :func:`extract_inputs` (:mod:`fedcore.distfl.extraction`), with :func:`bn_layers`,
  :func:`select_channels`, :func:`bn_statistics_loss`; :func:`check_has_batchnorm` refuses a model without
  BatchNorm (§3.2.1, §6). The pre-aggregated target model (§4.2.1 Eq. 3) is the shell's FedAvg.
- §4.3 Distribution-based clustering: Eq. 5 :func:`responses` (softmax on the synthetic inputs), Eq. 6
  :func:`kl_matrix` (KL of the normalised concatenated responses = mean per-input KL), the threshold partition
  :func:`link_components` (:mod:`fedcore.distfl.similarity`); beyond the paper, an automatic τ
  (``DistflConfig.threshold``: :func:`choose_threshold`, :func:`gap_threshold`, :func:`silhouette_threshold`,
  :func:`guarded_threshold` on the single-linkage merge heights :func:`single_link_merges`).
- §5.8.1-style evaluation of a clustering against ground-truth distribution types: :func:`adjusted_rand_index`.
- §4.4 Aggregation (Eq. 7, FedAvg inside each cluster) runs in the shell, on the membership kept by the
  cross-device state machine of SPEC §8 ("our design"): ``state, events = step(state, observation, config)``
  in :mod:`fedcore.distfl.clusters` (warm-up, periodic re-clustering, nearest-cluster assignment of newcomers,
  stable cluster ids).
- Configuration: :class:`DistflConfig` (the ``[distfl]`` section, :mod:`fedcore.distfl.config`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedcore.lazy import exported_names, lazy_exports

if TYPE_CHECKING:
    from fedcore.distfl.clusters import (
        ClusterAssigned as ClusterAssigned,
    )
    from fedcore.distfl.clusters import (
        ClusterEvent as ClusterEvent,
    )
    from fedcore.distfl.clusters import (
        ClusterFormed as ClusterFormed,
    )
    from fedcore.distfl.clusters import (
        ClusterInfo as ClusterInfo,
    )
    from fedcore.distfl.clusters import (
        ClusterObservation as ClusterObservation,
    )
    from fedcore.distfl.clusters import (
        ClusterState as ClusterState,
    )
    from fedcore.distfl.clusters import (
        StoredResponse as StoredResponse,
    )
    from fedcore.distfl.clusters import (
        cluster_members as cluster_members,
    )
    from fedcore.distfl.clusters import (
        cluster_of as cluster_of,
    )
    from fedcore.distfl.clusters import (
        clustering_due as clustering_due,
    )
    from fedcore.distfl.clusters import (
        step as step,
    )
    from fedcore.distfl.config import (
        THRESHOLDS as THRESHOLDS,
    )
    from fedcore.distfl.config import (
        DistflConfig as DistflConfig,
    )
    from fedcore.distfl.config import (
        validate_distfl_config as validate_distfl_config,
    )
    from fedcore.distfl.extraction import (
        Extraction as Extraction,
    )
    from fedcore.distfl.extraction import (
        bn_layers as bn_layers,
    )
    from fedcore.distfl.extraction import (
        bn_statistics_loss as bn_statistics_loss,
    )
    from fedcore.distfl.extraction import (
        check_has_batchnorm as check_has_batchnorm,
    )
    from fedcore.distfl.extraction import (
        extract_inputs as extract_inputs,
    )
    from fedcore.distfl.extraction import (
        select_channels as select_channels,
    )
    from fedcore.distfl.extraction import (
        synthesize as synthesize,
    )
    from fedcore.distfl.similarity import (
        GUARD_MIN_GROUP as GUARD_MIN_GROUP,
    )
    from fedcore.distfl.similarity import (
        GUARD_SILHOUETTE as GUARD_SILHOUETTE,
    )
    from fedcore.distfl.similarity import (
        KL_EPS as KL_EPS,
    )
    from fedcore.distfl.similarity import (
        adjusted_rand_index as adjusted_rand_index,
    )
    from fedcore.distfl.similarity import (
        choose_threshold as choose_threshold,
    )
    from fedcore.distfl.similarity import (
        flatten_response as flatten_response,
    )
    from fedcore.distfl.similarity import (
        gap_threshold as gap_threshold,
    )
    from fedcore.distfl.similarity import (
        guarded_cut as guarded_cut,
    )
    from fedcore.distfl.similarity import (
        guarded_threshold as guarded_threshold,
    )
    from fedcore.distfl.similarity import (
        kl_matrix as kl_matrix,
    )
    from fedcore.distfl.similarity import (
        link_components as link_components,
    )
    from fedcore.distfl.similarity import (
        mean_silhouette as mean_silhouette,
    )
    from fedcore.distfl.similarity import (
        responses as responses,
    )
    from fedcore.distfl.similarity import (
        silhouette_threshold as silhouette_threshold,
    )
    from fedcore.distfl.similarity import (
        single_link_merges as single_link_merges,
    )

# What each submodule gives the package, imported on first use (fedcore.lazy): importing one submodule
# loads no other.
_EXPORTS = {
    "fedcore.distfl.clusters": (
        "ClusterAssigned", "ClusterEvent", "ClusterFormed", "ClusterInfo", "ClusterObservation", "ClusterState",
        "StoredResponse", "cluster_members", "cluster_of", "clustering_due", "step"
    ),
    "fedcore.distfl.config": ("DistflConfig", "THRESHOLDS", "validate_distfl_config"),
    "fedcore.distfl.extraction": (
        "Extraction", "bn_layers", "bn_statistics_loss", "check_has_batchnorm", "extract_inputs", "select_channels",
        "synthesize"
    ),
    "fedcore.distfl.similarity": (
        "GUARD_MIN_GROUP", "GUARD_SILHOUETTE", "KL_EPS", "adjusted_rand_index", "choose_threshold",
        "flatten_response", "gap_threshold", "guarded_cut", "guarded_threshold", "kl_matrix", "link_components",
        "mean_silhouette", "responses", "silhouette_threshold", "single_link_merges"
    ),
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = exported_names(_EXPORTS)
