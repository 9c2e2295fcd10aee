"""Compressed updates (issue 52): the ``[compression]`` section, the codecs and the device's error feedback.

- :mod:`fedcore.compression.config`: :class:`CompressionConfig` and the kinds' registry (torch-free);
- :mod:`fedcore.compression.codecs`: :func:`encode` / :func:`roundtrip` on a float32 ``[P]`` update and the
  server's streaming :class:`Decoder`;
- :mod:`fedcore.compression.device`: :class:`DeviceCompressor`, the residual a device keeps (and persists) between
  rounds.

Only the config is imported here: reading a configuration loads no torch.
"""

from fedcore.compression.config import CODECS, FP16, INT8, NONE, TOPK, CompressionConfig, topk_count

__all__ = ["CODECS", "FP16", "INT8", "NONE", "TOPK", "CompressionConfig", "topk_count"]
