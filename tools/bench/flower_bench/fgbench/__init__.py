"""The Flower side of tools/bench/bench_flower.py: a timed FedAvg ServerApp and a no-op ClientApp (needs flwr)."""
