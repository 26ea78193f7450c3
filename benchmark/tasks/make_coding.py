"""Writes coding.jsonl: the scripted-agent task set (mas_task_v1; each task has a failing check and a
scripted solution that `mars serve --scripted` plays for Codex, OpenCode and OpenHands).

Regenerate with: python3 benchmark/tasks/make_coding.py
"""

import json
from pathlib import Path

T = []


def task(tid, text, files, check, script):
    T.append(
        {
            "schema": "mas_task_v1",
            "benchmark": "mars-coding",
            "task_id": tid,
            "payload": {"text": text, "check": check, "script": script},
            "workspace_init": [{"path": p, "content": c} for p, c in files.items()],
        }
    )


def fix(tid, text, path, src, test, old, new, extra_first=None, msg=None):
    check = f"python3 {test[0]}"
    script = []
    if extra_first:
        script += extra_first
    script += [
        {"op": "run", "cmd": check},
        {"op": "view", "path": path},
        {"op": "replace", "path": path, "old": old, "new": new},
        {"op": "run", "cmd": check},
        {"op": "finish", "message": msg or f"Fixed {path}: {check} passes."},
    ]
    task(tid, text, {path: src, test[0]: test[1]}, check, script)


fix(
    "calc-add",
    "The test test_calc.py fails: add() in calc.py gives the wrong sum. Fix calc.py so the test passes.",
    "calc.py",
    "def add(a, b):\n    return a - b\n",
    ("test_calc.py", "from calc import add\nassert add(2, 3) == 5, add(2, 3)\nprint('OK')\n"),
    "    return a - b",
    "    return a + b",
)
fix(
    "fizzbuzz",
    "test_fizz.py fails: fizz(15) should be 'FizzBuzz'. Fix fizz.py.",
    "fizz.py",
    "def fizz(n):\n    if n % 3 == 0:\n        return 'Fizz'\n    if n % 5 == 0:\n        return 'Buzz'\n    if n % 15 == 0:\n        return 'FizzBuzz'\n    return str(n)\n",
    (
        "test_fizz.py",
        "from fizz import fizz\nassert [fizz(i) for i in (3, 5, 15, 7)] == ['Fizz', 'Buzz', 'FizzBuzz', '7']\nprint('OK')\n",
    ),
    "def fizz(n):\n    if n % 3 == 0:",
    "def fizz(n):\n    if n % 15 == 0:\n        return 'FizzBuzz'\n    if n % 3 == 0:",
    extra_first=[{"op": "run", "cmd": "ls"}],
)
fix(
    "reverse-words",
    "test_words.py fails: reverse_words('a b c') must return 'c b a'. Fix words.py.",
    "words.py",
    "def reverse_words(s):\n    return s[::-1]\n",
    (
        "test_words.py",
        "from words import reverse_words\nassert reverse_words('hello big world') == 'world big hello'\nprint('OK')\n",
    ),
    "    return s[::-1]",
    "    return ' '.join(s.split()[::-1])",
)
fix(
    "palindrome",
    "test_pal.py fails: is_palindrome must ignore case. Fix pal.py.",
    "pal.py",
    "def is_palindrome(s):\n    return s == s[::-1]\n",
    (
        "test_pal.py",
        "from pal import is_palindrome\nassert is_palindrome('Level') and not is_palindrome('abc')\nprint('OK')\n",
    ),
    "    return s == s[::-1]",
    "    s = s.lower()\n    return s == s[::-1]",
)
fix(
    "vowels",
    "test_vowels.py fails: count_vowels('queue') must be 4. Fix vowels.py.",
    "vowels.py",
    "VOWELS = 'aeio'\n\n\ndef count_vowels(s):\n    return sum(1 for c in s.lower() if c in VOWELS)\n",
    (
        "test_vowels.py",
        "from vowels import count_vowels\nassert count_vowels('queue') == 4, count_vowels('queue')\nprint('OK')\n",
    ),
    "VOWELS = 'aeio'",
    "VOWELS = 'aeiou'",
)
fix(
    "factorial",
    "test_fact.py fails: factorial(5) must be 120. Fix fact.py.",
    "fact.py",
    "def factorial(n):\n    out = 1\n    for k in range(1, n):\n        out *= k\n    return out\n",
    (
        "test_fact.py",
        "from fact import factorial\nassert factorial(5) == 120 and factorial(0) == 1, factorial(5)\nprint('OK')\n",
    ),
    "    for k in range(1, n):",
    "    for k in range(1, n + 1):",
    extra_first=[{"op": "run", "cmd": "ls -la"}, {"op": "view", "path": "test_fact.py"}],
)
fix(
    "max-list",
    "test_largest.py fails: largest([3, 9, 2]) must be 9. Fix largest.py.",
    "largest.py",
    "def largest(xs):\n    best = xs[0]\n    for x in xs:\n        if x < best:\n            best = x\n    return best\n",
    ("test_largest.py", "from largest import largest\nassert largest([3, 9, 2]) == 9\nprint('OK')\n"),
    "        if x < best:",
    "        if x > best:",
)
fix(
    "celsius",
    "test_temp.py fails: to_fahrenheit(100) must be 212. Fix temp.py.",
    "temp.py",
    "def to_fahrenheit(c):\n    return c * 5 / 9 + 32\n",
    (
        "test_temp.py",
        "from temp import to_fahrenheit\nassert to_fahrenheit(100) == 212 and to_fahrenheit(0) == 32\nprint('OK')\n",
    ),
    "    return c * 5 / 9 + 32",
    "    return c * 9 / 5 + 32",
)
fix(
    "word-count",
    "test_wc.py fails: word_count must count words, not characters. Fix wc.py.",
    "wc.py",
    "def word_count(text):\n    return len(text)\n",
    ("test_wc.py", "from wc import word_count\nassert word_count('one two  three\\n') == 3\nprint('OK')\n"),
    "    return len(text)",
    "    return len(text.split())",
    extra_first=[{"op": "run", "cmd": "grep -n def wc.py"}],
)
# a task that adds a file
task(
    "greet-module",
    "test_greet.py fails because greet.py is missing. Create greet.py with greet(name) returning 'Hello, <name>!'.",
    {"test_greet.py": "from greet import greet\nassert greet('Ada') == 'Hello, Ada!'\nprint('OK')\n"},
    "python3 test_greet.py",
    [
        {"op": "run", "cmd": "ls"},
        {"op": "run", "cmd": "python3 test_greet.py"},
        {"op": "view", "path": "test_greet.py"},
        {"op": "write", "path": "greet.py", "content": "def greet(name):\n    return f'Hello, {name}!'\n"},
        {"op": "run", "cmd": "python3 test_greet.py"},
        {"op": "finish", "message": "Created greet.py: python3 test_greet.py passes."},
    ],
)
fix(
    "clamp",
    "test_clamp.py fails: clamp(15, 0, 10) must be 10. Fix clamp.py.",
    "clamp.py",
    "def clamp(x, lo, hi):\n    return max(lo, x)\n",
    (
        "test_clamp.py",
        "from clamp import clamp\nassert clamp(15, 0, 10) == 10 and clamp(-1, 0, 10) == 0 and clamp(5, 0, 10) == 5\nprint('OK')\n",
    ),
    "    return max(lo, x)",
    "    return max(lo, min(x, hi))",
)
fix(
    "dedupe",
    "test_dedupe.py fails: dedupe must keep the first occurrence order. Fix dedupe.py.",
    "dedupe.py",
    "def dedupe(xs):\n    return sorted(set(xs))\n",
    (
        "test_dedupe.py",
        "from dedupe import dedupe\nassert dedupe([3, 1, 3, 2, 1]) == [3, 1, 2], dedupe([3, 1, 3, 2, 1])\nprint('OK')\n",
    ),
    "    return sorted(set(xs))",
    "    return list(dict.fromkeys(xs))",
)
with open(Path(__file__).with_name("coding.jsonl"), "w") as f:
    f.writelines(json.dumps(t) + "\n" for t in T)
print(len(T))
