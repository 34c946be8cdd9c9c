"""How the cuda target launches kernels: block and tile sizes, and the limits they must keep.
"""

from __future__ import annotations

from dataclasses import dataclass


from kiln.core.errors import InvalidArgument


BLOCK = 128  # default threads per block of a one-thread-per-element launch

TILE = 16  # default GEMM tile: a block of TILE x TILE threads computes a TILE x TILE tile of C

BLOCKS = (32, 64, 128, 256, 512, 1024)

TILES = (8, 16, 32)  # 32 x 32 = 1024 threads, a block's most

MAX_LOCAL_KEYS = 4096  # attention: the most keys one query row keeps in thread-local memory

ATTENTION_KEYS = 32  # attention: keys per tile of K and of V staged in shared memory

SHARED_BYTES = 48 << 10  # shared memory a block may use without opting in


@dataclass(frozen=True)
class Launch:
    """One device function and how its launcher calls it."""
    name: str
    params: list[str]
    body: list[str]
    grid: str  # host expressions, over the kernel's symbols
    block: str
    guard: str = ""  # launch only when this holds (a grid of zero blocks is an error)


def check_launch(block: int, tile: int) -> None:
    if block not in BLOCKS or tile not in TILES:
        raise InvalidArgument(f"cuda launch shape block={block} tile={tile}: block is one of {BLOCKS}, "
                              f"tile one of {TILES}")
