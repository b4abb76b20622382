"""The Triton kernels of a comet call (see docs/design.md for the pipeline)."""

#: Revision of the kernels' performance behaviour, stored in every ``comet tune`` table.
#: A table from another revision is stale (its splits were measured on kernels that have
#: since changed) and is ignored with a warning. Bump it with any change that moves the
#: best block split: roles, tiles, comm algorithms, the plan's cost.
#: 2: per-chunk dispatch flags, 16-byte comm copies (2026-11-23); 3: the plan stops at
#: the call's tokens, combine at 4 programs/SM, reduce tile 64 x 256; 4: 2 layer1 column
#: splits (was 8); 5: flattened GEMM loops (interleaved W13, layer0 lanes, layer1 static
#: stride); 6: the decode tile (128-column layer1 blocks for calls that leave SMs idle);
#: 7: layer1's comm blocks run the first column split's GEMM before they reduce; 8: the
#: last round of layer0's work queue goes one item per take; 9: the tile table runs
#: expert-major after a local head, and the dispatch feeds every destination abreast.
KERNEL_REVISION = 10

#: TileConfig fields a tuned table may set per token bucket (``comet tune`` searches them
#: once the block split is chosen), with the smallest valid value of each. They change
#: only the order in which a rank runs its own work -- no buffer size, nothing a peer
#: reads -- so each call may use its own.
TUNABLE_TILE_FIELDS = {"group_m": 1, "local_head_tiles": 0}


def tile_field_error(name: str, value) -> str | None:
    """Why ``name = value`` cannot be a per-call tile choice, or None if it can."""
    if name not in TUNABLE_TILE_FIELDS:
        return f"{name!r} is not a per-call tile field (those are {sorted(TUNABLE_TILE_FIELDS)})"
    low = TUNABLE_TILE_FIELDS[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        return f"tile field {name!r} must be an integer >= {low}, got {value!r}"
    return None
