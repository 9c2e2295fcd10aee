from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedcore.serialization import (
    DTYPES,
    Reassembler,
    SerializationError,
    TensorMeta,
    fingerprint,
    iter_chunks,
    load_state,
    manifest_of,
    pack,
    roundtrip_chunks,
    save_state,
    unpack,
)

DTYPE_NAMES = sorted(DTYPES)


def _random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g, dtype=torch.float64) * 1e3).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -(2**62)), min(info.max, 2**62), shape, generator=g, dtype=dtype)


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert a[k].shape == b[k].shape, k
        # Bit-exact: compare raw bytes, so NaN payloads and -0.0 count too.
        assert torch.equal(a[k].reshape(-1).view(torch.uint8) if a[k].numel() else a[k],
                           b[k].reshape(-1).view(torch.uint8) if b[k].numel() else b[k]), k


shapes = st.lists(st.integers(min_value=0, max_value=7), min_size=0, max_size=4).map(tuple)


@settings(max_examples=60, deadline=None)
@given(specs=st.lists(st.tuples(st.sampled_from(DTYPE_NAMES), shapes, st.integers(0, 2**31)), min_size=0,
                      max_size=6),
       chunk=st.integers(min_value=1, max_value=300), one_buffer=st.booleans())
def test_roundtrip_any_dtype_shape_and_chunk_size(specs: list[tuple[str, tuple[int, ...], int]], chunk: int,
                                                  one_buffer: bool) -> None:
    state = {f"t{i}": _random_tensor(DTYPES[d], shape, seed) for i, (d, shape, seed) in enumerate(specs)}
    _assert_same(state, roundtrip_chunks(state, chunk_bytes=chunk, one_buffer=one_buffer))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int64", "bool"])
def test_zero_dim_and_empty_tensors(dtype: str) -> None:
    t = DTYPES[dtype]
    state = {"scalar": _random_tensor(t, (), 1), "empty": torch.empty((0, 3), dtype=t),
             "vec": _random_tensor(t, (5,), 2)}
    _assert_same(state, roundtrip_chunks(state, chunk_bytes=3))


def test_special_float_values_survive() -> None:
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-45, 3.4e38])
    out = roundtrip_chunks({"x": x})["x"]
    assert torch.equal(x.view(torch.int32), out.view(torch.int32))


def test_payload_is_little_endian_raw_bytes() -> None:
    manifest, payload = pack({"a": torch.tensor([1, 2], dtype=torch.int32), "b": torch.tensor([1.5])})
    assert bytes(payload) == np.array([1, 2], dtype="<i4").tobytes() + np.array([1.5], dtype="<f4").tobytes()
    assert manifest == [TensorMeta("a", "int32", (2,)), TensorMeta("b", "float32", (1,))]


def test_chunks_cover_payload_in_order() -> None:
    payload = bytes(range(256)) * 5
    chunks = list(iter_chunks(payload, 100))
    assert [off for off, _ in chunks] == list(range(0, len(payload), 100))
    assert b"".join(bytes(c) for _, c in chunks) == payload
    assert list(iter_chunks(b"", 10)) == []


def test_more_bytes_than_announced_is_refused() -> None:
    manifest, payload = pack({"w": torch.ones(4)})
    r = Reassembler(manifest, len(payload))
    r.feed(0, bytes(payload))
    with pytest.raises(SerializationError, match="more bytes than announced"):
        r.feed(len(payload), b"x")


def test_fewer_bytes_than_announced_is_refused() -> None:
    manifest, payload = pack({"w": torch.ones(4)})
    r = Reassembler(manifest, len(payload))
    r.feed(0, bytes(payload[:7]))
    with pytest.raises(SerializationError, match="received 7 of 16"):
        r.finish()


def test_out_of_order_chunk_is_refused() -> None:
    manifest, payload = pack({"w": torch.ones(4)})
    r = Reassembler(manifest, len(payload))
    with pytest.raises(SerializationError, match="expected offset 0"):
        r.feed(8, bytes(payload[8:]))


def test_announced_total_must_match_manifest_and_limit() -> None:
    manifest, _payload = pack({"w": torch.ones(4)})
    with pytest.raises(SerializationError, match="announced 15 bytes"):
        Reassembler(manifest, 15)
    with pytest.raises(SerializationError, match="exceeds the limit"):
        Reassembler(manifest, 16, max_bytes=8)


def test_bad_manifests_are_refused() -> None:
    with pytest.raises(SerializationError, match="appears twice"):
        Reassembler([TensorMeta("a", "float32", (1,)), TensorMeta("a", "float32", (1,))])
    with pytest.raises(SerializationError, match="unsupported dtype"):
        Reassembler([TensorMeta("a", "complex64", (1,))])
    with pytest.raises(SerializationError, match="negative dimension"):
        Reassembler([TensorMeta("a", "float32", (-1,))])
    with pytest.raises(SerializationError, match="payload has"):
        unpack([TensorMeta("a", "float32", (2,))], bytearray(4))


