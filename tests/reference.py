"""A cache-less dense reference forward of the model, the oracle for the engine's ragged step:
one sequence's whole prompt at once, softmax attention over a causal mask as the textbook writes
it (Vaswani et al. 2017, §3.2.1; query heads sharing KV heads, Ainslie et al. 2023), with no
pages, no attention backend, no window and no flat batch. It shares only the per-token math of
``model.llama`` (norms, projections, RoPE, MLP), which the Hugging Face goldens check
(tests/test_golden.py, tests/test_hf_llama.py); what the engine adds over it (the paged cache,
its writes, ragged batches, the backends) is what the tests hold to it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.llama import Llama, out_and_mlp, project_qkv, rope_tables


def dense_forward(model: Llama, tokens: jax.Array) -> jax.Array:
    """Logits [T, V] float32 of every position of one sequence ``tokens`` [T] int32."""
    cfg = model.cfg
    T = tokens.shape[0]
    x = model.embed_tokens(tokens)[None]  # [1, T, D]
    cos, sin = rope_tables(jnp.arange(T, dtype=jnp.int32)[None], cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    causal = jnp.tril(jnp.ones((T, T), bool))
    weights = model.layers.weights()
    for i in range(cfg.num_layers):
        p = {name: (w[i] if isinstance(w, tuple) else jax.tree.map(lambda a, i=i: a[i], w)) for name, w in weights.items()}
        q, k, v = project_qkv(cfg, x, p, cos, sin, jnp.float32)  # q [1, T, K, G, H] scaled; k, v [1, T, K, H]
        scores = jnp.einsum("tkgh,skh->kgts", q[0], k[0], precision=jax.lax.Precision.HIGHEST)
        probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
        attn = jnp.einsum("kgts,skh->tkgh", probs, v[0], precision=jax.lax.Precision.HIGHEST)
        x = out_and_mlp(cfg, x, p, attn[None])
    return model.logits(x[0])


def dense_logits(graphdef: nnx.GraphDef, params: Any, tokens: list[int] | np.ndarray) -> np.ndarray:
    """``dense_forward`` of a model's graph and parameters (stacked, as ``random_llama`` makes
    them) over ``tokens``: logits [T, V] float32 on the host."""
    return np.asarray(_jitted(graphdef)(params, jnp.asarray(tokens, jnp.int32)))


_cache: dict[Any, Any] = {}


def _jitted(graphdef: nnx.GraphDef) -> Any:
    if graphdef not in _cache:
        _cache[graphdef] = jax.jit(lambda params, tokens: dense_forward(nnx.merge(graphdef, params), tokens))
    return _cache[graphdef]
