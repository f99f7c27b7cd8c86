"""A policy, a dynamic loss scale and jitted fp16 training steps, narrated.

Run: python examples/quickstart.py
"""

import jax
import jax.numpy as jnp
import numpy as np

import jmp_lite as jl


def main() -> None:
  policy = jl.get_policy("params=float32,compute=float16,output=float32")
  print(f"policy: {policy}  (half on {jax.default_backend()} = {jnp.dtype(jl.half_dtype()).name})")

  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(256, 16)), jnp.float32)
  y = x @ jnp.asarray(rng.normal(size=(16, 1)), jnp.float32)
  params = {"w": jnp.zeros((16, 1), jnp.float32), "b": jnp.zeros((1,), jnp.float32)}

  traces = []  # the step's Python body runs once per trace, never on a compiled call

  @jax.jit
  def train_step(params, loss_scale, x, y):
    traces.append(1)

    def loss_fn(p):
      p16, x16 = policy.cast_to_compute((p, x))
      pred = policy.cast_to_output(x16 @ p16["w"] + p16["b"])
      return jnp.mean((pred - y) ** 2)

    # The gradients of loss_scale * loss, in fp16 through the model.
    loss, scaled_grads = loss_scale.value_and_grad(loss_fn)(params)
    # Unscaled in fp32, one finiteness check, the next scale.
    grads, finite, next_scale = loss_scale.unscale_and_adjust(scaled_grads, params)
    new_params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    params = jl.select_tree(finite, new_params, params)  # skip overflowing steps
    return params, next_scale, loss, finite

  # Start too high on purpose: 2^24 * loss overflows fp16, so the first steps
  # are skipped and the scale backs off until gradients are finite.
  loss_scale = jl.DynamicLossScale(jnp.float32(2.0**24), period=20)
  for step in range(60):
    scale_used = float(loss_scale.loss_scale)
    params, loss_scale, loss, finite = train_step(params, loss_scale, x, y)
    if step < 12 or step % 10 == 9:
      status = "applied" if finite else "skipped (overflow)"
      exponent = np.log2(scale_used)
      print(f"step {step:2d}  loss {float(loss):8.4f}  scale 2^{exponent:4.0f}  {status}")
  print(
    f"final loss scale 2^{np.log2(float(loss_scale.loss_scale)):.0f}; params stayed "
    f"{params['w'].dtype} master weights; compiled {len(traces)} time(s)"
  )


if __name__ == "__main__":
  main()
