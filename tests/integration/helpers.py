from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import torch

from fedcore.config import ServerConfig, build_config
from fedcore.serialization import pack
from fedguard import wire
from fedguard.v1 import fedguard_pb2 as pb
from fedguard.v1 import fedguard_pb2_grpc as pb_grpc

# The operator credential of the test servers (GetStatus is operator-only): a token file beside the run dir.
OPERATOR_TOKEN = "operator-token-of-the-tests"
OPERATOR_MD = (("fg-operator", OPERATOR_TOKEN),)


def server_config(tmp_path: Any, **sections: dict[str, Any]) -> ServerConfig:
    op = Path(tmp_path) / "operator.token"
    op.parent.mkdir(parents=True, exist_ok=True)
    op.write_text(OPERATOR_TOKEN + "\n")
    overrides: list[tuple[list[str], Any]] = [(["server", "address"], "127.0.0.1:0"),
                                              (["server", "run_dir"], str(tmp_path / "run")),
                                              (["security", "operator_token_file"], str(op))]
    if "security" not in sections:
        overrides.append((["security", "insecure"], True))
    for section, values in sections.items():
        for k, v in values.items():
            overrides.append(([section, k], v))
    return build_config(ServerConfig, None, overrides)


def stub(address: str) -> tuple[grpc.Channel, pb_grpc.FederationStub]:
    ch = grpc.insecure_channel(address)
    return ch, pb_grpc.FederationStub(ch)


def join_session(s: pb_grpc.FederationStub, name: str, token: str) -> str:
    """Join as ``name`` with the shared ``token``; the session id."""
    return str(s.Join(pb.JoinRequest(client_id=name, token=token), timeout=5).session_id)


def update_messages(session: str, round_: int, state: dict[str, torch.Tensor], num_samples: int = 10,
                    extra_bytes: bytes = b"", announce: int | None = None, chunk: int = 4096,
                    **header: Any) -> Iterator[pb.UpdateMessage]:
    manifest, payload = pack(state)
    data = bytes(payload) + extra_bytes
    yield pb.UpdateMessage(header=pb.UpdateHeader(
        session_id=session, round=round_, num_samples=num_samples, train_loss=header.pop("train_loss", 0.5),
        kind=pb.WEIGHTS, tensors=wire.metas_to_pb(manifest),
        total_bytes=len(payload) if announce is None else announce, **header))
    for off in range(0, len(data), chunk):
        yield pb.UpdateMessage(chunk=pb.Chunk(offset=off, data=data[off:off + chunk]))


def pull_model(s: pb_grpc.FederationStub, session: str, max_wait: float = 5.0) -> tuple[
    pb.TaskHeader | pb.Wait, dict[str, torch.Tensor] | None
]:
    from fedcore.serialization import Reassembler

    msgs = list(s.PullTask(pb.PullTaskRequest(session_id=session, max_wait_s=max_wait), timeout=max_wait + 10))
    if msgs[0].WhichOneof("kind") == "wait":
        return msgs[0].wait, None
    h = msgs[0].header
    asm = Reassembler(wire.metas_from_pb(h.tensors), h.total_bytes)
    for m in msgs[1:]:
        asm.feed(m.chunk.offset, m.chunk.data)
    return h, asm.finish()


def mark_ready(s: pb_grpc.FederationStub, sessions: Iterator[str] | list[str]) -> None:
    """A zero-wait poll per session: the server counts a client as available once it has asked for work."""
    for sid in sessions:
        list(s.PullTask(pb.PullTaskRequest(session_id=sid, max_wait_s=0.0), timeout=10))


def run_federation(config: ServerConfig, num_clients: int, timeout: float = 120.0, linger_s: float = 1.0,
                   model: Any = None, **client_options: Any) -> tuple[dict[str, Any] | None, list[Any]]:
    """Serve ``config`` in a thread with ``num_clients`` embedded FedClients (client-i on shard i) until the
    federation ends; returns the server's final status and the clients' summaries. ``model``: the clients' own
    model (a custom factory is the client's to name; an announcement only names built-in models)."""
    from fedclient import ClientConfig, FedClient
    from fedserver import ServerThread

    srv = ServerThread(config, linger_s=linger_s).start()
    clients = [FedClient(ClientConfig(insecure=True,
                                      server=srv.address, client_id=f"client-{i}", data_index=i, long_poll_s=5.0,
                                      **client_options), model=model).start()
               for i in range(num_clients)]
    status = srv.wait(timeout)
    return status, [c.join(30) for c in clients]


def stop_then_resume(config: ServerConfig, num_clients: int, after_rounds: int = 2, timeout: float = 120.0) -> Any:
    """Serve ``config`` with ``num_clients`` embedded FedClients (client-i on shard i), stop the server gracefully
    once ``after_rounds`` rounds completed, start it again on the same address and let the clients re-join unaided
    until the federation ends; returns the resumed server's final status (the stop is asserted to have left the
    federation unfinished)."""
    import time

    from fedclient import ClientConfig, FedClient
    from fedlaunch.supervise import free_server_port
    from fedserver import ServerThread

    if config.server.address.endswith(":0"):
        # A port P with P + 1 free, not the kernel's pick: the restart binds P again with its framed port at P + 1
        # ("auto"), and P + 1 after a kernel-picked P may be anyone's (seen: "port ... is in use by another process").
        config.server.address = f"127.0.0.1:{free_server_port()}"
    srv = ServerThread(config, linger_s=0.5).start()
    clients = [FedClient(ClientConfig(insecure=True, server=srv.address, client_id=f"client-{i}", data_index=i,
                                      long_poll_s=1.0, backoff_initial_s=0.05, backoff_max_s=0.3,
                                      give_up_after_s=60)).start() for i in range(num_clients)]
    deadline = time.monotonic() + 60
    while len(srv.coordinator.history) < after_rounds and time.monotonic() < deadline:  # type: ignore[union-attr]
        time.sleep(0.01)
    srv.stop()
    assert srv.result is not None and not srv.result.finished
    config.server.address = f"127.0.0.1:{srv.address.rsplit(':', 1)[1]}"
    status = ServerThread(config, linger_s=1.0).start().wait(timeout)
    for c in clients:
        c.join(30)
    return status
