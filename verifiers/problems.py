"""The project's own code task set: small functions, each with a reference and hidden inputs.

A problem's hidden tests are its inputs; the expected outputs come from the reference solution,
run here in our process (trusted code), and never enter the sandbox or a prompt.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Problem:
    entry: str
    signature: str
    description: str
    reference: Callable[..., Any]
    inputs: tuple[tuple[Any, ...], ...]

    def cases(self) -> list[tuple[list[Any], Any]]:
        return [(list(args), self.reference(*args)) for args in self.inputs]


def _fizz(n: int) -> list[str]:
    words = {3: "Fizz", 5: "Buzz", 15: "FizzBuzz"}
    return [
        words.get(15 if i % 15 == 0 else 5 if i % 5 == 0 else 3 if i % 3 == 0 else 0, str(i))
        for i in range(1, n + 1)
    ]


def _rle(text: str) -> str:
    out: list[str] = []
    for ch in text:
        if out and out[-1][-1] == ch:
            out[-1] = out[-1] + ch
        else:
            out.append(ch)
    return "".join(f"{len(run)}{run[0]}" for run in out)


def _balanced(text: str) -> bool:
    pairs, stack = {")": "(", "]": "[", "}": "{"}, []
    for ch in text:
        if ch in "([{":
            stack.append(ch)
        elif ch in pairs and (not stack or stack.pop() != pairs[ch]):
            return False
    return not stack


def _primes(n: int) -> list[int]:
    return [k for k in range(2, n + 1) if all(k % d for d in range(2, int(k**0.5) + 1))]


def _roman(n: int) -> str:
    table = [
        (1000, "M"),
        (900, "CM"),
        (500, "D"),
        (400, "CD"),
        (100, "C"),
        (90, "XC"),
        (50, "L"),
        (40, "XL"),
        (10, "X"),
        (9, "IX"),
        (5, "V"),
        (4, "IV"),
        (1, "I"),
    ]
    out = ""
    for value, numeral in table:
        count, n = divmod(n, value)
        out += numeral * count
    return out


def _merge(a: list[int], b: list[int]) -> list[int]:
    return sorted(a + b)


def _flatten(items: list[Any]) -> list[Any]:
    flat: list[Any] = []
    for item in items:
        flat.extend(_flatten(item) if isinstance(item, list) else [item])
    return flat


def _second_largest(values: list[int]) -> int | None:
    distinct = sorted(set(values))
    return distinct[-2] if len(distinct) > 1 else None


PROBLEMS: tuple[Problem, ...] = (
    Problem(
        "add",
        "add(a: int, b: int) -> int",
        "Return the sum of a and b.",
        lambda a, b: a + b,
        ((1, 2), (-5, 5), (100, 23), (0, 0)),
    ),
    Problem(
        "is_even",
        "is_even(n: int) -> bool",
        "Return True if n is even.",
        lambda n: n % 2 == 0,
        ((0,), (7,), (-4,), (13,), (22,)),
    ),
    Problem(
        "reverse_string",
        "reverse_string(s: str) -> str",
        "Return s reversed.",
        lambda s: s[::-1],
        (("abc",), ("",), ("racecar",), ("Hello, world",)),
    ),
    Problem(
        "count_vowels",
        "count_vowels(s: str) -> int",
        "Return how many characters of s are vowels (a, e, i, o, u, either case).",
        lambda s: sum(c in "aeiouAEIOU" for c in s),
        (("hello",), ("AEIOU xyz",), ("",), ("rhythm",)),
    ),
    Problem(
        "factorial",
        "factorial(n: int) -> int",
        "Return n! for n >= 0.",
        math.factorial,
        ((0,), (1,), (5,), (10,)),
    ),
    Problem(
        "fizzbuzz",
        "fizzbuzz(n: int) -> list[str]",
        "Return the FizzBuzz strings for 1..n: 'Fizz' for multiples of 3, 'Buzz' for "
        "multiples of 5, 'FizzBuzz' for both, else the number as a string.",
        _fizz,
        ((1,), (5,), (15,), (16,)),
    ),
    Problem(
        "max_of_list",
        "max_of_list(values: list[int]) -> int",
        "Return the largest value of a non-empty list.",
        max,
        (([3, 1, 2],), ([-7, -3, -9],), ([5],), ([2, 9, 9, 1],)),
    ),
    Problem(
        "is_palindrome",
        "is_palindrome(s: str) -> bool",
        "Return True if s reads the same backwards, ignoring case and non-letters.",
        lambda s: (t := [c.lower() for c in s if c.isalpha()]) == t[::-1],
        (("Racecar",), ("A man, a plan, a canal: Panama",), ("hello",), ("",)),
    ),
    Problem(
        "sum_digits",
        "sum_digits(n: int) -> int",
        "Return the sum of the decimal digits of abs(n).",
        lambda n: sum(int(d) for d in str(abs(n))),
        ((0,), (123,), (-905,), (99999,)),
    ),
    Problem(
        "run_length",
        "run_length(s: str) -> str",
        "Run-length encode s: each run of a repeated character becomes its count followed "
        "by the character, e.g. 'aaab' -> '3a1b'.",
        _rle,
        (("aaab",), ("",), ("abc",), ("zzzzzzzzzzzz",)),
    ),
    Problem(
        "balanced",
        "balanced(s: str) -> bool",
        "Return True if the brackets ()[]{} in s are balanced and properly nested.",
        _balanced,
        (("([]{})",), ("([)]",), ("",), ("((",), ("a(b)c",)),
    ),
    Problem(
        "primes_up_to",
        "primes_up_to(n: int) -> list[int]",
        "Return the primes <= n in increasing order.",
        _primes,
        ((1,), (2,), (20,), (50,)),
    ),
    Problem(
        "to_roman",
        "to_roman(n: int) -> str",
        "Return the Roman numeral of 1 <= n <= 3999.",
        _roman,
        ((1,), (4,), (1994,), (3999,), (58,)),
    ),
    Problem(
        "merge_sorted",
        "merge_sorted(a: list[int], b: list[int]) -> list[int]",
        "Merge two sorted lists into one sorted list.",
        _merge,
        (([1, 3], [2, 4]), ([], [1]), ([5, 6], []), ([1, 1], [1])),
    ),
    Problem(
        "flatten",
        "flatten(items: list) -> list",
        "Flatten arbitrarily nested lists into one list, keeping order.",
        _flatten,
        (([1, [2, [3, 4]], 5],), ([],), ([[[]]],), ([["a"], "b"],)),
    ),
    Problem(
        "second_largest",
        "second_largest(values: list[int]) -> int | None",
        "Return the second largest distinct value, or None if there is none.",
        _second_largest,
        (([1, 2, 3],), ([5, 5],), ([],), ([4, 1, 4, 3],)),
    ),
    Problem(
        "word_count",
        "word_count(s: str) -> int",
        "Return the number of whitespace-separated words in s.",
        lambda s: len(s.split()),
        (("hello world",), ("",), ("  a  b   c ",), ("one",)),
    ),
    Problem(
        "gcd",
        "gcd(a: int, b: int) -> int",
        "Return the greatest common divisor of two non-negative integers.",
        math.gcd,
        ((12, 18), (7, 5), (0, 9), (100, 75)),
    ),
    Problem(
        "celsius_to_fahrenheit",
        "celsius_to_fahrenheit(c: float) -> float",
        "Convert degrees Celsius to Fahrenheit.",
        lambda c: c * 9 / 5 + 32,
        ((0,), (100,), (-40,), (37.5,)),
    ),
    Problem(
        "unique_sorted",
        "unique_sorted(values: list[int]) -> list[int]",
        "Return the distinct values in increasing order.",
        lambda v: sorted(set(v)),
        (([3, 1, 3, 2],), ([],), ([7, 7, 7],)),
    ),
    Problem(
        "capitalize_words",
        "capitalize_words(s: str) -> str",
        "Upper-case the first letter of every space-separated word; keep the rest as is.",
        lambda s: " ".join(w[:1].upper() + w[1:] for w in s.split(" ")),
        (("hello world",), ("a",), ("already Done",), ("",)),
    ),
    Problem(
        "fibonacci",
        "fibonacci(n: int) -> int",
        "Return the n-th Fibonacci number, with fibonacci(0) = 0 and fibonacci(1) = 1.",
        lambda n: round(((1 + 5**0.5) / 2) ** n / 5**0.5),
        ((0,), (1,), (10,), (30,)),
    ),
    Problem(
        "chunk",
        "chunk(values: list[int], size: int) -> list[list[int]]",
        "Split values into consecutive chunks of `size`; the last may be shorter.",
        lambda v, n: [v[i : i + n] for i in range(0, len(v), n)],
        (([1, 2, 3, 4, 5], 2), ([], 3), ([1, 2], 5)),
    ),
    Problem(
        "anagrams",
        "anagrams(a: str, b: str) -> bool",
        "Return True if a and b contain the same letters, ignoring case and spaces.",
        lambda a, b: sorted(a.replace(" ", "").lower()) == sorted(b.replace(" ", "").lower()),
        (("Listen", "Silent"), ("abc", "abd"), ("a gentleman", "elegant man"), ("", "")),
    ),
)
