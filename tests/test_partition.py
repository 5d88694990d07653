import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from compaction.errors import InvalidInput
from compaction.partition import Chunk, partition


def test_explicit_partition() -> None:
    # inner borders: 5+300=305 -> 304, 605 -> 592, 905 -> 896
    assert partition(5, 1000, 300, 16) == (
        Chunk(0, 5, 304),
        Chunk(1, 304, 592),
        Chunk(2, 592, 896),
        Chunk(3, 896, 1000),
    )


def test_single_chunk_when_span_fits() -> None:
    assert partition(0, 100, 128, 16) == (Chunk(0, 0, 100),)


def test_count_is_ceil() -> None:
    assert len(partition(0, 1024, 256, 16)) == 4
    assert len(partition(0, 1025, 256, 16)) == 5


@given(
    start=st.integers(0, 500),
    length=st.integers(1, 5000),
    block=st.sampled_from([1, 16, 32, 128]),
    factor=st.integers(1, 40),
    extra=st.integers(0, 127),
)
def test_lossless_contiguous_and_aligned(start: int, length: int, block: int, factor: int, extra: int) -> None:
    chunk_tokens = block * factor + extra % block if block > 1 else factor
    chunks = partition(start, start + length, chunk_tokens, block)
    assert len(chunks) == -(-length // chunk_tokens)
    assert chunks[0].start == start and chunks[-1].end == start + length
    for a, b in itertools.pairwise(chunks):
        assert a.end == b.start and a.end % block == 0
    assert all(c.size > 0 for c in chunks)
    assert [c.index for c in chunks] == list(range(len(chunks)))


def test_chunk_below_one_block_is_refused() -> None:
    with pytest.raises(InvalidInput, match="chunk_tokens: 8 is below one cache block"):
        partition(0, 100, 8, 16)


def test_empty_span_is_refused() -> None:
    with pytest.raises(InvalidInput, match="nothing to compact"):
        partition(10, 10, 16, 16)
