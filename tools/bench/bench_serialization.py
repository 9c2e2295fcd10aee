"""Serialization throughput of a 940,362-parameter float32 model (the LINDT/FL-GUARD CIFAR CNN's shapes).

Measured side by side in one run, median of --reps repetitions, MB/s = model bytes / (serialize + deserialize):
  chunked      state dict -> views of the tensors' bytes -> 1 MiB chunks -> copied once into one torch.empty per
               tensor with byte-count checks (fedcore.serialization: Payload, Reassembler)
  wire         the same plus protobuf framing: every chunk written as the bytes of a TaskMessage (one copy, from
               the tensor's storage into the frame), the chunk's data read in place from the frame
               (fedguard.wire.chunk_frame_bytes / read_chunk; what fedserver and fedclient send and receive)
  old chunked  the previous release's path: pack into one payload -> 1 MiB slices -> one np.empty buffer
  old wire     the previous release's framing: a TaskMessage per chunk built with protobuf (bytes(slice),
               msg.chunk.data = ..., SerializeToString), parsed back with FromString, msg.chunk.data fed
  pack         state dict -> one contiguous payload -> state dict, no chunking
  np.save      np.save of every array into one BytesIO, then np.load of each (the issue's reference)
The protobuf framing is the bytes gRPC carries; the socket itself is not included.

Then the server's side of an upload, received and turned into the update u_i = weights - global (what the intake
hands the aggregator), side by side:
  per tensor   the wire path into one torch.empty per tensor, then flatten_update writes u_i into a new [P]
  one buffer   the wire path into one buffer (Reassembler one_buffer), u_i computed in that buffer
               (flatten_update consume: what fedserver does since issue 30's item 4, second half)
with the bytes each allocates per upload (the distinct storages of the tensors and of u_i).

    python tools/bench/bench_serialization.py [--reps 50]
"""

from __future__ import annotations

import argparse
import io
import statistics
import time
from collections.abc import Callable, Mapping

import numpy as np
import torch

from fedcore.serialization import (
    Reassembler,
    SerializationError,
    TensorMeta,
    iter_chunks,
    pack,
    payload_of,
    roundtrip_chunks,
    total_bytes,
    unpack,
)
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


def wire_roundtrip(state: dict[str, torch.Tensor], one_buffer: bool = False) -> Mapping[str, torch.Tensor]:
    manifest, payload = payload_of(state)
    header = pb.TaskMessage(header=pb.TaskHeader(tensors=wire.metas_to_pb(manifest), total_bytes=len(payload)))
    frames = [header.SerializeToString()]
    frames += wire.chunk_frame_bytes(payload, pb.TaskMessage)
    first = pb.TaskMessage.FromString(frames[0]).header
    asm = Reassembler(wire.metas_from_pb(first.tensors), first.total_bytes, one_buffer=one_buffer)
    for f in frames[1:]:
        chunk = wire.read_chunk(f, pb.TaskMessage)
        assert chunk is not None
        asm.feed(*chunk)
    return asm.finish()


class OldReassembler:
    """The previous release's receiver, kept here for the comparison: one np.empty buffer for the whole payload,
    every chunk copied into it, tensors viewing it."""

    def __init__(self, manifest: list[TensorMeta], announced_bytes: int) -> None:
        self.manifest = manifest
        self.expected = total_bytes(manifest)
        if announced_bytes != self.expected:
            raise SerializationError("announced bytes do not match the manifest")
        self._buf = np.empty(self.expected, dtype=np.uint8)
        self.received = 0

    def feed(self, offset: int, data: bytes | memoryview) -> None:
        n = len(data)
        if offset != self.received or self.received + n > self.expected:
            raise SerializationError("bad chunk")
        self._buf[offset : offset + n] = np.frombuffer(data, dtype=np.uint8)
        self.received += n

    def finish(self) -> dict[str, torch.Tensor]:
        if self.received != self.expected:
            raise SerializationError("short")
        return unpack(self.manifest, self._buf)


