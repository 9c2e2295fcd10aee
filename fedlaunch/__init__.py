"""fedlaunch: the operator's tools above both shells (``fedserver`` and ``fedclient``); ``fedguard`` below them keeps
only the wire contract, signing and certificates.

The launcher, ``fedguard-launch`` (``python -m fedlaunch``), in the order a launch runs:
:mod:`~fedlaunch.options` (the command line, experiment files, ``--resume``), :mod:`~fedlaunch.plan` (the
federation decided and checked before anything starts), :mod:`~fedlaunch.credentials` (throw-away CA, TLS flags,
operator token), :mod:`~fedlaunch.supervise` (server and client-host processes, graceful stop),
:mod:`~fedlaunch.hosts` (virtual clients in one process) and :mod:`~fedlaunch.ray_hosts` (hosts as Ray actors),
:mod:`~fedlaunch.follow` (the server's ``GetStatus`` since the last round seen), :mod:`~fedlaunch.progress` (the
round table, ETA) and :mod:`~fedlaunch.logs` (what the children's logs say); :mod:`~fedlaunch.cli` ties them.

The run tools live here too, because they sit where the launcher does: above the server (``fedguard-status``,
:mod:`~fedlaunch.status`, is a ``GetStatus`` client and prints the launcher's table) and above the run directory
the server writes (``fedguard-export`` and ``fedguard-plot``, :mod:`~fedlaunch.export` and :mod:`~fedlaunch.plot`,
read ``rounds.jsonl``); none of them is part of the wire contract.

Importing the package imports nothing else (``--help`` stays fast: no torch, no gRPC until they are needed).
"""
