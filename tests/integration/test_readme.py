"""The README's embedding example runs as written against a live server."""

from __future__ import annotations

import re
import time
from pathlib import Path

from fedclient import FedClient
from fedcore.data import load_client_data
from fedcore.models import build_model
from fedlaunch.credentials import make_tls_dir
from fedserver import ServerThread
from tests.integration.helpers import server_config

README = Path(__file__).resolve().parents[2] / "README.md"


def _embedding_snippet() -> str:
    text = README.read_text()
    section = text.split("## Embedding `FedClient` in an app", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "README lost its embedding example"
    return match.group(1)


def test_readme_embedding_example_runs(tmp_path: Path) -> None:
    pki = make_tls_dir(["device-42"], tmp_path / "pki")
    cfg = server_config(tmp_path, rounds={"num_rounds": 50, "clients_per_round": 1},
                        security={"tls_cert": str(pki / "server.pem"), "tls_key": str(pki / "server.key"),
                                  "client_ca": str(pki / "ca.pem")})
    srv = ServerThread(cfg, linger_s=0.1).start()
    try:
        shard = load_client_data("synthetic", 0, seed=0)

        def wait_for_a_round(client: FedClient) -> None:
            deadline = time.monotonic() + 30
            while client.summary.updates_accepted < 1 and time.monotonic() < deadline:
                time.sleep(0.05)

        code = _embedding_snippet().replace('"coordinator:8470"', repr(srv.address))
        code = code.replace('"/var/lib/app/fl"', repr(str(tmp_path / "state")))
        code = code.replace('"/etc/app/fl/ca.pem"', repr(str(pki / "ca.pem")))
        for ext in ("pem", "key"):
            code = code.replace(f'"/etc/app/fl/device-42.{ext}"', repr(str(pki / "clients" / f"device-42.{ext}")))
        code = code.replace("\n...\n", "\nwait_for_a_round(client)\n")
        namespace = {"x_train": shard.x_train, "y_train": shard.y_train, "x_test": shard.x_test,
                     "y_test": shard.y_test, "my_model_factory": lambda: build_model("mlp"),
                     "wait_for_a_round": wait_for_a_round}
        exec(compile(code, "README.md", "exec"), namespace)
        client = namespace["client"]
        assert isinstance(client, FedClient)
        assert client.summary.updates_accepted >= 1 and not client.running
        assert "device-42" in srv.coordinator.state.clients  # type: ignore[union-attr]
    finally:
        srv.stop()
