"""A character-level transformer language model trained on Python's own standard library.

The corpus is real text present on every machine that runs this script: the
source files of the running interpreter's standard library listed in
:data:`CORPUS_FILES` (read from ``sysconfig.get_paths()["stdlib"]``, in that
order, as UTF-8). Characters are their ASCII codes (vocabulary of 128); the
few non-ASCII characters (in comments and docstrings) map to code 0. Each file
is split at 90% of its characters: the first part goes to the training text,
the rest to the validation text, so both cover every file. The files differ
between Python versions, so results are reproducible for one version (the
recorded run in docs/examples.md used the version it names).

Training batches are random windows of ``seq_len + 1`` characters from the
training text, drawn from ``numpy.random.default_rng([seed, step])``, so every
recipe sees the same batches. Validation uses ``eval_windows`` windows spaced
evenly through the validation text.

The model is a pre-LayerNorm decoder-only transformer (learned positions,
causal multi-head attention, GELU MLP) written with no dtypes in it: the
precision comes from outside (:func:`jmp_lite.flax.policy_apply`). It calls
:func:`jmp_lite.stage_boundary` between its stages (embedding, each block, the
head), the identity except under layer-wise loss scaling.

Run: python -m examples.charlm                      (bf16 on CPU, ~2 minutes on 2 cores)
     python -m examples.charlm --recipe fp16-dynamic --replicas 4096
     python -m examples.charlm --recipe fp8          (fp8 matmuls, current scaling)
     python -m examples.charlm --recipe fp8 --fp8-scaling delayed
     python -m examples.charlm --preset accelerator  (bigger model, longer; GPU/TPU)
     python -m examples.charlm --help
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sysconfig
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_lite as jl
from examples import common

CORPUS_FILES: tuple[str, ...] = (
  "argparse.py",
  "ast.py",
  "collections/__init__.py",
  "contextlib.py",
  "dataclasses.py",
  "difflib.py",
  "enum.py",
  "fractions.py",
  "functools.py",
  "heapq.py",
  "random.py",
  "shutil.py",
  "statistics.py",
  "textwrap.py",
  "threading.py",
  "tokenize.py",
)
"""Standard library files making up the corpus, relative to the stdlib directory."""

TRAIN_FRACTION = 0.9
VOCAB = 128
GLOBAL_BATCH_TOKENS = 2**19
"""The global batch of the underflow scenario (examples.compare): 524,288 tokens, the batch
of GPT-3 Small; each step here is one replica's share of it (--replicas)."""


def read_corpus(stdlib_dir: str | None = None) -> tuple[np.ndarray, np.ndarray]:
  """(train, validation) character codes (uint8) of :data:`CORPUS_FILES`."""
  stdlib_dir = stdlib_dir or sysconfig.get_paths()["stdlib"]
  train, val = [], []
  for name in CORPUS_FILES:
    with open(os.path.join(stdlib_dir, name), encoding="utf-8") as f:
      text = f.read()
    codes = np.frombuffer(text.encode("utf-32-le"), np.uint32)
    codes = np.where(codes < VOCAB, codes, 0).astype(np.uint8)
    cut = int(len(codes) * TRAIN_FRACTION)
    train.append(codes[:cut])
    val.append(codes[cut:])
  return np.concatenate(train), np.concatenate(val)


class Block(nn.Module):
  """Pre-LayerNorm transformer block: causal self-attention and a GELU MLP."""

  width: int
  heads: int

  @nn.compact
  def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
    h = nn.LayerNorm(name="norm1")(x)
    x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads, name="attn")(h, h, mask=mask)
    h = nn.LayerNorm(name="norm2")(x)
    h = nn.gelu(nn.Dense(4 * self.width, name="mlp_in")(h))
    return x + nn.Dense(self.width, name="mlp_out")(h)


class CharLM(nn.Module):
  """Decoder-only character LM; stages: embedding, one per block, head."""

  vocab: int = VOCAB
  width: int = 64
  depth: int = 2
  heads: int = 4
  seq_len: int = 64

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = nn.Embed(self.vocab, self.width, name="embed")(tokens)
    pos = self.param("pos", nn.initializers.normal(0.02), (self.seq_len, self.width))
    x = x + pos[: tokens.shape[-1]]
    mask = nn.make_causal_mask(tokens)
    for i in range(self.depth):
      # Boundary i: between stage i and stage i + 1 (identity unless layer-wise).
      x = jl.stage_boundary(x, i)
      x = Block(self.width, self.heads, name=f"block_{i}")(x, mask)
    x = jl.stage_boundary(x, self.depth)
    return nn.Dense(self.vocab, name="head")(nn.LayerNorm(name="norm")(x))


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  width: int = 64
  depth: int = 2
  heads: int = 4
  seq_len: int = 64
  batch_size: int = 32
  eval_windows: int = 256


