"""Text from a trained byte-level GPT: ``python -m train.sample RUN_DIR [--prompt TEXT]``.

The run folder's ``config.json`` rebuilds the model and its ``params.msgpack`` (written when
a run completes) gives the parameters. Generation continues ``--prompt`` one byte at a time:
each step feeds the last ``seq_len`` bytes and draws the next byte from the softmax of the
last position's logits divided by ``--temperature`` (``0``: the most likely byte, greedy).
The prompt and its continuation are written to standard output as the bytes the model made.

    python -m train.sample runs/dp_default --prompt "ROMEO:" --length 300 --temperature 0.8
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

from . import RUN

__all__ = ["SampleError", "generate", "load_run", "main"]

# Byte-level text: one token per byte value.
BYTE_VOCAB = 256


class SampleError(ValueError):
    """A run folder that cannot be sampled from (the message says why, in one line)."""


# The most bytes one call generates (one compiled step a byte: about a minute on a CPU).
MAX_LENGTH = 100_000


def load_run(run_dir: str | Path) -> tuple[Any, Any]:
    """The :class:`models.Task` and trained parameters of the GPT run in ``run_dir``.

    Raises :class:`SampleError` when the folder has no ``config.json`` or
    ``params.msgpack``, is not a byte-level GPT run, or its parameters do not fit its
    config.
    """
    import jax

    from .checkpoint import load_model_params
    from .config import config_from_dict, read_saved_config

    run_dir = Path(run_dir)
    saved = run_dir / "config.json"
    if not saved.is_file():
        what = "does not exist" if not run_dir.exists() else "has no config.json"
        raise SampleError(f"{str(run_dir)!r} {what}: not a training run's folder")
    try:
        cfg = config_from_dict(read_saved_config(saved))
    except ValueError as e:
        raise SampleError(f"{str(saved)!r}: {str(e).splitlines()[0]}") from None
    if cfg.task != "gpt":
        raise SampleError(
            f"{str(run_dir)!r} trained task {cfg.task!r} on {cfg.dataset!r}, not a GPT: "
            "train.sample generates text from GPT runs only (task: gpt)"
        )
    task = cfg.model.build()
    gpt = task.module.cfg
    if gpt.vocab_size != BYTE_VOCAB:
        raise SampleError(
            f"{str(run_dir)!r}: the GPT has vocab_size={gpt.vocab_size}, not a byte-level "
            f"model ({BYTE_VOCAB} tokens), so its tokens are not text bytes"
        )
    path = run_dir / "params.msgpack"
    if not path.is_file():
        raise SampleError(
            f"{str(run_dir)!r} has no params.msgpack (a run writes it when it completes); "
            f"finish the run first: {RUN} --resume {run_dir}"
        )
    # The template's values are overwritten; the rbg generator initialises fast.
    tokens = np.zeros((1, gpt.seq_len + 1), np.int32)
    template = task.init(jax.random.key(0, impl="rbg"), {"tokens": tokens})
    try:
        params = load_model_params(path, template)
    except ValueError as e:
        raise SampleError(f"{str(path)!r} does not fit the run's config.json: {e}") from None
    except Exception as e:  # a truncated or foreign file: msgpack's own errors vary
        raise SampleError(f"{str(path)!r} is not a readable parameter file ({e})") from None
    return task, params


def generate(
    task: Any,
    params: Any,
    prompt: bytes | list[int] | np.ndarray,
    length: int,
    *,
    temperature: float = 1.0,
    seed: int = 0,
) -> np.ndarray:
    """``uint8[length]``: the bytes the GPT of ``task`` continues ``prompt`` with.

    Each new byte is drawn from ``softmax(logits / temperature)`` of the last position, the
    model seeing the last ``seq_len`` bytes; ``temperature=0`` takes the argmax instead.
    Draw ``i`` uses ``fold_in(key(seed), i)``, so a seed gives the same text every time.
    """
    import jax
    import jax.numpy as jnp

    context = np.frombuffer(prompt, np.uint8) if isinstance(prompt, bytes) else prompt
    context = np.asarray(context, np.int32).reshape(-1)
    if context.size == 0:
        raise ValueError("prompt must hold at least one byte")
    vocab = task.module.cfg.vocab_size
    if context.min() < 0 or context.max() >= vocab:
        raise ValueError(f"prompt tokens must be in [0, {vocab}), got {context.tolist()}")
    if length < 0:
        raise ValueError(f"length must be >= 0, got {length}")
    if not np.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
    seq_len = task.module.cfg.seq_len
    key = jax.random.key(seed)

    # One program for every step: the context sits left-aligned in a window of seq_len
    # positions; causal attention keeps the padding after it out of its logits.
    @jax.jit
    def next_token(window: jax.Array, used: jax.Array, i: jax.Array) -> jax.Array:
        logits = task.module.apply({"params": params}, window[None])[0, used - 1]
        if temperature == 0:
            return jnp.argmax(logits)
        return jax.random.categorical(jax.random.fold_in(key, i), logits / temperature)

    out = np.concatenate([context, np.zeros(length, np.int32)])
    start = context.size
    for i in range(length):
        recent = out[max(0, start + i - seq_len) : start + i]
        window = np.zeros(seq_len, np.int32)
        window[: recent.size] = recent
        out[start + i] = int(next_token(window, recent.size, i))
    return out[start:].astype(np.uint8)


def parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m train.sample``."""
    p = argparse.ArgumentParser(prog=f"{RUN}.sample", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", metavar="DIR", help="a GPT run's folder (config.json, params)")
    p.add_argument("--prompt", default="\n", help="the text to continue (default: a newline)")
    p.add_argument("--length", type=int, default=200, help="bytes to generate (default: 200)")
    p.add_argument(
        "--temperature",
        type=float,
        default=0.8,
        help="softmax temperature of each draw; 0 takes the most likely byte (default: 0.8)",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed of the draws (default: 0)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, load the run, write the prompt and its continuation to stdout."""
    args = parser().parse_args(argv)
    prompt = args.prompt.encode("utf-8", "surrogateescape")  # the bytes as given
    problem = None
    if not prompt:
        problem = "--prompt must hold at least one character"
    elif not 0 <= args.length <= MAX_LENGTH:
        problem = f"--length must be in [0, {MAX_LENGTH:,}], got {args.length}"
    elif not np.isfinite(args.temperature) or args.temperature < 0:
        problem = f"--temperature must be a finite number >= 0, got {args.temperature}"
    elif not 0 <= args.seed < 2**32:
        problem = f"--seed must be in [0, 2**32), got {args.seed}"
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        task, params = load_run(args.run_dir)
    except SampleError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    text = generate(task, params, prompt, args.length, temperature=args.temperature, seed=args.seed)
    sys.stdout.buffer.write(prompt + text.tobytes() + b"\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
