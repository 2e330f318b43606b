"""A step's results: packed on the device into one array (``pack_step``), brought to the host in
one copy (``StepOutput.host``)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from model.sampling import apply_token_mask

TOP_LOGPROBS = 20  # most alternatives a request may ask for
# Below this a log-probability is a masked id's (NEG_INF's): not an alternative the row could take.
MASKED_LOGPROB = -1e29


def pack_step(
    logits: jax.Array, ids: jax.Array, want_logprobs: jax.Array | bool = True, mask: jax.Array | None = None
) -> jax.Array:
    """Pack a step's host-bound results into one float32 array, so each step makes a single
    device-to-host copy.

    Args:
        logits: [R, V] float32. ids: [R] int32 sampled ids.
        want_logprobs: scalar bool; when False the log-softmax and top-k over the vocabulary
            are skipped (``lax.cond``) and those columns are 0.
        mask: [R, W] int32 packed token mask (``model.sampling.apply_token_mask``) or None: a
            constrained row's log-probabilities are those of the distribution its grammar
            leaves (the masked ids' are about -1e30: ``MASKED_LOGPROB`` drops them on the host).

    Returns:
        [R, 2 + 2 * TOP_LOGPROBS] float32: the id (exact in float32 below 2**24), its
        log-probability under the model's raw distribution (log-softmax of the logits, before
        temperature and filtering), the TOP_LOGPROBS highest log-probabilities, and their ids.
    """

    def with_logprobs(_: None) -> jax.Array:
        allowed = logits if mask is None else apply_token_mask(logits, mask)
        logprobs = jax.nn.log_softmax(allowed.astype(jnp.float32), axis=-1)
        chosen = jnp.take_along_axis(logprobs, ids[:, None], axis=-1)
        top_lp, top_ids = jax.lax.top_k(logprobs, TOP_LOGPROBS)
        return jnp.concatenate([chosen, top_lp, top_ids.astype(jnp.float32)], axis=-1)

    def without(_: None) -> jax.Array:
        return jnp.zeros((ids.shape[0], 1 + 2 * TOP_LOGPROBS), jnp.float32)

    extra = jax.lax.cond(jnp.asarray(want_logprobs), with_logprobs, without, None)
    return jnp.concatenate([ids[:, None].astype(jnp.float32), extra], axis=-1)


@dataclasses.dataclass(frozen=True)
class HostStep:
    """A step's results on the host: entries [0, S) one per row (the id sampled at the row's
    ``last_index``), then, in a step that verified draft ids, one per sampling slot
    (``slot_rows`` names their rows: a speculating row's slots are consecutive, in position
    order).

    Attributes: ids [E] int32; logprob [E] float32 (of each sampled id); top_logprobs
    [E, TOP_LOGPROBS] float32, descending; top_ids [E, TOP_LOGPROBS] int32; slot_rows [R]
    int32 (-1 an empty slot), empty without draft ids.
    """

    ids: np.ndarray
    logprob: np.ndarray
    top_logprobs: np.ndarray
    top_ids: np.ndarray
    slot_rows: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int32))

    def slots_of(self, row: int) -> np.ndarray:
        """The entries of row ``row``'s sampling slots, in position order (none without drafts)."""
        return len(self.ids) - len(self.slot_rows) + np.flatnonzero(self.slot_rows == row)


@dataclasses.dataclass(frozen=True)
class StepOutput:
    """Device results of one compiled step: ``packed`` [S, ...] (see ``pack_step``), one row
    per row, and the logits [R, V] of its sampling slots, whose rows ``sample_rows`` [R] (host,
    -1 for an empty slot) names; ``slots`` [R, ...] packed per slot, in a step that verified
    draft ids (else None: not copied)."""

    packed: jax.Array
    logits: jax.Array
    sample_rows: np.ndarray | None = None
    slots: jax.Array | None = None

    def row_logits(self, row: int) -> np.ndarray:
        """Row ``row``'s logits [V] float32 (on the host).

        Raises:
            ValueError: the row sampled nothing in this step.
        """
        slots = np.flatnonzero(self.sample_rows == row) if self.sample_rows is not None else np.zeros(0, np.int64)
        if not len(slots):
            raise ValueError(f"row {row} sampled nothing in this step")
        return np.asarray(self.logits[int(slots[0])])

    def host(self) -> HostStep:
        """The step's results on the host, in one device-to-host copy (blocks until the step is
        done)."""
        slot_rows = np.zeros(0, np.int32)
        if self.slots is None:
            a = np.asarray(self.packed)
        else:
            by_row, slots = jax.device_get((self.packed, self.slots))
            a = np.concatenate([by_row, slots])
            assert self.sample_rows is not None
            slot_rows = self.sample_rows
        n = TOP_LOGPROBS
        return HostStep(
            ids=a[:, 0].astype(np.int32),
            logprob=a[:, 1],
            top_logprobs=a[:, 2 : 2 + n],
            top_ids=a[:, 2 + n :].astype(np.int32),
            slot_rows=slot_rows,
        )
