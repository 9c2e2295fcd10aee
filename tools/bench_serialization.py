"""Serialization throughput of a 940,362-parameter float32 model (the LINDT/FL-GUARD CIFAR CNN's shapes).

Measured side by side in one run, median of --reps repetitions, MB/s = model bytes / (serialize + deserialize):
  chunked   state dict -> little-endian payload -> 1 MiB chunks -> reassembled with byte-count checks -> state
            dict (fedcore.serialization: the format, comparable to np.save/np.load producing/consuming bytes)
  wire      the same plus protobuf framing: every chunk wrapped in a TaskMessage, serialized to bytes, parsed
            back (what gRPC does to any payload; the socket itself is not included)
  pack      state dict -> one contiguous payload -> state dict, no chunking
  np.save   np.save of every array into one BytesIO, then np.load of each (the issue's reference)

    python tools/bench_serialization.py [--reps 50]
"""

from __future__ import annotations

import argparse
import io
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from fedcore.serialization import Reassembler, pack, roundtrip_chunks, unpack
from fedguard import wire
from fedguard.v1 import fedguard_pb2 as pb

SHAPES = {
    "conv1.weight": (32, 3, 5, 5), "conv1.bias": (32,), "conv2.weight": (64, 32, 5, 5), "conv2.bias": (64,),
    "fc1.weight": (512, 1600), "fc1.bias": (512,), "fc2.weight": (128, 512), "fc2.bias": (128,),
    "fc3.weight": (10, 128), "fc3.bias": (10,),
}


def model_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}


def wire_roundtrip(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    manifest, payload = pack(state)
    header = pb.TaskMessage(header=pb.TaskHeader(tensors=wire.metas_to_pb(manifest), total_bytes=len(payload)))
    frames = [header.SerializeToString()]
    frames += [m.SerializeToString() for m in wire.chunk_frames(payload, pb.TaskMessage)]
    first = pb.TaskMessage.FromString(frames[0]).header
    asm = Reassembler(wire.metas_from_pb(first.tensors), first.total_bytes)
    for f in frames[1:]:
        c = pb.TaskMessage.FromString(f).chunk
        asm.feed(c.offset, c.data)
    return asm.finish()


def pack_roundtrip(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    manifest, payload = pack(state)
    return unpack(manifest, payload)


def npsave_roundtrip(arrays: dict[str, np.ndarray]) -> list[np.ndarray]:
    buf = io.BytesIO()
    for a in arrays.values():
        np.save(buf, a)
    buf.seek(0)
    return [np.load(buf) for _ in arrays]


def interleaved(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Median seconds of each function, timed round-robin so allocator and cache state hit all alike."""
    for fn in fns.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    torch.set_num_threads(1)
    state = model_state()
    arrays = {k: v.numpy() for k, v in state.items()}
    params = sum(v.numel() for v in state.values())
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    assert params == 940_362, params
    out = wire_roundtrip(state)
    assert all(torch.equal(out[k], state[k]) for k in state), "wire round-trip is not exact"
    results = interleaved({
        "chunked (fedguard serialization)": lambda: roundtrip_chunks(state),
        "wire (chunked + protobuf framing)": lambda: wire_roundtrip(state),
        "pack/unpack (no chunking)": lambda: pack_roundtrip(state),
        "np.save/np.load (reference)": lambda: npsave_roundtrip(arrays),
    }, args.reps)
    ref = results["np.save/np.load (reference)"]
    print(f"model: {params:,} float32 parameters = {nbytes / 1e6:.2f} MB; median of {args.reps} runs")
    print(f"{'path':<36} {'ms':>8} {'MB/s':>9} {'vs np.save':>11}")
    for name, t in results.items():
        print(f"{name:<36} {t * 1e3:>8.2f} {nbytes / 1e6 / t:>9.0f} {ref / t:>10.2f}x")


if __name__ == "__main__":
    main()
