"""Developer scripts: protobuf generation (``gen_protos``), golden and seams metrics (``golden_seams``,
``seams_metrics``), the figures file behind the docs (``figures``) and ``plot``."""
