"""Token sampling with per-row parameters, inside the jitted step (no recompiles per request).

Every parameter is an array with one entry per slot, so requests with different settings
share one compiled program:

* temperature [S] float32: 0 means greedy (argmax); > 0 divides the logits.
* top_k [S] int32: keep the k most likely tokens; 0 (or >= V) disables the filter.
* top_p [S] float32 in (0, 1]: nucleus sampling (Holtzman et al. 2020, §3.1): keep the
  smallest prefix of the sorted distribution whose mass reaches top_p; 1 disables it.
* keys [S, 2] uint32: each request's PRNG key (from its seed); the step folds in the
  token's position, so a seeded request draws the same tokens whatever shares its batch.
* presence_penalty, frequency_penalty [S] float32: OpenAI's penalties over the ids the request
  has *generated* (OpenAI's API documentation, "Frequency and presence penalties"): with c[j]
  the times id j was generated, ``mu[j] - c[j] * frequency_penalty - float(c[j] > 0) *
  presence_penalty``; 0 disables them.
* repetition_penalty [S] float32 > 0: CTRL's penalty (Keskar et al. 2019, §4.1) in Hugging
  Face's form (``RepetitionPenaltyLogitsProcessor``): the logit of every id seen in the prompt
  or generated is divided by it when positive and multiplied by it when negative; 1 disables it.
* min_p [S] float32 in [0, 1]: keep the ids whose probability is at least min_p times the most
  likely id's (Nguyen et al. 2024, "Turning Up the Heat: Min-p Sampling for Creative and
  Coherent LLM Outputs"; Hugging Face's ``MinPLogitsWarper``); 0 disables it.
* eos_ids [S, E] int32: each slot's end-of-sequence ids, padded with -1 (E grows as needed);
  ban_eos [S] bool: this step may not pick them (their logits become -inf): the host sets it
  while the request has generated fewer than its ``min_tokens`` ids.

A token mask (constrained decoding: a grammar allows some ids only) is not a parameter but a
step's input, [S, W] int32 packed as llguidance and vLLM pack it: W = ceil(V / 32) words, bit j
of word i allowing id 32 i + j; a row with every bit set is unconstrained
(``apply_token_mask``). It acts first, on the raw logits: the penalties, the filters and the
draw see only the allowed ids, and so do the log-probabilities (``service.engine.output``).

The ids a slot has seen live on the device in a :class:`TokenHistory` (counts of generated ids,
a mask of prompt ids), which the engine updates inside its steps.

Order: the token mask, the EOS ban and the penalties act on the raw logits, as in vLLM's sampler
(repetition, then frequency, then presence); greedy slots take the argmax of those penalized
logits. Sampled slots then divide by the temperature and filter by top-k, top-p, then min_p,
the order of Hugging Face's warpers (and of vLLM's V0 sampler), and draw. min_p reads the distribution left
by top-k/top-p, whose ratios to the most likely id's probability are the unfiltered ones (a
renormalisation does not change them), so it keeps the survivors with p >= min_p * p_max.
Each stage runs only when some slot uses it (``lax.cond``, ``lax.switch``): a batch without
bans, penalties or min_p runs the stages it ran before these parameters existed, and the conds
return ids, not [S, V] logits, so no extra copy of the logits is made.

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
EOS_WIDTH = 4  # the starting width E of SamplingParams.eos_ids (grown when a request has more)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingParams:
    """Per-slot sampling arrays (see the module docstring for meanings and dtypes)."""

    temperature: jax.Array | np.ndarray  # [S] float32
    top_k: jax.Array | np.ndarray  # [S] int32
    top_p: jax.Array | np.ndarray  # [S] float32
    keys: jax.Array | np.ndarray  # [S, 2] uint32
    logprobs: jax.Array | np.ndarray  # [S] bool: the slot's request wants log-probabilities
    presence_penalty: jax.Array | np.ndarray  # [S] float32
    frequency_penalty: jax.Array | np.ndarray  # [S] float32
    repetition_penalty: jax.Array | np.ndarray  # [S] float32
    min_p: jax.Array | np.ndarray  # [S] float32
    eos_ids: jax.Array | np.ndarray  # [S, E] int32, -1 padding
    ban_eos: jax.Array | np.ndarray  # [S] bool

    @staticmethod
    def host(num_slots: int, eos_width: int = EOS_WIDTH) -> dict[str, np.ndarray]:
        """Host-side numpy buffers for ``num_slots`` slots, all greedy and unpenalized."""
        return {
            "temperature": np.zeros(num_slots, np.float32),
            "top_k": np.zeros(num_slots, np.int32),
            "top_p": np.ones(num_slots, np.float32),
            "keys": np.zeros((num_slots, 2), np.uint32),
            "logprobs": np.zeros(num_slots, bool),
            "presence_penalty": np.zeros(num_slots, np.float32),
            "frequency_penalty": np.zeros(num_slots, np.float32),
            "repetition_penalty": np.ones(num_slots, np.float32),
            "min_p": np.zeros(num_slots, np.float32),
            "eos_ids": np.full((num_slots, eos_width), -1, np.int32),
            "ban_eos": np.zeros(num_slots, bool),
        }


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TokenHistory:
    """What each row's request has seen, for the penalties (device state of the runner).

    Attributes:
        counts: [S, V] int32, how many times each id was generated (the prompt not included).
        in_prompt: [S, V] bool, the ids of the prompt.
    """

    counts: jax.Array
    in_prompt: jax.Array

    @staticmethod
    def zeros(num_slots: int, vocab_size: int) -> TokenHistory:
        """An empty history: nothing generated, empty prompts."""
        return TokenHistory(
            counts=jnp.zeros((num_slots, vocab_size), jnp.int32),
            in_prompt=jnp.zeros((num_slots, vocab_size), bool),
        )

    def with_row(self, slot: jax.Array, counts: jax.Array, in_prompt: jax.Array) -> TokenHistory:
        """This history with row ``slot`` (int32 scalar) replaced: counts [V] int32 (the ids its
        request already generated), in_prompt [V] bool (its prompt's ids)."""
        return TokenHistory(
            counts=jax.lax.dynamic_update_slice_in_dim(self.counts, counts[None], slot, 0),
            in_prompt=jax.lax.dynamic_update_slice_in_dim(self.in_prompt, in_prompt[None], slot, 0),
        )

    def counted(self, rows: jax.Array, tokens: jax.Array, generated: jax.Array) -> TokenHistory:
        """This history with each generated token counted in its row: rows, tokens [N] int32,
        generated [N] bool (tokens not generated, padding among them, are not counted)."""
        S = self.counts.shape[0]
        # Row S is out of range: dropped. A negative row would wrap to another row's counts.
        counts = self.counts.at[jnp.where(generated & (rows >= 0), rows, S), tokens].add(1, mode="drop")
        return TokenHistory(counts=counts, in_prompt=self.in_prompt)

    def at_slots(
        self,
        slot_rows: jax.Array,
        slot_positions: jax.Array,
        rows: jax.Array,
        positions: jax.Array,
        tokens: jax.Array,
        generated: jax.Array,
    ) -> TokenHistory:
        """What each sampling slot has seen: its row's history (``counted`` over the step's
        tokens) less the generated tokens of its row at later positions than its own. A row
        that verifies draft ids has them all counted, and the slot at position p samples after
        those up to p only (speculative decoding).

        Args:
            slot_rows: [R] int32, each slot's row (in range). slot_positions: [R] int32, the
                position of the token it samples from.
            rows, positions, tokens: [N] int32, the step's tokens. generated: [N] bool, as
                ``counted`` took them.

        Returns:
            [R, V] counts and prompt masks, one row per slot.
        """
        later = (
            (rows[None, :] == slot_rows[:, None]) & (positions[None, :] > slot_positions[:, None]) & generated[None, :]
        )
        slots = jnp.arange(slot_rows.shape[0])[:, None]
        counts = self.counts[slot_rows].at[slots, tokens[None, :]].add(-later.astype(jnp.int32))
        return TokenHistory(counts=counts, in_prompt=self.in_prompt[slot_rows])


def uses_penalties(sp: SamplingParams) -> jax.Array:
    """[S] bool: the slot's logits are changed by its penalties."""
    return (sp.presence_penalty != 0) | (sp.frequency_penalty != 0) | (sp.repetition_penalty != 1)


def penalize(logits: jax.Array, sp: SamplingParams, history: TokenHistory) -> jax.Array:
    """The penalized logits [S, V] float32, in vLLM's order: the repetition penalty over the ids
    seen in the prompt or generated (Hugging Face's ``RepetitionPenaltyLogitsProcessor``:
    ``where(x < 0, x * r, x / r)``), then OpenAI's ``x - c * frequency - float(c > 0) * presence``
    with c the generated counts. A slot with neutral values (1, 0, 0) keeps its logits exactly.

    Args:
        logits: [S, V] float32 raw logits.
        sp: per-row parameters (their penalties are read).
        history: [S, V] counts and prompt mask, one row per row of ``logits``.
    """
    rep = sp.repetition_penalty[:, None]
    generated = history.counts > 0
    seen = history.in_prompt | generated
    logits = jnp.where(seen, jnp.where(logits < 0, logits * rep, logits / rep), logits)
    counts = history.counts.astype(jnp.float32)
    return (
        logits - counts * sp.frequency_penalty[:, None] - generated.astype(jnp.float32) * sp.presence_penalty[:, None]
    )


def ban_eos(logits: jax.Array, sp: SamplingParams) -> jax.Array:
    """``logits`` [S, V] with each slot's ``eos_ids`` set to -inf where its ``ban_eos`` is set."""
    V = logits.shape[-1]
    is_eos = jnp.any(jnp.asarray(sp.eos_ids)[:, :, None] == jnp.arange(V, dtype=jnp.int32), axis=1)
    return jnp.where(sp.ban_eos[:, None] & is_eos, -jnp.inf, logits)


def mask_words(vocab_size: int) -> int:
    """W, the int32 words of one row's packed token mask over ``vocab_size`` ids."""
    return (vocab_size + 31) // 32


def apply_token_mask(logits: jax.Array, mask: jax.Array) -> jax.Array:
    """``logits`` [S, V] float32 with the ids the packed mask [S, W] int32 does not allow set to
    NEG_INF (finite, unlike -inf: a masked id's log-probability stays a number). Bit j of word i
    allows id 32 i + j (llguidance's ``allocate_token_bitmask`` layout); bits past V are ignored."""
    V = logits.shape[-1]
    bits = jnp.right_shift(mask[:, :, None], jnp.arange(32, dtype=jnp.int32)) & 1
    return jnp.where(bits.reshape(mask.shape[0], -1)[:, :V] != 0, logits, NEG_INF)


def min_p_filter(logits: jax.Array, min_p: jax.Array | np.ndarray) -> jax.Array:
    """``logits`` [S, V] (already divided by the temperature) with the ids whose probability is
    below ``min_p`` [S] times the row's largest probability set to NEG_INF (Hugging Face's
    ``MinPLogitsWarper``; the most likely id always survives; min_p 0 keeps every id)."""
    probs = jax.nn.softmax(logits, axis=-1)
    top = jnp.max(probs, axis=-1, keepdims=True)
    return jnp.where(probs < min_p[:, None] * top, NEG_INF, logits)


def sequence_seed(seed: int, index: int) -> int:
    """The 64-bit seed of sequence ``index`` of a request that asks for n > 1 sequences.

    Index 0 keeps ``seed`` itself, so the first sequence (and an n = 1 request) draws what the
    request alone would. Index i > 0 gets the i-th output of a SplitMix64 generator seeded
    with ``seed`` (Steele, Lea and Flood 2014, "Fast splittable pseudorandom number
    generators"; the finalizer's constants are Vigna's ``splitmix64.c``): its state advances
    by the golden-ratio gamma 0x9E3779B97F4A7C15 per output, and each state is mixed by two
    xor-shift-multiplies, so neighbouring indices (and seeds) give unrelated keys.

    Args:
        seed: the request's seed (taken modulo 2**64 for i > 0).
        index: the sequence's index, >= 0.

    Returns:
        ``seed`` for index 0, else an int in [0, 2**64).

    Raises:
        ValueError: ``index`` is negative.
    """
    if index < 0:
        raise ValueError(f"index must be >= 0, got {index}")
    if index == 0:
        return seed
    mask = 0xFFFFFFFFFFFFFFFF
    z = (int(seed) + index * 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


def seed_to_key(seed: int) -> np.ndarray:
    """Raw threefry key data [2] uint32 for a 64-bit seed: [high 32 bits, low 32 bits].

    Equal to ``jax.random.key_data(jax.random.PRNGKey(seed))`` for seeds below 2**32, but
    keeps all 64 bits (jax truncates seeds to 32 bits when x64 is off)."""
    seed = int(seed) & 0xFFFFFFFFFFFFFFFF
    return np.array([seed >> 32, seed & 0xFFFFFFFF], dtype=np.uint32)


def _filtered_logits(logits: jax.Array, sp: SamplingParams) -> jax.Array:
    """Temperature-scaled logits [S, V] with tokens outside top-k / top-p set to NEG_INF.

    The ids are ranked by the raw logits, not the scaled ones: dividing by a positive temperature
    keeps their order, except that a huge one (above about 1e37) rounds the scaled logits to equal
    zeros, and a ranking of those ties put id 0 first (top_k = 1 at temperature 1e38 answered
    <|endoftext|> every time). The nucleus is the scaled distribution's, in that order."""
    V = logits.shape[-1]
    temp = jnp.where(sp.temperature > 0, sp.temperature, 1.0)[:, None]
    scaled = logits / temp
    order = jnp.argsort(-logits, axis=-1)  # [S, V] token ids, most likely first
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
    history: TokenHistory | None = None,
    mask: jax.Array | None = None,
) -> jax.Array:
    """Pick one token per slot.

    Args:
        logits: [S, V] float32 raw logits.
        sp: per-row sampling parameters.
        positions: [S] int32, the position the sampled token will occupy (folded into the key,
            so the draw depends only on the request's seed and the position).
        argmax: [S, V] float32 -> [S] int32 with :func:`first_argmax`'s contract, for the
            greedy ids and the Gumbel-max draw; ``model.native.cpu_argmax.first_argmax`` on one CPU
            device, where XLA's reductions are slow.
        history: the ids each row's request has seen ([S, V] arrays, one row per row of
            ``logits``), for the penalties; None: nothing seen (the penalties change nothing).
        mask: [S, W] int32 packed token mask (``apply_token_mask``), one row per row of
            ``logits``; None (or every bit set): nothing masked.

    Returns:
        [S] int32 token ids. Slots with temperature 0 get the argmax of the penalized logits.
        Each stage runs only when some slot needs it (``lax.cond``, ``lax.switch``): the mask,
        the EOS ban and the penalties when a slot is masked, bans or is penalized, the draw when
        a slot samples, the sorts when a sampling slot filters by top-k or top-p, min_p when a
        sampling slot sets it.
    """
    V = logits.shape[-1]
    sampling = sp.temperature > 0
    filters = ((sp.top_k > 0) & (sp.top_k < V)) | (sp.top_p < 1.0)
    # Which filters the sampled slots need: 0 none, 1 top-k/top-p (two sorts over V), 2 min_p,
    # 3 both; one switch, so a batch without them pays for one [S, V] result as before.
    which = jnp.any(filters & sampling).astype(jnp.int32) + 2 * jnp.any((sp.min_p > 0) & sampling).astype(jnp.int32)

    def pick(logits: jax.Array) -> jax.Array:
        greedy = argmax(logits)

        def draw(_: None) -> jax.Array:
            def scaled() -> jax.Array:
                return logits / jnp.where(sampling, sp.temperature, 1.0)[:, None]

            filtered = jax.lax.switch(
                which,
                [
                    scaled,
                    lambda: _filtered_logits(logits, sp),
                    lambda: min_p_filter(scaled(), sp.min_p),
                    lambda: min_p_filter(_filtered_logits(logits, sp), sp.min_p),
                ],
            )
            keys = jax.vmap(jax.random.wrap_key_data)(jnp.asarray(sp.keys))
            step_keys = jax.vmap(jax.random.fold_in)(keys, positions)
            gumbel = jax.vmap(lambda key: jax.random.gumbel(key, logits.shape[-1:], jnp.float32))(step_keys)
            drawn = argmax(filtered + gumbel)
            return jnp.where(sampling, drawn, greedy)

        return jax.lax.cond(jnp.any(sampling), draw, lambda _: greedy, None)

    def processed() -> jax.Array:
        # Rows with every id allowed, no ban and neutral penalties come out unchanged.
        out = ban_eos(logits if mask is None else apply_token_mask(logits, mask), sp)
        return pick(out if history is None else penalize(out, sp, history))

    # The cond returns ids, not logits: a batch without masks, bans or penalties copies no [S, V] array.
    needs = jnp.any(sp.ban_eos)
    if history is not None:
        needs = needs | jnp.any(uses_penalties(sp))
    if mask is not None:
        needs = needs | jnp.any(mask != -1)
    return jax.lax.cond(needs, processed, lambda: pick(logits))