PRESETS: dict[str, tuple[ModelConfig, common.TrainConfig]] = {
  # About 2 minutes for one recipe on 2 CPU cores (examples.compare runs 200 steps).
  "cpu": (ModelConfig(), common.TrainConfig(steps=1000, learning_rate=3e-3, eval_every=100)),
  # For tests: seconds.
  "quick": (
    ModelConfig(width=32, depth=1, heads=2, seq_len=32, batch_size=16, eval_windows=32),
    common.TrainConfig(
      steps=30, learning_rate=3e-3, eval_every=15, stats_every=15, fast_compile=True
    ),
  ),
  # A GPU/TPU: a wider, deeper model for longer.
  "accelerator": (
    ModelConfig(width=256, depth=4, heads=8, seq_len=256, batch_size=64, eval_windows=1024),
    common.TrainConfig(steps=3000, learning_rate=1e-3, warmup_steps=200, eval_every=250),
  ),
}


class CharLMTask(common.Task):
  """Next-character prediction on the stdlib corpus."""

  name = "charlm"
  metric = "bpc"
  stages = "embedding, each block, head"

  def __init__(self, model_config: ModelConfig, seed: int = 0):
    self.config = model_config
    self.seed = seed
    self.train_text, self.val_text = read_corpus()
    c = model_config
    self.model = CharLM(width=c.width, depth=c.depth, heads=c.heads, seq_len=c.seq_len)
    window = c.seq_len + 1
    starts = np.linspace(0, len(self.val_text) - window, c.eval_windows).astype(np.int64)
    self._val = np.stack([self.val_text[s : s + window] for s in starts])

  def init_inputs(self):
    return (jnp.zeros((1, self.config.seq_len), jnp.int32),)

  def train_batch(self, step: int) -> common.Batch:
    c = self.config
    rng = np.random.default_rng([self.seed, step])
    starts = rng.integers(0, len(self.train_text) - c.seq_len - 1, c.batch_size)
    windows = np.stack([self.train_text[s : s + c.seq_len + 1] for s in starts])
    return {"tokens": windows.astype(np.int32)}

  def eval_batches(self) -> list[common.Batch]:
    size = max(self.config.batch_size, 64)
    return [
      {"tokens": self._val[i : i + size].astype(np.int32)} for i in range(0, len(self._val), size)
    ]

  def model_args(self, batch, train):
    return (batch["tokens"][:, :-1],), {}

  def loss_terms(self, outputs, batch):
    targets = batch["tokens"][:, 1:]
    logits = outputs.astype(jnp.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return {
      "loss": jnp.sum(losses),
      "count": jnp.asarray(losses.size, jnp.float32),
      "correct": jnp.sum(jnp.argmax(logits, -1) == targets).astype(jnp.float32),
    }

  def param_stages(self, params):
    depth = self.config.depth
    stages = {"embed": 0, "pos": 0, "norm": depth + 1, "head": depth + 1}
    stages.update({f"block_{i}": i + 1 for i in range(depth)})
    return stages


def bits_per_char(loss_nats: float) -> float:
  return loss_nats / math.log(2)


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    prog="python -m examples.charlm",
    description="Train a character-level transformer LM on Python's standard library sources "
    "under one mixed precision recipe.",
  )
  parser.add_argument("--recipe", default="half", help=common.recipe_help())
  common.add_preset_arguments(parser, PRESETS)
  g = parser.add_argument_group("model (defaults: the CPU preset's)")
  helps = {
    "width": "model width",
    "depth": "transformer blocks",
    "heads": "attention heads",
    "seq_len": "characters per training window",
    "batch_size": "windows per step",
    "eval_windows": "validation windows",
  }
  cpu = PRESETS["cpu"][0]
  for name, text in helps.items():
    flag = f"--{name.replace('_', '-')}"
    g.add_argument(flag, type=int, default=None, help=f"{text} ({getattr(cpu, name)})")
  common.add_train_arguments(parser, PRESETS["cpu"][1])
  parser.add_argument("--json", help="write the run's results to this JSON file")
  return parser


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  parser = build_parser()
  args = parser.parse_args(argv)
  platform = common.select_platform(args.platform)
  model_config, train_config = common.resolve_configs(args, PRESETS, platform)
  recipe = common.get_recipe(args.recipe)
  print(f"platform: {common.describe_platform()}")
  print(f"recipe: {recipe.name} ({recipe.summary})")
  task = CharLMTask(model_config, seed=train_config.seed)
  print(
    f"corpus: {len(CORPUS_FILES)} stdlib files, {len(task.train_text):,} train / "
    f"{len(task.val_text):,} validation characters"
  )
  result = common.train(task, recipe, train_config)
  f = result.final
  print(
    f"train loss {f['train_loss']:.3f} ({bits_per_char(f['train_loss']):.3f} bpc), "
    f"val loss {f['val_loss']:.3f} ({bits_per_char(f['val_loss']):.3f} bpc), "
    f"val accuracy {f['val_accuracy']:.3f}, skipped {len(result.skipped)} steps, "
    f"{result.step_time_ms:.1f} ms/step"
  )
  out = {"model": dataclasses.asdict(model_config), "result": result.as_dict()}
  if args.json:
    with open(args.json, "w") as fh:
      json.dump(out, fh)
  return out


if __name__ == "__main__":
  main()
