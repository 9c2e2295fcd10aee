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

from fedcore.distfl.clusters import (
    ClusterAssigned,
    ClusterEvent,
    ClusterFormed,
    ClusterInfo,
    ClusterObservation,
    ClusterState,
    StoredResponse,
    cluster_members,
    cluster_of,
    clustering_due,
    step,
)
from fedcore.distfl.config import THRESHOLDS, DistflConfig, validate_distfl_config
from fedcore.distfl.extraction import (
    Extraction,
    bn_layers,
    bn_statistics_loss,
    check_has_batchnorm,
    extract_inputs,
    select_channels,
    synthesize,
)
from fedcore.distfl.similarity import (
    GUARD_MIN_GROUP,
    GUARD_SILHOUETTE,
    KL_EPS,
    adjusted_rand_index,
    choose_threshold,
    flatten_response,
    gap_threshold,
    guarded_cut,
    guarded_threshold,
    kl_matrix,
    link_components,
    mean_silhouette,
    responses,
    silhouette_threshold,
    single_link_merges,
)

__all__ = [
    "GUARD_MIN_GROUP",
    "GUARD_SILHOUETTE",
    "KL_EPS",
    "THRESHOLDS",
    "ClusterAssigned",
    "ClusterEvent",
    "ClusterFormed",
    "ClusterInfo",
    "ClusterObservation",
    "ClusterState",
    "DistflConfig",
    "Extraction",
    "StoredResponse",
    "adjusted_rand_index",
    "bn_layers",
    "bn_statistics_loss",
    "check_has_batchnorm",
    "choose_threshold",
    "cluster_members",
    "cluster_of",
    "clustering_due",
    "extract_inputs",
    "flatten_response",
    "gap_threshold",
    "guarded_cut",
    "guarded_threshold",
    "kl_matrix",
    "link_components",
    "mean_silhouette",
    "responses",
    "select_channels",
    "silhouette_threshold",
    "single_link_merges",
    "step",
    "synthesize",
    "validate_distfl_config",
]
