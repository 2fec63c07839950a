"""The function library swe-lite builds its packages from: correct source, injectable bugs, input generators.

Each :class:`Template` is one function (``{fn}`` is its name in the generated package). A mutation is
``(description, old, new)``: ``old`` occurs exactly once in the correct source, ``new`` exactly once in the buggy
one, so the known fix is the string replacement ``new -> old`` (checked by the generator for every task).
Standard library only.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass
from typing import Callable

__all__ = ["Template", "TEMPLATES"]


@dataclass(frozen=True)
class Template:
    key: str
    names: tuple[str, ...]
    source: str
    mutations: tuple[tuple[str, str, str], ...]
    inputs: Callable[[random.Random], tuple]


def _word(rng: random.Random, lo: int = 2, hi: int = 8, alphabet: str = string.ascii_lowercase) -> str:
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(lo, hi)))


def _sentence(rng: random.Random, vocab=("apple", "Pear", "fig", "PLUM", "kiwi", "apple", "Fig")) -> str:
    return " ".join(rng.choice(vocab) for _ in range(rng.randint(1, 7)))


def _palindrome_input(rng: random.Random) -> tuple:
    if rng.random() < 0.5:
        return (_word(rng, 1, 8, "abcd"),)
    half = _word(rng, 1, 4, "abc")
    core = half + rng.choice(["", "x"]) + half[::-1]
    core = "".join(ch.upper() if rng.random() < 0.3 else ch for ch in core)
    pos = rng.randint(0, len(core))
    return (core[:pos] + rng.choice([" ", ", ", "-", ""]) + core[pos:],)


TEMPLATES: tuple[Template, ...] = (
    Template("clamp", ("clamp", "bound", "limit_to"), '''def {fn}(x, lo, hi):
    """Limit x to the closed interval [lo, hi]."""
    if x < lo:
        return lo
    if x > hi:
        return hi
    return x
''', (("the upper bound is ignored", "if x > hi:\n        return hi", "if x > hi:\n        return x"),
      ("values below the range come back as the upper bound", "if x < lo:\n        return lo",
       "if x < lo:\n        return hi")),
        lambda r: (r.randint(-40, 40), r.randint(-20, 0), r.randint(1, 20))),
    Template("total", ("total_price", "order_total", "basket_total"), '''def {fn}(items, discount_percent=0):
    """Total of (quantity, unit_price) pairs after a percentage discount, rounded to cents."""
    subtotal = 0
    for quantity, unit_price in items:
        subtotal += quantity * unit_price
    return round(subtotal * (100 - discount_percent) / 100, 2)
''', (("quantities are added to prices", "subtotal += quantity * unit_price",
       "subtotal += quantity + unit_price"),
      ("the discount increases the total", "(100 - discount_percent)", "(100 + discount_percent)")),
        lambda r: ([(r.randint(1, 5), r.randint(1, 50)) for _ in range(r.randint(1, 4))], r.choice([0, 10, 25, 50]))),
    Template("vowels", ("count_vowels", "vowel_count", "num_vowels"), '''def {fn}(text):
    """Number of vowels (a, e, i, o, u; any case) in text."""
    count = 0
    for ch in text.lower():
        if ch in "aeiou":
            count += 1
    return count
''', (("upper-case vowels are not counted", "for ch in text.lower():", "for ch in text:"),
      ("'u' is not counted", 'if ch in "aeiou":', 'if ch in "aeio":')),
        lambda r: (_word(r, 1, 12, "aeiouAEIOUbcdt"),)),
    Template("fizzbuzz", ("fizzbuzz", "fizz_buzz", "fb_label"), '''def {fn}(n):
    """'Fizz' for multiples of 3, 'Buzz' for multiples of 5, 'FizzBuzz' for both, else str(n)."""
    if n % 15 == 0:
        return "FizzBuzz"
    if n % 3 == 0:
        return "Fizz"
    if n % 5 == 0:
        return "Buzz"
    return str(n)
''', (("multiples of 10 are reported as FizzBuzz", "if n % 15 == 0:", "if n % 10 == 0:"),
      ("Buzz is reported for the wrong numbers", 'if n % 5 == 0:\n        return "Buzz"',
       'if n % 5 == 1:\n        return "Buzz"')),
        lambda r: (r.randint(1, 100),)),
    Template("palindrome", ("is_palindrome", "reads_same_backwards", "palindromic"), '''def {fn}(text):
    """True if text reads the same backwards, ignoring case and non-alphanumeric characters."""
    cleaned = [ch.lower() for ch in text if ch.isalnum()]
    return cleaned == cleaned[::-1]
''', (("punctuation and spaces are not ignored", "for ch in text if ch.isalnum()]", "for ch in text]"),
      ("case is not ignored", "[ch.lower() for ch", "[ch for ch")),
        _palindrome_input),
    Template("running_max", ("running_max", "prefix_max", "cumulative_max"), '''def {fn}(values):
    """List of max(values[:i + 1]) for every i."""
    out = []
    best = None
    for v in values:
        if best is None or v > best:
            best = v
        out.append(best)
    return out
''', (("it tracks the minimum instead", "if best is None or v > best:", "if best is None or v < best:"),
      ("it returns the values themselves", "out.append(best)", "out.append(v)")),
        lambda r: ([r.randint(-20, 20) for _ in range(r.randint(2, 8))],)),
    Template("chunk", ("chunk", "batched", "split_every"), '''def {fn}(items, size):
    """Split items into consecutive lists of length size (the last one may be shorter)."""
    return [items[i:i + size] for i in range(0, len(items), size)]
''', (("the last chunk is dropped", "range(0, len(items), size)", "range(0, len(items) - size, size)"),
      ("chunks are one element short", "items[i:i + size]", "items[i:i + size - 1]")),
        lambda r: ([r.randint(0, 9) for _ in range(r.randint(1, 10))], r.randint(2, 4))),
    Template("median", ("median", "middle_value", "med"), '''def {fn}(values):
    """Median of a non-empty list of numbers."""
    ordered = sorted(values)
    mid = len(ordered) // 2
    if len(ordered) % 2 == 1:
        return ordered[mid]
    return (ordered[mid - 1] + ordered[mid]) / 2
''', (("the input is not sorted first", "ordered = sorted(values)", "ordered = list(values)"),
      ("even-length inputs return the upper middle", "return (ordered[mid - 1] + ordered[mid]) / 2",
       "return ordered[mid]")),
        lambda r: ([r.randint(-30, 30) for _ in range(r.randint(2, 7))],)),
    Template("dedupe", ("dedupe", "unique_in_order", "drop_repeats"), '''def {fn}(items):
    """items without repeats, keeping the first occurrence of each, in order."""
    seen = set()
    out = []
    for item in items:
        if item not in seen:
            seen.add(item)
            out.append(item)
    return out
''', (("repeats are kept", "            seen.add(item)\n            out.append(item)",
       "            out.append(item)"),
      ("the order is lost", "    return out\n", "    return sorted(out)\n")),
        lambda r: ([r.randint(0, 6) for _ in range(r.randint(2, 9))],)),
    Template("rle", ("rle_encode", "run_length", "compress_runs"), '''def {fn}(text):
    """Run-length encoding: 'aaab' -> 'a3b1'."""
    if not text:
        return ""
    out = []
    current, count = text[0], 1
    for ch in text[1:]:
        if ch == current:
            count += 1
        else:
            out.append(current + str(count))
            current, count = ch, 1
    out.append(current + str(count))
    return "".join(out)
''', (("runs after the first are counted one short", "current, count = ch, 1", "current, count = ch, 0"),
      ("the last run is missing", "    out.append(current + str(count))\n    return", "    return")),
        lambda r: (_word(r, 2, 10, "aab"),)),
    Template("caesar", ("caesar", "rotate_letters", "shift_text"), '''def {fn}(text, shift):
    """Shift lower-case letters by shift places, wrapping around; other characters unchanged."""
    out = []
    for ch in text:
        if "a" <= ch <= "z":
            out.append(chr((ord(ch) - ord("a") + shift) % 26 + ord("a")))
        else:
            out.append(ch)
    return "".join(out)
''', (("letters wrap around at the wrong place", "% 26 + ord", "% 25 + ord"),
      ("'z' is never shifted", 'if "a" <= ch <= "z":', 'if "a" <= ch < "z":')),
        lambda r: (_word(r, 3, 10, "abxyz qrs"), r.randint(1, 30))),
    Template("factorial", ("factorial", "fact", "product_upto"), '''def {fn}(n):
    """n! for n >= 0."""
    result = 1
    for k in range(2, n + 1):
        result *= k
    return result
''', (("the last factor is missing", "range(2, n + 1)", "range(2, n)"),
      ("factors are added instead of multiplied", "result *= k", "result += k")),
        lambda r: (r.randint(0, 12),)),
    Template("word_count", ("word_count", "word_frequencies", "count_words"), '''def {fn}(text):
    """How often each whitespace-separated word occurs, case-insensitively: {{word: count}}."""
    counts = {{}}
    for word in text.lower().split():
        counts[word] = counts.get(word, 0) + 1
    return counts
''', (("words are counted case-sensitively", "for word in text.lower().split():", "for word in text.split():"),
      ("repeated words are counted once", "counts.get(word, 0) + 1", "counts.get(word, 1)")),
        lambda r: (_sentence(r),)),
    Template("gcd", ("gcd", "greatest_common_divisor", "hcf"), '''def {fn}(a, b):
    """Greatest common divisor of two positive integers."""
    while b:
        a, b = b, a % b
    return a
''', (("the loop stops one step early", "while b:", "while b > 1:"),
      ("the remainder is taken the wrong way round", "a, b = b, a % b", "a, b = b, b % a")),
        lambda r: (r.randint(1, 60) * r.choice([1, 2, 3, 6]), r.randint(1, 60))),
    Template("squash", ("squash_spaces", "normalize_whitespace", "collapse_blanks"), '''def {fn}(text):
    """Collapse runs of whitespace to single spaces and strip both ends."""
    return " ".join(text.split())
''', (("runs of spaces are kept", '" ".join(text.split())', '" ".join(text.split(" "))'),
      ("words are glued together", '" ".join(text.split())', '"".join(text.split())')),
        lambda r: ("".join(r.choice(["ab", " ", "  ", "cd", "\t", "e"]) for _ in range(r.randint(2, 8))),)),
    Template("fahrenheit", ("to_fahrenheit", "c_to_f", "celsius_to_fahrenheit"), '''def {fn}(celsius):
    """Degrees Celsius to degrees Fahrenheit, rounded to one decimal."""
    return round(celsius * 9 / 5 + 32, 1)
''', (("the conversion factor is inverted", "celsius * 9 / 5 + 32", "celsius * 5 / 9 + 32"),
      ("the offset is added before scaling", "celsius * 9 / 5 + 32", "(celsius + 32) * 9 / 5")),
        lambda r: (r.randint(-40, 110),)),
)
