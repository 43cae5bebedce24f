"""Procedurally generated prompts for `dflash2.data.sources`: reasoning-gym's task families, with a fixed seed.

reasoning-gym (Apache-2.0) is an optional extra (`pip install -e .[sources]`, which pins `reasoning-gym==0.1.25`);
only these sources need it. Each family's item `i` comes from `random.Random(seed + i)` inside reasoning-gym, so a
family's stream is the same on every run and machine. Three sources group the families by the kind of prompt:
- `gym_math`: arithmetic, number theory, short word problems, equations, polynomials, integrals, geometry and
  probability, asked as the math benches ask (`benches.MATH_SUFFIX`), so the target reasons as it does there.
- `gym_logic`: sequences, syllogisms, propositional logic, knights and knaves, relations, small puzzles.
- `gym_algorithms`: interview-style algorithm problems on given data (graphs, grids, matrices, strings, lists)
  and Brainf*ck programs to trace: reasoning about what code computes.
Left out: `gsm_symbolic` (its templates are GSM8K's test problems, the `gsm8k` bench), `codeio` (it executes the
dataset's code; its tasks are the `codeio`, `codeio_complete` and `codeio_explain` sources), and families whose
prompts are pictures, games or word lists rather than math, logic or code (ARC grids, sokoban, rubik's cube...).
Also left out, for reruns to write the same bytes: `polynomial_multiplication`, `intermediate_integration`,
`list_functions`, `isomorphic_strings` and `ransom_note`, whose items change with the interpreter's hash seed; and
`game_of_life`, `n_queens` and `tower_of_hanoi`, most of whose prompts share 13 words with a benchmark prompt (runs
of grid cells, the puzzle's stock rules).
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from typing import Any

REASONING_GYM = "reasoning-gym==0.1.25"
FAMILIES: dict[str, tuple[str, ...]] = {
    # Not gsm_symbolic: its templates are built from GSM8K's test problems, which the gsm8k bench asks.
    "gym_math": (
        "basic_arithmetic",
        "chain_sum",
        "decimal_arithmetic",
        "decimal_chain_sum",
        "fraction_simplification",
        "gcd",
        "lcm",
        "prime_factorization",
        "products",
        "count_primes",
        "power_function",
        "base_conversion",
        "bitwise_arithmetic",
        "complex_arithmetic",
        "count_bits",
        "time_intervals",
        "calendar_arithmetic",
        "leg_counting",
        "dice",
        "simple_equations",
        "polynomial_equations",
        "simple_integration",
        "simple_geometry",
        "advanced_geometry",
        "puzzle24",
        "countdown",
        "cryptarithm",
    ),
    "gym_logic": (
        "number_sequence",
        "knights_knaves",
        "syllogism",
        "propositional_logic",
        "family_relationships",
        "aiw",
        "self_reference",
        "circuit_logic",
        "quantum_lock",
        "jugs",
        "mini_sudoku",
    ),
    "gym_algorithms": (
        "bf",
        "course_schedule",
        "largest_island",
        "rotten_oranges",
        "group_anagrams",
        "palindrome_partitioning",
        "spiral_matrix",
        "rotate_matrix",
        "shortest_path",
        "binary_matrix",
        "string_manipulation",
        "manipulate_matrix",
        "pool_matrix",
        "number_filtering",
        "number_sorting",
    ),
}
# Asked with the math benches' suffix (the rest as generated).
MATH_SOURCES = frozenset({"gym_math"})
# Items generated per call: reasoning-gym builds some families' item pools up front.
CHUNK = 256


def _reasoning_gym() -> Any:
    try:
        import reasoning_gym
    except ImportError as e:
        raise FileNotFoundError(
            f"the gym_* sources generate with reasoning-gym, which is not installed: `pip install {REASONING_GYM}` "
            f"(or `pip install -e .[sources]`)"
        ) from e
    return reasoning_gym


def items(family: str, seed: int) -> Iterator[tuple[int, str, str]]:
    """(index, question, answer) of one family, endlessly, in index order; the same for the same seed.
    Anything the generators print is swallowed: the build logs its own counts."""
    rg = _reasoning_gym()
    start = 0
    while True:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            # Item i is seeded by seed + i, so a chunk starting at `start` is the stream's items start.. onwards.
            dataset = rg.create_dataset(family, seed=seed + start, size=CHUNK)
        for i in range(CHUNK):  # one at a time: some families take 0.1 s an item, and a build may want only a few
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                item = dataset[i]
            yield start + i, str(item["question"]), str(item["answer"])
        start += CHUNK
