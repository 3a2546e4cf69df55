"""Page-cache-free writes and in-place checkpoint reads used by the converters."""

import os
from pathlib import Path

import pytest
import torch

from glm5_mcore.checkpoint.direct_io import DirectWriter, bulk_io


def _write_pieces(path: Path, pieces: list[bytes], buffer_bytes: int) -> int:
    with DirectWriter(path, buffer_bytes=buffer_bytes) as w:
        for p in pieces:
            assert w.write(p) == len(p)
        return w.tell()


@pytest.mark.parametrize("where", ["disk", "shm"])
def test_direct_writer_writes_exactly_the_bytes(tmp_path, where):
    """Sizes around the 4 KiB alignment and across several buffer hand-offs; tmpfs (no O_DIRECT)
    takes the buffered fallback."""
    folder = tmp_path if where == "disk" else Path("/dev/shm")
    if not folder.is_dir():
        pytest.skip("no /dev/shm")
    g = torch.Generator().manual_seed(0)
    sizes = [0, 1, 4095, 4096, 4097, 100_000, 3, 70_000, 8192 * 3 + 5]
    pieces = [bytes(torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).tolist()) for n in sizes]
    path = folder / f"glm5-direct-test-{os.getpid()}.bin"
    try:
        for buffer_bytes in (8192, 1 << 20):
            told = _write_pieces(path, pieces, buffer_bytes)
            data = path.read_bytes()
            assert told == len(data) == sum(sizes)
            assert data == b"".join(pieces)
    finally:
        path.unlink(missing_ok=True)


def test_direct_writer_takes_tensor_memory(tmp_path):
    t = torch.randn(1000, 37).to(torch.bfloat16)
    with DirectWriter(tmp_path / "t.bin", buffer_bytes=4096) as w:
        w.write(b"head")
        w.write(t.view(-1).view(torch.uint8).numpy())
    raw = (tmp_path / "t.bin").read_bytes()
    assert raw[:4] == b"head"
    back = torch.frombuffer(bytearray(raw[4:]), dtype=torch.bfloat16).view(1000, 37)
    assert torch.equal(back, t)


def test_bulk_io_restores_the_collector():
    import gc

    assert gc.isenabled()
    with bulk_io():
        assert not gc.isenabled()
        x = torch.empty(8 << 20, dtype=torch.uint8)
        del x
    assert gc.isenabled()
