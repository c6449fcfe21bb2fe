"""Types of :mod:`snapstore._stream`, the optional C extension (``_stream.c``)."""

from collections.abc import Sequence
from typing import SupportsIndex

from _typeshed import ReadableBuffer, WriteableBuffer

FUSED: int  # 1 where the copies run (x86-64 with SSE4.2), else 0
MAX_DSTS: int  # the most destinations one copy_crc32c takes

def copy_crc32c(crc: SupportsIndex, src: ReadableBuffer, /, *dsts: WriteableBuffer) -> int: ...
def copy_crc32c_many(src: ReadableBuffer, dst: WriteableBuffer, table: ReadableBuffer,
                     crcs: WriteableBuffer, /) -> None: ...
def copy_crc32c_gather(dst: WriteableBuffer, table: ReadableBuffer, crcs: WriteableBuffer,
                       srcs: Sequence[ReadableBuffer], /) -> None: ...