def test_fingerprint_depends_on_names_shapes_dtypes_not_values() -> None:
    a = {"w": torch.zeros(2, 3), "b": torch.zeros(3)}
    b = {"w": torch.ones(2, 3), "b": torch.ones(3)}
    assert fingerprint(manifest_of(a)) == fingerprint(manifest_of(b))
    assert fingerprint(manifest_of(a)) != fingerprint(manifest_of({"w": torch.zeros(3, 2), "b": torch.zeros(3)}))
    assert fingerprint(manifest_of(a)) != fingerprint(manifest_of({"w": torch.zeros(2, 3), "c": torch.zeros(3)}))


def test_save_and_load_state_file(tmp_path: pytest.TempPathFactory) -> None:
    state = {"w": torch.randn(3, 4), "n": torch.tensor(7), "h": torch.randn(2).to(torch.bfloat16)}
    path = tmp_path / "m.fgt"  # type: ignore[operator]
    save_state(path, state, {"round": 3})
    loaded, extra = load_state(path)
    _assert_same(state, loaded)
    assert extra == {"round": 3}
    assert not list(tmp_path.glob("*.tmp"))  # type: ignore[attr-defined]


def test_load_state_refuses_foreign_file(tmp_path: pytest.TempPathFactory) -> None:
    path = tmp_path / "x.bin"  # type: ignore[operator]
    buf = io.BytesIO()
    np.save(buf, np.zeros(3))
    path.write_bytes(buf.getvalue())
    with pytest.raises(SerializationError, match="not a fedguard tensor file"):
        load_state(path)


def test_no_pickle_in_the_wire_or_file_path() -> None:
    import fedcore.serialization as ser
    import fedguard.wire as wire

    for mod in (ser, wire):
        src = Path(mod.__file__ or "").read_text()
        for banned in ("import pickle", "torch.load", "torch.save", "np.load"):
            assert banned not in src, (mod.__name__, banned)


def test_atomic_write_is_whole_or_nothing_and_writers_do_not_mix(tmp_path: Path) -> None:
    import threading

    from fedcore.serialization import atomic_write

    target = tmp_path / "f.bin"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError), atomic_write(target) as f:
        f.write(b"half")
        raise RuntimeError("crash mid-write")
    assert target.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]

    def writer(byte: bytes) -> None:
        for _ in range(20):
            with atomic_write(target) as f:
                for _ in range(64):
                    f.write(byte * 1024)

    threads = [threading.Thread(target=writer, args=(b,)) for b in (b"a", b"b", b"c")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    data = target.read_bytes()
    assert len(data) == 64 * 1024 and len(set(data)) == 1  # one writer's file, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_byte_views_are_the_tensors_own_bytes_whatever_the_path(dtype: str) -> None:
    # Through numpy where it has the dtype (every one but bfloat16), else through torch: the same bytes, and the
    # tensor's own storage when it is contiguous (no copy); a non-contiguous one, a 0-d one and one that requires
    # grad give their bytes too.
    from fedcore.serialization import _byte_view, _raw_bytes

    t = _random_tensor(DTYPES[dtype], (3, 4), 5)
    cases = [t, t.reshape(-1)[0], t.t()]
    if t.is_floating_point():
        cases.append(t.detach().clone().requires_grad_())
    for x in cases:
        assert bytes(_byte_view(x)) == bytes(_raw_bytes(x).numpy()), x.shape
    view = _byte_view(t)
    t.view(torch.uint8).reshape(-1)[0] ^= 1  # the storage changes: a view of it sees the change
    assert view[0] == int(t.view(torch.uint8).reshape(-1)[0])


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_received_tensors_are_views_of_the_one_buffer(dtype: str) -> None:
    state = {"a": _random_tensor(DTYPES[dtype], (2, 3), 1), "b": _random_tensor(DTYPES[dtype], (), 2),
             "c": torch.empty((0,), dtype=DTYPES[dtype]), "d": _random_tensor(DTYPES[dtype], (4,), 3)}
    got = roundtrip_chunks(state, chunk_bytes=5, one_buffer=True)
    _assert_same(state, dict(got))
    buffer = got.buffer  # type: ignore[attr-defined]
    a, d = got["a"], got["d"]
    buffer[0] ^= 1  # a's first byte and d's last: the views see the buffer change (no copies were made)
    buffer[-1] ^= 1
    assert int(a.reshape(-1).view(torch.uint8)[0]) == int(buffer[0])
    assert int(d.reshape(-1).view(torch.uint8)[-1]) == int(buffer[-1])
