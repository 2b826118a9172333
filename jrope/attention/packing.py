"""Packed rows: several sequences in one row, told apart by segment ids.

A packed row holds its sequences one after another, each a contiguous run of
one segment id; positions restart at each run and increase within one.
A query sees only the keys of its own segment, so a packed row gives each
sequence what it would give alone in a row of its own.

Shape legend: B batch, S row length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def check_segments(positions, segment_ids, batch: int, length: int) -> None:
    """Raises ValueError for segment ids a kernel cannot take; traced values are checked for shape only.

    positions: integers [S] or [B, S]; segment_ids: integers [B, S], with
    B = batch and S = length. Refused: another shape or dtype, a segment id
    that comes back after another one (a sequence must be one contiguous
    run), positions that do not increase within a run.
    """
    shape = tuple(jnp.shape(segment_ids))
    if shape != (batch, length):
        raise ValueError(
            f"segment_ids must be [B, S] = [{batch}, {length}], one id per key of each row; "
            f"got shape {shape}."
        )
    if not jnp.issubdtype(jnp.result_type(segment_ids), jnp.integer):
        raise ValueError(f"segment_ids must be integers; got dtype {jnp.result_type(segment_ids)}.")
    if isinstance(segment_ids, jax.core.Tracer) or isinstance(positions, jax.core.Tracer):
        return
    segments, rows, starts = _runs(positions, segment_ids)
    for row in range(segments.shape[0]):
        run_ids, counts = np.unique(segments[row][starts[row]], return_counts=True)
        if (counts > 1).any():
            raise ValueError(
                f"segment id {run_ids[counts > 1][0]} of row {row} comes back after another "
                "segment: each packed sequence must be one contiguous run of its id."
            )
    falls = np.argwhere((np.diff(rows, axis=-1) <= 0) & ~starts[:, 1:])
    if len(falls):
        row, index = falls[0]
        raise ValueError(
            f"positions must increase within segment {segments[row, index + 1]} of row {row}, "
            f"got {rows[row, index]} -> {rows[row, index + 1]} at index {index + 1}: they restart "
            "only where the segment id changes."
        )


def largest_segment_span(positions, segment_ids) -> int:
    """The largest last-minus-first position of one segment, over every row (concrete values).

    What one map origin must cover in a packed row: each sequence is mapped
    from its own origin (segment_midpoints, or the blocks' origins), so the
    row's own span, across restarts, does not matter.
    positions: integers [S] or [B, S]; segment_ids: integers [B, S], as
    check_segments accepts them.
    """
    segments, rows, starts = _runs(positions, segment_ids)
    # Each segment's first index, carried along its run; positions never go down in a run.
    first = np.maximum.accumulate(np.where(starts, np.arange(segments.shape[1]), 0), axis=1)
    return int(np.max(rows - np.take_along_axis(rows, first, axis=1)))


def _runs(positions, segment_ids):
    """Host copies: segment ids [B, S], positions int64 [B, S], and where each run starts."""
    segments = np.asarray(segment_ids)
    rows = np.broadcast_to(np.asarray(positions, np.int64), segments.shape)
    first = np.ones((segments.shape[0], 1), bool)
    starts = np.concatenate([first, segments[:, 1:] != segments[:, :-1]], axis=1)
    return segments, rows, starts


def segment_starts(segment_ids: jax.Array) -> jax.Array:
    """int32 [B, S]: the index of the first token of each token's segment (its contiguous run)."""
    change = segment_ids[:, 1:] != segment_ids[:, :-1]
    starts = jnp.pad(change, ((0, 0), (1, 0)), constant_values=True)
    return jax.lax.cummax(jnp.where(starts, jnp.arange(segment_ids.shape[-1]), 0), axis=1)


def segment_midpoints(positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """int32 [B, S]: each token's segment's midpoint position.

    The origin Encoding.transform_qk would give that sequence alone in a row
    (the midpoint of its positions): a kernel that maps a whole row at once
    bounds every factor by half its own sequence's span, and a same-segment
    pair shares one origin. A segment's positions run from its first token's
    to its last's (one contiguous run, not going down).
    positions: int [S] or [B, S]; segment_ids: int [B, S].
    """
    positions = jnp.broadcast_to(jnp.asarray(positions, jnp.int32), segment_ids.shape)
    length = segment_ids.shape[-1]
    index = jnp.arange(length)
    change = segment_ids[:, 1:] != segment_ids[:, :-1]
    ends = jnp.pad(change, ((0, 0), (0, 1)), constant_values=True)
    first = segment_starts(segment_ids)
    last = jax.lax.cummin(jnp.where(ends, index, length - 1), axis=1, reverse=True)
    low = jnp.take_along_axis(positions, first, axis=1)
    high = jnp.take_along_axis(positions, last, axis=1)
    return low + (high - low) // 2


def row_coordinates(positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """int32 [B, S]: positions shifted per segment so that they never go down along the row.

    Each segment's positions move by one constant (0 for the first), so
    differences within a segment are unchanged: what a translation-invariant
    map of a same-segment pair reads. A segment starts at the coordinate
    where the one before it ended.
    positions: int [S] or [B, S]; segment_ids: int [B, S].
    """
    positions = jnp.broadcast_to(jnp.asarray(positions, jnp.int32), segment_ids.shape)
    step = jnp.diff(positions, axis=-1)
    restarts = segment_ids[:, 1:] != segment_ids[:, :-1]
    # At a segment start the coordinate stays where the row was; elsewhere it follows the positions.
    shift = jnp.cumsum(jnp.where(restarts, -step, 0), axis=-1)
    return positions + jnp.pad(shift, ((0, 0), (1, 0)))
