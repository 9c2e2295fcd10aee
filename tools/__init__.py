"""fedguard's tools, in rooms: ``bench/`` (benchmarks), ``experiments/`` (experiment drivers), ``dev/`` (developer
scripts: protos, golden, seams metrics, figures) and ``prototypes/``. Helpers shared between rooms live here:
:mod:`tools.runs` (run directories and launching), :mod:`tools.procstat` (process CPU and memory) and
:mod:`tools.import_graph` (the import walker). The shell entry points (``setup.sh``, ``test.sh``, ``demo.sh``,
``bench_install.sh``, ``flower_env.sh``) stay at the top. No tool imports ``tests``."""
