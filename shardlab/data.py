"""A deterministic synthetic task: sequences from a fixed random Markov chain.

Each token has `branching` possible successors (a table drawn once from the seed); every batch is a pure
function of (seed, step), so any step can be reproduced and a resumed run sees the same data.

What a model can reach: every target follows its input token, so the floor is the chain's conditional entropy,
log(branching) or a little less where a token's successors repeat (1.37 for seed 0, 256 tokens, branching 4;
log 4 = 1.39), down from log(vocab_size) = 5.55 for a model that knows nothing. Measured with the defaults
(tiny model, 16 x 32 tokens per step, lr 2e-2): 5.56 -> 2.0 after the default 30 steps, 1.7 after 60, 1.45
after 200.

The FFN-only model (`model.kind=ffn`, the Scaling Book's blocks with no embeddings) reads each token as a fixed
code vector (`token_code`, no parameters) and regresses the next token's code: its floor is the spread of a
token's successors' codes around their mean.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class Batch(NamedTuple):
  """What a step trains on, already shifted, int32, sharded by the layout (batch over the batch axes, the
  sequence over `length`'s): inputs[B, L], targets[B, L], positions[L]. Every sequence of a batch holds its
  tokens at the same positions (no packed documents), so positions has no batch dim: RoPE's tables are [L, K],
  not [B, L, K]. A reordering of the sequence over devices (context parallelism's load balancing) reorders the
  positions with the tokens."""
  inputs: jax.Array      # the tokens the model reads
  targets: jax.Array     # the token after each input
  positions: jax.Array   # each input's position in its sequence (RoPE; the causal order)


def split(tokens_BL1, order=None) -> Batch:
  """A chain of L+1 tokens per sequence -> inputs [:, :-1], targets [:, 1:], positions 0..L-1; with `order` (a
  permutation of 0..L-1, e.g. `zigzag`) all three in that order: each input keeps its target and its position."""
  b = Batch(tokens_BL1[:, :-1], tokens_BL1[:, 1:], jnp.arange(tokens_BL1.shape[1] - 1, dtype=jnp.int32))
  if order is None:
    return b
  order = jnp.asarray(order)
  return Batch(b.inputs[:, order], b.targets[:, order], b.positions[order])


def zigzag(seq_len: int, parts: int) -> np.ndarray:
  """Causal load balancing over `parts` devices (MaxText's context_parallel_load_balance, the "zigzag" of
  zhuzilin/ring-flash-attention): the sequence cut into 2 x parts chunks, device r holding chunks r and
  2 parts - 1 - r, so every device has as many early (cheap) as late (expensive) queries. Returns the order of
  the original positions: device r's tokens are order[r L/parts : (r+1) L/parts]."""
  if seq_len % (2 * parts):
    raise ValueError(f"zigzag: {seq_len} tokens do not cut into {2 * parts} chunks")
  chunks = np.arange(seq_len).reshape(2 * parts, seq_len // (2 * parts))
  return np.concatenate([np.concatenate([chunks[r], chunks[2 * parts - 1 - r]]) for r in range(parts)])


def striped(seq_len: int, parts: int) -> np.ndarray:
  """Causal load balancing by round robin (Striped Attention, Brandon et al., arXiv:2311.09431): device r holds
  tokens r, r + parts, r + 2 parts, ...; its positions rise along its local sequence, so a kernel that skips blocks
  by their positions skips the upper half of every ring step's blocks, on every device alike. Returns the order
  of the original positions, as zigzag does."""
  if seq_len % parts:
    raise ValueError(f"striped: {seq_len} tokens do not split over {parts} devices")
  return np.arange(seq_len).reshape(seq_len // parts, parts).T.reshape(-1)


def successor_table(seed: int, vocab_size: int, branching: int):
  return jax.random.randint(jax.random.fold_in(jax.random.key(seed), 0), (vocab_size, branching), 0, vocab_size)


def markov_batch(seed: int, step, batch_size: int, seq_len: int, vocab_size: int, branching: int):
  """tokens[B, L+1] int32: inputs are [:, :-1], targets [:, 1:]."""
  succ_VK = successor_table(seed, vocab_size, branching)
  key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), 1), step)
  k_start, k_choice = jax.random.split(key)
  start_B = jax.random.randint(k_start, (batch_size,), 0, vocab_size)
  choice_LB = jax.random.randint(k_choice, (seq_len, batch_size), 0, branching)

  def next_token(tok_B, c_B):
    nxt_B = succ_VK[tok_B, c_B]
    return nxt_B, nxt_B
  _, rest_LB = jax.lax.scan(next_token, start_B, choice_LB)
  return jnp.concatenate([start_B[:, None], rest_LB.T], axis=1).astype(jnp.int32)


def token_code(tokens, d: int):
  """tokens[...] int -> codes[..., d] float32, a fixed function (no parameters): code[v, i] = sin(v a_i + b_i)
  with a_i = 2 pi frac((i + 1) g), g the golden ratio's fraction (frequencies spread over the circle, so every
  dimension tells tokens apart), and b_i = pi / 2 on odd i (a cosine). Each entry has mean square 1/2."""
  i = jnp.arange(d, dtype=jnp.float32)
  a_D = 2 * jnp.pi * jnp.mod((i + 1) * 0.6180339887, 1.0)
  b_D = (jnp.pi / 2) * jnp.mod(i, 2)
  lead = (1,) * tokens.ndim
  return jnp.sin(tokens.astype(jnp.float32)[..., None] * a_D.reshape(*lead, d) + b_D.reshape(*lead, d))


class MarkovData:
  """batch(step) -> Batch, each field placed with `shardings` (a Batch of them: train.batch_specs on the mesh)."""

  def __init__(self, seed: int, batch_size: int, seq_len: int, vocab_size: int, branching: int, shardings=None,
               order=None):
    from shardlab.mesh import compile_helper
    fn = jax.jit(lambda step: split(markov_batch(seed, step, batch_size, seq_len, vocab_size, branching), order),
                 out_shardings=shardings)
    placed = jax.tree.leaves(shardings)
    platform = next(iter(placed[0].device_set)).platform if placed else jax.default_backend()
    self._fn = compile_helper(fn, jnp.int32(0), platform=platform)

  def batch(self, step: int) -> Batch:
    return self._fn(jnp.int32(step))
