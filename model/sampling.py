"""Token sampling with per-slot parameters, inside the jitted step (no recompiles per request).

Every parameter is an array with one entry per slot, so requests with different settings
share one compiled program:

* temperature [S] float32: 0 means greedy (argmax); > 0 divides the logits.
* top_k [S] int32: keep the k most likely tokens; 0 (or >= V) disables the filter.
* top_p [S] float32 in (0, 1]: nucleus sampling (Holtzman et al. 2020, §3.1): keep the
  smallest prefix of the sorted distribution whose mass reaches top_p; 1 disables it.
* keys [S, 2] uint32: each request's PRNG key (from its seed); the step folds in the
  token's position, so a seeded request draws the same tokens whatever shares its batch.

Sampling uses the Gumbel-max trick: argmax(logits / T + Gumbel noise) is a draw from
softmax(logits / T) (Gumbel 1954; Maddison et al. 2014, §2).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

NEG_INF = -1e30


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingParams:
    """Per-slot sampling arrays (see the module docstring for meanings and dtypes)."""

    temperature: jax.Array | np.ndarray  # [S] float32
    top_k: jax.Array | np.ndarray  # [S] int32
    top_p: jax.Array | np.ndarray  # [S] float32
    keys: jax.Array | np.ndarray  # [S, 2] uint32
    logprobs: jax.Array | np.ndarray  # [S] bool: the slot's request wants log-probabilities

    @staticmethod
    def host(num_slots: int) -> dict[str, np.ndarray]:
        """Host-side numpy buffers for ``num_slots`` slots, all greedy."""
        return {
            "temperature": np.zeros(num_slots, np.float32),
            "top_k": np.zeros(num_slots, np.int32),
            "top_p": np.ones(num_slots, np.float32),
            "keys": np.zeros((num_slots, 2), np.uint32),
            "logprobs": np.zeros(num_slots, bool),
        }


def seed_to_key(seed: int) -> np.ndarray:
    """Raw threefry key data [2] uint32 for a 64-bit seed: [high 32 bits, low 32 bits].

    Equal to ``jax.random.key_data(jax.random.PRNGKey(seed))`` for seeds below 2**32, but
    keeps all 64 bits (jax truncates seeds to 32 bits when x64 is off)."""
    seed = int(seed) & 0xFFFFFFFFFFFFFFFF
    return np.array([seed >> 32, seed & 0xFFFFFFFF], dtype=np.uint32)


def _filtered_logits(logits: jax.Array, sp: SamplingParams) -> jax.Array:
    """Temperature-scaled logits [S, V] with tokens outside top-k / top-p set to NEG_INF."""
    V = logits.shape[-1]
    temp = jnp.where(sp.temperature > 0, sp.temperature, 1.0)[:, None]
    scaled = logits / temp
    order = jnp.argsort(-scaled, axis=-1)  # [S, V] token ids, most likely first
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(V)[None, :]
    k = jnp.where((sp.top_k <= 0) | (sp.top_k >= V), V, sp.top_k)[:, None]
    keep = rank < k
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, NEG_INF), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = keep & (mass_before < sp.top_p[:, None])
    keep = keep.at[:, 0].set(True)  # the most likely token always survives
    filtered_sorted = jnp.where(keep, sorted_logits, NEG_INF)
    inverse = jnp.argsort(order, axis=-1)
    return jnp.take_along_axis(filtered_sorted, inverse, axis=-1)


def first_argmax(logits: jax.Array) -> jax.Array:
    """The index of each row's largest value, the first one on a tie, as ``jnp.argmax``:
    logits [S, V] float -> [S] int32. Computed as a max, then the smallest index holding it:
    two plain reductions, which XLA:CPU runs faster than argmax's variadic (value, index)
    reduction (docs/cpu-kernels.md). A row
    with a NaN still gives an id in [0, V) (V - 1, or the largest other value's where XLA's
    max skips the NaN); argmax would give the NaN's index."""
    V = logits.shape[-1]
    top = jnp.max(logits, axis=-1, keepdims=True)
    first = jnp.min(jnp.where(logits == top, jnp.arange(V, dtype=jnp.int32), V), axis=-1)
    return jnp.minimum(first, V - 1).astype(jnp.int32)


def sample(
    logits: jax.Array,
    sp: SamplingParams,
    positions: jax.Array,
    argmax: Callable[[jax.Array], jax.Array] = first_argmax,
) -> jax.Array:
    """Pick one token per slot.

    Args:
        logits: [S, V] float32.
        sp: per-slot sampling parameters.
        positions: [S] int32, the position the sampled token will occupy (folded into the key,
            so the draw depends only on the request's seed and the position).
        argmax: [S, V] float32 -> [S] int32 with :func:`first_argmax`'s contract, for the
            greedy ids and the Gumbel-max draw; ``model.cpu_argmax.first_argmax`` on one CPU
            device, where XLA's reductions are slow.

    Returns:
        [S] int32 token ids. Slots with temperature 0 get the argmax; if no slot samples,
        nothing else runs, and the sorts run only when some sampling slot filters (``lax.cond``).
    """
    greedy = argmax(logits)

    V = logits.shape[-1]
    filters = ((sp.top_k > 0) & (sp.top_k < V)) | (sp.top_p < 1.0)

    def draw(_: None) -> jax.Array:
        # The two sorts over V only run when some slot filters by top-k or top-p.
        filtered = jax.lax.cond(
            jnp.any(filters & (sp.temperature > 0)),
            lambda: _filtered_logits(logits, sp),
            lambda: logits / jnp.where(sp.temperature > 0, sp.temperature, 1.0)[:, None],
        )
        step_keys = jax.vmap(jax.random.fold_in)(jax.vmap(jax.random.wrap_key_data)(jnp.asarray(sp.keys)), positions)
        gumbel = jax.vmap(lambda key: jax.random.gumbel(key, logits.shape[-1:], jnp.float32))(step_keys)
        drawn = argmax(filtered + gumbel)
        return jnp.where(sp.temperature > 0, drawn, greedy)

    return jax.lax.cond(jnp.any(sp.temperature > 0), draw, lambda _: greedy, None)


_MASK64 = 0xFFFFFFFFFFFFFFFF


def sequence_seed(seed: int, index: int) -> int:
    """The seed of sequence ``index`` of a request that asks for several (``n``), from the
    request's 64-bit ``seed``: ``seed`` itself for index 0 (so n = 1 samples as before), else
    splitmix64's mix of ``seed + index * golden gamma`` (Steele et al. 2014, §3), so the n seed
    streams are distinct and each depends only on (seed, index). Returns an int in [0, 2**64)."""
    if index == 0:
        return seed
    z = (seed + index * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)