def old_chunked_roundtrip(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    manifest, payload = pack(state)
    r = OldReassembler(manifest, total_bytes(manifest))
    for off, data in iter_chunks(payload):
        r.feed(off, data)
    return r.finish()


def old_wire_roundtrip(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    manifest, payload = pack(state)
    header = pb.TaskMessage(header=pb.TaskHeader(tensors=wire.metas_to_pb(manifest), total_bytes=len(payload)))
    frames = [header.SerializeToString()]
    frames += [m.SerializeToString() for m in wire.chunk_frames(payload, pb.TaskMessage)]
    first = pb.TaskMessage.FromString(frames[0]).header
    asm = OldReassembler(wire.metas_from_pb(first.tensors), first.total_bytes)
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


def interleaved(fns: Mapping[str, Callable[[], object]], reps: int) -> dict[str, float]:
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
    for fn in (wire_roundtrip, old_wire_roundtrip, roundtrip_chunks, old_chunked_roundtrip):
        out = fn(state)
        assert all(torch.equal(out[k], state[k]) for k in state), f"{fn.__name__} is not exact"
    results = interleaved({
        "chunked (zero-copy)": lambda: roundtrip_chunks(state),
        "wire (zero-copy + protobuf framing)": lambda: wire_roundtrip(state),
        "old chunked (previous release)": lambda: old_chunked_roundtrip(state),
        "old wire (previous release)": lambda: old_wire_roundtrip(state),
        "pack/unpack (no chunking)": lambda: pack_roundtrip(state),
        "np.save/np.load (reference)": lambda: npsave_roundtrip(arrays),
    }, args.reps)
    ref = results["np.save/np.load (reference)"]
    print(f"model: {params:,} float32 parameters = {nbytes / 1e6:.2f} MB; median of {args.reps} runs")
    print(f"{'path':<36} {'ms':>8} {'MB/s':>9} {'vs np.save':>11}")
    for name, t in results.items():
        print(f"{name:<36} {t * 1e3:>8.2f} {nbytes / 1e6 / t:>9.0f} {ref / t:>10.2f}x")
    new, old = results["wire (zero-copy + protobuf framing)"], results["old wire (previous release)"]
    print(f"with framing: new path {ref / new:.2f}x np.save, old path {ref / old:.2f}x (new/old {old / new:.2f}x)")
    upload_to_update(state, args.reps)


def allocated_bytes(*tensors: torch.Tensor) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.numel()}
    return sum(storages.values())


def upload_to_update(state: dict[str, torch.Tensor], reps: int) -> None:
    """The server's upload -> u_i, per-tensor buffers + a new [P] vs one buffer consumed in place."""
    from fedserver.global_models import GlobalModels

    g = torch.Generator().manual_seed(1)
    models = GlobalModels({k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in state.items()})

    def per_tensor() -> tuple[Mapping[str, torch.Tensor], torch.Tensor]:
        got = wire_roundtrip(state)
        return got, models.flatten_update(got, False)

    def one_buffer() -> tuple[Mapping[str, torch.Tensor], torch.Tensor]:
        got = wire_roundtrip(state, one_buffer=True)
        return got, models.flatten_update(got, False, consume=True)

    paths: dict[str, Callable[[], tuple[Mapping[str, torch.Tensor], torch.Tensor]]] = {
        "per tensor + new [P] (before)": per_tensor, "one buffer, u_i in place (now)": one_buffer}
    outs = {name: fn() for name, fn in paths.items()}
    a, b = (u for _, u in outs.values())
    assert torch.equal(a.view(torch.int32), b.view(torch.int32)), "the two paths must give the same bits"
    results = interleaved(paths, reps)
    print(f"server upload -> update u_i (median of {reps}):")
    print(f"{'path':<36} {'ms':>8} {'allocated MB':>13}")
    for name, t in results.items():
        got, u = outs[name]
        print(f"{name:<36} {t * 1e3:>8.2f} {allocated_bytes(*got.values(), u) / 1e6:>13.2f}")
    before, now = results["per tensor + new [P] (before)"], results["one buffer, u_i in place (now)"]
    print(f"one buffer: {before / now:.2f}x faster, allocates the payload only (bit-identical u_i)")


if __name__ == "__main__":
    main()
