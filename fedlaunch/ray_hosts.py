"""The launcher's Ray backend: client hosts as Ray actors spread over a Ray cluster (``fedguard-launch --ray``).

The server stays a standalone ``fedserver`` process on the launching machine. Each client host is an actor
(:class:`ClientHost`) that runs :func:`fedlaunch.hosts.host_clients` on a :class:`fedlaunch.hosts.HostSpec`: many
virtual clients, each a real gRPC client with its own channel to the server. Ray places the actors by the
resources each asks for (``--ray-cpus``, ``--ray-gpus``, ``--ray-resources``); the certificates a host needs
travel inside its spec, so hosts on other machines need only fedguard installed (``pip install fedguard[ray]``),
not the launcher's files. Ray is an optional dependency, imported only here.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from typing import Any

from fedlaunch.hosts import HostSpec, host_clients


class ClientHost:
    """A Ray actor hosting one :class:`HostSpec`'s virtual clients."""

    def run(self, spec: HostSpec) -> int:
        return host_clients(spec)


class RayHost:
    """A running :class:`ClientHost`, seen by the launcher like a worker process (:class:`fedlaunch.supervise.Host`)."""

    def __init__(self, actor: Any, ref: Any) -> None:
        self.actor, self.ref = actor, ref

    def wait(self, timeout: float | None = None) -> int:
        import ray

        ready, _ = ray.wait([self.ref], timeout=timeout)
        if not ready:
            raise subprocess.TimeoutExpired("ray actor ClientHost", timeout or 0.0)
        try:
            return int(ray.get(self.ref))
        except ray.exceptions.RayError:
            return 1

    def poll(self) -> int | None:
        """The host's exit status once it returned (1 when the actor died), None while it runs."""
        try:
            return self.wait(0)
        except subprocess.TimeoutExpired:
            return None

    def terminate(self) -> None:
        import ray

        ray.kill(self.actor)

    def kill(self) -> None:
        self.terminate()


def connect(address: str) -> None:
    """``auto``: the Ray cluster this machine belongs to (``RAY_ADDRESS`` or one started with ``ray start``), else a
    local instance; anything else is a cluster address (``HOST:6379`` or ``ray://HOST:10001``)."""
    import ray

    if ray.is_initialized():
        return
    ray.init(address=None if address == "auto" else address, include_dashboard=False, log_to_driver=False,
             configure_logging=False)


def node_address() -> str:
    """This node's address as the other nodes of the Ray cluster see it."""
    import ray

    return str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]


def missing_resources(args: argparse.Namespace, hosts: int) -> str | None:
    """Why ``hosts`` actors with the requested resources can never all run at once on this Ray cluster (they
    would wait for each other's resources for ever: the federation needs every host), or None when they fit."""
    import ray

    total = ray.cluster_resources()  # type: ignore[no-untyped-call]
    wanted: dict[str, float] = {"CPU": args.ray_cpus, "GPU": args.ray_gpus}
    if args.ray_resources:
        wanted.update({str(k): float(v) for k, v in json.loads(args.ray_resources).items()})
    for name, each in wanted.items():
        if each > 0 and hosts * each > total.get(name, 0.0) + 1e-9:
            return (f"{hosts} client hosts x {each:g} {name} = {hosts * each:g} {name}, but the Ray cluster has "
                    f"{total.get(name, 0.0):g}: every host must run at once; lower --procs or the per-host "
                    f"request (--ray-cpus, --ray-gpus, --ray-resources), or add nodes")
    return None


def start_ray_hosts(args: argparse.Namespace, specs: list[HostSpec]) -> list[RayHost]:
    """One :class:`ClientHost` actor per spec with ``--ray-cpus``/``--ray-gpus``/``--ray-resources`` each."""
    import ray

    connect(args.ray)
    options: dict[str, Any] = {"num_cpus": args.ray_cpus, "num_gpus": args.ray_gpus}
    if args.ray_resources:
        options["resources"] = json.loads(args.ray_resources)
    actor_cls: Any = ray.remote(ClientHost)
    hosts = []
    for spec in specs:
        actor = actor_cls.options(**options).remote()
        hosts.append(RayHost(actor, actor.run.remote(spec)))
    return hosts
