"""A small flax-nnx transformer trained with optax adam: the demo's and the tests' job.

Deterministic: the batch of step ``s`` depends only on (seed, s), so a run
restored at step ``k`` and retrained gives the same losses as an
uninterrupted run. Works on one process or many (``jax.distributed``): the
mesh spans ``jax.devices()``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
  vocab: int = 64
  dim: int = 32
  heads: int = 4
  layers: int = 2
  seq: int = 16
  batch: int = 8
  lr: float = 1e-2
  seed: int = 0


class Block(nnx.Module):
  def __init__(self, dim: int, heads: int, *, rngs: nnx.Rngs):
    self.norm1 = nnx.LayerNorm(dim, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(heads, dim, decode=False, rngs=rngs)
    self.norm2 = nnx.LayerNorm(dim, rngs=rngs)
    self.up = nnx.Linear(dim, 4 * dim, rngs=rngs)
    self.down = nnx.Linear(4 * dim, dim, rngs=rngs)

  def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
    x = x + self.attn(self.norm1(x), mask=mask)
    return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class TinyTransformer(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.embed = nnx.Embed(cfg.vocab, cfg.dim, rngs=rngs)
    self.blocks = nnx.List([Block(cfg.dim, cfg.heads, rngs=rngs) for _ in range(cfg.layers)])
    self.head = nnx.Linear(cfg.dim, cfg.vocab, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = self.embed(tokens)
    mask = nnx.make_causal_mask(tokens)
    for b in self.blocks:
      x = b(x, mask)
    return self.head(x)


def make_mesh(devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A (data, model) mesh over ``devices`` in their order (default: all
  devices, JAX's choice of order): model = 4 where it divides."""
  n = len(devices) if devices is not None else jax.device_count()
  model = 4 if n % 4 == 0 else 1
  if devices is not None:
    return Mesh(np.array(devices).reshape(n // model, model), ("data", "model"))
  return jax.make_mesh((n // model, model), ("data", "model"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _part(x: np.ndarray, index: Any) -> np.ndarray:
  """``x``'s part at ``index`` (a shard's, for ``make_array_from_callback``)."""
  return x[index]


def _param_spec(x: jax.Array, mesh: Mesh) -> P:
  """FSDP: shard the first dimension that divides over all devices, or model."""
  total = mesh.size
  for axes, size in ((("data", "model"), total), ("model", mesh.shape["model"])):
    for d, n in enumerate(x.shape):
      if n % size == 0 and n >= size:
        spec: list[str | tuple[str, ...] | None] = [None] * x.ndim
        spec[d] = axes
        return P(*spec)
  return P()


class Trainer:
  """Builds the state, the jitted (donating) step and the deterministic data."""

  def __init__(self, cfg: ModelConfig, mesh: Mesh | None = None):
    self.cfg = cfg
    self.mesh = mesh or make_mesh()
    self.tx = optax.adam(cfg.lr)
    model = TinyTransformer(cfg, rngs=nnx.Rngs(cfg.seed))
    self.graphdef, params = nnx.split(model, nnx.Param)
    self._param_shardings = jax.tree.map(
        lambda x: NamedSharding(self.mesh, _param_spec(x, self.mesh)), params)
    self._params_host = jax.tree.map(np.asarray, params)
    self.batch_sharding = NamedSharding(self.mesh, P("data"))
    self.replicated = NamedSharding(self.mesh, P())
    self._step = jax.jit(self._train_step, donate_argnums=0)
    self._compiled: Any = None

  def init_state(self) -> dict[str, Any]:
    params = jax.tree.map(
        lambda x, s: jax.make_array_from_callback(x.shape, s, functools.partial(_part, x)),
        self._params_host, self._param_shardings)
    opt = jax.jit(self.tx.init, out_shardings=self.opt_shardings(params))(params)
    rng = jax.jit(lambda: jax.random.key(self.cfg.seed + 1),
                  out_shardings=NamedSharding(self.mesh, P()))()
    return {"params": params, "opt": opt, "rng": rng}

  def opt_shardings(self, params: Any) -> Any:
    abstract = jax.eval_shape(self.tx.init, params)
    replicated = NamedSharding(self.mesh, P())
    by_shape: dict[tuple[Any, Any], NamedSharding] = {}
    for x, s in zip(jax.tree.leaves(params), jax.tree.leaves(self._param_shardings), strict=True):
      by_shape.setdefault((x.shape, x.dtype), s)
    return jax.tree.map(lambda a: by_shape.get((a.shape, a.dtype), replicated), abstract)

  def abstract_state(self) -> Any:
    """ShapeDtypeStructs with the shardings ``init_state`` produces."""
    sds = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)  # noqa: E731
    params = jax.tree.map(sds, self._params_host, self._param_shardings)
    opt = jax.tree.map(sds, jax.eval_shape(self.tx.init, params),
                       self.opt_shardings(params))
    rng = jax.eval_shape(lambda: jax.random.key(0))
    return {"params": params, "opt": opt,
            "rng": sds(rng, NamedSharding(self.mesh, P()))}

  def batch(self, step: int) -> jax.Array:
    rng = np.random.default_rng([self.cfg.seed, step])
    data = rng.integers(0, self.cfg.vocab, (self.cfg.batch, self.cfg.seq + 1), np.int32)
    return jax.make_array_from_callback(data.shape, self.batch_sharding,
                                        lambda i: data[i])

  def _train_step(self, state: dict[str, Any], batch: jax.Array):
    def loss_fn(params):
      model = nnx.merge(self.graphdef, params)
      logits = model(batch[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    updates, opt = self.tx.update(grads, state["opt"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    rng = jax.random.split(state["rng"])[0]
    return {"params": params, "opt": opt, "rng": rng}, loss

  def compile(self, state: Any) -> None:
    """Compiles the step ahead of time for ``state``'s shapes and shardings,
    so that a process's first step waits on no one's compiler (in place,
    peers' collectives time out on a peer that is still compiling)."""
    batch = jax.ShapeDtypeStruct((self.cfg.batch, self.cfg.seq + 1), np.int32,
                                 sharding=self.batch_sharding)
    self._compiled = self._step.lower(state, batch).compile()

  def step(self, state: dict[str, Any], step: int) -> tuple[dict[str, Any], jax.Array]:
    """One train step on the batch of ``step``; donates ``state``."""
    return (self._compiled or self._step)(state, self.batch(step))
